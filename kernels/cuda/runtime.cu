// What the CUDA backend's files share: error helpers, device allocation,
// scratch buffers, the weight table and host-to-device upload. In a file of
// their own so that the ops (matmul.cu, elementwise.cu, attention.cu,
// compactor.cu) and the backend that calls them (backend.cu) both use them
// without using each other.
#include "kernels/cuda/cuda_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * errors
 * ------------------------------------------------------------------------ */

// The errors the CUDA runtime documents as leaving the process's context
// unusable ("any further CUDA work will return the same error ... the
// process must be terminated and relaunched"), plus an uncorrectable ECC
// error. Newer codes by value, so that older toolkits compile this.
static bool cuda_error_is_sticky(cudaError_t e) {
    switch ((int)e) {
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case 226: // cudaErrorContained (CUDA 12.4)
    case 721: // cudaErrorTensorMemoryLeak (CUDA 12.8)
    case 810: // cudaErrorMpsClientTerminated
    case 911: // cudaErrorExternalDevice
        return true;
    default:
        return false;
    }
}

static int cuda_fatal(pd_error *err, cudaError_t e, const char *what) {
    return pd_errorf(err, PD_EDEVICE,
                     "CUDA %s failed: %s (%s); the GPU context is unusable until the process restarts (systemd "
                     "restarts prefixd on its own); check the GPU with nvidia-smi and prefixctl cuda-info",
                     what, cudaGetErrorString(e), cudaGetErrorName(e));
}

// The binary has no code this GPU runs: neither its SASS nor PTX it can
// JIT (kernels/meson.build embeds PTX of the newest gpu_sm entry).
static int cuda_no_kernel_image(pd_error *err, cudaError_t e, const char *what) {
    int dev = 0;
    cudaDeviceProp prop;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "CUDA %s failed: %s (%s); this build has no code for the GPU: rebuild with its "
                         "architecture in -Dgpu_sm (see prefixctl cuda-info)",
                         what, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    return pd_errorf(err, PD_EUNSUPPORTED,
                     "CUDA %s failed: %s (%s); this build has no code for %s (compute capability %d.%d): rebuild "
                     "with %d%d in -Dgpu_sm (meson setup --reconfigure -Dgpu_sm='80;90;%d%d')",
                     what, cudaGetErrorString(e), cudaGetErrorName(e), prop.name, prop.major, prop.minor, prop.major,
                     prop.minor, prop.major, prop.minor);
}

int cuda_fail(pd_error *err, cudaError_t e, const char *what) {
    // A failed runtime call also sets the thread's "last error"; clear it so
    // the next cuda_check_launch does not report this failure a second time
    // (sticky errors, which poison the context, stay whatever we do).
    (void)cudaGetLastError();
    if (cuda_error_is_sticky(e)) return cuda_fatal(err, e, what);
    if (e == cudaErrorNoKernelImageForDevice) return cuda_no_kernel_image(err, e, what);
    const int code = e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EIO;
    return pd_errorf(err, code, "CUDA %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

// A library call fails, not a runtime one: when a sticky error is behind it
// (the library's own launches hit a dead context), report that error.
static int library_fail_sticky(pd_error *err, const char *what) {
    const cudaError_t e = cudaPeekAtLastError();
    return cuda_error_is_sticky(e) ? cuda_fatal(err, e, what) : PD_OK;
}

int cublas_fail(pd_error *err, cublasStatus_t s, const char *what) {
    if (library_fail_sticky(err, what)) return PD_EDEVICE;
    const int code = s == CUBLAS_STATUS_ALLOC_FAILED ? PD_ENOMEM : PD_EIO;
    return pd_errorf(err, code, "cuBLAS %s failed: %s (status %d)", what, cublasGetStatusString(s), (int)s);
}

static const char *cusolver_status_name(cusolverStatus_t s) {
    switch (s) {
    case CUSOLVER_STATUS_SUCCESS: return "success";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "library not initialized";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "resource allocation failed";
    case CUSOLVER_STATUS_INVALID_VALUE: return "invalid value";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "architecture mismatch";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "internal error";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED: return "matrix type not supported";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "unknown status";
    }
}

int cusolver_fail(pd_error *err, cusolverStatus_t s, const char *what) {
    if (library_fail_sticky(err, what)) return PD_EDEVICE;
    const int code = s == CUSOLVER_STATUS_ALLOC_FAILED ? PD_ENOMEM : PD_EIO;
    return pd_errorf(err, code, "cuSOLVER %s failed: %s (status %d)", what, cusolver_status_name(s), (int)s);
}

int cuda_check_launch(pd_error *err, const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return PD_OK;
    char buf[160];
    snprintf(buf, sizeof buf, "kernel %s", what);
    return cuda_fail(err, e, buf);
}

int cuda_enter(cuda_backend *cb, pd_error *err) {
    const cudaError_t e = cudaSetDevice(cb->device);
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "cudaSetDevice");
}

// Report (once) a failure that release() could not return.
int cuda_take_deferred(cuda_backend *cb, pd_error *err) {
    const cudaError_t e = cb->deferred;
    if (e == cudaSuccess) return PD_OK;
    cb->deferred = cudaSuccess;
    return cuda_fail(err, e, "an earlier release of backend memory");
}

int cuda_malloc(cuda_backend *cb, void **p, size_t bytes, const char *what, pd_error *err) {
    *p = NULL;
    cudaError_t e = cudaMalloc(p, bytes);
    if (e == cudaErrorMemoryAllocation && cb->n_cached > 0) {
        // Memory the cache holds may be what is missing: give it back, retry once.
        (void)cudaGetLastError();
        cuda_cache_trim(cb);
        e = cudaMalloc(p, bytes);
    }
    if (e == cudaSuccess) {
        cb->counters.device_allocs++;
        return PD_OK;
    }
    *p = NULL;
    if (e != cudaErrorMemoryAllocation) {
        char buf[160];
        snprintf(buf, sizeof buf, "cudaMalloc of %zu bytes for %s", bytes, what);
        return cuda_fail(err, e, buf);
    }
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
    const double mib = 1024.0 * 1024.0;
    return pd_errorf(err, PD_ENOMEM,
                     "CUDA device %d (%s) is out of memory: %.1f MiB for %s do not fit (%.1f MiB free of "
                     "%.1f MiB); use a smaller model or context, free the GPU, or set model.device = cpu",
                     cb->device, cb->prop.name, (double)bytes / mib, what, (double)free_b / mib,
                     (double)total_b / mib);
}

cudaError_t cuda_stream_wait(cuda_backend *cb) {
    cb->counters.syncs++;
    return cudaStreamSynchronize(cb->stream);
}

cudaError_t cuda_event_wait(cuda_backend *cb, cudaEvent_t e) {
    const cudaError_t q = cudaEventQuery(e);
    if (q != cudaErrorNotReady) return q;
    cb->counters.syncs++;
    return cudaEventSynchronize(e);
}

/* ------------------------------------------------------------------------
 * caching allocator
 *
 * cudaMalloc and cudaFree are slow and cudaFree synchronises the device, so
 * released backend memory and outgrown scratch stay here for reuse. One
 * stream runs every op in order, so a block released while queued kernels
 * still read it is safe to hand out again at once: its next user's work is
 * queued after theirs. Blocks are handed out whole (no splitting); a
 * request takes the smallest cached block that fits within twice its size,
 * so a small request does not pin a huge block.
 * ------------------------------------------------------------------------ */

static bool block_push(cuda_block **arr, int64_t *n, int64_t *cap, int64_t at, cuda_block b) {
    if (*n == *cap) {
        const int64_t c = *cap ? *cap * 2 : 64;
        cuda_block *g = (cuda_block *)realloc(*arr, (size_t)c * sizeof **arr);
        if (!g) return false;
        *arr = g;
        *cap = c;
    }
    memmove(*arr + at + 1, *arr + at, (size_t)(*n - at) * sizeof **arr);
    (*arr)[at] = b;
    (*n)++;
    return true;
}

// Index of the first live block at or after address p.
static int64_t live_lower(const cuda_backend *cb, const void *p) {
    int64_t lo = 0, hi = cb->n_live;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)cb->live[mid].p < (uintptr_t)p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void device_free(cuda_backend *cb, void *p) {
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
    cb->counters.device_frees++;
}

void *cuda_block_alloc(cuda_backend *cb, size_t bytes, const char *what, pd_error *err) {
    // 256-byte granules, so near sizes share blocks (and the alignment the
    // backend promises holds: cudaMalloc aligns to at least 256).
    if (bytes > SIZE_MAX - 255) {
        pd_errorf(err, PD_ERANGE, "cuda backend: %zu bytes for %s is too large", bytes, what);
        return NULL;
    }
    bytes = bytes ? (bytes + 255) & ~(size_t)255 : 256;
    int64_t best = -1;
    for (int64_t i = 0; i < cb->n_cached; i++) {
        const size_t b = cb->cached[i].bytes;
        if (b >= bytes && b / 2 <= bytes && (best < 0 || b < cb->cached[best].bytes)) best = i;
    }
    cuda_block blk;
    if (best >= 0) {
        blk = cb->cached[best];
        cb->cached[best] = cb->cached[--cb->n_cached];
        cb->cached_bytes -= blk.bytes;
    } else {
        blk.bytes = bytes;
        if (cuda_malloc(cb, &blk.p, bytes, what, err) != PD_OK) return NULL;
    }
    if (!block_push(&cb->live, &cb->n_live, &cb->cap_live, live_lower(cb, blk.p), blk)) {
        if (best >= 0) {
            if (block_push(&cb->cached, &cb->n_cached, &cb->cap_cached, cb->n_cached, blk)) cb->cached_bytes += blk.bytes;
            else device_free(cb, blk.p);
        } else {
            device_free(cb, blk.p);
        }
        pd_errorf(err, PD_ENOMEM, "cuda backend: out of host memory for the allocator's table");
        return NULL;
    }
    return blk.p;
}

void cuda_block_release(cuda_backend *cb, void *p) {
    if (!p) return;
    const int64_t i = live_lower(cb, p);
    if (i < cb->n_live && cb->live[i].p == p) {
        const cuda_block blk = cb->live[i];
        memmove(cb->live + i, cb->live + i + 1, (size_t)(cb->n_live - i - 1) * sizeof *cb->live);
        cb->n_live--;
        if (block_push(&cb->cached, &cb->n_cached, &cb->cap_cached, cb->n_cached, blk)) {
            cb->cached_bytes += blk.bytes;
            return;
        }
        p = blk.p; // no room in the table: free it after all
    }
    // Not ours (or no table space): kernels queued earlier may still use it.
    const cudaError_t e = cuda_stream_wait(cb);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (cb->deferred == cudaSuccess) cb->deferred = e;
    }
    device_free(cb, p);
}

void cuda_cache_trim(cuda_backend *cb) {
    if (cb->n_cached == 0) return;
    // cudaFree synchronises too; waiting first makes the order explicit.
    if (cuda_stream_wait(cb) != cudaSuccess) (void)cudaGetLastError();
    for (int64_t i = 0; i < cb->n_cached; i++) device_free(cb, cb->cached[i].p);
    cb->n_cached = 0;
    cb->cached_bytes = 0;
}

void cuda_blocks_destroy(cuda_backend *cb) {
    cuda_cache_trim(cb);
    for (int64_t i = 0; i < cb->n_live; i++) device_free(cb, cb->live[i].p);
    free(cb->live);
    free(cb->cached);
    cb->live = cb->cached = NULL;
    cb->n_live = cb->cap_live = cb->n_cached = cb->cap_cached = 0;
}

/* ------------------------------------------------------------------------
 * scratch
 * ------------------------------------------------------------------------ */

void *cuda_scratch_get(cuda_backend *cb, int slot, size_t bytes, pd_error *err) {
    if (slot < 0 || slot >= (int)(sizeof cb->scratch / sizeof cb->scratch[0])) {
        pd_errorf(err, PD_EINVAL, "cuda backend: no scratch slot %d", slot);
        return NULL;
    }
    cuda_scratch *s = &cb->scratch[slot];
    if (s->p && bytes <= s->bytes) return s->p;
    // Grow with a quarter of headroom, in whole MiB, so a slowly growing
    // size does not reallocate on every call.
    const size_t mib = (size_t)1 << 20;
    if (bytes > SIZE_MAX / 2) {
        pd_errorf(err, PD_ERANGE, "cuda backend: scratch request of %zu bytes is too large", bytes);
        return NULL;
    }
    size_t want = bytes + bytes / 4;
    want = (want + mib - 1) / mib * mib;
    if (want == 0) want = mib;
    if (s->p) {
        // Back to the cache: work queued on the stream still reads it
        // before anyone queued later writes it.
        cuda_block_release(cb, s->p);
        s->p = NULL;
        s->bytes = 0;
    }
    void *p = cuda_block_alloc(cb, want, "scratch", err);
    if (!p) {
        // The headroom may be what does not fit: try the exact size.
        if (!(p = cuda_block_alloc(cb, bytes ? bytes : 1, "scratch", err))) return NULL;
        want = bytes ? bytes : 1;
    }
    s->p = p;
    s->bytes = want;
    return p;
}

/* ------------------------------------------------------------------------
 * weight table: open addressing on the host pointer
 * ------------------------------------------------------------------------ */

static uint64_t ptr_hash(const void *p) {
    uint64_t h = (uint64_t)(uintptr_t)p;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return h;
}

cuda_weight_entry *cuda_weight_find(cuda_backend *cb, const void *host) {
    if (cb->weight_slots == 0) return NULL;
    const uint64_t mask = (uint64_t)cb->weight_slots - 1;
    for (uint64_t i = ptr_hash(host) & mask;; i = (i + 1) & mask) {
        const int64_t slot = cb->weight_index[i];
        if (slot == 0) return NULL;
        if (cb->weights[slot - 1].host == host) return &cb->weights[slot - 1];
    }
}

static void index_insert(int64_t *index, int64_t slots, const void *host, int64_t entry) {
    const uint64_t mask = (uint64_t)slots - 1;
    uint64_t i = ptr_hash(host) & mask;
    while (index[i] != 0) i = (i + 1) & mask;
    index[i] = entry + 1;
}

// Swap-remove the entry and rebuild the index: only a model's teardown
// calls this, a few hundred weights at most.
void cuda_weight_forget(cuda_backend *cb, const void *host) {
    cuda_weight_entry *e = cuda_weight_find(cb, host);
    if (!e) return;
    // Kernels queued earlier may still read it.
    if (cuda_stream_wait(cb) != cudaSuccess) (void)cudaGetLastError();
    device_free(cb, e->dev);
    *e = cb->weights[--cb->n_weights];
    for (int64_t i = 0; i < cb->weight_slots; i++) cb->weight_index[i] = 0;
    for (int64_t i = 0; i < cb->n_weights; i++) index_insert(cb->weight_index, cb->weight_slots, cb->weights[i].host, i);
}

cuda_weight_entry *cuda_weight_add(cuda_backend *cb, const cuda_weight_entry *e, pd_error *err) {
    if (cb->n_weights == cb->cap_weights) {
        const int64_t cap = cb->cap_weights ? cb->cap_weights * 2 : 64;
        cuda_weight_entry *w =
            (cuda_weight_entry *)realloc(cb->weights, (size_t)cap * sizeof(cuda_weight_entry));
        if (!w) {
            pd_errorf(err, PD_ENOMEM, "cuda backend: out of host memory for the weight table");
            return NULL;
        }
        cb->weights = w;
        cb->cap_weights = cap;
    }
    // Keep the index at most half full so probes stay short.
    if ((cb->n_weights + 1) * 2 > cb->weight_slots) {
        const int64_t slots = cb->weight_slots ? cb->weight_slots * 2 : 128;
        int64_t *index = (int64_t *)calloc((size_t)slots, sizeof(int64_t));
        if (!index) {
            pd_errorf(err, PD_ENOMEM, "cuda backend: out of host memory for the weight table");
            return NULL;
        }
        for (int64_t i = 0; i < cb->n_weights; i++) index_insert(index, slots, cb->weights[i].host, i);
        free(cb->weight_index);
        cb->weight_index = index;
        cb->weight_slots = slots;
    }
    cb->weights[cb->n_weights] = *e;
    index_insert(cb->weight_index, cb->weight_slots, e->host, cb->n_weights);
    return &cb->weights[cb->n_weights++];
}

/* ------------------------------------------------------------------------
 * upload
 * ------------------------------------------------------------------------ */

// Whether host pointer p is page-locked (cudaHostAlloc'd or registered), so
// the copy engine can read it directly. Fails with PD_EINVAL for device
// memory passed where host memory belongs.
int cuda_host_kind(const void *p, bool *pinned, const char *op, pd_error *err) {
    cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    *pinned = false;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError(); // plain pageable memory on older drivers
        return PD_OK;
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged)
        return pd_errorf(err, PD_EINVAL, "cuda backend: %s was given device memory where host memory belongs", op);
    *pinned = a.type == cudaMemoryTypeHost;
    return PD_OK;
}

/* The upload ring: a pinned buffer that every upload is copied into and
 * queued from. Pieces are placed one after another (wrapping to the start
 * when the end is too near), each with an event recorded behind its copy;
 * before bytes are reused, the records covering them are retired in FIFO
 * order, waiting only for a copy that has not run yet. Copies from pinned
 * memory are truly asynchronous, so an upload never drains the stream, and
 * the caller's buffer is free on return whatever memory it is. */

int cuda_ring_create(cuda_backend *cb, pd_error *err) {
    cudaError_t e = cudaHostAlloc((void **)&cb->ring, CUDA_RING_BYTES, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cb->ring = NULL;
        return cuda_fail(err, e, "cudaHostAlloc (upload ring)");
    }
    for (int i = 0; i < CUDA_RING_RECORDS; i++)
        if ((e = cudaEventCreateWithFlags(&cb->ring_done[i], cudaEventDisableTiming)) != cudaSuccess) {
            cb->ring_done[i] = NULL;
            return cuda_fail(err, e, "cudaEventCreate (upload ring)");
        }
    return PD_OK;
}

void cuda_ring_destroy(cuda_backend *cb) {
    for (int i = 0; i < CUDA_RING_RECORDS; i++)
        if (cb->ring_done[i]) (void)cudaEventDestroy(cb->ring_done[i]);
    if (cb->ring) (void)cudaFreeHost(cb->ring);
    cb->ring = NULL;
}

// Room for len bytes (a multiple of 256, at most CUDA_RING_BYTES): retire
// the oldest records until nothing in flight lies in the bytes to be used
// (or skipped at the end when the piece wraps) and a record slot is free.
static int ring_reserve(cuda_backend *cb, size_t len, size_t *at, pd_error *err) {
    if (cb->ring_count == 0) cb->ring_head = 0;
    const size_t head = cb->ring_head;
    const bool wrap = head + len > CUDA_RING_BYTES;
    const size_t off = wrap ? 0 : head;
    while (cb->ring_count > 0) {
        const cuda_ring_rec *r = &cb->ring_rec[cb->ring_first];
        // Records lie in allocation order from just past head, so the ones
        // in the way are always the oldest.
        const bool in_way = wrap ? (r->start >= head || r->start < len) : (r->start < off + len && r->end > off);
        if (!in_way && cb->ring_count < CUDA_RING_RECORDS) break;
        if (cb->ring_count <= cb->ring_pending)
            return pd_errorf(err, PD_EUNSUPPORTED,
                             "cuda backend: the uploads of one recorded graph do not fit the staging ring");
        const cudaError_t e =
            cuda_event_wait(cb, r->in_graph ? cb->graph_done : cb->ring_done[cb->ring_first]);
        if (e != cudaSuccess) return cuda_fail(err, e, "upload (waiting for the staging ring)");
        cb->ring_first = (cb->ring_first + 1) % CUDA_RING_RECORDS;
        cb->ring_count--;
    }
    *at = off;
    return PD_OK;
}

int cuda_upload(cuda_backend *cb, void *dst, const void *src, size_t bytes, pd_error *err) {
    if (bytes == 0) return PD_OK;
    if (!dst || !src) return pd_errorf(err, PD_EINVAL, "cuda backend: upload with a NULL pointer");
    bool pinned;
    int rc = cuda_host_kind(src, &pinned, "upload", err);
    if (rc) return rc;
    cb->counters.uploads++;
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    for (size_t off = 0; off < bytes;) {
        const size_t len = bytes - off < CUDA_RING_PIECE ? bytes - off : CUDA_RING_PIECE;
        const size_t room = (len + 255) & ~(size_t)255; // keeps every piece 256-byte aligned
        size_t at = 0;
        if ((rc = ring_reserve(cb, room, &at, err))) return rc;
        memcpy(cb->ring + at, s + off, len);
        cudaError_t e = cudaMemcpyAsync(d + off, cb->ring + at, len, cudaMemcpyHostToDevice, cb->stream);
        if (e != cudaSuccess) return cuda_fail(err, e, "upload (cudaMemcpyAsync from the staging ring)");
        const int slot = (cb->ring_first + cb->ring_count) % CUDA_RING_RECORDS;
        // Recorded into a graph, the copy runs at its launch, after which
        // graph_done is recorded (an event recorded during a capture marks
        // no point in time).
        if (!cb->capturing && (e = cudaEventRecord(cb->ring_done[slot], cb->stream)) != cudaSuccess)
            return cuda_fail(err, e, "upload (cudaEventRecord)");
        cb->ring_rec[slot] = cuda_ring_rec{at, at + room, cb->capturing};
        cb->ring_pending += cb->capturing;
        cb->ring_count++;
        cb->ring_head = at + room;
        off += len;
    }
    return PD_OK;
}

int cuda_download(cuda_backend *cb, void *dst, const void *src, size_t bytes, pd_error *err) {
    if (cb->capturing)
        return pd_errorf(err, PD_EINVAL, "cuda backend: download while a graph is being recorded (end it first)");
    int rc = cuda_take_deferred(cb, err);
    if (rc) return rc;
    cudaError_t e;
    if (bytes == 0) {
        e = cuda_stream_wait(cb);
        return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "download (stream synchronize)");
    }
    if (!dst || !src) return pd_errorf(err, PD_EINVAL, "cuda backend: download with a NULL pointer");
    bool pinned;
    rc = cuda_host_kind(dst, &pinned, "download", err);
    if (rc) return rc;
    cb->counters.downloads++;
    if (pinned) {
        // Ordered after all queued work; the wait covers both and reports
        // any failure among them.
        e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream);
        if (e == cudaSuccess) e = cuda_stream_wait(cb);
        return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "download");
    }
    // Pageable destination: queue chunk k into one pinned buffer, then copy
    // chunk k-1 out of the other while chunk k is in flight.
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    int buf = 0;
    size_t prev_off = 0, prev_len = 0; // chunk waiting in pinned[buf ^ 1]
    for (size_t off = 0; off < bytes;) {
        const size_t len = bytes - off < cb->pinned_bytes ? bytes - off : cb->pinned_bytes;
        e = cudaMemcpyAsync(cb->pinned[buf], s + off, len, cudaMemcpyDeviceToHost, cb->stream);
        if (e != cudaSuccess) return cuda_fail(err, e, "download (cudaMemcpyAsync to staging)");
        e = cudaEventRecord(cb->pinned_done[buf], cb->stream);
        if (e != cudaSuccess) return cuda_fail(err, e, "download (cudaEventRecord)");
        if (prev_len) {
            e = cuda_event_wait(cb, cb->pinned_done[buf ^ 1]);
            if (e != cudaSuccess) return cuda_fail(err, e, "download");
            memcpy(d + prev_off, cb->pinned[buf ^ 1], prev_len);
        }
        prev_off = off;
        prev_len = len;
        off += len;
        buf ^= 1;
    }
    e = cuda_event_wait(cb, cb->pinned_done[buf ^ 1]);
    if (e != cudaSuccess) return cuda_fail(err, e, "download");
    memcpy(d + prev_off, cb->pinned[buf ^ 1], prev_len);
    return PD_OK;
}

// cudaemu: the CUDA runtime calls kernels/cuda makes, and kernel execution,
// on the CPU (see include/cuda_runtime.h for what this is for).
//
// Strictness is the point: device memory is tracked, so a copy whose kind
// does not match its pointers, a kernel handed a host pointer, or a free of
// something that is not an allocation fails with a message instead of
// silently working the way plain host memory would. New device memory is
// filled with 0xff bytes (NaN as floats) so code that relies on zeroed
// memory shows, and so is dynamic shared memory at each block's start.
//
// A non-null stream is a worker thread that runs copies, memsets, launches
// and library calls in order while the host goes on; the host must order
// its accesses as on a GPU (sync, events, the pageable-copy rules), and
// under TSan an access that is not so ordered is reported.
//
// A kernel's blocks are spread over a pool of OS threads; a block's threads
// are fibers (own stacks, a small context switch) that run until they reach
// __syncthreads or a warp shuffle, and are released when every live thread
// of the block (of the warp) has arrived. Threads run in forward order in
// one phase and reverse order in the next. A block whose threads wait at
// different barriers is reported and aborts. Races between GPU threads are
// for ThreadSanitizer to find (see the TSAN notes below).
#include "cudaemu_device.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

// Fiber switch. On x86-64 a few instructions (callee-saved registers, the
// SSE and x87 control words, the stack pointer): glibc's swapcontext makes
// a sigprocmask system call per switch, which dominated run time.
// Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void cudaemu_switch(void **save_sp, void *load_sp);
asm(".text\n"
    ".globl cudaemu_switch\n"
    ".type cudaemu_switch, @function\n"
    "cudaemu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size cudaemu_switch, .-cudaemu_switch\n"
    ".section .note.GNU-stack,\"\",@progbits\n"
    ".text\n");
#define CUDAEMU_ASM_SWITCH 1
typedef void *fiber_context; // the saved stack pointer
static inline void switch_context(fiber_context *save, fiber_context *load) { cudaemu_switch(save, *load); }
#else
#include <ucontext.h>
typedef ucontext_t fiber_context;
static inline void switch_context(fiber_context *save, fiber_context *load) { swapcontext(save, load); }
#endif

// Under ASan the kernels (instrumented) run on fiber stacks, which ASan must
// be told about. meson builds this file itself uninstrumented and defines
// CUDAEMU_ASAN there (kernels/meson.build).
#if defined(__SANITIZE_ADDRESS__) && !defined(CUDAEMU_ASAN)
#define CUDAEMU_ASAN 1
#endif
#ifdef CUDAEMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

// Under ThreadSanitizer (meson defines CUDAEMU_TSAN and builds this file
// uninstrumented: the scheduler's bookkeeping is shared by design) every GPU
// thread is a TSan fiber, switches carry no synchronisation, and only what
// orders memory on a GPU orders it here: __syncthreads, __syncwarp, the
// start and end of a block (of the launch). Shuffles do not order memory
// (the CUDA memory model says so). So TSan reports any shared or global
// memory race between threads of a kernel, whatever order they ran in.
#if defined(CUDAEMU_TSAN)
#include <sanitizer/tsan_interface.h>
#define TSAN(x) x
#else
#define TSAN(x)
#endif

/* ------------------------------------------------------------------------
 * device description
 * ------------------------------------------------------------------------ */

static const size_t EMU_TOTAL_MEM = (size_t)16 << 30;
static const size_t EMU_SMEM_OPTIN = 227 * 1024;

static int emu_device_count() {
    const char *s = getenv("CUDAEMU_DEVICES"); // tests may ask for zero devices
    return s && *s ? atoi(s) : 1;
}

namespace {
void drain_all();
}

static thread_local int current_device = 0;
static thread_local cudaError_t last_error = cudaSuccess;

void cudaemu_set_error(cudaError_t e, const char *why) {
    if (why) fprintf(stderr, "cudaemu: %s\n", why);
    if (last_error == cudaSuccess) last_error = e;
}

// A failed call returns its error and also leaves it as the last error, as
// the runtime does.
static cudaError_t fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static cudaError_t fail(cudaError_t e, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    cudaemu_set_error(e, buf);
    return e;
}

/* ------------------------------------------------------------------------
 * fault injection
 *
 * CUDAEMU_FAIL_LAUNCH=N makes the N-th kernel launch of the process (from 1)
 * fail with CUDAEMU_FAIL_ERROR (a cudaError_t name, default
 * cudaErrorIllegalAddress) instead of running, as if the GPU had faulted in
 * it. An error the runtime documents as poisoning the context is then
 * returned by every later call that touches the context, cudaGetLastError
 * included (it stays), as on a GPU; any other is reported once, by the next
 * cudaGetLastError.
 *
 * CUDAEMU_FAIL_ARM=PATH counts launches only from the first one that finds
 * PATH existing, so a test can place the fault after a state it has reached
 * (a request running, another queued) instead of guessing a launch number.
 *
 * CUDAEMU_FAIL_CAPTURE=N invalidates the N-th stream capture of the process
 * (from 1): its cudaStreamEndCapture fails with
 * cudaErrorStreamCaptureInvalidated, as when an operation in it could not
 * be recorded. No sticky error.
 * ------------------------------------------------------------------------ */

static const cudaError_t emu_errors[] = {
    cudaErrorInvalidValue,           cudaErrorMemoryAllocation,   cudaErrorInitializationError,
    cudaErrorInvalidConfiguration,   cudaErrorInvalidDevicePointer, cudaErrorInvalidMemcpyDirection,
    cudaErrorNoDevice,               cudaErrorInvalidDevice,      cudaErrorNoKernelImageForDevice,
    cudaErrorECCUncorrectable,       cudaErrorInvalidResourceHandle, cudaErrorIllegalAddress,
    cudaErrorLaunchTimeout,          cudaErrorAssert,             cudaErrorHardwareStackError,
    cudaErrorIllegalInstruction,     cudaErrorMisalignedAddress,  cudaErrorInvalidAddressSpace,
    cudaErrorInvalidPc,              cudaErrorLaunchFailure,
};

static bool emu_error_is_sticky(cudaError_t e) {
    switch (e) {
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure: return true;
    default: return false;
    }
}

namespace {
struct fault_plan {
    uint64_t launch; // 0: none
    cudaError_t error;
    const char *arm_path; // NULL: counting from the first launch
    uint64_t capture; // 0: none
};

const fault_plan &fault() {
    static const fault_plan plan = [] {
        fault_plan p = {0, cudaErrorIllegalAddress, nullptr, 0};
        const char *n = getenv("CUDAEMU_FAIL_LAUNCH");
        if (n && *n) p.launch = strtoull(n, nullptr, 10);
        const char *c = getenv("CUDAEMU_FAIL_CAPTURE");
        if (c && *c) p.capture = strtoull(c, nullptr, 10);
        const char *arm = getenv("CUDAEMU_FAIL_ARM");
        if (arm && *arm) p.arm_path = arm;
        const char *name = getenv("CUDAEMU_FAIL_ERROR");
        if (name && *name) {
            bool known = false;
            for (cudaError_t e : emu_errors)
                if (strcmp(cudaGetErrorName(e), name) == 0) {
                    p.error = e;
                    known = true;
                }
            if (!known) {
                fprintf(stderr, "cudaemu: CUDAEMU_FAIL_ERROR=%s is not an emulated cudaError_t name\n", name);
                abort();
            }
        }
        return p;
    }();
    return plan;
}

std::atomic<int> sticky_error{cudaSuccess};
std::atomic<uint64_t> launches{0};
std::atomic<uint64_t> captures{0};
std::atomic<bool> armed{false};
} // namespace

// The context's sticky error, or cudaSuccess.
static cudaError_t sticky() { return (cudaError_t)sticky_error.load(std::memory_order_relaxed); }

// Counts a launch; true when it is the one to fail (and fails it).
static bool injected_launch_fault(const char *kernel) {
    const fault_plan &p = fault();
    if (p.launch && p.arm_path && !armed.load()) {
        if (access(p.arm_path, F_OK) != 0) return false;
        armed.store(true);
    }
    const uint64_t n = launches.fetch_add(1) + 1;
    if (!p.launch || n != p.launch) return false;
    fprintf(stderr, "cudaemu: launch %llu (%s) fails with %s (CUDAEMU_FAIL_LAUNCH)\n", (unsigned long long)n, kernel,
            cudaGetErrorName(p.error));
    if (emu_error_is_sticky(p.error)) sticky_error.store(p.error);
    else cudaemu_set_error(p.error, nullptr);
    return true;
}

// Kernel launches of this process that reached a stream (a launch refused
// for its configuration or a sticky error is not counted): tests compare
// the CUDA backend's launch counter with it.
extern "C" uint64_t cudaemu_kernel_launches(void) { return launches.load(); }

extern "C" {

cudaError_t cudaGetDeviceCount(int *count) {
    *count = emu_device_count();
    return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice, "no device (CUDAEMU_DEVICES=0)");
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= emu_device_count()) return cudaErrorInvalidDevice;
    current_device = device;
    return sticky();
}

cudaError_t cudaGetDevice(int *device) {
    *device = current_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    if (device < 0 || device >= emu_device_count()) return cudaErrorInvalidDevice;
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cudaemu %d (CPU emulation, not a GPU)", device);
    prop->totalGlobalMem = EMU_TOTAL_MEM;
    prop->sharedMemPerBlock = 48 * 1024;
    prop->sharedMemPerBlockOptin = EMU_SMEM_OPTIN;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->multiProcessorCount = 4; // small: grid-stride loops take several turns
    prop->major = 9;
    prop->minor = 0;
    prop->memoryBusWidth = 5120;
    prop->memoryClockRate = 2619000;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    const cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess) return e;
    switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; return cudaSuccess;
    case cudaDevAttrMemoryClockRate: *value = p.memoryClockRate; return cudaSuccess;
    case cudaDevAttrGlobalMemoryBusWidth: *value = p.memoryBusWidth; return cudaSuccess;
    }
    return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d not emulated", (int)attr);
}

cudaError_t cudaDeviceSynchronize(void) {
    drain_all();
    return sticky();
}
cudaError_t cudaDriverGetVersion(int *version) {
    *version = 12000;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *version) {
    *version = CUDART_VERSION;
    return cudaSuccess;
}

} // extern "C"

/* ------------------------------------------------------------------------
 * memory
 * ------------------------------------------------------------------------ */

namespace {
struct registry {
    std::mutex mu;
    std::map<uintptr_t, size_t> device, pinned;
    size_t device_bytes = 0;
    // At exit. A process whose context died cannot free its memory (the
    // frees fail with the sticky error, and the driver reclaims it all):
    // do that here so that a leak check reports only what a live context
    // leaked.
    ~registry() {
        if (!sticky()) return;
        for (auto &b : device) free((void *)b.first);
        for (auto &b : pinned) free((void *)b.first);
    }
};
registry &reg() {
    static registry r;
    return r;
}

// Whether [p, p + n) is inside one block of `m`; for n == 0, whether p
// points into one (not just past its end: the next block may start there).
bool in_map(const std::map<uintptr_t, size_t> &m, const void *p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    auto it = m.upper_bound(a);
    if (it == m.begin()) return false;
    --it;
    const uintptr_t off = a - it->first;
    if (n == 0) return off < it->second || (off == 0 && it->second == 0);
    return off <= it->second && n <= it->second - off;
}
} // namespace

extern "C" int cudaemu_is_device_range(const void *p, size_t bytes) {
    registry &r = reg();
    std::lock_guard<std::mutex> g(r.mu);
    return p != nullptr && in_map(r.device, p, bytes);
}

static bool is_pinned_range(const void *p, size_t bytes) {
    registry &r = reg();
    std::lock_guard<std::mutex> g(r.mu);
    return p != nullptr && in_map(r.pinned, p, bytes);
}

static bool touches_device(const void *p, size_t bytes) {
    registry &r = reg();
    std::lock_guard<std::mutex> g(r.mu);
    const uintptr_t a = (uintptr_t)p;
    auto it = r.device.upper_bound(a + (bytes ? bytes - 1 : 0));
    if (it == r.device.begin()) return false;
    --it;
    return it->first + it->second > a;
}

static const size_t EMU_SMEM_DEFAULT = 48 * 1024;

namespace {
struct smem_limits {
    std::mutex mu;
    std::map<const void *, size_t> raised;
};
smem_limits &limits() {
    static smem_limits l;
    return l;
}
} // namespace

cudaError_t cudaemu_func_set_smem(const void *kernel, int attr, int value) {
    if (sticky()) return sticky();
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d not emulated", attr);
    if (value < 0 || (size_t)value > EMU_SMEM_OPTIN)
        return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: %d bytes of dynamic shared memory (at most %zu)", value,
                    EMU_SMEM_OPTIN);
    smem_limits &l = limits();
    std::lock_guard<std::mutex> g(l.mu);
    l.raised[kernel] = (size_t)value;
    return cudaSuccess;
}

size_t cudaemu_func_smem_limit(const void *kernel) {
    smem_limits &l = limits();
    std::lock_guard<std::mutex> g(l.mu);
    auto it = l.raised.find(kernel);
    return it == l.raised.end() ? EMU_SMEM_DEFAULT : it->second;
}

extern "C" {

cudaError_t cudaMalloc(void **p, size_t bytes) {
    *p = nullptr;
    if (sticky()) return sticky();
    registry &r = reg();
    {
        std::lock_guard<std::mutex> g(r.mu);
        if (bytes > EMU_TOTAL_MEM - r.device_bytes) return fail(cudaErrorMemoryAllocation, "cudaMalloc(%zu): out of emulated memory", bytes);
    }
    void *q = nullptr;
    if (posix_memalign(&q, 256, bytes ? bytes : 1) != 0) return fail(cudaErrorMemoryAllocation, "cudaMalloc(%zu) failed", bytes);
    memset(q, 0xff, bytes);
    std::lock_guard<std::mutex> g(r.mu);
    r.device[(uintptr_t)q] = bytes;
    r.device_bytes += bytes;
    *p = q;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    drain_all(); // cudaFree synchronises the device
    registry &r = reg();
    {
        std::lock_guard<std::mutex> g(r.mu);
        auto it = r.device.find((uintptr_t)p);
        if (it == r.device.end()) return fail(cudaErrorInvalidDevicePointer, "cudaFree(%p): not a device allocation", p);
        r.device_bytes -= it->second;
        r.device.erase(it);
    }
    free(p);
    return sticky(); // freed all the same, so that a test's leak check stays quiet
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned int flags) {
    (void)flags;
    *p = nullptr;
    if (sticky()) return sticky();
    *p = malloc(bytes ? bytes : 1);
    if (!*p) return fail(cudaErrorMemoryAllocation, "cudaHostAlloc(%zu) failed", bytes);
    registry &r = reg();
    std::lock_guard<std::mutex> g(r.mu);
    r.pinned[(uintptr_t)*p] = bytes;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaFreeHost(void *p) {
    if (!p) return cudaSuccess;
    drain_all();
    registry &r = reg();
    {
        std::lock_guard<std::mutex> g(r.mu);
        auto it = r.pinned.find((uintptr_t)p);
        if (it == r.pinned.end()) return fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not a pinned allocation", p);
        r.pinned.erase(it);
    }
    free(p);
    return sticky();
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
    memset(a, 0, sizeof *a);
    if (cudaemu_is_device_range(p, 0)) {
        a->type = cudaMemoryTypeDevice;
        a->devicePointer = (void *)p;
    } else if (is_pinned_range(p, 0)) {
        a->type = cudaMemoryTypeHost;
        a->hostPointer = (void *)p;
        a->devicePointer = (void *)p;
    } else {
        a->type = cudaMemoryTypeUnregistered;
        a->hostPointer = (void *)p;
    }
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    if (sticky()) return sticky();
    registry &r = reg();
    std::lock_guard<std::mutex> g(r.mu);
    *free_bytes = EMU_TOTAL_MEM - r.device_bytes;
    *total_bytes = EMU_TOTAL_MEM;
    return cudaSuccess;
}

} // extern "C"

static const char *kind_name(cudaMemcpyKind k) {
    switch (k) {
    case cudaMemcpyHostToHost: return "HostToHost";
    case cudaMemcpyHostToDevice: return "HostToDevice";
    case cudaMemcpyDeviceToHost: return "DeviceToHost";
    case cudaMemcpyDeviceToDevice: return "DeviceToDevice";
    case cudaMemcpyDefault: return "Default";
    }
    return "?";
}

// A copy's pointers must match its kind: device sides inside one allocation,
// host sides touching no device memory.
static cudaError_t check_side(const void *p, size_t bytes, bool device, const char *what, cudaMemcpyKind kind) {
    if (bytes == 0) return cudaSuccess;
    if (device && !cudaemu_is_device_range(p, bytes))
        return fail(cudaErrorInvalidValue, "cudaMemcpy%s: %s %p (+%zu bytes) is not inside one device allocation", kind_name(kind), what, p, bytes);
    if (!device && touches_device(p, bytes))
        return fail(cudaErrorInvalidValue, "cudaMemcpy%s: %s %p (+%zu bytes) is device memory", kind_name(kind), what, p, bytes);
    return cudaSuccess;
}

// Which sides of a copy are device memory, checked against its kind.
static cudaError_t copy_sides(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, bool *dst_dev, bool *src_dev) {
    switch (kind) {
    case cudaMemcpyHostToHost: *dst_dev = *src_dev = false; break;
    case cudaMemcpyHostToDevice: *dst_dev = true, *src_dev = false; break;
    case cudaMemcpyDeviceToHost: *dst_dev = false, *src_dev = true; break;
    case cudaMemcpyDeviceToDevice: *dst_dev = *src_dev = true; break;
    default:
        *dst_dev = cudaemu_is_device_range(dst, bytes);
        *src_dev = cudaemu_is_device_range(src, bytes);
        break;
    }
    cudaError_t e = check_side(dst, bytes, *dst_dev, "destination", kind);
    if (e == cudaSuccess) e = check_side(src, bytes, *src_dev, "source", kind);
    return e;
}

/* ------------------------------------------------------------------------
 * streams: a worker thread each, running enqueued work in order while the
 * host goes on, so the host must order its accesses the way a GPU makes it
 * (a sync, an event, or the pageable-copy rules below). The null stream
 * runs work at once on the calling thread; the streams here are
 * non-blocking, so it does not wait for them either.
 * ------------------------------------------------------------------------ */

// One piece of recorded work: what it runs, and what it is (a kernel's
// function, a library call's name, a copy or memset) for graph updates.
struct cudaemu_graph_node {
    std::function<void()> work;
    const void *what;
};

struct cudaemu_stream {
    int id;
    std::mutex mu;
    std::condition_variable has_work, progressed;
    std::deque<std::function<void()>> queue;
    uint64_t enqueued = 0, completed = 0;
    bool stop = false;
    std::thread worker;
    // Stream capture: while `capture` is Active, enqueued work goes into
    // `recorded` instead of the queue; an operation that cannot be recorded
    // turns it Invalidated (cudaStreamEndCapture then fails).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    std::vector<cudaemu_graph_node> recorded;
};

struct cudaemu_graph {
    std::vector<cudaemu_graph_node> nodes;
};
struct cudaemu_graph_exec {
    std::vector<cudaemu_graph_node> nodes;
};

// What copies and memsets are, as graph nodes.
static const char node_memcpy[] = "memcpy", node_memset[] = "memset", node_host[] = "host work";

namespace {
struct stream_table {
    std::mutex mu;
    std::map<cudaStream_t, int> live;
    int next_id = 1;
};
stream_table &streams() {
    static stream_table t;
    return t;
}
bool stream_ok(cudaStream_t s) {
    if (!s) return true;
    stream_table &t = streams();
    std::lock_guard<std::mutex> g(t.mu);
    return t.live.count(s) != 0;
}

void stream_loop(cudaemu_stream *s) {
    for (;;) {
        std::function<void()> work;
        {
            std::unique_lock<std::mutex> g(s->mu);
            s->has_work.wait(g, [s] { return s->stop || !s->queue.empty(); });
            if (s->queue.empty()) return; // stopped and drained
            work = std::move(s->queue.front());
            s->queue.pop_front();
        }
        work();
        std::lock_guard<std::mutex> g(s->mu);
        s->completed++;
        s->progressed.notify_all();
    }
}

// The work's place in the stream's order (0: recorded by a capture, or
// dropped by an invalidated one: nothing to wait for).
uint64_t stream_enqueue(cudaemu_stream *s, std::function<void()> work, const void *what = node_host) {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->capture == cudaStreamCaptureStatusActive) {
        s->recorded.push_back(cudaemu_graph_node{std::move(work), what});
        return 0;
    }
    if (s->capture == cudaStreamCaptureStatusInvalidated) return 0;
    s->queue.push_back(std::move(work));
    s->has_work.notify_one();
    return ++s->enqueued;
}

bool capturing(cudaemu_stream *s) {
    if (!s) return false;
    std::lock_guard<std::mutex> g(s->mu);
    return s->capture != cudaStreamCaptureStatusNone;
}

// An operation a capture cannot record (a host wait, a copy from or to
// pageable memory): the capture is invalidated, as the runtime does.
cudaError_t capture_refuses(cudaemu_stream *s, const char *what) {
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->capture = cudaStreamCaptureStatusInvalidated;
        s->recorded.clear();
    }
    return fail(cudaErrorStreamCaptureUnsupported, "%s on stream %p while it is being captured", what, (void *)s);
}

void stream_wait(cudaemu_stream *s, uint64_t seq) {
    std::unique_lock<std::mutex> g(s->mu);
    s->progressed.wait(g, [s, seq] { return s->completed >= seq; });
}

void stream_drain(cudaemu_stream *s) {
    uint64_t seq;
    {
        std::lock_guard<std::mutex> g(s->mu);
        seq = s->enqueued;
    }
    stream_wait(s, seq);
}

// What cudaFree and cudaDeviceSynchronize imply: every stream idle.
void drain_all() {
    std::vector<cudaStream_t> all;
    {
        stream_table &t = streams();
        std::lock_guard<std::mutex> g(t.mu);
        for (auto &kv : t.live) all.push_back(kv.first);
    }
    for (cudaStream_t s : all) stream_drain(s);
}

} // namespace

void cudaemu_enqueue(cudaStream_t s, std::function<void()> work, const void *what) {
    if (!s) {
        work();
        return;
    }
    if (!stream_ok(s)) cudaemu_device_fault("cudaemu: work enqueued on stream %p, which is not live", (void *)s);
    stream_enqueue(s, std::move(work), what ? what : node_host);
}

void cudaemu_device_fault(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

struct cudaemu_event {
    std::chrono::steady_clock::time_point at; // written by the stream's marker
    cudaemu_stream *stream;                   // recorded on (NULL: the null stream)
    uint64_t seq;
    bool recorded;
    unsigned flags;
    bool captured; // last recorded on a capturing stream: not a point in time
};

extern "C" {

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    if (sticky()) return sticky();
    bool dd, sd;
    const cudaError_t e = copy_sides(dst, src, bytes, kind, &dd, &sd);
    if (e != cudaSuccess) return e;
    if (bytes) memmove(dst, src, bytes);
    return cudaSuccess;
}

// The runtime's rules for pageable host memory (pinned memory is plain
// asynchronous): from pageable memory the source is staged before the call
// returns (the caller may reuse it); to pageable memory the call returns
// once the copy, and all work before it on the stream, is done.
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    if (sticky()) return sticky();
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync: stream %p is not live", (void *)s);
    bool dd, sd;
    const cudaError_t e = copy_sides(dst, src, bytes, kind, &dd, &sd);
    if (e != cudaSuccess || bytes == 0) return e;
    if (!s) {
        memmove(dst, src, bytes);
        return cudaSuccess;
    }
    if (((!sd && !is_pinned_range(src, bytes)) || (!dd && !is_pinned_range(dst, bytes))) && capturing(s))
        return capture_refuses(s, "cudaMemcpyAsync to or from pageable host memory");
    if (!sd && !is_pinned_range(src, bytes)) {
        // The staged copy belongs to the work alone (no shared_ptr: this file
        // is uninstrumented under TSan, which would not see its atomics).
        std::vector<unsigned char> staged((const unsigned char *)src, (const unsigned char *)src + bytes);
        stream_enqueue(s, [dst, staged = std::move(staged)] { memcpy(dst, staged.data(), staged.size()); }, node_memcpy);
    } else if (!dd && !is_pinned_range(dst, bytes)) {
        stream_drain(s);
        memmove(dst, src, bytes);
    } else {
        stream_enqueue(s, [dst, src, bytes] { memmove(dst, src, bytes); }, node_memcpy);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t s) {
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaMemcpy2DAsync: stream %p is not live", (void *)s);
    if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width %zu above a pitch", width);
    for (size_t r = 0; r < height; r++) {
        const cudaError_t e = cudaMemcpyAsync((char *)dst + r * dpitch, (const char *)src + r * spitch, width, kind, s);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

static cudaError_t check_memset(const char *fn, const void *p, size_t bytes) {
    if (bytes && !cudaemu_is_device_range(p, bytes))
        return fail(cudaErrorInvalidValue, "%s: %p (+%zu bytes) is not inside one device allocation", fn, p, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    if (sticky()) return sticky();
    const cudaError_t e = check_memset("cudaMemset", p, bytes);
    if (e == cudaSuccess && bytes) memset(p, value, bytes);
    return e;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t s) {
    if (sticky()) return sticky();
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync: stream %p is not live", (void *)s);
    const cudaError_t e = check_memset("cudaMemsetAsync", p, bytes);
    if (e == cudaSuccess && bytes) cudaemu_enqueue(s, [p, value, bytes] { memset(p, value, bytes); }, node_memset);
    return e;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    (void)flags;
    if (sticky()) return sticky();
    cudaemu_stream *st = new cudaemu_stream();
    stream_table &t = streams();
    {
        std::lock_guard<std::mutex> g(t.mu);
        st->id = t.next_id++;
        t.live[st] = 1;
    }
    st->worker = std::thread(stream_loop, st);
    *s = st;
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

// Work already enqueued completes first, as the runtime promises.
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    stream_table &t = streams();
    {
        std::lock_guard<std::mutex> g(t.mu);
        if (!s || !t.live.erase(s)) return cudaErrorInvalidResourceHandle;
    }
    {
        std::lock_guard<std::mutex> g(s->mu);
        s->stop = true;
        s->has_work.notify_one();
    }
    s->worker.join();
    delete s;
    return sticky();
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: stream %p is not live", (void *)s);
    if (capturing(s)) return capture_refuses(s, "cudaStreamSynchronize");
    if (s) stream_drain(s);
    return sticky();
}

/* Stream capture and graphs. A graph is the recorded work in order; a
 * launch queues a copy of each piece on the stream, so an executable graph
 * may be updated or destroyed while a launch of it is still running. Host
 * memory a recorded copy reads (pinned, or capture refuses it) is read when
 * the launch runs, not when it was recorded, as on a GPU. */

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (sticky()) return sticky();
    if (!s) return fail(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: the null stream cannot be captured");
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamBeginCapture: stream %p is not live", (void *)s);
    if ((int)mode < 0 || (int)mode > 2) return fail(cudaErrorInvalidValue, "cudaStreamBeginCapture: mode %d", (int)mode);
    std::lock_guard<std::mutex> g(s->mu);
    if (s->capture != cudaStreamCaptureStatusNone)
        return fail(cudaErrorIllegalState, "cudaStreamBeginCapture: stream %p is already being captured", (void *)s);
    s->capture = cudaStreamCaptureStatusActive;
    s->recorded.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    *graph = nullptr;
    if (!s || !stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamEndCapture: stream %p is not live", (void *)s);
    std::vector<cudaemu_graph_node> nodes;
    cudaStreamCaptureStatus was;
    {
        std::lock_guard<std::mutex> g(s->mu);
        was = s->capture;
        nodes.swap(s->recorded);
        s->capture = cudaStreamCaptureStatusNone;
    }
    if (was == cudaStreamCaptureStatusNone)
        return fail(cudaErrorIllegalState, "cudaStreamEndCapture: stream %p is not being captured", (void *)s);
    const uint64_t nth = captures.fetch_add(1) + 1;
    if (fault().capture && nth == fault().capture) {
        fprintf(stderr, "cudaemu: capture %llu is invalidated (CUDAEMU_FAIL_CAPTURE)\n", (unsigned long long)nth);
        was = cudaStreamCaptureStatusInvalidated;
    }
    if (was == cudaStreamCaptureStatusInvalidated)
        return fail(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: the capture was invalidated");
    if (sticky()) return sticky();
    *graph = new cudaemu_graph{std::move(nodes)};
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamIsCapturing: stream %p is not live", (void *)s);
    *status = cudaStreamCaptureStatusNone;
    if (s) {
        std::lock_guard<std::mutex> g(s->mu);
        *status = s->capture;
    }
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
    *exec = nullptr;
    if (sticky()) return sticky();
    if (!graph || flags) return fail(cudaErrorInvalidValue, "cudaGraphInstantiateWithFlags: no graph, or flags");
    *exec = new cudaemu_graph_exec{graph->nodes};
    return cudaSuccess;
}

// Succeeds when the graphs have the same nodes in the same order, each of
// the same kind (the same kernel function or library call); then the
// executable takes the new graph's parameters.
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo *info) {
    if (sticky()) return sticky();
    if (!exec || !graph || !info) return fail(cudaErrorInvalidValue, "cudaGraphExecUpdate: a NULL argument");
    info->errorNode = info->errorFromNode = nullptr;
    if (exec->nodes.size() != graph->nodes.size()) {
        info->result = cudaGraphExecUpdateErrorTopologyChanged;
        cudaemu_set_error(cudaErrorGraphExecUpdateFailure, nullptr); // an expected outcome: no message
        return cudaErrorGraphExecUpdateFailure;
    }
    for (size_t i = 0; i < exec->nodes.size(); i++)
        if (exec->nodes[i].what != graph->nodes[i].what) {
            info->result = cudaGraphExecUpdateErrorFunctionChanged;
            cudaemu_set_error(cudaErrorGraphExecUpdateFailure, nullptr);
            return cudaErrorGraphExecUpdateFailure;
        }
    exec->nodes = graph->nodes;
    info->result = cudaGraphExecUpdateSuccess;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (sticky()) return sticky();
    if (!exec) return fail(cudaErrorInvalidValue, "cudaGraphLaunch: no executable graph");
    if (!s || !stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaGraphLaunch: stream %p is not live", (void *)s);
    for (const cudaemu_graph_node &n : exec->nodes) stream_enqueue(s, n.work, n.what);
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    if (sticky()) return sticky();
    *e = new cudaemu_event{std::chrono::steady_clock::time_point(), nullptr, 0, false, flags, false};
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
// Waits for a pending marker, which writes into the event (the runtime
// would release it later instead).
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    cudaEventSynchronize(e);
    delete e;
    return sticky();
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (sticky()) return sticky();
    if (!stream_ok(s)) return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: stream %p is not live", (void *)s);
    if (capturing(s)) {
        // A captured record orders work inside the capture only; the event
        // marks no point in time until it is recorded outside one.
        e->captured = true;
        e->recorded = false;
        return cudaSuccess;
    }
    e->captured = false;
    e->recorded = true;
    e->stream = s;
    if (!s) {
        e->at = std::chrono::steady_clock::now();
        e->seq = 0;
    } else {
        e->seq = stream_enqueue(s, [e] { e->at = std::chrono::steady_clock::now(); });
    }
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (e->captured) return fail(cudaErrorCapturedEvent, "cudaEventSynchronize: the event was recorded in a capture");
    if (e->recorded && e->stream) {
        if (!stream_ok(e->stream)) return cudaSuccess; // destroyed: its work is done
        stream_wait(e->stream, e->seq);
    }
    return sticky();
}
// cudaSuccess once the work before the event's record has run,
// cudaErrorNotReady before (a poisoned context wins, as on a GPU).
cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (sticky()) return sticky();
    if (e->captured) return fail(cudaErrorCapturedEvent, "cudaEventQuery: the event was recorded in a capture");
    if (!e->recorded || !e->stream || !stream_ok(e->stream)) return cudaSuccess;
    std::lock_guard<std::mutex> g(e->stream->mu);
    return e->stream->completed >= e->seq ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t stop) {
    if (sticky()) return sticky();
    if (start->captured || stop->captured)
        return fail(cudaErrorCapturedEvent, "cudaEventElapsedTime: an event was recorded in a capture");
    if (!start->recorded || !stop->recorded || (start->flags | stop->flags) & cudaEventDisableTiming)
        return fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: event not recorded or without timing");
    cudaEventSynchronize(start);
    cudaEventSynchronize(stop);
    *ms = std::chrono::duration<float, std::milli>(stop->at - start->at).count();
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    if (sticky()) return sticky(); // it stays: the context is gone
    const cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return sticky() ? sticky() : last_error; }

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorECCUncorrectable: return "cudaErrorECCUncorrectable";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorAssert: return "cudaErrorAssert";
    case cudaErrorHardwareStackError: return "cudaErrorHardwareStackError";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorInvalidAddressSpace: return "cudaErrorInvalidAddressSpace";
    case cudaErrorInvalidPc: return "cudaErrorInvalidPc";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
    case cudaErrorGraphExecUpdateFailure: return "cudaErrorGraphExecUpdateFailure";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "emulated error";
    }
}

} // extern "C"

/* ------------------------------------------------------------------------
 * kernel execution
 * ------------------------------------------------------------------------ */

namespace cudaemu {

thread_local block_state *cur_block;
thread_local thread_state *cur_thread;

namespace {

const size_t FIBER_STACK = (size_t)256 << 10;

enum fiber_state { READY, AT_BARRIER, AT_WARP, DONE };

struct fiber {
    thread_state ts;
    int linear;
    fiber_state state;
    fiber_context ctx;
    void *stack;
    void *asan_fake;
    void *tsan_fiber;
    unsigned bar_gen, warp_gen; // barriers passed: which sync object is next
    // warp exchange
    uint32_t xmask;
    int xsrc;
    uint64_t xval, xres;
};

struct executor {
    fiber_context sched;
    std::vector<fiber> fibers; // the first n run the current block
    int n;
    const std::function<void()> *body;
    fiber *cur;
    const char *kernel;
    block_state blk;
    std::vector<unsigned char> dyn;
    const void *sched_stack_bottom;
    size_t sched_stack_size;
    // TSan sync objects (their addresses): barriers alternate between two so
    // a thread past barrier k cannot release into what a slower one acquires
    // at barrier k.
    void *tsan_sched;
    char bar_sync[2], warp_sync[32][2], block_start, block_end;
    // scheduling (run_block)
    std::deque<int> ready; // fiber indices
    std::vector<int> warp_live, warp_arrived;
    int block_live, block_arrived;
    unsigned releases;
    ~executor() {
        for (fiber &f : fibers) {
            munmap(f.stack, FIBER_STACK);
            TSAN(__tsan_destroy_fiber(f.tsan_fiber));
        }
    }
};
thread_local executor *ex;
thread_local std::unique_ptr<executor> ex_owner; // frees it when the OS thread ends

[[noreturn]] void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void die(const char *fmt, ...) {
    executor *e = ex;
    fprintf(stderr, "cudaemu: kernel %s, block (%u,%u,%u): ", e ? e->kernel : "?", e ? e->blk.idx.x : 0,
            e ? e->blk.idx.y : 0, e ? e->blk.idx.z : 0);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

// Fiber -> scheduler.
void yield_to_scheduler(fiber *f) {
    executor *e = ex;
#ifdef CUDAEMU_ASAN
    __sanitizer_start_switch_fiber(f->state == DONE ? nullptr : &f->asan_fake, e->sched_stack_bottom, e->sched_stack_size);
#endif
    TSAN(__tsan_switch_to_fiber(e->tsan_sched, __tsan_switch_to_fiber_no_sync));
    switch_context(&f->ctx, &e->sched);
#ifdef CUDAEMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, &e->sched_stack_bottom, &e->sched_stack_size);
#endif
}

void fiber_main() {
    executor *e = ex;
    fiber *f = e->cur;
#ifdef CUDAEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &e->sched_stack_bottom, &e->sched_stack_size);
#endif
    TSAN(__tsan_acquire(&e->block_start));
    (*e->body)();
    TSAN(__tsan_release(&e->block_end));
    f->state = DONE;
    yield_to_scheduler(f);
    die("a finished fiber was resumed");
}

// Scheduler -> fiber, until it yields.
void resume(executor *e, fiber *f) {
    e->cur = f;
    cur_thread = &f->ts;
    void *fake = nullptr;
#ifdef CUDAEMU_ASAN
    __sanitizer_start_switch_fiber(&fake, f->stack, FIBER_STACK);
#endif
    TSAN(__tsan_switch_to_fiber(f->tsan_fiber, __tsan_switch_to_fiber_no_sync));
    switch_context(&e->sched, &f->ctx);
#ifdef CUDAEMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)fake;
}

const char *state_name(fiber_state s) {
    switch (s) {
    case READY: return "running";
    case AT_BARRIER: return "at __syncthreads";
    case AT_WARP: return "at a warp shuffle";
    case DONE: return "exited";
    }
    return "?";
}

// Scheduling is event-driven: the scheduler resumes fibers from a ready
// queue and, as each one stops, counts arrivals; a warp (the block) is
// released the moment its last live lane (thread) arrives. Released threads
// are queued in forward order at one release and reverse order at the next.
void make_ready(executor *e, int lo, int hi, fiber_state from) {
    const bool reverse = (e->releases++ & 1u) != 0;
    for (int k = lo; k < hi; k++) {
        const int i = reverse ? hi - 1 - (k - lo) : k;
        if (e->fibers[i].state == from) {
            e->fibers[i].state = READY;
            e->ready.push_back(i);
        }
    }
}

// Release warp w if every live lane has reached a shuffle.
void maybe_release_warp(executor *e, int w) {
    if (e->warp_arrived[w] == 0 || e->warp_arrived[w] != e->warp_live[w]) return;
    const int w0 = w * 32, w1 = w0 + 32 < e->n ? w0 + 32 : e->n;
    const bool some_exited = e->warp_live[w] < w1 - w0;
    for (int i = w0; i < w1; i++) {
        fiber &f = e->fibers[i];
        if (f.state != AT_WARP) continue;
        for (int l = 0; some_exited && l < w1 - w0; l++)
            if ((f.xmask >> l & 1u) && e->fibers[w0 + l].state == DONE)
                die("thread %d shuffles with mask %#x but lane %d has exited", f.linear, f.xmask, l);
        if (f.xsrc >= 0) {
            if (f.xsrc >= w1 - w0) die("thread %d reads lane %d of a %d-lane warp", f.linear, f.xsrc, w1 - w0);
            f.xres = e->fibers[w0 + f.xsrc].xval;
        }
    }
    e->warp_arrived[w] = 0;
    make_ready(e, w0, w1, AT_WARP);
}

// Release the block barrier if every live thread has reached it.
void maybe_release_block(executor *e) {
    if (e->block_arrived == 0 || e->block_arrived != e->block_live) return;
    e->block_arrived = 0;
    make_ready(e, 0, e->n, AT_BARRIER);
}

void run_block(executor *e) {
    const int n = e->n;
    for (int i = 0; i < n; i++) {
        fiber &f = e->fibers[i];
        f.state = READY;
        f.bar_gen = f.warp_gen = 0;
#ifdef CUDAEMU_ASM_SWITCH
        // The frame cudaemu_switch pops: control words, six registers, and
        // fiber_main as the return address, placed so fiber_main starts with
        // the stack alignment of a call.
        uint64_t *top = (uint64_t *)((char *)f.stack + FIBER_STACK);
        uint64_t *frame = top - 9;
        uint32_t mxcsr;
        uint16_t fpcw;
        asm volatile("stmxcsr %0" : "=m"(mxcsr));
        asm volatile("fnstcw %0" : "=m"(fpcw));
        frame[0] = (uint64_t)mxcsr | (uint64_t)fpcw << 32;
        for (int r = 1; r <= 6; r++) frame[r] = 0;
        frame[7] = (uint64_t)(uintptr_t)&fiber_main;
        frame[8] = 0;
        f.ctx = frame;
#else
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = FIBER_STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
#endif
    }
    if (!e->dyn.empty()) memset(e->dyn.data(), 0xff, e->dyn.size());
    TSAN(__tsan_release(&e->block_start));
    const int n_warps = (n + 31) / 32;
    e->warp_live.assign(n_warps, 0);
    e->warp_arrived.assign(n_warps, 0);
    for (int i = 0; i < n; i++) e->warp_live[i >> 5]++;
    e->block_live = n;
    e->block_arrived = 0;
    e->ready.clear();
    e->releases = e->blk.idx.x + e->blk.idx.y;
    for (int i = 0; i < n; i++) e->fibers[i].state = AT_BARRIER; // released together below
    e->block_arrived = n;
    maybe_release_block(e);
    while (!e->ready.empty()) {
        fiber *f = &e->fibers[e->ready.front()];
        e->ready.pop_front();
        resume(e, f);
        const int w = f->linear >> 5;
        switch (f->state) {
        case AT_WARP:
            e->warp_arrived[w]++;
            maybe_release_warp(e, w);
            break;
        case AT_BARRIER:
            e->block_arrived++;
            maybe_release_block(e);
            break;
        case DONE:
            e->warp_live[w]--;
            e->block_live--;
            maybe_release_warp(e, w);
            maybe_release_block(e);
            break;
        case READY: die("thread %d stopped without a reason", f->linear);
        }
    }
    if (e->block_live == 0) {
        TSAN(__tsan_acquire(&e->block_end));
        return;
    }
    for (int i = 0; i < n; i++)
        fprintf(stderr, "  thread %d: %s\n", i, state_name(e->fibers[i].state));
    die("deadlock: threads wait at different barriers (divergent __syncthreads or shuffle)");
}

executor *get_executor(int threads) {
    if (!ex) {
        ex_owner.reset(new executor());
        ex = ex_owner.get();
    }
    executor *e = ex;
    while ((int)e->fibers.size() < threads) {
        fiber f{};
        f.stack = mmap(nullptr, FIBER_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f.stack == MAP_FAILED) {
            fprintf(stderr, "cudaemu: cannot map a fiber stack\n");
            abort();
        }
        TSAN(f.tsan_fiber = __tsan_create_fiber(0));
        e->fibers.push_back(f);
    }
    e->n = threads;
    return e;
}

// One launch: blocks handed out by an atomic counter.
struct grid_work {
    const launch_cfg *c;
    const char *kernel;
    const std::function<void()> *body;
    int threads;
    uint64_t n_blocks;
    std::atomic<uint64_t> next{0};
};

// Run blocks of `w` on the calling OS thread until none is left.
void run_blocks(grid_work &w) {
    const launch_cfg &c = *w.c;
    executor *e = get_executor(w.threads);
    TSAN(e->tsan_sched = __tsan_get_current_fiber());
    e->body = w.body;
    e->kernel = w.kernel;
    // 128-byte aligned, as on a GPU (wmma needs 32): the vector has slack.
    e->dyn.assign(c.smem ? c.smem + 127 : 0, 0xff);
    e->blk.dynamic_smem =
        e->dyn.empty() ? nullptr : (void *)(((uintptr_t)e->dyn.data() + 127) & ~(uintptr_t)127);
    e->blk.dim = uint3{c.block.x, c.block.y, c.block.z};
    e->blk.grid = uint3{c.grid.x, c.grid.y, c.grid.z};
    for (int i = 0; i < w.threads; i++) {
        fiber &f = e->fibers[i];
        f.linear = i;
        f.ts.idx = uint3{(unsigned)i % c.block.x, (unsigned)i / c.block.x % c.block.y, (unsigned)i / (c.block.x * c.block.y)};
    }
    block_state *saved_block = cur_block;
    thread_state *saved_thread = cur_thread;
    cur_block = &e->blk;
    for (;;) {
        const uint64_t b = w.next.fetch_add(1);
        if (b >= w.n_blocks) break;
        e->blk.idx = uint3{(unsigned)(b % c.grid.x), (unsigned)(b / c.grid.x % c.grid.y),
                           (unsigned)(b / ((uint64_t)c.grid.x * c.grid.y))};
        run_block(e);
    }
    cur_block = saved_block;
    cur_thread = saved_thread;
}

// Worker OS threads that run blocks beside the launching thread (the GPU's
// blocks are independent, so a kernel that depends on their order is a bug
// this shows). CUDAEMU_THREADS sets how many OS threads in all (default: the
// CPUs, at most 16). A launch from a second host thread waits its turn.
class worker_pool {
  public:
    worker_pool() {
        const char *s = getenv("CUDAEMU_THREADS");
        int n = s && *s ? atoi(s) : (int)std::thread::hardware_concurrency();
        if (n < 1) n = 1;
        if (n > 16 && !(s && *s)) n = 16;
        for (int i = 1; i < n; i++) workers_.emplace_back([this] { loop(); });
    }
    ~worker_pool() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto &t : workers_) t.join();
    }
    void run(grid_work &w) {
        std::lock_guard<std::mutex> launch_guard(launch_mu_);
        if (workers_.empty() || w.n_blocks == 1) {
            run_blocks(w);
            return;
        }
        {
            std::lock_guard<std::mutex> g(mu_);
            work_ = &w;
            busy_ = (int)workers_.size();
            generation_++;
        }
        cv_.notify_all();
        run_blocks(w);
        std::unique_lock<std::mutex> g(mu_);
        done_cv_.wait(g, [this] { return busy_ == 0; });
        work_ = nullptr;
    }

  private:
    void loop() {
        uint64_t seen = 0;
        for (;;) {
            grid_work *w;
            {
                std::unique_lock<std::mutex> g(mu_);
                cv_.wait(g, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
                w = work_;
            }
            run_blocks(*w);
            std::lock_guard<std::mutex> g(mu_);
            if (--busy_ == 0) done_cv_.notify_one();
        }
    }
    std::mutex launch_mu_, mu_;
    std::condition_variable cv_, done_cv_;
    std::vector<std::thread> workers_;
    grid_work *work_ = nullptr;
    int busy_ = 0;
    uint64_t generation_ = 0;
    bool stop_ = false;
};

worker_pool &pool() {
    static worker_pool p;
    return p;
}

} // namespace

// CUDAEMU_LAUNCH_LOG=PATH: the name of every kernel launched is appended to
// PATH, one a line, so a test can check which kernels a call chose.
static void log_launch(const char *kernel) {
    const char *path = getenv("CUDAEMU_LAUNCH_LOG");
    if (!path || !*path) return;
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", kernel);
    fclose(f);
}

void run_grid(const launch_cfg &c, const char *kernel, const void *fn, const std::function<void()> &body) {
    const uint64_t threads = (uint64_t)c.block.x * c.block.y * c.block.z;
    if (!c.grid.x || !c.grid.y || !c.grid.z || !threads || threads > 1024 || c.block.z > 64 || c.grid.y > 65535 ||
        c.grid.z > 65535) {
        char why[256];
        snprintf(why, sizeof why, "launch of %s: invalid configuration grid (%u,%u,%u) block (%u,%u,%u)", kernel, c.grid.x,
                 c.grid.y, c.grid.z, c.block.x, c.block.y, c.block.z);
        cudaemu_set_error(cudaErrorInvalidConfiguration, why);
        return;
    }
    if (c.smem > cudaemu_func_smem_limit(fn)) {
        char why[256];
        snprintf(why, sizeof why, "launch of %s: %zu bytes of dynamic shared memory, above its limit of %zu%s", kernel,
                 c.smem, cudaemu_func_smem_limit(fn),
                 c.smem <= EMU_SMEM_OPTIN ? " (raise it with cudaFuncSetAttribute first)" : "");
        cudaemu_set_error(cudaErrorInvalidValue, why);
        return;
    }
    if (!stream_ok(c.stream)) {
        cudaemu_set_error(cudaErrorInvalidResourceHandle, "launch on a stream that is not live");
        return;
    }
    // A dead context runs nothing (cudaGetLastError reports it); an
    // injected fault takes the launch's place.
    if (sticky() || injected_launch_fault(kernel)) return;
    log_launch(kernel);
    // The launch runs later, in stream order; everything it needs is copied.
    cudaemu_enqueue(c.stream, [c, kernel, body, threads] {
        grid_work w;
        w.c = &c;
        w.kernel = kernel;
        w.body = &body;
        w.threads = (int)threads;
        w.n_blocks = (uint64_t)c.grid.x * c.grid.y * c.grid.z;
        pool().run(w);
    }, fn);
}

void *dynamic_smem() {
    if (!ex || !ex->blk.dynamic_smem) die("extern __shared__ memory used by a launch that asked for none");
    return ex->blk.dynamic_smem;
}

void syncthreads() {
    fiber *f = ex->cur;
    void *sync = &ex->bar_sync[f->bar_gen++ & 1u];
    TSAN(__tsan_release(sync));
    f->state = AT_BARRIER;
    yield_to_scheduler(f);
    TSAN(__tsan_acquire(sync));
    (void)sync;
}

int lane_id() { return ex->cur->linear & 31; }

uint64_t warp_exchange(uint32_t mask, uint64_t v, int src, bool orders_memory) {
    fiber *f = ex->cur;
    void *sync = &ex->warp_sync[f->linear >> 5 & 31][f->warp_gen & 1u];
    if (orders_memory) {
        f->warp_gen++;
        TSAN(__tsan_release(sync));
    }
    f->xmask = mask;
    f->xval = v;
    f->xsrc = src;
    f->xres = v;
    f->state = AT_WARP;
    yield_to_scheduler(f);
    if (orders_memory) {
        TSAN(__tsan_acquire(sync));
    }
    (void)sync;
    return f->xres;
}

void check_kernel_pointer(const char *kernel, int index, const void *p) {
    if (!p || cudaemu_is_device_range(p, 0) || is_pinned_range(p, 0)) return;
    fprintf(stderr, "cudaemu: kernel %s: argument %d (%p) is neither device nor pinned host memory\n", kernel, index, p);
    abort();
}

} // namespace cudaemu

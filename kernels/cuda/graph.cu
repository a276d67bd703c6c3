// CUDA graphs for decode steps. A step is a few hundred small launches and
// copies; queued one by one, the GPU idles between them while the host
// enqueues. Recorded as a graph and launched at once, the GPU runs them
// back to back.
//
// Every step is recorded afresh (stream capture costs the host about what
// queuing the launches would), so what changes from step to step (token
// ids, positions, KV lengths, the attention plan) needs no special
// handling. What is kept is the executable graph of each batch size: a new
// recording of the same shape updates it in place (cudaGraphExecUpdate,
// cheap) and only a changed shape (an attention plan with more splits, a
// scratch buffer that grew) instantiates a new one.
#include "kernels/cuda/cuda_internal.h"

#include <string.h>

// cuBLAS allocates scratch on first use unless given its own; an
// allocation inside a recording is what to avoid. 32 MiB is what NVIDIA
// suggests for Hopper.
#define CUDA_BLAS_WORKSPACE ((size_t)32 << 20)

int cuda_graphs_create(cuda_backend *cb, pd_error *err) {
    cudaError_t e = cudaEventCreateWithFlags(&cb->graph_done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cb->graph_done = NULL;
        return cuda_fail(err, e, "cudaEventCreate (graphs)");
    }
    int rc = cuda_malloc(cb, &cb->blas_workspace, CUDA_BLAS_WORKSPACE, "the cuBLAS workspace", err);
    if (rc) return rc;
    const cublasStatus_t bs = cublasSetWorkspace(cb->cublas, cb->blas_workspace, CUDA_BLAS_WORKSPACE);
    return bs == CUBLAS_STATUS_SUCCESS ? PD_OK : cublas_fail(err, bs, "cublasSetWorkspace");
}

void cuda_graphs_destroy(cuda_backend *cb) {
    if (cb->capturing) {
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(cb->stream, &g) == cudaSuccess && g) (void)cudaGraphDestroy(g);
        cb->capturing = false;
    }
    for (int i = 0; i < PD_GRAPH_BUCKETS; i++)
        if (cb->graph_exec[i]) (void)cudaGraphExecDestroy(cb->graph_exec[i]);
    if (cb->graph_done) (void)cudaEventDestroy(cb->graph_done);
    // After cublasDestroy (the caller's order): the handle may use it until then.
    if (cb->blas_workspace) (void)cudaFree(cb->blas_workspace);
    (void)cudaGetLastError();
}

int cuda_graph_begin(pd_backend *be, int bucket, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->capturing) return pd_errorf(err, PD_EINVAL, "cuda backend: a graph is already being recorded");
    if (cb->graphs_off) return pd_errorf(err, PD_EUNSUPPORTED, "cuda backend: graphs are off after a failed recording");
    if (bucket < 1 || bucket > PD_GRAPH_BUCKETS)
        return pd_errorf(err, PD_EUNSUPPORTED, "cuda backend: no graph for a batch of %d (1..%d)", bucket,
                         PD_GRAPH_BUCKETS);
    int rc = cuda_enter(cb, err);
    if (!rc) rc = cuda_take_deferred(cb, err);
    if (rc) return rc;
    // Relaxed: an allocation the step makes (a KV stream outgrowing its
    // slab) is allowed while recording; it is not a device wait.
    const cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeRelaxed);
    if (e != cudaSuccess) {
        rc = cuda_fail(err, e, "cudaStreamBeginCapture");
        if (rc != PD_EDEVICE) {
            cb->graphs_off = true;
            rc = PD_EUNSUPPORTED;
        }
        return rc;
    }
    cb->capturing = true;
    cb->capture_bucket = bucket;
    return PD_OK;
}

// Whether x now runs g's parameters (same shape); CUDA 12 changed the call.
static bool exec_update(cudaGraphExec_t x, cudaGraph_t g) {
#if CUDART_VERSION >= 12000
    cudaGraphExecUpdateResultInfo info;
    memset(&info, 0, sizeof info);
    return cudaGraphExecUpdate(x, g, &info) == cudaSuccess;
#else
    cudaGraphNode_t bad = NULL;
    cudaGraphExecUpdateResult result;
    return cudaGraphExecUpdate(x, g, &bad, &result) == cudaSuccess;
#endif
}

// The step's graph for its bucket: the last one updated with `g`, or a new
// one when the shapes differ. PD_OK or a cuda_fail code.
static int bucket_exec(cuda_backend *cb, cudaGraph_t g, cudaGraphExec_t *out, pd_error *err) {
    cudaGraphExec_t *slot = &cb->graph_exec[cb->capture_bucket - 1];
    if (*slot) {
        if (exec_update(*slot, g)) {
            *out = *slot;
            return PD_OK;
        }
        (void)cudaGetLastError(); // a different shape is no failure: build anew
        (void)cudaGraphExecDestroy(*slot);
        *slot = NULL;
    }
    const cudaError_t e = cudaGraphInstantiateWithFlags(slot, g, 0);
    if (e != cudaSuccess) {
        *slot = NULL;
        return cuda_fail(err, e, "cudaGraphInstantiateWithFlags");
    }
    cb->counters.graph_builds++;
    *out = *slot;
    return PD_OK;
}

int cuda_graph_end(pd_backend *be, bool launch, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    if (!cb->capturing) return pd_errorf(err, PD_EINVAL, "cuda backend: no graph is being recorded");
    int rc = cuda_enter(cb, err);
    cudaGraph_t g = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(cb->stream, &g);
    cb->capturing = false;
    // The staged uploads become ordinary in-flight records: they retire on
    // graph_done, recorded below after a launch (dropped, they were never
    // copied, and waiting for an older graph is merely early).
    cb->ring_pending = 0;
    if (!rc && e != cudaSuccess)
        rc = cuda_fail(err, e, "cudaStreamEndCapture (an operation of the step could not be recorded)");
    if (!rc && launch && !(rc = bucket_exec(cb, g, &exec, err)) &&
        (e = cudaGraphLaunch(exec, cb->stream)) != cudaSuccess)
        rc = cuda_fail(err, e, "cudaGraphLaunch");
    if (g) (void)cudaGraphDestroy(g);
    if (rc) {
        // Nothing ran. Unless the device is dead, the step runs again
        // without a graph, and so do later ones (a recording that failed
        // once would again).
        if (rc == PD_EDEVICE) return rc;
        cb->graphs_off = true;
        pd_error_prefix(err, "CUDA graph (the step runs without one)");
        if (err) err->code = PD_EUNSUPPORTED;
        return PD_EUNSUPPORTED;
    }
    if (!launch) return PD_OK;
    cb->counters.graph_launches++;
    if (cudaEventRecord(cb->graph_done, cb->stream) == cudaSuccess) return PD_OK;
    // Without the event the ring cannot tell when the graph's copies are
    // done: wait for them here.
    (void)cudaGetLastError();
    e = cuda_stream_wait(cb);
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "waiting for a graph");
}

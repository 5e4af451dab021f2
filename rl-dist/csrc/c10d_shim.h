// C interface of the c10d shim: every function catches every C++ exception and reports it as an
// error string, so nothing unwinds into Rust.
//
// Functions returning `char*` return NULL on success, or a heap-allocated NUL-terminated message
// that the caller releases with `rl_c10d_free_error`.
// Tensors are passed as `at::Tensor*` (what tch's `Tensor::as_ptr` holds), typed `void*` here.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rl_c10d_group rl_c10d_group;
// An asynchronous collective in flight (c10d's `Work`).
typedef struct rl_c10d_work rl_c10d_work;

// Reduction codes shared with Rust's `ReduceOp` (only the ones c10d backends execute natively).
enum { RL_C10D_SUM = 0, RL_C10D_MAX = 1, RL_C10D_MIN = 2 };
// Backend codes shared with Rust's `Backend`.
enum { RL_C10D_GLOO = 0, RL_C10D_NCCL = 1 };

// 1 when this build can create NCCL groups (libtorch_cuda and the CUDA/NCCL headers were found).
int rl_c10d_has_nccl(void);

// Rendezvous through a TCPStore at `addr:port` (rank 0 hosts it) and create the backend.
// `gloo_iface` / `gloo_host` pick Gloo's device (interface name or local address); empty = default.
char* rl_c10d_group_new(
    int backend,
    const char* addr,
    uint16_t port,
    int rank,
    int world_size,
    int64_t timeout_ms,
    const char* gloo_iface,
    const char* gloo_host,
    rl_c10d_group** out);
void rl_c10d_group_free(rl_c10d_group* group);

char* rl_c10d_all_reduce(rl_c10d_group* group, void* tensor, int op, int64_t timeout_ms);
char* rl_c10d_broadcast(rl_c10d_group* group, void* tensor, int src, int64_t timeout_ms);
// `outputs` holds `n_outputs` (= world size) preallocated tensors shaped like `input`.
char* rl_c10d_all_gather(
    rl_c10d_group* group,
    void* const* outputs,
    int n_outputs,
    void* input,
    int64_t timeout_ms);
// `input` is 1-D of `world_size * n` elements, `output` 1-D of `n`: rank r receives the
// reduction of every rank's elements `[r * n, (r + 1) * n)` (c10d's `_reduce_scatter_base`).
char* rl_c10d_reduce_scatter(
    rl_c10d_group* group,
    void* output,
    void* input,
    int op,
    int64_t timeout_ms);
// `input` is 1-D of `n` elements, `output` 1-D of `world_size * n`: every rank's `input`
// concatenated in rank order (c10d's `_allgather_base`).
char* rl_c10d_all_gather_flat(
    rl_c10d_group* group,
    void* output,
    void* input,
    int64_t timeout_ms);
// `rl_c10d_all_gather_flat` started and not waited for: `*out` is the work in flight, which
// `rl_c10d_work_wait` completes (bounded by `timeout_ms`) and `rl_c10d_work_free` releases. The
// backend keeps `output` and `input` alive until the collective completes. Collectives issued
// meanwhile are allowed; every rank must issue them all in the same order.
char* rl_c10d_all_gather_flat_start(
    rl_c10d_group* group,
    void* output,
    void* input,
    int64_t timeout_ms,
    rl_c10d_work** out);
char* rl_c10d_work_wait(rl_c10d_work* work);
void rl_c10d_work_free(rl_c10d_work* work);
char* rl_c10d_barrier(rl_c10d_group* group, int64_t timeout_ms);
// Changes the backend's bound on every later collective.
char* rl_c10d_set_timeout(rl_c10d_group* group, int64_t timeout_ms);

void rl_c10d_free_error(char* error);

#ifdef __cplusplus
}
#endif

// The one translation unit binding Rust to PyTorch's c10d: TCPStore rendezvous plus a Gloo (and,
// on CUDA builds with NCCL headers, NCCL) backend, with every call wrapped in try/catch.
#include "c10d_shim.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if defined(RL_DIST_NCCL) && __has_include(<nccl.h>) && __has_include(<cuda_runtime.h>)
#define RL_DIST_HAS_NCCL 1
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#else
#define RL_DIST_HAS_NCCL 0
#endif

struct rl_c10d_group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
};

struct rl_c10d_work {
  c10::intrusive_ptr<c10d::Work> work;
  int64_t timeout_ms;
};

namespace {

char* to_error(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

// c10::Error's what() carries a C++ backtrace; the message without it is what users need.
std::string describe(const c10::Error& e) {
  return e.what_without_backtrace();
}

// Runs `body`, turning any exception into an error string (NULL = success).
template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return to_error(describe(e));
  } catch (const std::exception& e) {
    return to_error(e.what());
  } catch (...) {
    return to_error("unknown C++ exception");
  }
}

// Waits for `work`, bounded: the backend's own timeout normally fires first; this is a backstop.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, int64_t timeout_ms) {
  auto backstop = std::chrono::milliseconds(timeout_ms * 2 + 1000);
  if (!work->wait(backstop)) {
    throw std::runtime_error("work did not complete");
  }
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case RL_C10D_SUM:
      return c10d::ReduceOp::SUM;
    case RL_C10D_MAX:
      return c10d::ReduceOp::MAX;
    case RL_C10D_MIN:
      return c10d::ReduceOp::MIN;
    default:
      throw std::invalid_argument("unknown reduce op code " + std::to_string(op));
  }
}

} // namespace

extern "C" {

int rl_c10d_has_nccl(void) {
  return RL_DIST_HAS_NCCL;
}

char* rl_c10d_group_new(
    int backend,
    const char* addr,
    uint16_t port,
    int rank,
    int world_size,
    int64_t timeout_ms,
    const char* gloo_iface,
    const char* gloo_host,
    rl_c10d_group** out) {
  *out = nullptr;
  return guarded([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions store_opts;
    store_opts.port = port;
    store_opts.isServer = rank == 0;
    store_opts.numWorkers = static_cast<std::size_t>(world_size);
    store_opts.waitWorkers = true;
    store_opts.timeout = timeout;
    auto group = std::make_unique<rl_c10d_group>();
    group->store = c10::make_intrusive<c10d::TCPStore>(std::string(addr), store_opts);

    if (backend == RL_C10D_GLOO) {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      std::string iface(gloo_iface);
      std::string host(gloo_host);
      if (!iface.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      } else if (!host.empty()) {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      group->backend =
          c10::make_intrusive<c10d::ProcessGroupGloo>(group->store, rank, world_size, opts);
    } else if (backend == RL_C10D_NCCL) {
#if RL_DIST_HAS_NCCL
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      group->backend =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(group->store, rank, world_size, opts);
#else
      throw std::runtime_error(
          "this build has no NCCL: libtorch_cuda or the CUDA/NCCL headers were missing at build time");
#endif
    } else {
      throw std::invalid_argument("unknown backend code " + std::to_string(backend));
    }
    *out = group.release();
  });
}

void rl_c10d_group_free(rl_c10d_group* group) {
  try {
    delete group;
  } catch (...) {
    // Destructors of c10d objects do not throw in practice; never let one cross into Rust.
  }
}

char* rl_c10d_all_reduce(rl_c10d_group* group, void* tensor, int op, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<at::Tensor> tensors{*static_cast<at::Tensor*>(tensor)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(group->backend->allreduce(tensors, opts), timeout_ms);
  });
}

char* rl_c10d_broadcast(rl_c10d_group* group, void* tensor, int src, int64_t timeout_ms) {
  return guarded([&] {
    std::vector<at::Tensor> tensors{*static_cast<at::Tensor*>(tensor)};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    opts.rootTensor = 0;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(group->backend->broadcast(tensors, opts), timeout_ms);
  });
}

char* rl_c10d_all_gather(
    rl_c10d_group* group,
    void* const* outputs,
    int n_outputs,
    void* input,
    int64_t timeout_ms) {
  return guarded([&] {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int i = 0; i < n_outputs; ++i) {
      outs[0].push_back(*static_cast<at::Tensor*>(outputs[i]));
    }
    std::vector<at::Tensor> ins{*static_cast<at::Tensor*>(input)};
    c10d::AllgatherOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(group->backend->allgather(outs, ins, opts), timeout_ms);
  });
}

char* rl_c10d_reduce_scatter(
    rl_c10d_group* group,
    void* output,
    void* input,
    int op,
    int64_t timeout_ms) {
  return guarded([&] {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(
        group->backend->_reduce_scatter_base(
            *static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), opts),
        timeout_ms);
  });
}

char* rl_c10d_all_gather_flat(
    rl_c10d_group* group,
    void* output,
    void* input,
    int64_t timeout_ms) {
  return guarded([&] {
    c10d::AllgatherOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(
        group->backend->_allgather_base(
            *static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), opts),
        timeout_ms);
  });
}

char* rl_c10d_all_gather_flat_start(
    rl_c10d_group* group,
    void* output,
    void* input,
    int64_t timeout_ms,
    rl_c10d_work** out) {
  return guarded([&] {
    c10d::AllgatherOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto work = group->backend->_allgather_base(
        *static_cast<at::Tensor*>(output), *static_cast<at::Tensor*>(input), opts);
    *out = new rl_c10d_work{std::move(work), timeout_ms};
  });
}

char* rl_c10d_work_wait(rl_c10d_work* work) {
  return guarded([&] { wait_for(work->work, work->timeout_ms); });
}

void rl_c10d_work_free(rl_c10d_work* work) {
  delete work;
}

char* rl_c10d_barrier(rl_c10d_group* group, int64_t timeout_ms) {
  return guarded([&] {
    c10d::BarrierOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    wait_for(group->backend->barrier(opts), timeout_ms);
  });
}

char* rl_c10d_set_timeout(rl_c10d_group* group, int64_t timeout_ms) {
  // A virtual call through `Backend`: libtorch's own `ProcessGroupGloo::setTimeout` runs.
  return guarded([&] { group->backend->setTimeout(std::chrono::milliseconds(timeout_ms)); });
}

void rl_c10d_free_error(char* error) {
  std::free(error);
}

} // extern "C"

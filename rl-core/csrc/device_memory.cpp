// The caching allocator's memory statistics of an accelerator (CUDA), through c10's
// device-generic `DeviceAllocator` interface (c10/core/CachingDeviceAllocator.h), which needs no
// CUDA headers: the same figures as `torch.cuda.memory_allocated`/`max_memory_allocated`/
// `memory_reserved`/`max_memory_reserved`. Every call is wrapped in try/catch; an error comes
// back as a malloc'd string (NULL = success) that Rust frees with `rl_core_free_error`.
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace {

char* to_error(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, message.c_str(), message.size() + 1);
  }
  return out;
}

template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return to_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return to_error(e.what());
  } catch (...) {
    return to_error("unknown C++ exception");
  }
}

c10::DeviceAllocator* cuda_allocator() {
  c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
  auto* device_allocator = dynamic_cast<c10::DeviceAllocator*>(allocator);
  if (device_allocator == nullptr) {
    throw std::runtime_error(
        "no CUDA caching allocator is registered (a CPU build of libtorch, or libtorch_cuda not loaded)");
  }
  return device_allocator;
}

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

}  // namespace

extern "C" {

// out[0..4]: bytes allocated now, their peak, bytes reserved (cached) now, their peak.
char* rl_core_cuda_memory(int device, int64_t* out) {
  return guarded([&] {
    auto stats = cuda_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    out[0] = stats.allocated_bytes[kAggregate].current;
    out[1] = stats.allocated_bytes[kAggregate].peak;
    out[2] = stats.reserved_bytes[kAggregate].current;
    out[3] = stats.reserved_bytes[kAggregate].peak;
  });
}

char* rl_core_cuda_reset_peak(int device) {
  return guarded([&] { cuda_allocator()->resetPeakStats(static_cast<c10::DeviceIndex>(device)); });
}

void rl_core_free_error(char* error) { std::free(error); }

}  // extern "C"

// What the shim's C++ files share: C++ exceptions become a malloc'd error text (freed by
// `rl_onednn_free`, bound in src/ffi.rs) instead of crossing into Rust; the kernels'
// per-instruction-set clones.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>

// A kernel compiled once per instruction set (the helpers it inlines with it), the one for this
// CPU picked when the library loads.
#if defined(__x86_64__) && defined(__GNUC__)
#define RL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RL_CLONES
#endif

namespace rl_shim {

inline char* error_text(const char* what) {
  const size_t n = std::strlen(what) + 1;
  char* out = static_cast<char*>(std::malloc(n));
  if (out != nullptr) std::memcpy(out, what, n);
  return out;
}

// Runs `body`; null when it returns, its exception's text when it throws.
template <class F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return error_text(e.what());
  } catch (...) {
    return error_text("unknown C++ exception");
  }
}

}  // namespace rl_shim

// What the shim's C entry points share: C++ exceptions become a malloc'd error text (freed by
// `rl_onednn_free`, bound in src/gemm/ffi.rs) instead of crossing into Rust.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>

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

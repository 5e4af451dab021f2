// What the shim's C++ files share: C++ exceptions become a malloc'd error text (freed by
// `rl_onednn_free`, bound in src/ffi.rs) instead of crossing into Rust; the kernels'
// per-instruction-set clones; a vectorizable exponential.
#pragma once

#include <cstdint>
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

// A helper inlined into each of its callers' clones (so it runs in their instruction set).
#define RL_INLINE inline __attribute__((always_inline))

namespace rl_shim {

// e^x to about 2 ulp in a form the compiler vectorizes (libm's `expf` is a call per element):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' polynomial, 2^n put into the exponent
// bits. Inputs are clamped to where float's e^x is finite and normal: below -87.3 it gives
// 1.2e-38 rather than less, which SiLU, a log-sum-exp and a softmax's weights all absorb.
inline float exp_approx(float x) {
  x = x < -87.3365447505531f ? -87.3365447505531f : x;
  x = x > 88.0f ? 88.0f : x;
  // round to nearest by the float adder itself (1.5 * 2^23 leaves no fraction bits)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return er * __builtin_bit_cast(float, bits);
}

// e^x where that is a normal float, else 0 (x below -87.3: exactly 0 for -inf, a masked key or
// a forbidden token, instead of exp_approx's clamped 1.2e-38), vectorizable too.
inline float exp_or_zero(float x) {
  return x < -87.3365447505531f ? 0.0f : exp_approx(x);
}

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

// A decode step's attention on the CPU (one query per row; see `Attention::one_query_attention`
// in src/model.rs).
//
// libtorch computes it (through `scaled_dot_product_attention` or two `matmul`s) as one tiny
// matrix product per row and head in MKL's generic kernels, on one thread: a quarter of the
// main thread's time in a greedy rollout of SmolLM2-135M at 32 rows. Here each row's key head
// is read once for its whole group of query heads, in float32, split over libtorch's intra-op
// threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "shim.h"

namespace {

RL_INLINE float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y += a * x
RL_INLINE void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#if defined(__GNUC__) && !defined(__clang__)
#define RL_VECTOR 1
// 16 floats (one AVX-512 register; two AVX2 ones, four SSE ones: GCC splits it where needed).
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));

// Folds two vectors of partial sums into one holding half as many partials of each, in order:
// lanes that were [a: n partials of each of its k sums] and [b: likewise] become [a's k sums,
// b's k sums] with n / 2 partials each.
RL_INLINE v16 fold(v16 a, v16 b, i16v lo, i16v hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// The 16 dot products of `q` (D floats) with rows t..t+15 of `key` (row stride `stride`), one
// vector of partial sums a row, folded into one vector of 16 sums (15 folds instead of 16
// horizontal reductions).
template <int D>
RL_INLINE v16 dot16(const float* q, const float* key, int64_t stride) {
  static_assert(D % 16 == 0, "D must be a multiple of 16");
  v16 qv[D / 16];
  for (int c = 0; c < D / 16; ++c) std::memcpy(&qv[c], q + 16 * c, sizeof(v16));
  v16 acc[16];
  for (int j = 0; j < 16; ++j) {
    const float* row = key + j * stride;
    v16 sum = {};
    for (int c = 0; c < D / 16; ++c) {
      v16 kv;
      std::memcpy(&kv, row + 16 * c, sizeof(v16));
      sum += qv[c] * kv;
    }
    acc[j] = sum;
  }
  const i16v lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16v hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16v lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16v hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i16v lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16v hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i16v lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i16v hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 l1[8], l2[4], l3[2];
  for (int j = 0; j < 8; ++j) l1[j] = fold(acc[2 * j], acc[2 * j + 1], lo1, hi1);
  for (int j = 0; j < 4; ++j) l2[j] = fold(l1[2 * j], l1[2 * j + 1], lo2, hi2);
  for (int j = 0; j < 2; ++j) l3[j] = fold(l2[2 * j], l2[2 * j + 1], lo3, hi3);
  return fold(l3[0], l3[1], lo4, hi4);
}
#endif

// The operands of one call, as raw pointers and strides.
struct Operands {
  const float* q;  // [b, heads, d] contiguous
  const float* k;
  const float* v;
  const bool* mask;  // [b, len] contiguous
  float* out;        // [b, heads, d] contiguous
  int64_t heads, kv_heads, group, len, d;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  float scale;
};

// Tasks [begin, end) of `b * kv_heads`: one row's key head and its group of query heads.
// `D` is the head width when known at compile time (16, 32, 64 and 128: the loops then unroll
// into registers; 16 is the tiny test models' width, where the generic path's scalar loops took
// a third of a multi-turn GRPO run's time), 0 for any other (`x.d`).
template <int D>
RL_INLINE void attend_tasks(const Operands& x, int64_t begin, int64_t end, float* p) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t group = x.group, len = x.len, d = D > 0 ? D : x.d;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i / x.kv_heads, kv = i % x.kv_heads;
    const float* key = x.k + row * x.ks0 + kv * x.ks1;
    const float* value = x.v + row * x.vs0 + kv * x.vs1;
    const bool* m = x.mask + row * len;
    const float* query = x.q + (row * x.heads + kv * group) * d;
    float* o = x.out + (row * x.heads + kv * group) * d;
    int64_t t = 0;
#ifdef RL_VECTOR
    if constexpr (D > 0 && D % 16 == 0) {
      for (; t + 16 <= len; t += 16) {
        for (int64_t g = 0; g < group; ++g) {
          const v16 scores = dot16<D>(query + g * d, key + t * x.ks2, x.ks2);
          float* pg = p + g * len + t;
          for (int j = 0; j < 16; ++j) pg[j] = m[t + j] ? scores[j] * x.scale : minus_inf;
        }
      }
    }
#endif
    for (; t < len; ++t) {
      for (int64_t g = 0; g < group; ++g) {
        p[g * len + t] = m[t] ? dot(query + g * d, key + t * x.ks2, d) * x.scale : minus_inf;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* pg = p + g * len;
      float* og = o + g * d;
      float top = minus_inf;
#pragma omp simd reduction(max : top)
      for (int64_t t = 0; t < len; ++t) top = pg[t] > top ? pg[t] : top;
      if (top == minus_inf) {
        std::fill(og, og + d, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      // the weights, in vectors (libm's expf was a call per score): masked keys (-inf) weigh
      // exactly 0, as does any key whose weight is below float's smallest normal, 1.2e-38,
      // against the largest key's 1
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < len; ++t) {
        const float e = rl_shim::exp_or_zero(pg[t] - top);
        pg[t] = e;
        sum += e;
      }
      const float inv = 1.0f / sum;
#ifdef RL_VECTOR
      if constexpr (D > 0 && D % 16 == 0) {
        // the output row stays in registers across the keys
        v16 acc[D / 16] = {};
        for (int64_t t = 0; t < len; ++t) {
          if (!m[t]) continue;
          const float w = pg[t] * inv;
          const float* row = value + t * x.vs2;
          for (int c = 0; c < D / 16; ++c) {
            v16 vv;
            std::memcpy(&vv, row + 16 * c, sizeof(v16));
            acc[c] += w * vv;
          }
        }
        std::memcpy(og, acc, sizeof(acc));
        continue;
      }
#endif
      std::fill(og, og + d, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        if (m[t]) axpy(pg[t] * inv, value + t * x.vs2, og, d);
      }
    }
  }
}

// One function compiled for each instruction set (the helpers inline into it), picked at load.
RL_CLONES void attend(const Operands& x, int64_t begin, int64_t end, float* p) {
  switch (x.d) {
    case 16:
      attend_tasks<16>(x, begin, end, p);
      break;
    case 32:
      attend_tasks<32>(x, begin, end, p);
      break;
    case 64:
      attend_tasks<64>(x, begin, end, p);
      break;
    case 128:
      attend_tasks<128>(x, begin, end, p);
      break;
    default:
      attend_tasks<0>(x, begin, end, p);
  }
}

// q: [b, heads, 1, d]; k, v: [b, kv_heads, len, d] with unit stride in d (the cache's views);
// mask: [b, 1, 1, len] bool, true = may attend. Query head h reads key head h / (heads /
// kv_heads), as Hugging Face's `repeat_kv`. A row with nothing to attend to gets NaN, as a
// softmax over nothing does.
at::Tensor one_query_attention(const at::Tensor& q_in, const at::Tensor& k_in,
                               const at::Tensor& v_in, const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1, "q must be [batch, heads, 1, head_dim]");
  TORCH_CHECK(k_in.dim() == 4 && v_in.sizes() == k_in.sizes(),
              "k and v must both be [batch, kv_heads, len, head_dim]");
  const int64_t b = q_in.size(0), heads = q_in.size(1), d = q_in.size(3);
  const int64_t kv_heads = k_in.size(1), len = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == b && k_in.size(3) == d, "k does not match q");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(mask_in.numel() == b * len && mask_in.scalar_type() == at::kBool,
              "mask must be [batch, 1, 1, len] bool");
  for (const auto* t : {&q_in, &k_in, &v_in}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "float32 CPU tensors only");
  }
  const at::Tensor q = q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const at::Tensor mask = mask_in.reshape({b, len}).contiguous();
  at::Tensor out = at::empty({b, heads, 1, d}, q.options());
  const Operands x{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                   mask.data_ptr<bool>(), out.data_ptr<float>(), heads, kv_heads,
                   heads / kv_heads, len, d, k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), static_cast<float>(scale)};
  at::parallel_for(0, b * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(x.group * len);
    attend(x, begin, end, p.data());
  });
  return out;
}

}  // namespace

// The attention of one query per row into `*out` (a new tensor the caller owns); null, or an
// error text the caller frees with `rl_onednn_free`.
extern "C" char* rl_one_query_attention(at::Tensor** out, const at::Tensor* q, const at::Tensor* k,
                                        const at::Tensor* v, const at::Tensor* mask,
                                        double scale) {
  return rl_shim::guarded(
      [&] { *out = new at::Tensor(one_query_attention(*q, *k, *v, *mask, scale)); });
}

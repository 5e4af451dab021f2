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
#include <limits>
#include <vector>

#include "shim.h"

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define RL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RL_CLONES
#endif
#define RL_INLINE inline __attribute__((always_inline))

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

// Tasks [begin, end) of `b * kv_heads`: one row's key head and its group of query heads. One
// function compiled for each instruction set (the helpers inline into it), picked at load.
RL_CLONES void attend(const Operands& x, int64_t begin, int64_t end, float* p) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t group = x.group, len = x.len, d = x.d;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i / x.kv_heads, kv = i % x.kv_heads;
    const float* key = x.k + row * x.ks0 + kv * x.ks1;
    const float* value = x.v + row * x.vs0 + kv * x.vs1;
    const bool* m = x.mask + row * len;
    const float* query = x.q + (row * x.heads + kv * group) * d;
    float* o = x.out + (row * x.heads + kv * group) * d;
    for (int64_t t = 0; t < len; ++t) {
      for (int64_t g = 0; g < group; ++g) {
        p[g * len + t] = m[t] ? dot(query + g * d, key + t * x.ks2, d) * x.scale : minus_inf;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* pg = p + g * len;
      float* og = o + g * d;
      const float top = *std::max_element(pg, pg + len);
      if (top == minus_inf) {
        std::fill(og, og + d, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      float sum = 0.0f;
      for (int64_t t = 0; t < len; ++t) {
        pg[t] = std::exp(pg[t] - top);
        sum += pg[t];
      }
      const float inv = 1.0f / sum;
      std::fill(og, og + d, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        if (m[t]) axpy(pg[t] * inv, value + t * x.vs2, og, d);
      }
    }
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

// The decoder layer's element-wise work without gradients, in float32 on the CPU, one kernel
// per group of libtorch operations (see src/fused.rs): RMSNorm (with the residual add before
// it), rotary embedding of q and k with the cache writes, SiLU(gate) * up.
//
// At a decode step's sizes (32 rows of 576) each libtorch operation takes a few microseconds,
// most of it dispatch and allocation while the second thread waits; a layer ran ~40 of them.
// Each kernel here reads its inputs once and writes its outputs once; the rows are split over
// libtorch's intra-op threads only when there are enough of them to pay for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "shim.h"

namespace {

// Denormal results flushed to zero on the calling thread while alive (x86's MXCSR.FTZ), the
// thread's own setting restored after. For SiLU's clamped exponential GCC computes the clamped
// lanes' quotient (gate / (1 + e^88)) for every lane and blends it in: for |gate| < 2 that is
// denormal, and on Intel cores each vector producing one takes a microcode assist of ~150
// cycles (the kernel ran at 0.24 G elements/s instead of 2.1). Only a result that is itself
// denormal (|silu(g) * up| < 1.2e-38) changes: to zero.
class FlushDenormals {
 public:
#if defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8000u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// Rows handed to one thread at least: about 16k floats of work.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// A pick's destination for its tokens: int64 [rows], contiguous, on the CPU.
void check_tokens_dst(const at::Tensor& tokens_dst, int64_t rows) {
  TORCH_CHECK(tokens_dst.scalar_type() == at::kLong && tokens_dst.device().is_cpu() &&
                  tokens_dst.dim() == 1 && tokens_dst.size(0) == rows &&
                  tokens_dst.is_contiguous(),
              "tokens must be a contiguous int64 CPU tensor of one entry per row");
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name,
              " must be a float32 CPU tensor");
}

// Rows `[begin, end)` of `x` (+ `res`), each `h` wide: `sum` = x + res (when `res`), `out` =
// weight * (s * rsqrt(mean(s^2) + eps)) with s the row, as Hugging Face's LlamaRMSNorm in f32.
RL_CLONES void rms_rows(const float* x, const float* res, const float* weight, float* sum,
                        float* out, int64_t begin, int64_t end, int64_t h, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * h;
    float* orow = out + r * h;
    const float* s = xr;
    if (res != nullptr) {
      const float* rr = res + r * h;
      float* sr = sum + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) sr[i] = xr[i] + rr[i];
      s = sr;
    }
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < h; ++i) acc += s[i] * s[i];
    const float inv = 1.0f / std::sqrt(acc / static_cast<float>(h) + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) orow[i] = weight[i] * (s[i] * inv);
  }
}

// (x + res, rms_norm(x + res)) or, without `res`, (undefined, rms_norm(x)); x: [..., h].
std::pair<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor* res_in,
                                           const at::Tensor& w_in, double eps) {
  check_float_cpu(x_in, "x");
  check_float_cpu(w_in, "weight");
  const int64_t h = x_in.size(-1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == h, "weight must be [", h, "]");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  at::Tensor res, sum;
  if (res_in != nullptr) {
    check_float_cpu(*res_in, "residual");
    TORCH_CHECK(res_in->sizes() == x_in.sizes(), "the residual must have x's shape");
    res = res_in->contiguous();
    sum = at::empty(x.sizes(), x.options());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = h == 0 ? 0 : x.numel() / h;
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* sp = sum.defined() ? sum.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    rms_rows(xp, rp, wp, sp, op, begin, end, h, e);
  });
  return {sum, out};
}

// One head's rotary embedding, as Hugging Face's `x * cos + rotate_half(x) * sin` (the tables
// hold each frequency twice, so both halves read their own entries).
inline void rotate(const float* x, const float* cos, const float* sin, float* y, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    y[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
    y[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

struct RopeOperands {
  const float *q, *k, *v, *cos, *sin;
  float *q_out, *k_dst, *v_dst;
  int64_t s, heads, kv_heads, d;
  // q, k, v: [b, s, n * d] with unit stride in the last dimension
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;
  // k_dst, v_dst: [b, kv_heads, s, d] with unit stride in the last dimension
  int64_t kd0, kd1, kd2, vd0, vd1, vd2;
};

// Positions `[begin, end)` of the flattened (row, position) pairs.
RL_CLONES void rope_positions(const RopeOperands& x, int64_t begin, int64_t end) {
  const int64_t d = x.d;
  for (int64_t bt = begin; bt < end; ++bt) {
    const int64_t b = bt / x.s, t = bt % x.s;
    const float* cos = x.cos + bt * d;
    const float* sin = x.sin + bt * d;
    const float* q = x.q + b * x.qs0 + t * x.qs1;
    for (int64_t h = 0; h < x.heads; ++h) {
      rotate(q + h * d, cos, sin, x.q_out + ((b * x.heads + h) * x.s + t) * d, d);
    }
    const float* k = x.k + b * x.ks0 + t * x.ks1;
    for (int64_t h = 0; h < x.kv_heads; ++h) {
      rotate(k + h * d, cos, sin, x.k_dst + b * x.kd0 + h * x.kd1 + t * x.kd2, d);
    }
    if (x.v_dst != nullptr) {
      const float* v = x.v + b * x.vs0 + t * x.vs1;
      for (int64_t h = 0; h < x.kv_heads; ++h) {
        float* dst = x.v_dst + b * x.vd0 + h * x.vd1 + t * x.vd2;
        const float* src = v + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
      }
    }
  }
}

// q: [b, s, heads * d], k and v: [b, s, kv_heads * d] (views of a fused projection are fine);
// cos, sin: [b, 1, s, d]. Writes rope(k) into k_dst and, when given, v into v_dst (both [b,
// kv_heads, s, d]: the cache's slots, or fresh tensors); returns rope(q) as [b, heads, s, d].
at::Tensor rope_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                    const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor& k_dst,
                    const at::Tensor* v_dst, int64_t heads, int64_t kv_heads) {
  for (const auto* t : {&q, &k, &cos_in, &sin_in, &k_dst}) check_float_cpu(*t, "every operand");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [batch, seq_len, heads * head_dim]");
  const int64_t b = q.size(0), s = q.size(1);
  TORCH_CHECK(heads > 0 && kv_heads > 0 && q.size(2) % heads == 0, "bad head counts");
  const int64_t d = q.size(2) / heads;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  TORCH_CHECK(k.size(0) == b && k.size(1) == s && k.size(2) == kv_heads * d, "k does not match q");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k need unit stride in their last dim");
  const std::vector<int64_t> table{b, 1, s, d};
  TORCH_CHECK(cos_in.sizes() == table && sin_in.sizes() == table, "cos and sin must be [", b,
              ", 1, ", s, ", ", d, "]");
  const std::vector<int64_t> kv{b, kv_heads, s, d};
  TORCH_CHECK(k_dst.sizes() == kv && k_dst.stride(3) == 1,
              "k_dst must be [batch, kv_heads, seq_len, head_dim] with unit stride in head_dim");
  TORCH_CHECK((v == nullptr) == (v_dst == nullptr), "v and v_dst come together");
  if (v != nullptr) {
    check_float_cpu(*v, "v");
    check_float_cpu(*v_dst, "v_dst");
    TORCH_CHECK(v->sizes() == k.sizes() && v->stride(2) == 1, "v must be shaped as k");
    TORCH_CHECK(v_dst->sizes() == kv && v_dst->stride(3) == 1, "v_dst must be shaped as k_dst");
  }
  const at::Tensor cos = cos_in.contiguous();
  const at::Tensor sin = sin_in.contiguous();
  at::Tensor q_out = at::empty({b, heads, s, d}, q.options());
  RopeOperands x{q.data_ptr<float>(),
                 k.data_ptr<float>(),
                 v != nullptr ? v->data_ptr<float>() : nullptr,
                 cos.data_ptr<float>(),
                 sin.data_ptr<float>(),
                 q_out.data_ptr<float>(),
                 k_dst.data_ptr<float>(),
                 v_dst != nullptr ? v_dst->data_ptr<float>() : nullptr,
                 s,
                 heads,
                 kv_heads,
                 d,
                 q.stride(0),
                 q.stride(1),
                 k.stride(0),
                 k.stride(1),
                 v != nullptr ? v->stride(0) : 0,
                 v != nullptr ? v->stride(1) : 0,
                 k_dst.stride(0),
                 k_dst.stride(1),
                 k_dst.stride(2),
                 v_dst != nullptr ? v_dst->stride(0) : 0,
                 v_dst != nullptr ? v_dst->stride(1) : 0,
                 v_dst != nullptr ? v_dst->stride(2) : 0};
  at::parallel_for(0, b * s, grain((heads + 2 * kv_heads) * d),
                   [&](int64_t begin, int64_t end) { rope_positions(x, begin, end); });
  return q_out;
}

RL_CLONES void silu_mul_rows(const float* gate, const float* up, float* out, int64_t begin,
                             int64_t end, int64_t width, int64_t gs, int64_t us) {
  for (int64_t r = begin; r < end; ++r) {
    const float* g = gate + r * gs;
    const float* u = up + r * us;
    float* o = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) o[i] = g[i] / (1.0f + rl_shim::exp_approx(-g[i])) * u[i];
  }
}

// silu(gate) * up for [..., width] operands whose rows may be strided (views of a fused
// projection), contiguous otherwise.
at::Tensor silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_float_cpu(gate_in, "gate");
  check_float_cpu(up_in, "up");
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.dim() >= 1,
              "gate and up must have one shape");
  const int64_t width = gate_in.size(-1);
  const int64_t rows = width == 0 ? 0 : gate_in.numel() / width;
  // rows at one stride: views of a fused product's last dimension, or contiguous tensors
  auto rowwise = [&](const at::Tensor& t) {
    if (t.dim() == 1) return t.contiguous();
    auto v = t.stride(-1) == 1 ? t : t.contiguous();
    for (int64_t i = v.dim() - 2; i > 0; --i) {
      if (v.stride(i - 1) != v.stride(i) * v.size(i)) return v.contiguous();
    }
    return v;
  };
  const at::Tensor gate = rowwise(gate_in);
  const at::Tensor up = rowwise(up_in);
  const int64_t gs = gate.dim() == 1 ? width : gate.stride(-2);
  const int64_t us = up.dim() == 1 ? width : up.stride(-2);
  at::Tensor out = at::empty(gate_in.sizes(), gate_in.options());
  const float* gp = gate.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    silu_mul_rows(gp, up_p, op, begin, end, width, gs, us);
  });
  return out;
}

// The largest of `x[0..n)` (-inf for none) in vectors, and whether any is NaN (the maximum
// then means nothing).
RL_INLINE float row_max(const float* x, int64_t n, bool& nan) {
  float top = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#pragma omp simd reduction(max : top) reduction(|| : any_nan)
  for (int64_t i = 0; i < n; ++i) {
    top = std::max(top, x[i]);
    any_nan = any_nan || x[i] != x[i];
  }
  nan = any_nan;
  return top;
}

// Rows [begin, end) of `logits` (`vocab` wide, rows `ls` apart): each row's first largest entry
// into `tokens` (a NaN counts as the largest, as in libtorch's argmax) and its log-probability
// under the row's softmax into `logp`, -log(sum(exp(x - max))): greedy decoding's pick without a
// full-vocabulary log-softmax written out and gathered from.
RL_CLONES void greedy_rows(const float* logits, int64_t ls, int64_t vocab, int64_t* tokens,
                           float* logp, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* x = logits + r * ls;
    bool nan = false;
    const float top = row_max(x, vocab, nan);
    int64_t at = 0;
    if (nan) {
      while (x[at] == x[at]) ++at;
      tokens[r] = at;
      logp[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    while (x[at] != top) ++at;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < vocab; ++i) sum += rl_shim::exp_approx(x[i] - top);
    tokens[r] = at;
    logp[r] = -std::log(sum);
  }
}

// (tokens, log-probs) of greedy decoding from `logits` [rows, vocab] (rows may be strided):
// tokens into `tokens_dst` (int64 [rows], contiguous), log-probs returned (float32 [rows]).
at::Tensor greedy_pick(const at::Tensor& logits_in, const at::Tensor& tokens_dst) {
  check_float_cpu(logits_in, "logits");
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [rows, vocab]");
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_tokens_dst(tokens_dst, rows);
  at::Tensor logp = at::empty({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  int64_t* tp = tokens_dst.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  at::parallel_for(0, rows, grain(vocab), [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    greedy_rows(lp, ls, vocab, tp, op, begin, end);
  });
  return logp;
}

// Rows [begin, end) of `logits` (`vocab` wide, rows `ls` apart) sampled at `temperature` by
// inverse CDF: with x = logits / temperature and lp = log_softmax(x), the token is the first
// whose running sum of exp(lp) (in float64, in vocabulary order) exceeds u[r] times the whole
// sum, its log-prob lp[token]. That is `rollout::pick`'s libtorch path (divide, log-softmax,
// exp, float64 cumsum, searchsorted) without its five full-vocabulary tensors; sums run in
// another order, so a uniform within rounding of a CDF step may pick the neighbouring token.
// Non-finite rows (a NaN, no finite maximum) get the last token and a NaN log-prob, as there.
// `p` is scratch of `vocab` floats.
RL_CLONES void sample_rows(const float* logits, int64_t ls, int64_t vocab, float temperature,
                           const double* u, int64_t* tokens, float* logp, float* p,
                           int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* x = logits + r * ls;
    // dividing by a positive number keeps the order, so the largest quotient is max(x) / t;
    // p = x / t, divided once (a division costs a dozen multiplications)
    bool nan = false;
    const float top = row_max(x, vocab, nan) / temperature;
    if (nan || !std::isfinite(top)) {
      tokens[r] = vocab - 1;
      logp[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < vocab; ++i) {
      p[i] = x[i] / temperature;
      sum += rl_shim::exp_or_zero(p[i] - top);
    }
    const float log_sum = std::log(sum);
    // lp = (p - top) - log_sum as log_softmax computes it; p becomes exp(lp)
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) {
      p[i] = rl_shim::exp_or_zero((p[i] - top) - log_sum);
      total += p[i];
    }
    const double target = u[r] * total;
    double run = 0.0;
    int64_t at = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      run += p[i];
      if (run > target) {
        at = i;
        break;
      }
    }
    // the running sum fell short of the target by rounding: the last token that can be drawn
    if (at < 0) {
      at = vocab - 1;
      while (at > 0 && p[at] == 0.0f) --at;
    }
    tokens[r] = at;
    logp[r] = (x[at] / temperature - top) - log_sum;
  }
}

// (tokens, log-probs) sampled from `logits` [rows, vocab] (rows may be strided) at
// `temperature` with `uniforms` (float64, one a row): tokens into `tokens_dst` (int64 [rows],
// contiguous), log-probs returned (float32 [rows]).
at::Tensor sample_pick(const at::Tensor& logits_in, const at::Tensor& uniforms_in,
                       double temperature, const at::Tensor& tokens_dst) {
  check_float_cpu(logits_in, "logits");
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.size(1) > 0, "logits must be [rows, vocab]");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature),
              "temperature must be positive and finite");
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(uniforms_in.scalar_type() == at::kDouble && uniforms_in.device().is_cpu() &&
                  uniforms_in.numel() == rows,
              "uniforms must be a float64 CPU tensor of one entry per row");
  check_tokens_dst(tokens_dst, rows);
  const at::Tensor uniforms = uniforms_in.reshape({rows}).contiguous();
  at::Tensor logp = at::empty({rows}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  const double* up = uniforms.data_ptr<double>();
  int64_t* tp = tokens_dst.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  // no denormals to flush: exp_or_zero is 0 below float's normal range
  at::parallel_for(0, rows, grain(vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> p(vocab);
    sample_rows(lp, ls, vocab, t, up, tp, op, p.data(), begin, end);
  });
  return logp;
}

}  // namespace

// Sampled decoding's tokens (into `tokens`) and their log-probs (into `*out`) from `logits`;
// null, or an error text.
extern "C" char* rl_sample_pick(at::Tensor** out, const at::Tensor* logits,
                                const at::Tensor* uniforms, double temperature,
                                const at::Tensor* tokens) {
  return rl_shim::guarded(
      [&] { *out = new at::Tensor(sample_pick(*logits, *uniforms, temperature, *tokens)); });
}

// Greedy decoding's tokens (into `tokens`) and their log-probs (into `*out`) from `logits`; null,
// or an error text.
extern "C" char* rl_greedy_pick(at::Tensor** out, const at::Tensor* logits,
                                const at::Tensor* tokens) {
  return rl_shim::guarded([&] { *out = new at::Tensor(greedy_pick(*logits, *tokens)); });
}

// RMSNorm of `x` (plus `residual` when not null, whose sum goes to `*sum`) into `*out`; null,
// or an error text the caller frees with `rl_onednn_free`.
extern "C" char* rl_rms_norm(at::Tensor** sum, at::Tensor** out, const at::Tensor* x,
                             const at::Tensor* residual, const at::Tensor* weight, double eps) {
  return rl_shim::guarded([&] {
    auto [s, o] = rms_norm(*x, residual, *weight, eps);
    *out = new at::Tensor(std::move(o));
    *sum = s.defined() ? new at::Tensor(std::move(s)) : nullptr;
  });
}

// Rotary embedding of q (into `*out`) and k (into `k_dst`), v copied into `v_dst` when both are
// not null; null, or an error text.
extern "C" char* rl_rope_qkv(at::Tensor** out, const at::Tensor* q, const at::Tensor* k,
                             const at::Tensor* v, const at::Tensor* cos, const at::Tensor* sin,
                             const at::Tensor* k_dst, const at::Tensor* v_dst, int64_t heads,
                             int64_t kv_heads) {
  return rl_shim::guarded([&] {
    *out = new at::Tensor(rope_qkv(*q, *k, v, *cos, *sin, *k_dst, v_dst, heads, kv_heads));
  });
}

// silu(gate) * up into `*out`; null, or an error text.
extern "C" char* rl_silu_mul(at::Tensor** out, const at::Tensor* gate, const at::Tensor* up) {
  return rl_shim::guarded([&] { *out = new at::Tensor(silu_mul(*gate, *up)); });
}

// Whether autograd records operations on this thread now.
extern "C" bool rl_grad_mode_enabled() { return c10::GradMode::is_enabled(); }

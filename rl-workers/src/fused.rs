//! The decoder layer's element-wise work as one kernel per group of libtorch operations
//! (`csrc/fused_ops.cpp`), in generation: rollouts and the serving engine (see [`on`]).
//!
//! A decode step of SmolLM2-135M at 32 rows ran ~40 libtorch operations per layer besides the
//! products (RMSNorm six, rotary embedding fourteen, the cache writes, SiLU and its product,
//! the residual adds), each a few microseconds of dispatch and allocation on tensors of 32 x
//! 576 while the second thread waits. The kernels compute the same formulas in float32 (sums in
//! another order, SiLU's exponential by its own polynomial), so they equal libtorch's to float32
//! rounding (the tests below), not to the bit.
//!
//! Each function answers `None` where it does not apply (outside [`on`], another dtype or
//! device, autograd recording, or the shim refused: said once on stderr); the caller then runs
//! libtorch's operations.

use tch::{Device, Kind, Tensor};

thread_local! {
    /// Set inside [`on`].
    static ON: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the kernels on for this thread: generation only ([`PackedWeights::scope`]
/// wraps every rollout and serving step in it). Elsewhere the model keeps libtorch's
/// operations, so that a forward without gradients (`old_log_prob`, the reference policy, the
/// first pass of gradient checkpointing) rounds exactly as the training forward it is compared
/// with: a PPO ratio of exactly 1 on policy, DPO and SPIN rewards of exactly 0 while the policy
/// equals its reference.
///
/// [`PackedWeights::scope`]: crate::gemm::PackedWeights::scope
pub(crate) fn on<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ON.set(self.0);
        }
    }
    let _restore = Restore(ON.replace(true));
    f()
}

/// Whether the kernels apply: inside [`on`], float32 CPU tensors, autograd recording nothing
/// (they have no backward).
fn applies(ts: &[&Tensor]) -> bool {
    ON.get()
        && ts
            .iter()
            .all(|t| t.device() == Device::Cpu && t.kind() == Kind::Float)
        && !crate::ffi::grad_mode_enabled()
}

fn refused<T>(kernel: &str, result: Result<T, String>) -> Option<T> {
    match result {
        Ok(t) => Some(t),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "warning: the fused {kernel} kernel refused ({}); using libtorch's operations",
                    e.lines().next().unwrap_or_default()
                )
            });
            None
        }
    }
}

/// `weight * (x / sqrt(mean(x²) + eps))` over the last dimension, as Hugging Face's RMSNorm in
/// float32.
pub(crate) fn rms_norm(xs: &Tensor, weight: &Tensor, eps: f64) -> Option<Tensor> {
    if !applies(&[xs, weight]) {
        return None;
    }
    refused("RMSNorm", crate::ffi::rms_norm(xs, None, weight, eps)).map(|(_, out)| out)
}

/// `(xs + residual, rms_norm(xs + residual))`: a layer's residual add and the norm after it.
pub(crate) fn add_rms_norm(
    xs: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> Option<(Tensor, Tensor)> {
    if !applies(&[xs, residual, weight]) {
        return None;
    }
    match refused(
        "RMSNorm",
        crate::ffi::rms_norm(xs, Some(residual), weight, eps),
    )? {
        (Some(sum), out) => Some((sum, out)),
        (None, _) => None,
    }
}

/// Where [`rope_qkv`] leaves the keys and values.
pub(crate) enum KvSlots<'a> {
    /// This call's columns of the cache (`[batch, kv_heads, seq_len, head_dim]` views):
    /// rotated keys and the values are written there.
    Cache {
        keys: &'a Tensor,
        values: &'a Tensor,
    },
    /// A fresh tensor for the rotated keys, returned; the values are left to the caller.
    Fresh,
}

/// Rotary embedding of `q` and `k` (`[batch, seq_len, heads * head_dim]`, views of a fused
/// projection are fine; `cos`/`sin`: `[batch, 1, seq_len, head_dim]`), as Hugging Face's
/// `x * cos + rotate_half(x) * sin`: returns the rotated queries as `[batch, heads, seq_len,
/// head_dim]` and the rotated keys as `[batch, kv_heads, seq_len, head_dim]` (for
/// [`KvSlots::Cache`], the cache's slots they were written to).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_qkv(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: KvSlots<'_>,
    heads: i64,
    kv_heads: i64,
) -> Option<(Tensor, Tensor)> {
    if !applies(&[q, k, v, cos, sin]) {
        return None;
    }
    let result = match slots {
        KvSlots::Cache { keys, values } => {
            crate::ffi::rope_qkv(q, k, Some((v, values)), cos, sin, keys, heads, kv_heads)
                .map(|q| (q, keys.shallow_clone()))
        }
        KvSlots::Fresh => {
            let (b, s, width) = k.size3().ok()?;
            let keys = Tensor::empty(
                [b, kv_heads, s, width / kv_heads.max(1)],
                (Kind::Float, Device::Cpu),
            );
            crate::ffi::rope_qkv(q, k, None, cos, sin, &keys, heads, kv_heads).map(|q| (q, keys))
        }
    };
    refused("rotary embedding", result)
}

/// Greedy decoding's pick from `logits` `[rows, vocab]`: each row's first largest entry and its
/// log-probability, `-log(sum(exp(logits - max)))`, without the full-vocabulary log-softmax
/// (a decode step of SmolLM2 at 32 rows wrote and read 6 MB for 32 numbers).
pub(crate) fn greedy_pick(logits: &Tensor) -> Option<(Tensor, Tensor)> {
    if !applies(&[logits]) || logits.dim() != 2 {
        return None;
    }
    refused("greedy pick", crate::ffi::greedy_pick(logits))
}

/// Sampled decoding's pick from `logits` `[rows, vocab]` at `temperature` with `uniforms`
/// (`[rows, 1]` f64): the token whose float64 CDF step holds `u` times the whole sum and its
/// log-probability under `log_softmax(logits / temperature)`, as [`crate::rollout`]'s libtorch
/// path computes them but without its five full-vocabulary tensors (a decode step of SmolLM2 at
/// 32 rows wrote and read ~40 MB of them). Sums run in another order: a uniform within rounding
/// of a CDF step may take the neighbouring token.
pub(crate) fn sample_pick(
    logits: &Tensor,
    uniforms: &Tensor,
    temperature: f64,
) -> Option<(Tensor, Tensor)> {
    if !applies(&[logits]) || logits.dim() != 2 || uniforms.device() != Device::Cpu {
        return None;
    }
    refused(
        "sampling pick",
        crate::ffi::sample_pick(logits, uniforms, temperature),
    )
}

/// `silu(gate) * up` (SwiGLU's activation).
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Option<Tensor> {
    if !applies(&[gate, up]) {
        return None;
    }
    refused("SiLU", crate::ffi::silu_mul(gate, up))
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

    /// As in generation: kernels on, no gradients.
    fn generating<T>(f: impl FnOnce() -> T) -> T {
        on(|| tch::no_grad(f))
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.size(), b.size());
        (a - b).abs().max().double_value(&[])
    }

    /// The model's RMSNorm in libtorch's operations.
    fn rms_reference(xs: &Tensor, w: &Tensor, eps: f64) -> Tensor {
        let variance = xs.square().mean_dim(-1, true, Kind::Float);
        w * (xs * (variance + eps).rsqrt())
    }

    #[test]
    fn rms_norm_equals_libtorch_with_and_without_the_residual() {
        tch::manual_seed(3);
        // one row (a decode step), many rows (a prefill: split over threads), odd widths
        for shape in [
            vec![1, 1, 576],
            vec![32, 41, 576],
            vec![3, 5, 7],
            vec![2, 130],
        ] {
            let xs = Tensor::randn(shape.as_slice(), F32) * 3.0;
            let res = Tensor::randn(shape.as_slice(), F32);
            let w = Tensor::randn([*shape.last().unwrap()], F32);
            let ours = generating(|| rms_norm(&xs, &w, 1e-5)).expect("f32 CPU without grad");
            let diff = max_diff(&ours, &rms_reference(&xs, &w, 1e-5));
            assert!(diff < 2e-5, "{shape:?}: {diff}");
            let (sum, normed) =
                generating(|| add_rms_norm(&xs, &res, &w, 1e-5)).expect("f32 CPU without grad");
            assert_eq!(max_diff(&sum, &(&xs + &res)), 0.0);
            let diff = max_diff(&normed, &rms_reference(&(&xs + &res), &w, 1e-5));
            assert!(diff < 2e-5, "{shape:?}: {diff}");
        }
        // a strided input (a transposed view) is read as its values, not its memory
        let xs = Tensor::randn([6, 4], F32).transpose(0, 1);
        let w = Tensor::randn([6], F32);
        let ours = generating(|| rms_norm(&xs, &w, 1e-6)).unwrap();
        assert!(max_diff(&ours, &rms_reference(&xs, &w, 1e-6)) < 1e-5);
    }

    /// Hugging Face's rotary embedding, as the model computes it without the kernel.
    fn rope_reference(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = xs.size()[3] / 2;
        let rotated = Tensor::cat(&[-xs.narrow(3, half, half), xs.narrow(3, 0, half)], 3);
        xs * cos + rotated * sin
    }

    fn tables(b: i64, s: i64, d: i64) -> (Tensor, Tensor) {
        let pos = Tensor::arange(s, F32).view([1, s, 1]) + Tensor::arange(b, F32).view([b, 1, 1]);
        let inv = Tensor::arange(d / 2, F32)
            .multiply_scalar(-2.0 / d as f64)
            .exp2()
            .multiply_scalar(0.3);
        let freqs = pos * inv;
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1);
        (emb.cos(), emb.sin())
    }

    #[test]
    fn rotary_embedding_equals_libtorch_into_the_cache_and_fresh() {
        tch::manual_seed(5);
        for (b, s, heads, kv_heads, d) in [(4, 1, 9, 3, 64), (3, 7, 4, 4, 16), (2, 40, 6, 2, 128)] {
            // q, k and v as views of one fused projection, as the model passes them
            let widths = [heads * d, kv_heads * d, kv_heads * d];
            let fused = Tensor::randn([b, s, widths.iter().sum::<i64>()], F32);
            let parts = fused.split_with_sizes(widths, -1);
            let (q, k, v) = (&parts[0], &parts[1], &parts[2]);
            let (cos, sin) = tables(b, s, d);
            let heads_of = |t: &Tensor, n: i64| t.view([b, s, n, d]).transpose(1, 2);
            let want_q = rope_reference(&heads_of(q, heads), &cos, &sin);
            let want_k = rope_reference(&heads_of(k, kv_heads), &cos, &sin);

            // into a cache of 50 columns, at column 3
            let keys = Tensor::zeros([b, kv_heads, 50, d], F32);
            let values = Tensor::zeros([b, kv_heads, 50, d], F32);
            let slots = KvSlots::Cache {
                keys: &keys.narrow(2, 3, s),
                values: &values.narrow(2, 3, s),
            };
            let (ours_q, ours_k) =
                generating(|| rope_qkv(q, k, v, &cos, &sin, slots, heads, kv_heads))
                    .expect("f32 CPU without grad");
            assert!(max_diff(&ours_q, &want_q) < 1e-5);
            assert!(max_diff(&keys.narrow(2, 3, s), &want_k) < 1e-5);
            // the keys returned are the slots written
            assert_eq!(max_diff(&ours_k, &keys.narrow(2, 3, s)), 0.0);
            assert_eq!(
                max_diff(&values.narrow(2, 3, s), &heads_of(v, kv_heads)),
                0.0
            );
            // nothing outside the slots was written
            let outside = keys
                .narrow(2, 0, 3)
                .abs()
                .sum(Kind::Float)
                .double_value(&[])
                + values
                    .narrow(2, 3 + s, 47 - s)
                    .abs()
                    .sum(Kind::Float)
                    .double_value(&[]);
            assert_eq!(outside, 0.0);

            let (ours_q, ours_k) =
                generating(|| rope_qkv(q, k, v, &cos, &sin, KvSlots::Fresh, heads, kv_heads))
                    .unwrap();
            assert!(max_diff(&ours_q, &want_q) < 1e-5);
            assert!(max_diff(&ours_k, &want_k) < 1e-5);
        }
    }

    #[test]
    fn silu_mul_equals_libtorch_over_the_whole_range() {
        // the exponential's clamps and its polynomial: large and tiny, both signs
        let gate = Tensor::from_slice(&[
            -200.0f32, -88.0, -87.0, -20.0, -1.0, -1e-6, 0.0, 1e-6, 0.5, 3.0, 40.0, 88.5, 200.0,
        ]);
        let up = Tensor::ones_like(&gate) * 1.5;
        let ours = generating(|| silu_mul(&gate, &up)).expect("f32 CPU without grad");
        let want = gate.silu() * &up;
        // relative to 1e-6, or absolutely negligible (-1.8e-36 for silu(-200) = -0.0)
        let over = (&ours - &want).abs() - want.abs() * 1e-6 - 1e-30;
        let worst = over.max().double_value(&[]);
        let (ours, want) = (Vec::<f32>::try_from(&ours), Vec::<f32>::try_from(&want));
        assert!(worst <= 0.0, "{ours:?} vs {want:?}");

        tch::manual_seed(7);
        // views of one fused gate/up product, a decode step's and a prefill's rows
        for rows in [1, 32, 1312] {
            let fused = Tensor::randn([rows, 2 * 1536], F32) * 4.0;
            let parts = fused.split(1536, -1);
            let ours = generating(|| silu_mul(&parts[0], &parts[1])).unwrap();
            let want = parts[0].silu() * &parts[1];
            let rel = ((&ours - &want).abs() / (want.abs() + 1e-6))
                .max()
                .double_value(&[]);
            assert!(rel < 1e-5, "{rows} rows: {rel}");
        }
        // strided otherwise: a transposed view
        let gate = Tensor::randn([5, 3], F32).transpose(0, 1);
        let up = Tensor::randn([3, 5], F32);
        let ours = generating(|| silu_mul(&gate, &up)).unwrap();
        assert!(max_diff(&ours, &(gate.silu() * &up)) < 1e-6);

        // the kernel flushes denormals only while it runs: rows this few run on the calling
        // thread, whose arithmetic keeps its denormals afterwards (Rust's and libtorch's)
        let tiny = std::hint::black_box(f32::MIN_POSITIVE) / std::hint::black_box(4.0f32);
        assert!(
            tiny > 0.0,
            "denormals flushed on the calling thread after the kernel"
        );
        let tiny = Tensor::from_slice(&[f32::MIN_POSITIVE]) * 0.25;
        assert!(tiny.double_value(&[0]) > 0.0);
    }

    #[test]
    fn greedy_pick_equals_argmax_and_log_softmax() {
        tch::manual_seed(11);
        // a decode step's rows over SmolLM2's vocabulary, scaled as logits are; one row of a
        // wider tensor (strided rows), and a vocabulary that is no multiple of the vector width
        for (rows, vocab, scale) in [(32, 49_152, 8.0), (3, 37, 1.0), (5, 1000, 60.0)] {
            let wide = Tensor::randn([rows, vocab + 5], F32) * scale;
            let logits = wide.narrow(1, 2, vocab);
            let (tokens, lp) = generating(|| greedy_pick(&logits)).expect("f32 CPU");
            let want_tokens = logits.argmax(-1, false);
            assert!(tokens.equal(&want_tokens), "{rows} x {vocab}");
            let want = logits
                .log_softmax(-1, Kind::Float)
                .gather(1, &want_tokens.unsqueeze(1), false)
                .squeeze_dim(1);
            // -log(sum) against libtorch's own rounding of the same sum
            let diff = max_diff(&lp, &want);
            assert!(diff < 1e-5, "{rows} x {vocab}: log-probs {diff} apart");
        }
        // ties go to the first; a certain pick has log-prob 0; -inf entries weigh nothing; a NaN
        // is the largest (libtorch's argmax), its log-prob NaN
        let inf = f32::INFINITY;
        let logits = Tensor::from_slice2(&[
            [1.0f32, 3.0, 3.0, -1.0],
            [-inf, 7.0, -inf, -inf],
            [2.0, f32::NAN, 9.0, f32::NAN],
        ]);
        let (tokens, lp) = generating(|| greedy_pick(&logits)).unwrap();
        assert_eq!(Vec::<i64>::try_from(&tokens).unwrap(), vec![1, 1, 1]);
        assert!(tokens.equal(&logits.argmax(-1, false)));
        let lp = Vec::<f32>::try_from(&lp).unwrap();
        let want = logits.log_softmax(-1, Kind::Float).double_value(&[0, 1]) as f32;
        assert!((lp[0] - want).abs() < 1e-6, "{lp:?} vs {want}");
        assert_eq!(lp[1], 0.0);
        assert!(lp[2].is_nan());
        // outside generation: libtorch's operations
        assert!(tch::no_grad(|| greedy_pick(&logits)).is_none());
    }

    /// Against `rollout::pick`'s libtorch path (the same function outside generation), on many
    /// draws from SmolLM2-sized rows: the same tokens but where a uniform falls within rounding
    /// of a CDF step, and the same log-probs to float32 rounding.
    #[test]
    fn sample_pick_draws_what_the_libtorch_path_draws() {
        tch::manual_seed(13);
        for (rows, vocab, scale, temperature) in [
            (256, 49_152, 8.0, 0.7),
            (256, 49_152, 3.0, 1.0),
            (512, 37, 2.0, 1.3),
        ] {
            // eight distinct rows, each drawn rows / 8 times; strided rows
            let wide = (Tensor::randn([8, vocab + 3], F32) * scale).repeat([rows / 8, 1]);
            let logits = wide.narrow(1, 1, vocab);
            let uniforms = Tensor::rand([rows, 1], (Kind::Double, Device::Cpu));
            let cfg = crate::RolloutConfig {
                temperature,
                ..Default::default()
            };
            let (tokens, lp) = generating(|| crate::rollout::pick(&logits, &cfg, Some(&uniforms)));
            let (want_tokens, want_lp) =
                tch::no_grad(|| crate::rollout::pick(&logits, &cfg, Some(&uniforms)));
            let same = tokens.eq_tensor(&want_tokens);
            let differ = rows - same.sum(Kind::Int64).int64_value(&[]);
            assert!(differ <= 1, "{vocab}: {differ} of {rows} draws differ");
            let diff = max_diff(&lp.masked_select(&same), &want_lp.masked_select(&same));
            assert!(diff < 1e-5, "{vocab}: log-probs {diff} apart");
        }
    }

    /// The inverse CDF itself, where the answer is known: uniforms on a grid draw each token
    /// in proportion to its probability; -inf logits are never drawn, even at u = 0 or u -> 1;
    /// a row with a NaN gets the last token and a NaN log-prob (as the libtorch path).
    #[test]
    fn sample_pick_follows_the_distribution_and_never_draws_a_forbidden_token() {
        let ninf = f32::NEG_INFINITY;
        // probabilities 0.1, 0.2, 0.3, 0.4 at temperature 0.5 (logits halved back)
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let row: Vec<f32> = probs.iter().map(|p| (p.ln() * 0.5) as f32).collect();
        let n = 10_000;
        let logits = Tensor::from_slice(&row).view([1, 4]).repeat([n, 1]);
        let grid: Vec<f64> = (0..n).map(|i| (i as f64 + 0.5) / n as f64).collect();
        let uniforms = Tensor::from_slice(&grid).view([n, 1]);
        let (tokens, lp) = generating(|| sample_pick(&logits, &uniforms, 0.5)).expect("f32 CPU");
        let tokens = Vec::<i64>::try_from(&tokens).unwrap();
        for (t, p) in probs.iter().enumerate() {
            let count = tokens.iter().filter(|&&x| x == t as i64).count();
            assert!(
                (count as f64 - p * n as f64).abs() <= 1.0,
                "token {t}: {count} of {n}"
            );
        }
        let lp = Vec::<f32>::try_from(&lp).unwrap();
        for (&t, &l) in tokens.iter().zip(&lp) {
            assert!((l as f64 - probs[t as usize].ln()).abs() < 1e-5, "{t}: {l}");
        }
        let logits = Tensor::from_slice2(&[
            [ninf, 1.0f32, ninf, 2.0, ninf],
            [ninf, 1.0, ninf, 2.0, ninf],
            [0.5, f32::NAN, 1.0, 0.0, 0.0],
        ]);
        let uniforms = Tensor::from_slice(&[0.0f64, 1.0 - f64::EPSILON, 0.5]).view([3, 1]);
        let (tokens, lp) = generating(|| sample_pick(&logits, &uniforms, 1.0)).unwrap();
        assert_eq!(Vec::<i64>::try_from(&tokens).unwrap(), vec![1, 3, 4]);
        let lp = Vec::<f32>::try_from(&lp).unwrap();
        assert!(
            lp[0].is_finite() && lp[1].is_finite() && lp[2].is_nan(),
            "{lp:?}"
        );
        // outside generation: libtorch's operations
        assert!(tch::no_grad(|| sample_pick(&logits, &uniforms, 1.0)).is_none());
    }

    /// Where the kernels do not apply, the caller gets `None` (and uses libtorch).
    #[test]
    fn the_kernels_decline_outside_generation_gradients_and_other_dtypes() {
        let xs = Tensor::randn([2, 8], F32);
        let w = Tensor::ones([8], F32);
        // autograd recording: no backward here
        assert!(rms_norm(&xs, &w, 1e-6).is_none());
        assert!(silu_mul(&xs, &xs).is_none());
        assert!(generating(|| rms_norm(&xs, &w, 1e-6)).is_some());
        // outside generation (an `old_log_prob` forward), and again after a generation scope
        assert!(tch::no_grad(|| rms_norm(&xs, &w, 1e-6)).is_none());
        let xd = xs.to_kind(Kind::Double);
        assert!(generating(|| rms_norm(&xd, &w.to_kind(Kind::Double), 1e-6)).is_none());
        assert!(generating(|| silu_mul(&xd, &xd)).is_none());
        // a shape the kernel cannot take is refused with its reason, not computed wrong
        let short = Tensor::ones([7], F32);
        assert!(generating(|| rms_norm(&xs, &short, 1e-6)).is_none());
        let err = crate::ffi::rms_norm(&xs, None, &short, 1e-6).unwrap_err();
        assert!(err.contains("weight must be [8]"), "{err}");
    }
}

#[cfg(test)]
mod model_tests {
    use tch::{Device, Kind, Tensor};

    use crate::{CausalLm, Config, KvCache};

    /// A prefill and decode steps through the cache with the kernels (as in generation), and the
    /// same without them (libtorch's operations), give the same logits to float32 rounding: the
    /// kernels are wired where the layer's operations were, with the cache written at the same
    /// columns.
    #[test]
    fn a_cached_decode_with_the_kernels_equals_one_without() {
        let cfg = Config::tiny();
        let lm = crate::seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap());
        let run = || {
            tch::no_grad(|| {
                let mut cache = KvCache::new(&cfg, 2, 12, Kind::Float, Device::Cpu);
                let ids = Tensor::from_slice(&[0i64, 5, 9, 17, 3, 40, 41, 2]).view([2, 4]);
                let mut mask = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1, 1, 1]).view([2, 4]);
                let mut pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
                let mut logits = vec![lm.forward(&ids, &mask, &pos, Some(&mut cache)).unwrap()];
                for step in 0..5i64 {
                    let next = Tensor::from_slice(&[7 + step, 30 - step]).view([2, 1]);
                    mask = Tensor::cat(
                        &[&mask, &Tensor::ones([2, 1], (Kind::Int64, Device::Cpu))],
                        1,
                    );
                    pos = pos.narrow(1, -1, 1) + 1;
                    logits.push(lm.forward(&next, &mask, &pos, Some(&mut cache)).unwrap());
                }
                Tensor::cat(&logits, 1)
            })
        };
        let fused = super::on(run);
        let plain = run();
        assert_eq!(fused.size(), vec![2, 9, cfg.vocab_size]);
        let diff = (&fused - &plain).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{diff}");
        assert!(fused.isfinite().all().int64_value(&[]) == 1);
    }

    /// Outside generation a forward without gradients (`old_log_prob`, the reference policy)
    /// equals the training forward to the bit: on policy the PPO ratio is exactly 1, and DPO's
    /// and SPIN's rewards are exactly 0 while the policy equals its reference.
    #[test]
    fn a_forward_without_gradients_outside_generation_equals_the_training_forward() {
        let cfg = Config::tiny();
        let lm = crate::seeded(4, || CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap());
        let ids = Tensor::from_slice(&[0i64, 5, 9, 17, 3, 40, 41, 2]).view([2, 4]);
        let mask = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1, 1, 1]).view([2, 4]);
        let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
        let training = lm.forward(&ids, &mask, &pos, None).unwrap();
        assert!(training.requires_grad());
        let scoring = tch::no_grad(|| lm.forward(&ids, &mask, &pos, None).unwrap());
        assert!(training.detach().equal(&scoring));
    }
}

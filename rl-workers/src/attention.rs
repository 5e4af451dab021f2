//! A decode step's attention on the CPU: one query per row against the KV cache, computed by
//! the shim's kernel (`csrc/decode_attention.cpp`).
//!
//! libtorch computes it (`scaled_dot_product_attention`, or two `matmul`s) as one small
//! matrix-vector product per row and head in MKL's generic kernels, on one thread: in a greedy
//! rollout of SmolLM2-135M at 32 rows that was a quarter of the main thread's time. The kernel
//! reads each row's key head once for its whole group of query heads and splits the rows over
//! libtorch's intra-op threads; it sums in a different order, so it equals libtorch's attention
//! to float32 rounding (the test below), not to the bit.

use tch::{Device, Kind, Tensor};

/// The attention of `q` over `k`/`v` under `mask` (query head `h` reads key head
/// `h / (n_heads / n_kv_heads)`, as Hugging Face's `repeat_kv`), or `None` where the kernel
/// does not apply: more than one query per row, another device or dtype, gradients wanted (it
/// has no backward), or the shim refused (said once on stderr). The caller then uses
/// `scaled_dot_product_attention`.
///
/// # Shapes
/// - `q`: `[batch, n_heads, 1, head_dim]`; `k`, `v`: `[batch, n_kv_heads, kv_len, head_dim]`
/// - `mask`: `[batch, 1, 1, kv_len]` bool, true = may attend; a row with nothing to attend to
///   gets NaN, as a softmax over nothing does
/// - returns `[batch, n_heads, 1, head_dim]`
pub(crate) fn one_query(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> Option<Tensor> {
    let fits = q.dim() == 4
        && q.size()[2] == 1
        && [q, k, v]
            .iter()
            .all(|t| t.device() == Device::Cpu && t.kind() == Kind::Float && !t.requires_grad())
        && mask.kind() == Kind::Bool;
    if !fits {
        return None;
    }
    match crate::ffi::one_query_attention(q, k, v, mask, scale) {
        Ok(ys) => Some(ys),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "warning: the decode attention kernel refused ({}); using \
                     scaled_dot_product_attention",
                    e.lines().next().unwrap_or_default()
                )
            });
            None
        }
    }
}

/// libtorch's `scaled_dot_product_attention` of `q` over `k`/`v` under `mask` (bool, true =
/// may attend, or additive), no dropout, the default scale; `gqa`: query head `h` reads key
/// head `h / (n_heads / n_kv_heads)`.
pub(crate) fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, gqa: bool) -> Tensor {
    Tensor::scaled_dot_product_attention(q, k, v, Some(mask), 0.0, false, None, gqa)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against libtorch's attention: grouped heads (3 query heads a key head, as SmolLM2) and
    /// plain ones, head widths of both of the kernel's paths, keys and values as views of a
    /// longer cache (the decode step's layout), rows with left padding of different lengths and
    /// with holes of masked columns (a multi-turn rollout's layout, 33 columns wide); a
    /// row with nothing to attend to is NaN and leaves the others alone.
    #[test]
    fn one_query_attention_equals_libtorch() {
        tch::manual_seed(11);
        let opts = (Kind::Float, Device::Cpu);
        // head widths 16, 32, 64 and 128 take the kernel's unrolled path (rows in blocks of
        // 16, then the rest one by one), 24 its general one
        for (heads, kv_heads, len, d) in [
            (9, 3, 37, 64),
            (4, 4, 5, 16),
            (4, 4, 35, 16),
            (2, 2, 33, 32),
            (3, 3, 20, 24),
            (2, 1, 1, 128),
            (3, 1, 40, 128),
            (2, 2, 16, 64),
        ] {
            let (b, capacity) = (5, 48);
            let q = Tensor::randn([b, 1, heads, d], opts).transpose(1, 2);
            let k_cache = Tensor::randn([b, kv_heads, capacity, d], opts);
            let v_cache = Tensor::randn([b, kv_heads, capacity, d], opts);
            let (k, v) = (k_cache.narrow(2, 0, len), v_cache.narrow(2, 0, len));
            // row r may attend from column min(r, len - 1) on (left padding of r columns)
            let pads = Tensor::arange(b, (Kind::Int64, Device::Cpu)).clamp_max(len - 1);
            let mask = Tensor::arange(len, (Kind::Int64, Device::Cpu))
                .view([1, len])
                .ge_tensor(&pads.view([b, 1]))
                .view([b, 1, 1, len]);
            let ours = tch::no_grad(|| one_query(&q, &k, &v, &mask, (d as f64).powf(-0.5)))
                .expect("the kernel takes f32 CPU tensors without gradients");
            let want = sdpa(&q, &k, &v, &mask, heads != kv_heads);
            assert_eq!(ours.size(), vec![b, heads, 1, d]);
            let diff = (&ours - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "heads {heads}/{kv_heads}, len {len}: {diff}");

            // holes in the middle (a multi-turn rollout's masked columns): row r also skips
            // columns [1 + r, 34 + r)
            let cols = Tensor::arange(len, (Kind::Int64, Device::Cpu)).view([1, len]);
            let start = Tensor::arange(b, (Kind::Int64, Device::Cpu)).view([b, 1]) + 1;
            let hole = cols
                .ge_tensor(&start)
                .logical_and(&cols.lt_tensor(&(&start + 33)));
            let holed = mask.logical_and(&hole.logical_not().view([b, 1, 1, len]));
            // a row left with nothing is NaN on both sides; compare the others
            let seen = holed.any_dims([1i64, 2, 3].as_slice(), false);
            let ours = tch::no_grad(|| one_query(&q, &k, &v, &holed, (d as f64).powf(-0.5)))
                .expect("kernel");
            let want_holed = sdpa(&q, &k, &v, &holed, heads != kv_heads);
            let diff = (ours.index(&[Some(&seen)]) - want_holed.index(&[Some(&seen)]))
                .abs()
                .max()
                .double_value(&[]);
            assert!(
                diff < 1e-5,
                "holes: heads {heads}/{kv_heads}, len {len}: {diff}"
            );

            // row 1 attends to nothing
            let blind = mask.copy();
            let _ = blind.get(1).fill_(0);
            let ours = tch::no_grad(|| one_query(&q, &k, &v, &blind, (d as f64).powf(-0.5)))
                .expect("kernel");
            assert_eq!(ours.get(1).isnan().all().int64_value(&[]), 1);
            let others = Tensor::from_slice(&[0i64, 2, 3, 4]);
            let diff = (ours.index_select(0, &others) - want.index_select(0, &others))
                .abs()
                .max()
                .double_value(&[]);
            assert!(diff < 1e-5);
        }
    }

    /// Where the kernel does not apply, the caller gets `None` (and uses libtorch's attention).
    #[test]
    fn one_query_attention_declines_what_it_does_not_compute() {
        let opts = (Kind::Float, Device::Cpu);
        let (k, v) = (
            Tensor::randn([1, 1, 3, 4], opts),
            Tensor::randn([1, 1, 3, 4], opts),
        );
        let mask = Tensor::ones([1, 1, 1, 3], (Kind::Bool, Device::Cpu));
        let q = Tensor::randn([1, 1, 1, 4], opts);
        assert!(one_query(&q, &k, &v, &mask, 0.5).is_some());
        // gradients wanted: no backward here
        let wants_grad = q.copy().set_requires_grad(true);
        assert!(one_query(&wants_grad, &k, &v, &mask, 0.5).is_none());
        // two queries a row (a prefill)
        let two = Tensor::randn([1, 1, 2, 4], opts);
        assert!(one_query(&two, &k, &v, &mask, 0.5).is_none());
        // f64
        let qd = q.to_kind(Kind::Double);
        let (kd, vd) = (k.to_kind(Kind::Double), v.to_kind(Kind::Double));
        assert!(one_query(&qd, &kd, &vd, &mask, 0.5).is_none());
    }
}

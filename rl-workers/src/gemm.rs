//! The models' weight projections (the decoder's linear layers, the value and score heads, and
//! the LM head) go through [`linear`], which picks the f32 GEMM library on the CPU. LoRA's
//! low-rank adapter products (`lora::Adapter::delta`) still call libtorch's `linear`.
//!
//! libtorch's `linear` calls MKL's `sgemm` for f32 on the CPU. On AMD CPUs MKL runs its generic
//! path without AVX-512 (`mkl_blas_def_sgemm_kernel_0_zen` in a profile), while oneDNN, which the
//! same libtorch carries, runs its AVX-512 kernels: on the Zen 5 dev machine SmolLM2-135M's
//! projections at 32 rows take 45 ms through oneDNN against 75 ms through MKL, and at 1,312
//! rows 1.22 s against 1.73 s (docs/perf.md). [`CpuGemm::OneDnn`], the default, sends f32 CPU
//! projections to oneDNN through one C++ autograd node (`csrc/onednn_linear.cpp`, bound in
//! `crate::ffi`) that saves the dense input and the weight, as `linear` does (libtorch's own oneDNN
//! route would keep two more copies of every projection's activations for the backward);
//! [`CpuGemm::Blas`] keeps libtorch's own `linear`. Both compute the same products; they round differently (about 1e-6 relative),
//! as two BLAS libraries do. Other dtypes and devices always take libtorch's `linear` (bf16 on
//! the CPU already goes to oneDNN inside libtorch; CUDA to cuBLAS).
//!
//! Passes without gradients that run every projection many times with the same weights (a
//! rollout's decode steps) run inside [`PackedWeights::scope`]: each weight is copied once into
//! oneDNN's blocked layout and every product reads that copy, which saves oneDNN reordering the
//! weight on each call (SmolLM2-135M's projections at 32 rows: 28-30 ms a decode step against
//! 41-48 ms; at 1,312 prefill rows 0.81 s against 1.02 s). The products are the same oneDNN
//! kernels' (equal to the unpacked ones in the unit test below).

use crate::ffi;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Which library computes f32 projections on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum CpuGemm {
    /// oneDNN's kernels (`mkldnn_linear`): AVX-512 wherever the CPU has it.
    #[default]
    #[serde(rename = "onednn")]
    OneDnn,
    /// libtorch's `linear` (MKL's `sgemm` in PyTorch's wheels).
    #[serde(rename = "blas")]
    Blas,
}

static CHOICE: AtomicU8 = AtomicU8::new(0);

/// Sets the process-wide choice (it is a property of the machine, like libtorch's thread
/// count, not of one model).
pub fn set_cpu_gemm(choice: CpuGemm) {
    CHOICE.store(choice as u8, Ordering::Relaxed);
}

/// The process-wide choice.
pub fn cpu_gemm() -> CpuGemm {
    match CHOICE.load(Ordering::Relaxed) {
        0 => CpuGemm::OneDnn,
        _ => CpuGemm::Blas,
    }
}

fn onednn_available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(tch::utils::has_mkldnn)
}

fn takes_onednn(choice: CpuGemm, xs: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> bool {
    choice == CpuGemm::OneDnn
        && xs.device() == Device::Cpu
        && weight.device() == Device::Cpu
        && xs.kind() == Kind::Float
        && weight.kind() == Kind::Float
        && bias.is_none_or(|b| b.kind() == Kind::Float)
        && weight.dim() == 2
        && xs.dim() >= 2
        && xs.numel() > 0
        && onednn_available()
}

/// `xs · weightᵀ + bias`, as `torch.nn.functional.linear`.
///
/// # Shapes
/// - `xs`: `[..., in]`; `weight`: `[out, in]`; `bias`: `[out]`; returns `[..., out]`
pub(crate) fn linear(xs: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    linear_via(cpu_gemm(), xs, weight, bias)
}

fn linear_via(choice: CpuGemm, xs: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    if takes_onednn(choice, xs, weight, bias) {
        let packed = ACTIVE.with_borrow_mut(|active| {
            active
                .as_mut()
                .and_then(|map| packed_product(map, xs, &[(weight, bias)]))
        });
        match packed.unwrap_or_else(|| ffi::onednn_linear(xs, weight, bias)) {
            Ok(ys) => return ys,
            Err(e) => warn_refused(&e),
        }
    }
    xs.linear(weight, bias)
}

/// The products of `xs` with several weights that share it as input (a layer's q, k and v
/// projections; gate and up), as one product with their concatenation packed once, split
/// back into the parts' outputs (`[..., out_i]` each). Only inside a [`PackedWeights::scope`]
/// on oneDNN; `None` elsewhere, for a view or a mix of widths, or if oneDNN refuses (said
/// once): the caller then computes each part with [`linear`].
pub(crate) fn linear_fused(
    xs: &Tensor,
    parts: &[(&Tensor, Option<&Tensor>)],
) -> Option<Vec<Tensor>> {
    let choice = cpu_gemm();
    let width = parts.first()?.0.size()[1];
    let fits = parts
        .iter()
        .all(|(w, b)| takes_onednn(choice, xs, w, *b) && w.size()[1] == width);
    if !fits {
        return None;
    }
    let product = ACTIVE.with_borrow_mut(|active| {
        active
            .as_mut()
            .and_then(|map| packed_product(map, xs, parts))
    })?;
    match product {
        Ok(ys) => {
            let outs: Vec<i64> = parts.iter().map(|(w, _)| w.size()[0]).collect();
            Some(ys.split_with_sizes(&outs, -1))
        }
        Err(e) => {
            warn_refused(&e);
            None
        }
    }
}

/// Says once that oneDNN refused a product (computed through libtorch instead): a refusal
/// would otherwise cost the speed without a trace.
fn warn_refused(e: &str) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "warning: oneDNN refused a linear layer ({}); using libtorch's linear where it \
             does (trainer.cpu_gemm = \"blas\" silences this)",
            e.lines().next().unwrap_or_default()
        )
    });
}

/// The identity of a packed entry in a [`PackedWeights`] cache: the memory and shape of each
/// tensor it was made from (one weight; or several fused weights and their biases). The entry
/// holds those tensors, so no other tensor can take their memory while it lives.
type Key = Vec<(usize, Vec<i64>)>;

struct Packed {
    /// The tensors it was made from (shallow copies: their memory stays allocated while the
    /// entry lives).
    _sources: Vec<Tensor>,
    /// Their version counters when packed.
    versions: Vec<i64>,
    packed: Tensor,
    /// A fused entry's biases concatenated (zeros for a part without one); `None` for a single
    /// weight, whose bias is passed as it is.
    bias: Option<Tensor>,
    /// Read in the scope under way (entries unread in a scope are dropped at its end).
    used: bool,
}

thread_local! {
    /// The cache of the [`PackedWeights::scope`] running on this thread.
    static ACTIVE: RefCell<Option<HashMap<Key, Packed>>> = const { RefCell::new(None) };
}

/// The product of `xs` with the packed copy of `parts`' weights (concatenated when several,
/// with their biases) from `map`, made now if missing or stale, or `None` where a weight or a
/// fused bias is a view (ZeRO-3's gathered parameters live for one product: packing them
/// would only copy them once more).
fn packed_product(
    map: &mut HashMap<Key, Packed>,
    xs: &Tensor,
    parts: &[(&Tensor, Option<&Tensor>)],
) -> Option<Result<Tensor, String>> {
    let fused = parts.len() > 1;
    // a fused entry keeps its parts' biases concatenated, so it depends on them too
    let sources: Vec<&Tensor> = parts
        .iter()
        .flat_map(|(w, b)| std::iter::once(*w).chain(b.filter(|_| fused)))
        .collect();
    let versions = sources
        .iter()
        .map(|t| ffi::packable_version(t))
        .collect::<Option<Vec<i64>>>()?;
    let key: Key = sources
        .iter()
        .map(|t| (t.data_ptr() as usize, t.size()))
        .collect();
    let entry = match map.get_mut(&key) {
        Some(entry) if entry.versions == versions => entry,
        _ => {
            let weights: Vec<&Tensor> = parts.iter().map(|(w, _)| *w).collect();
            let whole = match weights.as_slice() {
                [one] => one.shallow_clone(),
                many => Tensor::cat(many, 0),
            };
            let packed = match ffi::onednn_pack(&whole) {
                Ok(packed) => packed,
                Err(e) => return Some(Err(e)),
            };
            let bias = (fused && parts.iter().any(|(_, b)| b.is_some())).then(|| {
                let each: Vec<Tensor> = parts
                    .iter()
                    .map(|(w, b)| {
                        b.map_or_else(
                            || w.new_zeros([w.size()[0]], (w.kind(), w.device())),
                            Tensor::copy,
                        )
                    })
                    .collect();
                Tensor::cat(&each, 0)
            });
            map.insert(
                key.clone(),
                Packed {
                    _sources: sources.iter().map(|t| t.shallow_clone()).collect(),
                    versions,
                    packed,
                    bias,
                    used: false,
                },
            );
            map.get_mut(&key).expect("just inserted")
        }
    };
    entry.used = true;
    let bias = if fused {
        entry.bias.as_ref()
    } else {
        parts[0].1
    };
    Some(ffi::onednn_linear_packed(xs, &entry.packed, bias))
}

/// Copies of the weights in oneDNN's blocked layout, kept for passes without gradients that
/// reuse them (see the module docs). Owned by whoever runs such passes: a rollout makes one for
/// its duration; the serving engine keeps one across its steps (a weight changed in place since
/// it was packed, e.g. by an optimiser step or a weight sync, is packed again on its next use:
/// every in-place tensor operation moves autograd's version counter; a write that bypasses
/// libtorch's operators, such as a collective's, would not, which is why only the engine, whose
/// weights change through `copy_`, keeps a cache across calls).
#[derive(Default)]
pub struct PackedWeights {
    map: HashMap<Key, Packed>,
}

impl std::fmt::Debug for PackedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeights")
            .field("weights", &self.map.len())
            .finish()
    }
}

impl PackedWeights {
    /// Runs `f` as generation: without gradients, with the decoder's fused element-wise
    /// kernels on (the crate's `fused` module), and its f32 CPU projections on oneDNN reading
    /// packed weights (only while `trainer.cpu_gemm` is oneDNN). Weights unread during `f` are
    /// dropped from the cache at the end. A scope inside another on the same thread uses the
    /// outer one's cache.
    pub fn scope<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let nested = ACTIVE.with_borrow(Option::is_some);
        if nested || cpu_gemm() != CpuGemm::OneDnn {
            return crate::fused::on(|| tch::no_grad(f));
        }
        /// Puts the cache back where it came from, also when `f` panics.
        struct Restore<'a>(&'a mut HashMap<Key, Packed>);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                if let Some(mut map) = ACTIVE.take() {
                    map.retain(|_, entry| std::mem::take(&mut entry.used));
                    *self.0 = map;
                }
            }
        }
        ACTIVE.set(Some(std::mem::take(&mut self.map)));
        let _restore = Restore(&mut self.map);
        crate::fused::on(|| tch::no_grad(f))
    }

    /// How many packed weights the cache holds.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the cache holds none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shim's node against libtorch's `linear`: values and the gradients of the input, the
    /// weight and the bias, with and without a bias, and with a frozen weight (LoRA's base).
    #[test]
    fn onednn_equals_blas_in_values_and_gradients() {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        for (bias, frozen) in [(false, false), (true, false), (true, true)] {
            let xs = Tensor::randn([3, 5, 16], opts).set_requires_grad(true);
            let w = Tensor::randn([24, 16], opts).set_requires_grad(!frozen);
            let b = Tensor::randn([24], opts).set_requires_grad(true);
            let run = |onednn: bool| {
                let bias_t = bias.then_some(&b);
                let ys = if onednn {
                    ffi::onednn_linear(&xs, &w, bias_t).expect("the shim computes a linear layer")
                } else {
                    xs.linear(&w, bias_t)
                };
                let grads = Tensor::run_backward(
                    &[ys.square().sum(Kind::Float) * 0.5],
                    &[&xs, &w, &b][..if frozen { 1 } else { 2 + bias as usize }],
                    false,
                    false,
                );
                (ys.detach(), grads)
            };
            let ((y1, g1), (y0, g0)) = (run(true), run(false));
            assert_eq!(y1.size(), vec![3, 5, 24]);
            assert!(y1.allclose(&y0, 1e-5, 1e-5, false), "values, bias {bias}");
            assert_eq!(g1.len(), g0.len());
            for (a, b) in g1.iter().zip(&g0) {
                assert_eq!(a.size(), b.size());
                assert!(a.allclose(b, 1e-4, 1e-4, false), "gradients, bias {bias}");
                assert!(a.abs().sum(Kind::Float).double_value(&[]) > 0.0);
            }
        }
        // not f32: libtorch's own linear, the same answer
        let xh = Tensor::randn([3, 16], (Kind::Double, Device::Cpu));
        let wh = Tensor::randn([8, 16], (Kind::Double, Device::Cpu));
        let ours = linear_via(CpuGemm::OneDnn, &xh, &wh, None);
        assert!(ours.allclose(&xh.linear::<Tensor>(&wh, None), 0.0, 0.0, false));
    }

    /// Packed weights give the unpacked oneDNN products (2-D and 3-D inputs, with and without a
    /// bias, one row and many), a weight changed in place is packed again, a view is not
    /// packed, and an entry unread in a scope is dropped at its end.
    #[test]
    fn packed_weights_equal_the_unpacked_products_and_follow_the_weights() {
        tch::manual_seed(5);
        let opts = (Kind::Float, Device::Cpu);
        let w = Tensor::randn([24, 16], opts).set_requires_grad(true);
        let b = Tensor::randn([24], opts);
        let w2 = Tensor::randn([8, 16], opts);
        let mut cache = PackedWeights::default();
        for shape in [vec![1, 16], vec![5, 16], vec![3, 7, 16]] {
            let xs = Tensor::randn(shape.as_slice(), opts);
            for bias in [None, Some(&b)] {
                let plain = tch::no_grad(|| linear_via(CpuGemm::OneDnn, &xs, &w, bias));
                let packed = cache.scope(|| linear(&xs, &w, bias));
                assert_eq!(packed.size(), plain.size());
                assert!(!packed.requires_grad());
                assert!(packed.allclose(&plain, 1e-6, 1e-6, false), "{shape:?}");
                assert!(packed.allclose(&xs.linear(&w, bias), 1e-5, 1e-5, false));
            }
        }
        assert_eq!(cache.len(), 1, "one packed copy of the one weight");

        // changed in place (as an optimiser step or a weight sync does): packed again
        tch::no_grad(|| {
            let _ = w.shallow_clone().g_mul_scalar_(2.0);
        });
        let xs = Tensor::randn([4, 16], opts);
        let after = cache.scope(|| linear(&xs, &w, None));
        assert!(after.allclose(&xs.linear::<Tensor>(&w, None), 1e-5, 1e-5, false));
        assert_eq!(cache.len(), 1);

        // a view (ZeRO-3's gathered parameters are views of one vector): computed, not packed
        let flat = Tensor::randn([2 * 8 * 16], opts);
        let view = flat.narrow(0, 8 * 16, 8 * 16).view([8, 16]);
        let ys = cache.scope(|| linear(&xs, &view, None) + linear(&xs, &w2, None));
        let want = xs.linear::<Tensor>(&view, None) + xs.linear::<Tensor>(&w2, None);
        assert!(ys.allclose(&want, 1e-5, 1e-5, false));
        assert_eq!(
            cache.len(),
            1,
            "w2 packed, the view not, w dropped (unread in the scope)"
        );
    }

    /// Fused products equal the parts' own, with biases on some parts only; the fused entry
    /// follows in-place changes of any part; outside a scope (or with a width mismatch) there
    /// is no fusing.
    #[test]
    fn fused_products_equal_the_parts() {
        tch::manual_seed(6);
        let opts = (Kind::Float, Device::Cpu);
        let (wq, wk, wv) = (
            Tensor::randn([12, 16], opts),
            Tensor::randn([4, 16], opts),
            Tensor::randn([4, 16], opts),
        );
        let bk = Tensor::randn([4], opts);
        let parts = [(&wq, None), (&wk, Some(&bk)), (&wv, None)];
        let xs = Tensor::randn([2, 3, 16], opts);
        assert!(linear_fused(&xs, &parts).is_none(), "no scope, no fusing");
        let mut cache = PackedWeights::default();
        let check = |cache: &mut PackedWeights| {
            let ys = cache
                .scope(|| linear_fused(&xs, &parts))
                .expect("fused in a scope");
            assert_eq!(ys.len(), 3);
            for (y, (w, b)) in ys.iter().zip(parts) {
                assert_eq!(y.size(), vec![2, 3, w.size()[0]]);
                assert!(y.allclose(&xs.linear(w, b), 1e-5, 1e-5, false));
            }
        };
        check(&mut cache);
        assert_eq!(cache.len(), 1, "one packed copy of the three");
        tch::no_grad(|| {
            let _ = wv.shallow_clone().g_add_scalar_(1.0);
        });
        check(&mut cache);
        assert_eq!(cache.len(), 1);
        // the fused entry keeps the biases concatenated: a changed bias is taken up too
        tch::no_grad(|| {
            let _ = bk.shallow_clone().g_add_scalar_(1.0);
        });
        check(&mut cache);
        assert_eq!(cache.len(), 1);
        let narrow = Tensor::randn([4, 8], opts);
        let mixed = [(&wq, None), (&narrow, None)];
        assert!(cache.scope(|| linear_fused(&xs, &mixed)).is_none());
    }
}

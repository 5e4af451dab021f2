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
//! `ffi`) that saves the dense input and the weight, as `linear` does (libtorch's own oneDNN
//! route would keep two more copies of every projection's activations for the backward);
//! [`CpuGemm::Blas`] keeps libtorch's own `linear`. Both compute the same products; they round differently (about 1e-6 relative),
//! as two BLAS libraries do. Other dtypes and devices always take libtorch's `linear` (bf16 on
//! the CPU already goes to oneDNN inside libtorch; CUDA to cuBLAS).

mod ffi;

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
        match ffi::onednn_linear(xs, weight, bias) {
            Ok(ys) => return ys,
            // the same product through libtorch, said once: a refusal would otherwise cost the
            // speed without a trace
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "warning: oneDNN refused a linear layer ({}); using libtorch's linear \
                         where it does (trainer.cpu_gemm = \"blas\" silences this)",
                        e.lines().next().unwrap_or_default()
                    )
                });
            }
        }
    }
    xs.linear(weight, bias)
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
}

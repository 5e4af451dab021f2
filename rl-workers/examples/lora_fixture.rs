//! Writes `rl-workers/tests/fixtures/peft/ours/` (a LoRA adapter in PEFT's format, by our
//! writer) and `merged/` (the merged export, a plain Hugging Face folder) over the tiny-llama
//! fixture, and `ours_tied/` and `merged_tied/` (adapters on every linear layer, the head and
//! the embedding) over tiny-qwen2, whose head is tied to the embedding, for PEFT and
//! transformers to load (see that folder's `make_peft_fixtures.py`).
//!
//! `cargo run -p rl-workers --example lora_fixture`

use std::path::Path;

use rl_workers::{CausalLm, LoraConfig, TargetModules, seeded};
use tch::{Device, Kind, Tensor};

/// `base` with rank-4 adapters on `targets`, their B (an embedding's A) drawn: fresh, they are
/// zero.
fn adapted(base: &Path, targets: TargetModules) -> rl_workers::Result<CausalLm> {
    seeded(22, || -> rl_workers::Result<CausalLm> {
        let mut lm = CausalLm::from_pretrained(base, Device::Cpu, Kind::Float)?;
        lm.add_lora(&LoraConfig {
            rank: 4,
            alpha: 8.0,
            target_modules: targets,
            exclude_modules: Vec::new(),
            dropout: 0.0,
            use_rslora: false,
        })?;
        // a trained-looking adapter: a fresh B is zero
        tch::no_grad(|| {
            let mut vars: Vec<(String, Tensor)> = lm.var_store().variables().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, mut t) in vars {
                if name.contains(".lora_B.") || name.ends_with(".lora_embedding_A") {
                    t.copy_(&(Tensor::randn_like(&t) * 0.1));
                }
            }
        });
        Ok(lm)
    })
}

fn main() -> rl_workers::Result<()> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let out = fixtures.join("peft");
    for (base, targets, suffix) in [
        ("tiny-llama", TargetModules::AllLinear, ""),
        ("tiny-qwen2", TargetModules::every_layer(), "_tied"),
    ] {
        let lm = adapted(&fixtures.join(base), targets)?;
        let (adapter, merged) = (
            out.join(format!("ours{suffix}")),
            out.join(format!("merged{suffix}")),
        );
        lm.save_adapter(&adapter, Some(base))?;
        lm.save_pretrained(&merged)?;
        println!("wrote {} and {}", adapter.display(), merged.display());
    }
    Ok(())
}

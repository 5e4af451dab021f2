//! Writes `rl-workers/tests/fixtures/peft/ours/` (a LoRA adapter in PEFT's format, by our
//! writer) and `merged/` (the merged export, a plain Hugging Face folder) over the tiny-llama
//! fixture, for PEFT and transformers to load (see that folder's `make_peft_fixtures.py`).
//!
//! `cargo run -p rl-workers --example lora_fixture`

use std::path::Path;

use rl_workers::{CausalLm, LoraConfig, TargetModules, seeded};
use tch::{Device, Kind, Tensor};

fn main() -> rl_workers::Result<()> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let lm = seeded(22, || -> rl_workers::Result<CausalLm> {
        let mut lm =
            CausalLm::from_pretrained(fixtures.join("tiny-llama"), Device::Cpu, Kind::Float)?;
        lm.add_lora(&LoraConfig {
            rank: 4,
            alpha: 8.0,
            target_modules: TargetModules::AllLinear,
            exclude_modules: Vec::new(),
            dropout: 0.0,
            use_rslora: false,
        })?;
        // a trained-looking adapter: a fresh B is zero
        tch::no_grad(|| {
            let mut vars: Vec<(String, Tensor)> = lm.var_store().variables().into_iter().collect();
            vars.sort_by(|a, b| a.0.cmp(&b.0));
            for (name, mut t) in vars {
                if name.contains(".lora_B.") {
                    t.copy_(&(Tensor::randn_like(&t) * 0.1));
                }
            }
        });
        Ok(lm)
    })?;
    let out = fixtures.join("peft");
    lm.save_adapter(out.join("ours"), Some("tiny-llama"))?;
    lm.save_pretrained(out.join("merged"))?;
    println!(
        "wrote {} and {}",
        out.join("ours").display(),
        out.join("merged").display()
    );
    Ok(())
}

//! How a LoRA policy's rollout should run: adapters applied unmerged (what the rollout does: no
//! copy of the weights) against a merged copy (`W + scale·B·A` in a second model) and the base
//! model without adapters, interleaved A/B/C so that load shifts hit every variant alike.
//!
//! `cargo run --release -p rl-workers --example lora_rollout_bench -- MODEL_DIR [ROUNDS] [ROWS] [NEW_TOKENS] [RANK]`
//! prints the median seconds of each variant, the spread, and the ratios to the base model.

use std::time::Instant;

use rl_workers::{CausalLm, GenerateOptions, LoraConfig, RolloutConfig, TargetModules, generate};
use tch::{Device, Kind, Tensor};

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args
        .first()
        .ok_or("usage: lora_rollout_bench MODEL_DIR [ROUNDS] [ROWS] [NEW_TOKENS] [RANK]")?;
    let arg = |i: usize, d: i64| args.get(i).map_or(Ok(d), |s| s.parse::<i64>());
    let (rounds, rows, new_tokens, rank) = (arg(1, 3)?, arg(2, 8)?, arg(3, 64)?, arg(4, 16)?);
    tch::set_num_threads(2);
    let base = CausalLm::from_pretrained(dir, Device::Cpu, Kind::Float)?;
    let mut adapted = rl_workers::seeded(1, || {
        CausalLm::from_pretrained(dir, Device::Cpu, Kind::Float)
    })?;
    adapted.add_lora(&LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        target_modules: TargetModules::AllLinear,
        exclude_modules: Vec::new(),
        dropout: 0.0,
        use_rslora: false,
    })?;
    tch::no_grad(|| {
        for (name, mut t) in adapted.var_store().variables() {
            if name.contains(".lora_B.") {
                t.copy_(&(Tensor::randn_like(&t) * 1e-3));
            }
        }
    });
    let tmp = std::env::temp_dir().join(format!("lora-merged-{}", std::process::id()));
    adapted.save_pretrained(&tmp)?;
    let merged = CausalLm::from_pretrained(&tmp, Device::Cpu, Kind::Float)?;
    std::fs::remove_dir_all(&tmp)?;

    let vocab = base.config().vocab_size;
    let prompt_len = 32;
    let ids = rl_workers::seeded(2, || {
        Tensor::randint_low(10, vocab, [rows, prompt_len], (Kind::Int64, Device::Cpu))
    });
    let mask = Tensor::ones([rows, prompt_len], (Kind::Int64, Device::Cpu));
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let cfg = RolloutConfig {
        do_sample: false,
        response_length: new_tokens,
        ..Default::default()
    };
    let run = |lm: &CausalLm| -> Result<(f64, Tensor), Box<dyn std::error::Error>> {
        let mut opts = GenerateOptions::from_config(lm.config());
        opts.eos_token_ids = Vec::new(); // every row runs the full length
        let start = Instant::now();
        let out = generate(lm, &ids, &mask, &pos, &cfg, &mut opts)?;
        Ok((start.elapsed().as_secs_f64(), out.responses))
    };
    let load_before = load_average();
    let variants: [(&str, &CausalLm); 3] =
        [("base", &base), ("unmerged", &adapted), ("merged", &merged)];
    let mut times = vec![Vec::new(); 3];
    let mut tokens: Vec<Option<Tensor>> = vec![None, None, None];
    let _ = run(&base)?; // warm-up
    for _ in 0..rounds {
        for (i, (_, lm)) in variants.iter().enumerate() {
            let (t, out) = run(lm)?;
            times[i].push(t);
            tokens[i] = Some(out);
        }
    }
    let same = tokens[1]
        .as_ref()
        .zip(tokens[2].as_ref())
        .is_some_and(|(a, b)| a.equal(b));
    println!(
        "SmolLM2 LoRA rollout: {rows} rows x {new_tokens} new tokens after {prompt_len}, greedy, rank {rank} on every linear layer, 2 threads, {rounds} interleaved rounds; load average before {load_before}, after {}",
        load_average()
    );
    println!("| variant | median s | min s | max s | vs base |");
    println!("| --- | --- | --- | --- | --- |");
    let base_median = median(&mut times[0].clone());
    for (i, (name, _)) in variants.iter().enumerate() {
        let xs = &mut times[i];
        let m = median(xs);
        println!(
            "| {name} | {m:.2} | {:.2} | {:.2} | {:.2}x |",
            xs[0],
            xs[xs.len() - 1],
            m / base_median
        );
    }
    println!("unmerged and merged greedy tokens identical: {same}");
    Ok(())
}

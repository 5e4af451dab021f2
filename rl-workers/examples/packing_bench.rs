//! Padded against packed forwards (verl's `use_remove_padding`) for the actor's share of a GRPO
//! step on a batch of skewed lengths: `compute_log_prob` (old log-probs, no gradient) then one
//! `update` (forward and backward of every micro-batch, clip, AdamW step), as the trainer runs
//! them after the rollout. One response in `LONG_EVERY` is `LONG` tokens, the others `SHORT`.
//!
//! `cargo run --release -p rl-workers --example packing_bench -- MODEL_DIR MODE [ROUNDS] [ROWS] [LONG_EVERY] [LONG] [SHORT] [PROMPT]`
//!
//! `MODE` `both` runs the two interleaved (padded, packed, padded, ...: load shifts hit both
//! alike), each round from the same initial weights, and prints the median seconds of each and
//! their ratio; `padded` or `packed` runs one kind only and prints its median and the process's
//! peak RSS (`VmHWM`), for `scripts/packing-bench`, which runs each in a process of its own.

use std::time::Instant;

use rl_core::roles::{Actor, Metrics, MiniBatchInfo, PolicyObjective, PolicyOutput};
use rl_core::{Batch, keys};
use rl_workers::CausalLm;
use rl_workers::roles::{ActorConfig, ActorWorker, OptimConfig};
use tch::{Device, Kind, Tensor};

/// The token-mean policy gradient: the loss's cost is the forward and backward, not its form.
struct TokenMeanPg;

impl PolicyObjective for TokenMeanPg {
    fn needs_entropy(&self) -> bool {
        false
    }
    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = micro.get(keys::RESPONSE_MASK)?;
        let adv = micro.get(keys::ADVANTAGES)?;
        let loss = -(&out.log_prob * adv * mask).sum(Kind::Float) / info.tokens;
        Ok((loss, Metrics::new()))
    }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn peak_kib() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .map(|v| v.trim().trim_end_matches("kB").trim().to_owned())
        .unwrap_or_else(|| "?".into())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `rows` rows as the rollout lays them out: prompts of `prompt` tokens (left-padded to it),
/// responses right-padded to the longest.
fn skewed(vocab: i64, rows: i64, long_every: i64, long: i64, short: i64, prompt: i64) -> Batch {
    let lens: Vec<i64> = (0..rows)
        .map(|r| if r % long_every == 0 { long } else { short })
        .collect();
    let width = lens.iter().copied().max().unwrap_or(1);
    let ids = Tensor::randint_low(3, vocab, [rows, prompt + width], (Kind::Int64, Device::Cpu));
    let col = Tensor::arange(prompt + width, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    let ends = Tensor::from_slice(&lens).unsqueeze(1) + prompt;
    let mask = col.lt_tensor(&ends).to_kind(Kind::Int64);
    let ids = ids * &mask;
    let rmask = mask.narrow(1, prompt, width).to_kind(Kind::Float);
    let mut b = Batch::new();
    let put = |b: &mut Batch, k: &str, t: Tensor| b.insert(k, t).expect("a column");
    put(&mut b, keys::RESPONSES, ids.narrow(1, prompt, width));
    put(
        &mut b,
        keys::POSITION_IDS,
        (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0),
    );
    put(&mut b, keys::INPUT_IDS, ids);
    put(&mut b, keys::ATTENTION_MASK, mask);
    put(
        &mut b,
        keys::ADVANTAGES,
        Tensor::randn([rows, width], (Kind::Float, Device::Cpu)) * &rmask,
    );
    put(&mut b, keys::RESPONSE_MASK, rmask);
    b
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: packing_bench MODEL_DIR padded|packed|both [ROUNDS] [ROWS] [LONG_EVERY] [LONG] [SHORT] [PROMPT]";
    let (dir, mode) = match (args.first(), args.get(1)) {
        (Some(d), Some(m)) => (d.clone(), m.clone()),
        _ => return Err(usage.into()),
    };
    let modes: Vec<bool> = match mode.as_str() {
        "padded" => vec![false],
        "packed" => vec![true],
        "both" => vec![false, true],
        other => return Err(format!("MODE {other:?}: {usage}").into()),
    };
    let arg = |i: usize, d: i64| args.get(i).map_or(Ok(d), |s| s.parse::<i64>());
    let (rounds, rows, long_every, long, short, prompt) = (
        arg(2, 3)?,
        arg(3, 20)?,
        arg(4, 10)?,
        arg(5, 256)?,
        arg(6, 16)?,
        arg(7, 32)?,
    );
    tch::set_num_threads(2);
    let lm = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float)?;
    let initial = rl_workers::roles::share(lm);
    let snapshot: Vec<(String, Tensor)> = initial
        .lock()
        .map_err(|_| "poisoned")?
        .var_store()
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.copy()))
        .collect();
    let batch = rl_workers::seeded(3, || {
        let vocab = initial.lock().map(|l| l.config().vocab_size).unwrap_or(100);
        skewed(vocab, rows, long_every, long, short, prompt)
    });
    let real: f64 = batch
        .get(keys::ATTENTION_MASK)?
        .sum(Kind::Double)
        .double_value(&[]);
    let padded_tokens = batch.get(keys::INPUT_IDS)?.numel();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for _ in 0..rounds {
        for (slot, &packed) in modes.iter().enumerate() {
            // every run from the same weights
            tch::no_grad(|| {
                let lm = initial.lock().expect("policy lock");
                for (name, mut t) in lm.var_store().variables() {
                    if let Some((_, s)) = snapshot.iter().find(|(n, _)| *n == name) {
                        t.copy_(s);
                    }
                }
            });
            let cfg = ActorConfig {
                ppo_mini_batch_size: rows as usize,
                ppo_micro_batch_size_per_gpu: Some(rows as usize / 2),
                log_prob_micro_batch_size_per_gpu: Some(rows as usize / 2),
                use_remove_padding: packed,
                optim: OptimConfig {
                    lr: 1e-6,
                    ..OptimConfig::default()
                },
                ..ActorConfig::default()
            };
            let mut actor = ActorWorker::new(initial.clone(), cfg, 1)?;
            let t0 = Instant::now();
            let old = actor.compute_log_prob(&batch, false)?;
            let mut b = batch.shallow_clone();
            b.insert(
                keys::OLD_LOG_PROBS,
                old.get(keys::OLD_LOG_PROBS)?.shallow_clone(),
            )?;
            actor.update(&b, &TokenMeanPg)?;
            times[slot].push(t0.elapsed().as_secs_f64());
        }
    }
    println!(
        "rows={rows} long_every={long_every} long={long} short={short} prompt={prompt} real_tokens={real} padded_tokens={padded_tokens} load=\"{}\"",
        load_average()
    );
    let medians: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
    for (slot, &packed) in modes.iter().enumerate() {
        println!(
            "mode={} median_s={:.2} runs={:?} peak_kib={}",
            if packed { "packed" } else { "padded" },
            medians[slot],
            times[slot]
                .iter()
                .map(|t| format!("{t:.2}"))
                .collect::<Vec<_>>(),
            peak_kib()
        );
    }
    if medians.len() == 2 {
        println!("speedup={:.2}", medians[0] / medians[1]);
    }
    Ok(())
}

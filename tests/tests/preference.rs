//! End to end on CPU: the preference trainers on a tiny Llama SFT-warmed on single-step
//! addition (the warm-up runs once per test binary and is shared). Offline DPO on correct vs
//! incorrect answers raises held-out preference accuracy; the first DPO loss at the reference
//! is ln 2.

use std::path::PathBuf;
use std::sync::OnceLock;

use rl_algos::trainer::{BatchSource, DpoTrainer, DpoTrainerConfig, MemorySink, RunOptions, run};
use rl_core::{Batch, Trainer};
use rl_data::{DataConfig, RlDataset, Tokenizer};
use rl_e2e::*;
use rl_workers::roles::{ActorConfig, ActorWorker, OptimConfig, ReferenceWorker, SharedPolicy};
use serde_json::Value;

const MAX_OPERAND: i64 = 19;
const SEED: u64 = 11;
const SFT_STEPS: u64 = 200;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Warm {
    task: TinyTask,
    ckpt: PathBuf,
    data: DataConfig,
}

fn warm() -> &'static Warm {
    static WARM: OnceLock<Warm> = OnceLock::new();
    WARM.get_or_init(|| {
        let task = tiny_task(MAX_OPERAND, 300, 100, SEED).unwrap();
        let policy = fresh_tiny_policy(task.tokenizer.vocab_size() as i64, SEED as i64).unwrap();
        let actor = ActorConfig {
            ppo_mini_batch_size: 32,
            optim: OptimConfig {
                lr: 3e-3,
                weight_decay: 0.0,
                ..OptimConfig::default()
            },
            ..ActorConfig::default()
        };
        let steps = env_or("PREF_SFT_STEPS", SFT_STEPS);
        let mut sft = build_sft(&task, policy.clone(), actor, steps, SEED).unwrap();
        let mut sink = MemorySink::default();
        run(
            &mut sft,
            &mut sink,
            RunOptions {
                val_before_train: true,
                test_freq: steps as i64,
            },
        )
        .unwrap();
        let losses: Vec<f64> = sink
            .records
            .iter()
            .filter_map(|(_, m)| m.get("val/loss").copied())
            .collect();
        println!("sft val/loss {losses:?}");
        let ckpt = task.root.path().join("sft");
        policy.lock().unwrap().save_pretrained(&ckpt).unwrap();
        let data = tiny_data_config(&task, 16, SEED);
        Warm { task, ckpt, data }
    })
}

/// A wrong sum for row `row`: any other value a sum of two operands can take, picked by a
/// fixed hash of the row.
fn wrong_answer(answer: i64, row: usize) -> i64 {
    let span = (2 * MAX_OPERAND) as u64;
    let h = (row as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33;
    // a value in 0..=span other than `answer`
    let w = (h % span) as i64;
    if w >= answer { w + 1 } else { w }
}

/// Synthetic preference pairs of `dataset`'s rows `idx` (chosen: the right sum, rejected: a
/// wrong one), interleaved in the rollout layout.
fn pair_batch(dataset: &RlDataset, tok: &Tokenizer, idx: &[usize]) -> AnyResult<Batch> {
    let (mut prompts, mut responses) = (Vec::new(), Vec::new());
    for &i in idx {
        let row = dataset.row(i)?;
        let answer = row
            .extra_info
            .get("answer")
            .and_then(Value::as_str)
            .ok_or("row lacks extra_info.answer")?;
        let wrong = wrong_answer(answer.parse()?, i).to_string();
        for resp in [answer, wrong.as_str()] {
            let ex = rl_data::tokenize_prompt_response(tok, &row.prompt, resp)?;
            let split = ex.loss_mask.iter().position(|&m| m == 1).unwrap_or(0);
            prompts.push(ex.input_ids[..split].to_vec());
            responses.push(ex.input_ids[split..].to_vec());
        }
    }
    rollout_layout(&prompts, &responses, tok.pad_id_or_eos()?)
}

/// Fixed batches, cycled; the state is the cursor.
struct Cycle {
    batches: Vec<Batch>,
    cursor: usize,
}

impl BatchSource for Cycle {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let b = self.batches[self.cursor % self.batches.len()].shallow_clone();
        self.cursor += 1;
        Ok(b)
    }
    fn state(&self) -> Value {
        self.cursor.into()
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        self.cursor = state.as_u64().unwrap_or(0) as usize;
        Ok(())
    }
}

/// Train and held-out pair batches of `pairs` pairs each.
fn pair_sources(w: &Warm, pairs: usize) -> AnyResult<(Cycle, Vec<Batch>)> {
    let tok = &w.task.tokenizer;
    let train = RlDataset::train(&w.data)?;
    let val = RlDataset::val(&w.data)?;
    let idx: Vec<usize> = (0..train.len()).collect();
    let batches = idx
        .chunks_exact(pairs)
        .map(|c| pair_batch(&train, tok, c))
        .collect::<AnyResult<Vec<_>>>()?;
    let vidx: Vec<usize> = (0..val.len()).collect();
    let val_batches = vidx
        .chunks(50)
        .map(|c| pair_batch(&val, tok, c))
        .collect::<AnyResult<Vec<_>>>()?;
    Ok((Cycle { batches, cursor: 0 }, val_batches))
}

fn dpo_actor(policy: SharedPolicy, pairs: usize, lr: f64) -> AnyResult<ActorWorker> {
    let cfg = ActorConfig {
        ppo_mini_batch_size: pairs,
        ppo_micro_batch_size_per_gpu: Some(2 * pairs),
        optim: OptimConfig {
            lr,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    Ok(ActorWorker::new(policy, cfg, 2)?)
}

fn build_dpo(cfg: DpoTrainerConfig, pairs: usize, lr: f64) -> AnyResult<DpoTrainer> {
    let w = warm();
    let policy = load_policy(&w.ckpt)?;
    let reference = ReferenceWorker::from_policy(&policy, None)?;
    let (train, val) = pair_sources(w, pairs)?;
    let actor = dpo_actor(policy, pairs, lr)?;
    Ok(DpoTrainer::new(
        cfg,
        Box::new(actor),
        Some(Box::new(reference)),
        Box::new(train),
        val,
    )?)
}

#[test]
fn first_dpo_loss_is_ln2_at_the_reference() {
    let mut t = build_dpo(DpoTrainerConfig::default(), 16, 1e-3).unwrap();
    let m = t.step().unwrap();
    println!(
        "step 1: loss {} (ln 2 = {})",
        m["loss"],
        std::f64::consts::LN_2
    );
    assert!((m["loss"] - std::f64::consts::LN_2).abs() < 1e-5, "{m:?}");
    assert_eq!(m["rewards/margins"], 0.0);
    for key in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "actor/grad_norm",
        "timing_s/ref",
    ] {
        assert!(m.contains_key(key), "lacks {key}");
    }
}

#[test]
fn offline_dpo_raises_held_out_preference_accuracy() {
    let steps = env_or("DPO_STEPS", 30);
    let cfg = DpoTrainerConfig {
        beta: env_or("DPO_BETA_E2", 10) as f64 * 1e-2,
        precompute_ref_log_probs: true,
        total_training_steps: steps,
        ..DpoTrainerConfig::default()
    };
    let lr = env_or("DPO_LR_E4", 10) as f64 * 1e-4;
    let mut t = build_dpo(cfg, 16, lr).unwrap();
    let (before, _) = t.validate().unwrap();
    let mut last = Default::default();
    let mut ref_steps = 0;
    while t.global_step() < t.total_steps() {
        last = t.step().unwrap();
        ref_steps += last.contains_key("timing_s/ref") as usize;
    }
    let (after, _) = t.validate().unwrap();
    println!("before {before:?}\nafter {after:?}");
    let key = "val/rewards/accuracies";
    // at the reference every implicit reward is 0: ties, so the ranking is chance (50%)
    assert_eq!(before["val/rewards/margins"], 0.0);
    println!(
        "offline dpo: held-out preference accuracy 50% (all ties) -> {:.1}% over {steps} steps; \
         margins {:.3} -> {:.3}, val/loss {:.4} -> {:.4}; last train loss {:.4}; reference \
         forwards on {ref_steps} of {steps} steps",
        after[key] * 100.0,
        before["val/rewards/margins"],
        after["val/rewards/margins"],
        before["val/loss"],
        after["val/loss"],
        last["loss"],
    );
    assert!(after[key] >= 0.8, "{after:?}");
    assert!(after["val/loss"] < before["val/loss"]);
    // the cache: one reference forward per training batch, none once the data cycles
    assert!(ref_steps < steps as usize, "{ref_steps}");
}

//! GRPO on the imported SmolLM2-135M-Instruct (single-digit addition, last-number reward):
//! a few steps complete on CPU with finite metrics, and the time per step is printed with its
//! gen / ref / update breakdown (8 prompts x 4 samples). Skips with a reason when the model has
//! not been imported (`scripts/import-smollm2`).
//!
//! Run: `cargo test -p rl-e2e --release --test smollm2 -- --nocapture`

use std::path::Path;
use std::sync::Arc;

use rl_algos::AdvEstimator;
use rl_core::Trainer;
use rl_data::Tokenizer;
use rl_data::tasks::{ArithmeticConfig, SplitSizes, generate_arithmetic};
use rl_e2e::*;
use rl_workers::RolloutConfig;
use rl_workers::roles::{ActorConfig, OptimConfig};

#[test]
fn grpo_on_smollm2_completes() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-instruct");
    if !model.join("model.safetensors").exists() {
        println!(
            "skipped: {} is absent; run scripts/import-smollm2",
            model.display()
        );
        return;
    }
    let steps: u64 = std::env::var("SMOLLM2_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg = ArithmeticConfig {
        digits: 1,
        operators: vec!['+'],
        operands: 2,
    };
    let files = generate_arithmetic(
        dir.path(),
        &cfg,
        SplitSizes {
            train: 60,
            test: 16,
        },
        0,
    )
    .unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model).unwrap());
    let data = rl_data::DataConfig {
        train_files: vec![files.train],
        val_files: vec![files.test],
        max_prompt_length: 128,
        max_response_length: 16,
        train_batch_size: 8,
        val_batch_size: Some(16),
        seed: Some(0),
        pad_to_max_prompt_length: false,
        return_raw_chat: false,
        ..rl_data::DataConfig::default()
    };
    let mut exp = ExperimentConfig {
        data,
        ..ExperimentConfig::default()
    };
    exp.actor_rollout_ref.rollout = RolloutConfig {
        n: 4,
        response_length: 16,
        seed: 0,
        ..RolloutConfig::default()
    };
    exp.actor_rollout_ref.actor = ActorConfig {
        ppo_mini_batch_size: 8,
        ppo_micro_batch_size_per_gpu: Some(8),
        log_prob_micro_batch_size_per_gpu: Some(16),
        optim: OptimConfig {
            lr: 1e-6,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    exp.actor_rollout_ref.ref_micro_batch_size = Some(16);
    exp.actor_rollout_ref.actor_loss.use_kl_loss = true;
    exp.algorithm.adv_estimator = AdvEstimator::Grpo;
    exp.trainer.total_training_steps = Some(steps);
    let policy = load_policy(&model).unwrap();
    let mut trainer = build_on_policy(&exp, policy, None, &tokenizer).unwrap();
    for _ in 0..steps {
        let m = trainer.step().unwrap();
        let old = phase_seconds(&m, "old_log_prob", 2);
        println!(
            "smollm2 grpo step {}: step {:.2}s = gen {:.2}s + reward {:.2}s + old_log_prob {old} + ref {:.2}s + adv {:.3}s + update_actor {:.2}s; score {:.3}, response_length {:.1}, pg_loss {:.4}, grad_norm {:.3}",
            trainer.global_step(),
            m["timing_s/step"],
            m["timing_s/gen"],
            m["timing_s/reward"],
            m["timing_s/ref"],
            m["timing_s/adv"],
            m["timing_s/update_actor"],
            m["critic/score/mean"],
            m["response_length/mean"],
            m["actor/pg_loss"],
            m["actor/grad_norm"],
        );
        for key in [
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "critic/score/mean",
        ] {
            assert!(m[key].is_finite(), "{key} = {}", m[key]);
        }
    }
    assert_eq!(trainer.global_step(), steps);
}

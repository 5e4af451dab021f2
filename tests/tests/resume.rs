//! Resume is exact: a GRPO run checkpointed after step 1 and resumed in a fresh trainer
//! returns the same metrics at steps 2 and 3 (timings aside) as the uninterrupted run.

use rl_core::{StepMetrics, Trainer};
use rl_e2e::*;

fn config(task: &TinyTask) -> ExperimentConfig {
    tiny_grpo_config(task, 3)
}

fn comparable(m: &StepMetrics) -> Vec<(String, f64)> {
    m.iter()
        .filter(|(k, _)| !rl_core::is_wall_clock(k))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

#[test]
fn resumed_run_equals_uninterrupted() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let cfg = config(&task);
    let vocab = task.tokenizer.vocab_size() as i64;

    let mut a = build_on_policy(
        &cfg,
        fresh_tiny_policy(vocab, 1).unwrap(),
        None,
        &task.tokenizer,
    )
    .unwrap();
    let full: Vec<StepMetrics> = (0..3).map(|_| a.step().unwrap()).collect();

    let ckpt = task.root.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut b = build_on_policy(
        &cfg,
        fresh_tiny_policy(vocab, 1).unwrap(),
        None,
        &task.tokenizer,
    )
    .unwrap();
    let first = b.step().unwrap();
    assert_eq!(comparable(&first), comparable(&full[0]));
    b.save_checkpoint(&ckpt).unwrap();
    drop(b);

    // a fresh trainer (its reference is the same initial policy), restored from the checkpoint
    let mut c = build_on_policy(
        &cfg,
        fresh_tiny_policy(vocab, 1).unwrap(),
        None,
        &task.tokenizer,
    )
    .unwrap();
    c.load_checkpoint(&ckpt).unwrap();
    assert_eq!(c.global_step(), 1);
    for (i, want) in full.iter().enumerate().skip(1) {
        let got = c.step().unwrap();
        assert_eq!(comparable(&got), comparable(want), "step {}", i + 1);
    }
    assert_eq!(c.global_step(), 3);
}

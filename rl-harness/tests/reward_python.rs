//! verl's `custom_reward_function` through `harness train`: a GRPO run on the tiny addition task
//! scored by a reward file that imports a PyPI package (math-verify, from `.venv-reward`, which
//! `scripts/reward-env` installs), its scores landing in the run store; and a bad file named
//! before any model loads.

mod common;

use common::{Env, repo_root, tiny_llm};

/// `.venv-reward/bin/python`; a clear failure when `scripts/reward-env` has not been run.
fn reward_python() -> String {
    let bin = repo_root().join(".venv-reward/bin/python");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/reward-env first (scripts/test does)",
        bin.display()
    );
    bin.to_string_lossy().into_owned()
}

/// Every row scores 0.75 (a value the arithmetic rule, 0 or 1, cannot average to on these
/// batches by chance... and the test checks every step), and records what it saw.
const REWARD: &str = r#"
import json, os
from math_verify import parse

def compute_score(data_source, solution_str, ground_truth, extra_info=None, weight=1.0):
    parse(solution_str)  # the PyPI package works in the worker
    with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth]) + "\n")
    return {"score": 0.75 * weight, "acc": 0.0, "pid": os.getpid()}
"#;

#[test]
fn a_grpo_run_scores_through_a_verl_reward_file_and_the_scores_land_in_the_store() {
    let env = Env::new();
    tiny_llm(&env, 64, 16);
    env.file("my_reward.py", REWARD);
    let grpo = repo_root().join("experiments/quickstart.toml");
    let python = format!("reward.python={}", reward_python());
    let args = [
        "train",
        grpo.to_str().unwrap(),
        "actor_rollout_ref.model.path=models/tiny-llama",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "custom_reward_function.path=my_reward.py",
        "custom_reward_function.reward_kwargs.weight=1.0",
        &python,
        "reward.workers=2",
    ];
    env.ok(&args);
    let (rt, store) = env.store();
    let m = rt.block_on(store.all_metrics(1)).unwrap();
    let at = |step: i64, key: &str| {
        m.iter()
            .find(|(s, k, _, _)| *s == step && k == key)
            .map(|x| x.2)
            .unwrap_or_else(|| panic!("no {key} at step {step}"))
    };
    for step in [1, 2] {
        assert_eq!(at(step, "reward/score/mean"), 0.75, "step {step}");
        assert_eq!(at(step, "reward/score/min"), 0.75, "step {step}");
        assert_eq!(at(step, "reward/failed_score/mean"), 0.0, "step {step}");
    }
    assert_eq!(at(2, "val/test_score/arithmetic"), 0.75);
    // the file saw every row, with verl's arguments: 2 steps x 8 rows, and the validations
    let seen = std::fs::read_to_string(env.path().join("seen.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = seen
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(rows.len() >= 16 + 16, "{} rows scored", rows.len());
    assert!(
        rows.iter()
            .all(|r| r[0] == "arithmetic" && r[2].is_string())
    );

    // a missing file, and a file without the function, are named before any training
    let mut bad = args.to_vec();
    bad[8] = "custom_reward_function.path=nope.py";
    let e = env.fails(&bad);
    assert!(
        e.contains("custom_reward_function.path") && e.contains("nope.py"),
        "{e}"
    );
    let mut bad = args.to_vec();
    bad.push("custom_reward_function.name=score_it");
    let e = env.fails(&bad);
    assert!(
        e.contains("score_it") && e.contains("my_reward.py") && e.contains("compute_score"),
        "{e}"
    );
}

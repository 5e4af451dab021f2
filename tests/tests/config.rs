//! Bad experiment configs are rejected before any model loads, naming the key.

use rl_algos::AdvEstimator;
use rl_e2e::*;
use rl_workers::RolloutConfig;

fn grpo() -> ExperimentConfig {
    let mut cfg = ExperimentConfig::default();
    cfg.data.train_batch_size = 8;
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 4;
    cfg.actor_rollout_ref.rollout = RolloutConfig {
        n: 4,
        ..RolloutConfig::default()
    };
    cfg.algorithm.adv_estimator = AdvEstimator::Grpo;
    // a model folder that does not exist: any attempt to load it would fail differently
    cfg.actor_rollout_ref.model.path = "/nonexistent/model".into();
    cfg
}

fn rejected(cfg: &ExperimentConfig) -> String {
    // the tokenizer is only needed past the checks; a missing model proves none was loaded
    let task = tiny_task(9, 50, 10, 0).unwrap();
    let policy = fresh_tiny_policy(100, 0).unwrap();
    let err = build_on_policy(cfg, policy, None, &task.tokenizer)
        .unwrap_err()
        .to_string();
    assert_eq!(err, check_on_policy(cfg).unwrap_err().to_string());
    err
}

#[test]
fn grpo_with_one_sample_names_rollout_n() {
    check_on_policy(&grpo()).unwrap();
    let mut cfg = grpo();
    cfg.actor_rollout_ref.rollout.n = 1;
    let err = rejected(&cfg);
    assert!(err.contains("actor_rollout_ref.rollout.n"), "{err}");
}

#[test]
fn mini_batch_not_dividing_the_batch_names_ppo_mini_batch_size() {
    let mut cfg = grpo();
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 3;
    let err = rejected(&cfg);
    assert!(
        err.contains("actor_rollout_ref.actor.ppo_mini_batch_size"),
        "{err}"
    );
}

#[test]
fn unknown_estimator_names_adv_estimator() {
    let err = parse_algorithm(&serde_json::json!({"adv_estimator": "ppo2", "gamma": 1.0}))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("algorithm.adv_estimator") && err.contains("ppo2") && err.contains("grpo"),
        "{err}"
    );
    let err = parse_algorithm(&serde_json::json!({"adv_estimatr": "grpo"}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("adv_estimatr"), "{err}");
    let ok = parse_algorithm(&serde_json::json!({"adv_estimator": "rloo"})).unwrap();
    assert_eq!(ok.adv_estimator, AdvEstimator::Rloo);
}

//! Tests of the layered config: layering order, unknown keys with suggestions, type errors.

use super::*;

fn write(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("exp.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn layers_apply_in_order_defaults_file_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "[trainer]\nsave_freq = 5\nseed = 3\n[algorithm]\nadv_estimator = 'grpo'\n",
    );
    let cfg = load(&Sources {
        file: Some(file),
        env: false,
        overrides: vec![
            Override::parse("trainer.seed=9").unwrap(),
            Override::parse("bandit.lr=0.1").unwrap(),
        ],
    })
    .unwrap();
    assert_eq!(cfg.trainer.save_freq, 5);
    assert_eq!(cfg.trainer.seed, 9);
    assert_eq!(cfg.bandit.lr, 0.1);
    assert_eq!(cfg.algorithm.adv_estimator, rl_algos::AdvEstimator::Grpo);
    assert_eq!(cfg.trainer.test_freq, -1, "default kept");
    assert_eq!(cfg.data, rl_data::DataConfig::default());
}

#[test]
fn unknown_keys_name_the_key_and_suggest_the_nearest() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "[trainer]\nsave_frq = 5\n");
    let err = format!(
        "{:#}",
        load(&Sources {
            file: Some(file.clone()),
            env: false,
            overrides: vec![]
        })
        .unwrap_err()
    );
    assert!(
        err.contains("unknown config key `trainer.save_frq`"),
        "{err}"
    );
    assert!(err.contains("did you mean `trainer.save_freq`"), "{err}");
    assert!(err.contains("exp.toml"), "{err}");
    let err = format!(
        "{:#}",
        load(&Sources {
            file: None,
            env: false,
            overrides: vec![Override::parse("algorithm.kl_ctrl.kl_cof=0.1").unwrap()]
        })
        .unwrap_err()
    );
    assert!(
        err.contains("did you mean `algorithm.kl_ctrl.kl_coef`"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        load(&Sources {
            file: None,
            env: false,
            overrides: vec![Override::parse("actor_rollout_ref.rollout.temprature=0.5").unwrap()]
        })
        .unwrap_err()
    );
    assert!(
        err.contains("did you mean `actor_rollout_ref.rollout.temperature`"),
        "{err}"
    );
}

#[test]
fn type_errors_name_the_key_and_the_expected_type() {
    let err = format!(
        "{:#}",
        load(&Sources {
            file: None,
            env: false,
            overrides: vec![Override::parse("trainer.save_freq=often").unwrap()]
        })
        .unwrap_err()
    );
    assert!(err.contains("trainer.save_freq"), "{err}");
    assert!(err.contains("expected") && err.contains("i64"), "{err}");
    let err = format!(
        "{:#}",
        load(&Sources {
            file: None,
            env: false,
            overrides: vec![Override::parse("algorithm.adv_estimator=ppo").unwrap()]
        })
        .unwrap_err()
    );
    assert!(
        err.contains("algorithm.adv_estimator") && err.contains("grpo"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        load(&Sources {
            file: None,
            env: false,
            overrides: vec![Override::parse("bandit.lr=-1").unwrap()]
        })
        .unwrap_err()
    );
    assert!(err.contains("bandit.lr"), "{err}");
}

#[test]
fn overrides_parse_toml_values_and_reject_bad_forms() {
    assert_eq!(
        Override::parse("a.b=3").unwrap().value,
        toml::Value::Integer(3)
    );
    assert_eq!(
        Override::parse("a=grpo").unwrap().value,
        toml::Value::String("grpo".into())
    );
    assert_eq!(
        Override::parse("a='x y'").unwrap().value,
        toml::Value::String("x y".into())
    );
    assert!(Override::parse("novalue").is_err());
    assert!(Override::parse("a..b=1").is_err());
}

#[test]
fn resolved_config_round_trips_through_toml_and_json() {
    let cfg = load(&Sources {
        file: None,
        env: false,
        overrides: vec![Override::parse("trainer.max_ckpt_to_keep=2").unwrap()],
    })
    .unwrap();
    let back: ExperimentConfig = toml::from_str(&to_toml(&cfg).unwrap()).unwrap();
    assert_eq!(back, cfg);
    assert_eq!(from_stored(&to_json(&cfg).unwrap(), &[]).unwrap(), cfg);
}

#[test]
fn resume_safety_and_diffs() {
    assert!(resume_safe("trainer.total_training_steps"));
    assert!(resume_safe("trainer.tracker.uri"));
    assert!(!resume_safe("bandit.lr"));
    assert!(!resume_safe("trainer.seed"));
    let a = ExperimentConfig::default();
    let mut b = a.clone();
    b.bandit.lr = 0.2;
    let d = diff(&a, &b);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].0, "bandit.lr");
}

#[test]
fn levenshtein_basics() {
    assert_eq!(levenshtein("kitten", "sitting"), 3);
    assert_eq!(levenshtein("", "abc"), 3);
    assert_eq!(levenshtein("same", "same"), 0);
}

#[test]
fn the_reward_group_maps_data_sources_to_configured_rule_rewards() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "[reward.prefixes.searchR1_]\nname = 'qa_em'\nformat_score = 0.2\n\
         [reward.sources.'my/sums']\nname = 'arithmetic'\n",
    );
    let cfg = load(&Sources {
        file: Some(file),
        env: false,
        overrides: vec![],
    })
    .unwrap();
    let rewards = crate::compose::rule_rewards(&cfg).unwrap();
    let gt = serde_json::json!({"target": ["blue"]});
    let none = serde_json::Value::Null;
    let score = |source: &str, response: &str, gt: &serde_json::Value| {
        rewards.score(source, response, gt, &none).unwrap().score
    };
    // the configured format score replaces verl's 0 for a well-formed miss
    assert_eq!(
        score("searchR1_synthetic", "<answer>red</answer>", &gt),
        0.2
    );
    assert_eq!(
        score("searchR1_synthetic", "<answer>Blue</answer>", &gt),
        1.0
    );
    assert_eq!(score("my/sums", "so 12", &serde_json::json!("12")), 1.0);

    let bad = write(
        dir.path(),
        "[reward.sources.x]\nname = 'custom'\nfunction = 'nowhere'\n",
    );
    let err = format!(
        "{:#}",
        load(&Sources {
            file: Some(bad),
            env: false,
            overrides: vec![]
        })
        .unwrap_err()
    );
    assert!(err.contains("reward") && err.contains("nowhere"), "{err}");
}

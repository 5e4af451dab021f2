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
    assert!(err.contains("expected an integer"), "{err}");
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
    let value = |arg: &str| Override::parse(arg).unwrap().value;
    use toml::Value::{Array, Boolean, Float, Integer, String as S};
    assert_eq!(value("a.b=3"), Some(Integer(3)));
    assert_eq!(value("a=grpo"), Some(S("grpo".into())));
    assert_eq!(value("a='x y'"), Some(S("x y".into())));
    assert!(Override::parse("novalue").is_err());
    assert!(Override::parse("a..b=1").is_err());
    // verl's (Hydra's) spellings
    assert_eq!(value("a=True"), Some(Boolean(true)));
    assert_eq!(value("a=False"), Some(Boolean(false)));
    assert_eq!(value("a=None"), None);
    assert_eq!(value("a=null"), None);
    assert_eq!(value("a=5e-4"), Some(Float(5e-4)));
    assert_eq!(value("a=.5"), Some(Float(0.5)));
    assert_eq!(value("a=\"5e-4\""), Some(S("5e-4".into())));
    assert_eq!(
        value("a=[a.parquet,b.parquet]"),
        Some(Array(vec![S("a.parquet".into()), S("b.parquet".into())]))
    );
    assert_eq!(
        value("a=['console','mlflow']"),
        Some(Array(vec![S("console".into()), S("mlflow".into())]))
    );
    assert_eq!(
        value("a=[1,True]"),
        Some(Array(vec![Integer(1), Boolean(true)]))
    );
    assert_eq!(
        Override::parse("+trainer.seed=3").unwrap().key,
        "trainer.seed"
    );
    assert_eq!(
        Override::parse("++trainer.seed=3").unwrap().key,
        "trainer.seed"
    );
    let err = format!("{:#}", Override::parse("~trainer.seed=3").unwrap_err());
    assert!(err.contains("`key=null` unsets"), "{err}");
}

fn load_with(overrides: &[&str]) -> Result<ExperimentConfig> {
    load(&Sources {
        file: None,
        env: false,
        overrides: overrides
            .iter()
            .map(|o| Override::parse(o).unwrap())
            .collect(),
    })
}

/// Issue 19: the overrides of verl's own example command line (examples/grpo_trainer/
/// run_qwen2-7b.sh and the GSM8K PPO example, written here by hand from verl's docs, paths
/// left out) load: each either sets our key, maps to it, or is noted as having no effect.
#[test]
fn verls_grpo_and_ppo_command_lines_load() {
    let grpo = [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=1024",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','mlflow']",
        "trainer.project_name='verl_grpo_example_gsm8k'",
        "trainer.experiment_name='qwen2_7b_function_rm'",
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        "+trainer.val_before_train=False",
    ];
    let cfg = load_with(&grpo).unwrap();
    assert_eq!(cfg.trainer.tracker.kind, TrackerKind::Mlflow);
    // a Hydra list is a list of files, not one file named `[a,b]`
    let files = load_with(&["data.train_files=[a.parquet,b.parquet]"]).unwrap();
    assert_eq!(
        files.data.train_files,
        [PathBuf::from("a.parquet"), PathBuf::from("b.parquet")]
    );
    assert_eq!(cfg.trainer.experiment_name, "qwen2_7b_function_rm");
    assert!(!cfg.trainer.val_before_train);
    assert_eq!(cfg.trainer.total_epochs, 15);
    let ppo = [
        "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-5",
        "critic.model.use_remove_padding=True",
        "critic.model.enable_gradient_checkpointing=True",
        "critic.ppo_micro_batch_size_per_gpu=32",
        "critic.model.fsdp_config.param_offload=False",
        "critic.model.fsdp_config.optimizer_offload=False",
        "trainer.logger=[console,tensorboard]",
        "trainer.default_local_dir=/tmp/ckpts",
    ];
    let cfg = load_with(&ppo).unwrap();
    assert_eq!(cfg.trainer.tracker.kind, TrackerKind::None);
    assert!(cfg.trainer.tensorboard);
    // a sink this harness does not write is refused, naming what it writes
    let err = format!(
        "{:#}",
        load_with(&["trainer.logger=['console','wandb']"]).unwrap_err()
    );
    assert!(
        err.contains("`wandb` is not written by this harness") && err.contains("mlflow"),
        "{err}"
    );
    // a typo of a verl key is still an unknown key
    let err = format!("{:#}", load_with(&["trainer.nnode=1"]).unwrap_err());
    assert!(err.contains("unknown config key `trainer.nnode`"), "{err}");
    // keys followed for one value: that value has no effect, another is refused naming it
    load_with(&[
        "actor_rollout_ref.actor.optim.optimizer=AdamW",
        "critic.optim.optimizer=adamw",
        "actor_rollout_ref.actor.router_replay.mode=disabled",
    ])
    .unwrap();
    let err = format!(
        "{:#}",
        load_with(&["critic.optim.optimizer=SGD"]).unwrap_err()
    );
    assert!(
        err.contains("`critic.optim.optimizer`: only `AdamW` is followed here")
            && err.contains("`SGD`"),
        "{err}"
    );
}

/// No verl key taken for having no effect here shadows one of ours.
#[test]
fn verls_foreign_keys_are_not_ours() {
    let known = known_keys();
    for k in verl::foreign_keys() {
        let k = k.trim_end_matches('.');
        assert!(!known.iter().any(|o| o == k), "{k} is one of ours");
    }
}

/// Issue 19: a wrong type names the key itself, also inside a table two structs share
/// (`actor_rollout_ref.actor`), in words; `null` unsets an optional key.
#[test]
fn wrong_types_name_the_key_not_its_group() {
    let err = format!(
        "{:#}",
        load_with(&["actor_rollout_ref.actor.optim.lr=\"5e-4\""]).unwrap_err()
    );
    assert!(
        err.contains("config key `actor_rollout_ref.actor.optim.lr`")
            && err.contains("expected a number, found string \"5e-4\""),
        "{err}"
    );
    let err = format!(
        "{:#}",
        load_with(&["actor_rollout_ref.actor.use_kl_loss=maybe"]).unwrap_err()
    );
    assert!(
        err.contains("config key `actor_rollout_ref.actor.use_kl_loss`")
            && err.contains("expected a boolean"),
        "{err}"
    );
    let err = format!("{:#}", load_with(&["critic.model.path=3"]).unwrap_err());
    assert!(err.contains("config key `critic.model.path`"), "{err}");
    let cfg = load_with(&[
        "trainer.max_ckpt_to_keep=3",
        "trainer.max_ckpt_to_keep=None",
    ])
    .unwrap();
    assert_eq!(cfg.trainer.max_ckpt_to_keep, None);
    let err = format!("{:#}", load_with(&["trainer.seed=null"]).unwrap_err());
    assert!(
        err.contains("config key `trainer.seed`") && err.contains("found null"),
        "{err}"
    );
    // `none` is a name, not null
    let cfg = load_with(&["trainer.experiment_name=none"]).unwrap();
    assert_eq!(cfg.trainer.experiment_name, "none");
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

/// Issue 19: docs/config.md gives every key a meaning, taken from the doc comment on its field
/// (so a key added without one fails here, and the reference cannot drift from the code).
#[test]
fn every_key_in_the_reference_has_a_meaning() {
    let reference = reference_markdown();
    let rows: Vec<&str> = reference.lines().filter(|l| l.starts_with("| `")).collect();
    assert!(rows.len() > 150, "{} rows", rows.len());
    let missing: Vec<&str> = rows
        .iter()
        .filter(|r| r.trim_end().ends_with("|  |"))
        .copied()
        .collect();
    assert!(missing.is_empty(), "keys without a meaning: {missing:#?}");
    assert!(
        reference.contains("| `trainer.max_nonfinite_steps` | `3` | Consecutive steps whose loss"),
        "{reference}"
    );
    assert!(
        reference.contains("| `actor_rollout_ref.rollout.do_sample` | `true` | Sample (true)"),
        "{reference}"
    );
}

/// verl's keys in a TOML file, not only on the command line: the no-effect ones are left out
/// with a note, `trainer.logger` maps to the sinks.
#[test]
fn verl_keys_in_a_config_file_load_too() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        "[trainer]\nlogger = ['console', 'tensorboard']\nnnodes = 1\nn_gpus_per_node = 8\n\
         [actor_rollout_ref.rollout]\nname = 'vllm'\ngpu_memory_utilization = 0.6\n\
         [actor_rollout_ref.actor.fsdp_config]\nparam_offload = true\n",
    );
    let cfg = load(&Sources {
        file: Some(file.clone()),
        env: false,
        overrides: vec![],
    })
    .unwrap();
    assert!(cfg.trainer.tensorboard);
    assert_eq!(cfg.trainer.tracker.kind, TrackerKind::None);
    let bad = write(dir.path(), "[trainer]\nlogger = ['wandb']\n");
    let err = format!(
        "{:#}",
        load(&Sources {
            file: Some(bad),
            env: false,
            overrides: vec![],
        })
        .unwrap_err()
    );
    assert!(
        err.contains("`wandb` is not written by this harness"),
        "{err}"
    );
}

/// Issue 20: verl's `custom_reward_function` keys load as written (`+` and all), and the reward
/// sources are checked before any model loads, each error naming its key.
#[test]
fn verls_custom_reward_function_keys_load_and_bad_reward_settings_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "def my_fn(**kw):\n    return 1\n");
    let path = format!("custom_reward_function.path={}", file.display());
    let cfg = load_with(&[
        &path,
        "custom_reward_function.name=my_fn",
        "+custom_reward_function.reward_kwargs.weight=2",
        "reward.on_error=zero",
        "reward.workers=3",
    ])
    .unwrap();
    let c = &cfg.custom_reward_function;
    assert_eq!(c.path.as_deref(), Some(file.as_path()));
    assert_eq!(c.name, "my_fn");
    assert_eq!(c.reward_kwargs["weight"], serde_json::json!(2));
    assert_eq!(cfg.reward.on_error, rl_data::reward::python::OnError::Zero);
    assert_eq!(cfg.reward.workers, 3);
    assert_eq!(
        load_with(&[]).unwrap().custom_reward_function.name,
        "compute_score"
    );
    let err = |overrides: &[&str]| format!("{:#}", load_with(overrides).unwrap_err());
    let e = err(&["custom_reward_function.path=/no/such/reward.py"]);
    assert!(
        e.contains("custom_reward_function.path") && e.contains("/no/such/reward.py"),
        "{e}"
    );
    let e = err(&[&path, "custom_reward_function.name=' '"]);
    assert!(e.contains("custom_reward_function.name"), "{e}");
    let e = err(&[&path, "reward.remote_url='http://127.0.0.1:1/x'"]);
    assert!(
        e.contains("custom_reward_function.path") && e.contains("reward.remote_url"),
        "{e}"
    );
    let e = err(&["reward.remote_url='https://scorer.example/x'"]);
    assert!(
        e.contains("reward.remote_url") && e.contains("http://"),
        "{e}"
    );
    let e = err(&["reward.workers=0"]);
    assert!(e.contains("reward.workers"), "{e}");
    let e = err(&["reward.timeout_s=0"]);
    assert!(e.contains("reward.timeout_s"), "{e}");
    let e = err(&["reward.on_error=ignore"]);
    assert!(e.contains("on_error"), "{e}");
}

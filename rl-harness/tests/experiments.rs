//! Every file in experiments/ runs as the README says (`harness train` or `harness sweep`), on
//! the quickstart's tiny data and a tiny model, with step and batch overrides so the whole
//! catalogue takes about a minute. The real-model files (SmolLM2, Qwen2.5 on GSM8K) are
//! resolved and checked, not trained. A file added to experiments/ without a line here fails.

mod common;

use std::collections::BTreeSet;

use common::{Env, repo_root, tiny_llm};

/// Overrides that shrink an on-policy run to 2 steps of 4 prompts x 2 samples.
const ON_POLICY: &[&str] = &[
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
];

fn exercised() -> Vec<(&'static str, Vec<&'static str>)> {
    let with = |extra: &[&'static str]| {
        let mut v = ON_POLICY.to_vec();
        v.extend_from_slice(extra);
        v
    };
    vec![
        (
            "quickstart_sft",
            vec![
                "sft.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            ],
        ),
        ("quickstart", with(&[])),
        ("ppo_critic", with(&["critic.ppo_mini_batch_size=4"])),
        ("rloo", with(&[])),
        ("reinforce_pp", with(&[])),
        // fresh weights score 0 on every sample, so dynamic sampling would find no group to keep;
        // tests/tests/learning/on_policy.rs covers it on the SFT-warmed model
        ("dapo", with(&["algorithm.filter_groups.enable=false"])),
        (
            "dpo",
            vec![
                "preference_data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            ],
        ),
        (
            "online_dpo",
            vec![
                "data.train_batch_size=4",
                "dpo.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            ],
        ),
        (
            "spin",
            vec![
                "data.train_batch_size=4",
                "sft.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "dpo.ref_update_freq=1",
            ],
        ),
    ]
}

/// Resolved and checked only: they need a real model (and the Qwen one a GPU); search_r1 a
/// live retriever (tests/tests/search.rs trains it against one).
const RESOLVED_ONLY: &[&str] = &["smollm2_arith_grpo", "gsm8k_qwen_ppo", "search_r1"];
/// The bandit experiments are exercised by tests/cli.rs and tests/sweep.rs, the reward model
/// (trained, resumed, exported and used as a reward) by tests/tests/learning/reward_model.rs, the Search-R1
/// warm-up (on the search task's traces) by tests/search_sft.rs.
const ELSEWHERE: &[&str] = &["bandit", "bandit_sweep", "reward_model", "search_r1_sft"];
const SWEEPS: &[&str] = &["kl_coef"];

#[test]
fn every_experiment_file_is_exercised_here() {
    let mut listed: BTreeSet<String> = exercised().iter().map(|(n, _)| n.to_string()).collect();
    listed.extend(
        RESOLVED_ONLY
            .iter()
            .chain(ELSEWHERE)
            .chain(SWEEPS)
            .map(|s| s.to_string()),
    );
    let on_disk: BTreeSet<String> = std::fs::read_dir(repo_root().join("experiments"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "toml").then(|| p.file_stem().unwrap().to_string_lossy().into())
        })
        .collect();
    assert_eq!(listed, on_disk, "experiments/ and this test disagree");
}

#[test]
fn every_llm_experiment_trains_on_the_tiny_model() {
    let env = Env::new();
    tiny_llm(&env, 64, 16);
    env.ok(&[
        "data",
        "tiny-addition",
        "data/tiny-addition",
        "--train",
        "64",
        "--test",
        "16",
        "--seed",
        "7",
        "--pairs",
    ]);
    // the SFT checkpoint the catalogue starts from, here fresh weights
    env.ok(&["model", "init-tiny", "models/tiny-llama-sft", "--seed", "7"]);
    let (rt, store) = env.store();
    for (id, (name, overrides)) in exercised().into_iter().enumerate() {
        let file = repo_root().join(format!("experiments/{name}.toml"));
        let mut args = vec![
            "train",
            file.to_str().unwrap(),
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
        ];
        args.extend(overrides);
        let out = env.ok(&args);
        assert!(out.contains("val/"), "{name}: no validation summary: {out}");
        let run = rt.block_on(store.run(id as i64 + 1)).unwrap().unwrap();
        assert_eq!(run.status, "finished", "{name}");
        let m = rt.block_on(store.all_metrics(run.id)).unwrap();
        for step in [1, 2] {
            assert!(
                m.iter()
                    .any(|(s, k, _, _)| *s == step && !k.starts_with("val/")),
                "{name}: no training metric at step {step}"
            );
        }
        assert!(
            std::path::Path::new(&run.run_dir)
                .join("model/model.safetensors")
                .is_file(),
            "{name}: no exported policy"
        );
    }
}

#[test]
fn the_kl_coef_sweep_runs_its_trials_over_the_quickstart() {
    let env = Env::new();
    tiny_llm(&env, 64, 16);
    env.ok(&["model", "init-tiny", "models/tiny-llama-sft", "--seed", "7"]);
    let file = repo_root().join("experiments/kl_coef.toml");
    let out = env
        .cmd()
        .args(["sweep", file.to_str().unwrap()])
        .env("RL_TRAINER__TOTAL_TRAINING_STEPS", "1")
        .env("RL_DATA__TRAIN_BATCH_SIZE", "4")
        .env("RL_ACTOR_ROLLOUT_REF__ACTOR__PPO_MINI_BATCH_SIZE", "4")
        .env("RL_ACTOR_ROLLOUT_REF__ROLLOUT__N", "2")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (rt, store) = env.store();
    let runs = rt.block_on(store.runs(None)).unwrap();
    assert_eq!(runs.len(), 4, "one run per kl_loss_coef");
    // by the sweep's name, as the README does
    let ranked = env.ok(&[
        "compare",
        "--sweep",
        "kl_coef",
        "--metric",
        "val/test_score/arithmetic",
    ]);
    for coef in ["0.0", "0.01", "0.1", "1.0"] {
        assert!(ranked.contains(coef), "trial {coef} missing: {ranked}");
    }
}

#[test]
fn the_real_model_experiments_resolve_and_check() {
    let env = Env::new();
    for name in RESOLVED_ONLY {
        let file = repo_root().join(format!("experiments/{name}.toml"));
        let shown = env.ok(&["config", "show", file.to_str().unwrap()]);
        assert!(
            shown.contains("algorithm = \"on_policy\""),
            "{name}: {shown}"
        );
    }
}

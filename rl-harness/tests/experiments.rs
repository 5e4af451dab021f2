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

/// Resolved and checked only: they need a real model (and the Qwen one a GPU; the SmolLM2 ones
/// train two steps in tests/scripts.rs's smoke of scripts/real-model); search_r1 a live
/// retriever (tests/tests/search.rs trains it against one).
const RESOLVED_ONLY: &[&str] = &[
    "smollm2_arith_grpo",
    "smollm2_word_problems_sft",
    "smollm2_word_problems_grpo",
    "gsm8k_qwen_ppo",
    "search_r1",
];
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

/// The tiny model and the quickstart's data (prompts and pairs) the catalogue trains on.
fn catalogue_env() -> Env {
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
    env
}

/// LoRA and bf16 mixed precision through `harness train` for every trainer that takes them:
/// SFT, DPO, online DPO, PPO with a LoRA critic, reward-model training; SPIN with LoRA is
/// refused by key. A LoRA policy is exported merged with its adapter beside it. The policy
/// trainers run packed (`use_remove_padding`, the critic's too), so packing goes through each
/// of them with LoRA (and DPO's and PPO's with bf16) as well.
#[test]
fn lora_mixed_precision_and_packing_train_every_trainer_through_the_cli() {
    let env = catalogue_env();
    env.ok(&["model", "init-tiny", "models/tiny-llama-sft", "--seed", "7"]);
    const LORA: &[&str] = &[
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.target_modules=[\"q_proj\",\"v_proj\",\"up_proj\"]",
    ];
    const BF16: &str = "actor_rollout_ref.actor.mixed_precision.param_dtype=bf16";
    // packed forwards (verl's use_remove_padding) for the policy, its reference and the critic
    const PACKED: &str = "actor_rollout_ref.model.use_remove_padding=true";
    let (exercised, (rt, store)) = (exercised(), env.store());
    let overrides = |name: &str| {
        exercised
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1
            .clone()
    };
    let cases: Vec<(&str, Vec<&str>, bool)> = vec![
        (
            "quickstart_sft",
            [overrides("quickstart_sft"), LORA.to_vec(), vec![PACKED]].concat(),
            true,
        ),
        (
            "dpo",
            [overrides("dpo"), LORA.to_vec(), vec![BF16, PACKED]].concat(),
            true,
        ),
        (
            "online_dpo",
            [overrides("online_dpo"), LORA.to_vec(), vec![PACKED]].concat(),
            true,
        ),
        (
            "ppo_critic",
            [
                overrides("ppo_critic"),
                LORA.to_vec(),
                vec![
                    BF16,
                    PACKED,
                    "critic.model.lora_rank=4",
                    "critic.mixed_precision.param_dtype=bf16",
                    "critic.model.use_remove_padding=true",
                ],
            ]
            .concat(),
            true,
        ),
        (
            "reward_model",
            [
                LORA.to_vec(),
                vec![
                    "preference_data.train_batch_size=4",
                    "reward_model.train.mixed_precision.param_dtype=bf16",
                ],
            ]
            .concat(),
            false,
        ),
    ];
    for (id, (name, extra, policy)) in cases.into_iter().enumerate() {
        let file = repo_root().join(format!("experiments/{name}.toml"));
        let mut args = vec![
            "train",
            file.to_str().unwrap(),
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=2",
        ];
        args.extend(extra);
        env.ok(&args);
        let run = rt.block_on(store.run(id as i64 + 1)).unwrap().unwrap();
        assert_eq!(run.status, "finished", "{name}");
        let model = std::path::Path::new(&run.run_dir).join("model");
        assert!(model.join("model.safetensors").is_file(), "{name}");
        // the policy's adapter beside its merged export; a reward model is exported merged
        assert_eq!(
            model.join("adapter/adapter_model.safetensors").is_file(),
            policy,
            "{name}"
        );
        let ckpt = rt.block_on(store.checkpoints(run.id)).unwrap();
        let actor = std::path::Path::new(&ckpt.last().unwrap().path).join("trainer");
        let trained = if policy { "actor" } else { "rm" };
        assert!(
            actor
                .join(trained)
                .join("adapter_model.safetensors")
                .is_file(),
            "{name}: the checkpoint holds adapters: {:?}",
            std::fs::read_dir(&actor).map(|d| d.map(|e| e.unwrap().path()).collect::<Vec<_>>())
        );
        if name == "ppo_critic" {
            assert!(actor.join("critic/adapter_model.safetensors").is_file());
        }
    }
    let spin = repo_root().join("experiments/spin.toml");
    let mut args = vec!["train", spin.to_str().unwrap()];
    args.extend(LORA);
    let err = env.fails(&args);
    assert!(err.contains("lora_rank") && err.contains("SPIN"), "{err}");
}

#[test]
fn every_llm_experiment_trains_on_the_tiny_model() {
    let env = catalogue_env();
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
        // the resolved config keeps the file's algorithm (on_policy, or sft for a warm-up)
        let text = std::fs::read_to_string(&file).unwrap();
        let algorithm = text
            .lines()
            .find(|l| l.starts_with("algorithm = "))
            .unwrap_or_else(|| panic!("{name}: no algorithm line"));
        assert!(shown.contains(algorithm), "{name}: {shown}");
    }
}

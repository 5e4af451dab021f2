//! `harness train` driving the LLM trainers on the tiny character-level Llama: the quickstart's
//! SFT → GRPO path through the CLI (the exported policy is a Hugging Face folder the next run
//! loads), the kill -9 exactness tests against real GRPO runs (full; LoRA with bf16 mixed precision),
//! and verl's
//! `custom_reward_function`: a GRPO run scored by a reward file that imports a PyPI package
//! (math-verify, from `.venv-reward`, which `scripts/reward-env` installs).

mod common;

use std::path::Path;
use std::time::Duration;

use tch::Tensor;

use common::{Env, metrics_of, repo_root, tiny_llm, wait_for};

#[test]
fn the_quickstart_path_sft_then_grpo_runs_through_the_cli() {
    let env = Env::new();
    tiny_llm(&env, 256, 32);
    let sft = repo_root().join("experiments/quickstart_sft.toml");
    let out = env.ok(&[
        "train",
        sft.to_str().unwrap(),
        "trainer.total_training_steps=12",
        "trainer.test_freq=6",
        "trainer.save_freq=6",
    ]);
    assert!(out.contains("val/loss:"), "{out}");
    let exported = env.path().join("models/tiny-llama-sft");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(exported.join(f).is_file(), "export lacks {f}");
    }
    assert!(
        env.path()
            .join("runs/1-quickstart-sft/model/model.safetensors")
            .is_file()
    );

    let grpo = repo_root().join("experiments/quickstart.toml");
    let out = env.ok(&[
        "train",
        grpo.to_str().unwrap(),
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
    ]);
    assert!(out.contains("val/test_score/arithmetic:"), "{out}");
    let (rt, store) = env.store();
    let run = rt.block_on(store.resolve_run("quickstart-grpo")).unwrap();
    assert_eq!(run.status, "finished");
    let m = rt.block_on(store.all_metrics(run.id)).unwrap();
    let has = |step: i64, key: &str| m.iter().any(|(s, k, _, _)| *s == step && k == key);
    assert!(
        has(0, "val/test_score/arithmetic"),
        "validation before training"
    );
    assert!(has(2, "val/test_score/arithmetic"), "validation at the end");
    for key in [
        "actor/pg_loss",
        "actor/kl_loss",
        "critic/score/mean",
        "timing_s/gen",
    ] {
        assert!(has(1, key) && has(2, key), "step metrics lack {key}");
    }
    // The on-policy run started from the SFT export: its stored config names it.
    assert!(
        run.config.contains("models/tiny-llama-sft"),
        "{}",
        run.config
    );
    // Issue 19: `harness eval` validates the exported model and records the scores as a run:
    // the held-out score the GRPO run saw before its first step, nothing trained or exported.
    let out = env.ok(&[
        "eval",
        grpo.to_str().unwrap(),
        "trainer.experiment_name=eval-sft",
    ]);
    assert!(out.contains("val/test_score/arithmetic:"), "{out}");
    let eval = rt.block_on(store.resolve_run("eval-sft")).unwrap();
    assert_eq!(eval.status, "finished");
    let em = rt.block_on(store.all_metrics(eval.id)).unwrap();
    assert!(em.iter().all(|(s, _, _, _)| *s == 0), "only step 0: {em:?}");
    let score = |m: &[(i64, String, f64, f64)]| {
        m.iter()
            .find(|(s, k, _, _)| *s == 0 && k == "val/test_score/arithmetic")
            .map(|r| r.2)
            .unwrap()
    };
    assert_eq!(score(&em), score(&m), "the same model, the same validation");
    assert!(rt.block_on(store.checkpoints(eval.id)).unwrap().is_empty());
    assert!(!std::path::Path::new(&eval.run_dir).join("model").exists());
}

#[test]
fn an_llm_config_error_names_the_key_before_any_model_loads() {
    let env = Env::new();
    let grpo = repo_root().join("experiments/quickstart.toml");
    let grpo = grpo.to_str().unwrap();
    // a typo in a key that verl's actor table shares between the worker and the loss
    let err = env.fails(&[
        "config",
        "show",
        grpo,
        "actor_rollout_ref.actor.clip_ration=0.3",
    ]);
    assert!(
        err.contains("`actor_rollout_ref.actor.clip_ration`")
            && err.contains("did you mean `actor_rollout_ref.actor.clip_ratio`"),
        "{err}"
    );
    // a cross-group rule: the mini-batch must divide the prompt batch
    let err = env.fails(&[
        "train",
        grpo,
        "actor_rollout_ref.actor.ppo_mini_batch_size=5",
    ]);
    assert!(err.contains("ppo_mini_batch_size"), "{err}");
    // the model folder is checked when the trainer is built
    let err = env.fails(&["train", grpo, "actor_rollout_ref.model.path=nowhere"]);
    assert!(err.contains("nowhere"), "{err}");
    let err = env.fails(&["config", "show", grpo, "trainer.algorithm=ppo"]);
    assert!(err.contains("on_policy"), "{err}");
}

/// GRPO on the tiny model through the CLI: an uninterrupted run, and a run killed with SIGKILL
/// mid-step after a checkpoint then resumed, record identical metrics (timings aside).
#[test]
fn kill_9_mid_grpo_step_after_a_checkpoint_then_resume_matches_an_uninterrupted_run() {
    let _ = kill_9_then_resume_matches(&[]);
}

/// The same with LoRA adapters (with dropout, whose masks must follow the step; on the decoder's
/// linear layers and on the tied vocabulary layers, `lm_head` and `embed_tokens`), KL to the
/// base model, and bf16 mixed precision: the checkpoints hold the adapters in PEFT's format
/// (not the model) and their float32 master weights, so the resumed run continues from those
/// rather than from the bf16-rounded adapters. (One run for all: CI's time is short.)
#[test]
fn kill_9_then_resume_of_a_lora_bf16_mixed_precision_run_matches_an_uninterrupted_run() {
    let (_env, checkpoint) = kill_9_then_resume_matches(&[
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.lora_dropout=0.1",
        r#"actor_rollout_ref.model.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head","embed_tokens"]"#,
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.mixed_precision.param_dtype=bf16",
    ]);
    let actor = Path::new(&checkpoint).join("trainer/actor");
    assert!(actor.join("adapter_model.safetensors").is_file());
    assert!(actor.join("adapter_config.json").is_file());
    assert!(
        !actor.join("model.safetensors").exists(),
        "a LoRA checkpoint holds the adapters only"
    );
    let optim = Tensor::read_safetensors(actor.join("optim.safetensors")).unwrap();
    let masters: Vec<_> = optim
        .iter()
        .filter(|(n, _)| n.starts_with("master."))
        .collect();
    assert!(!masters.is_empty(), "master weights in the checkpoint");
    assert!(
        masters
            .iter()
            .all(|(n, t)| n.contains(".lora_") && t.kind() == tch::Kind::Float),
        "float32 masters of the adapters only"
    );
    for layer in [
        "lm_head.lora_B.weight",
        "model.embed_tokens.lora_embedding_A",
    ] {
        assert!(
            masters.iter().any(|(n, _)| n.ends_with(layer)),
            "{layer}'s master in the checkpoint"
        );
    }
}

/// Runs GRPO twice with `extra` settings, the second killed with SIGKILL mid-step after a
/// checkpoint and resumed; asserts identical metrics and returns the environment (its folder
/// lives as long as it) and the last checkpoint's path.
fn kill_9_then_resume_matches(extra: &[&'static str]) -> (Env, String) {
    let env = Env::new();
    tiny_llm(&env, 128, 16);
    let grpo = repo_root().join("experiments/quickstart.toml");
    let grpo = grpo.to_str().unwrap();
    let common = [
        "actor_rollout_ref.model.path=models/tiny-llama",
        "trainer.total_training_steps=8",
        "trainer.save_freq=2",
        "trainer.test_freq=4",
        "trainer.max_ckpt_to_keep=4",
        "trainer.heartbeat_s=0.5",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
    ];
    let args = |name: &'static str| {
        let mut a = vec!["train", grpo];
        a.extend(common);
        a.extend(extra);
        a.push(name);
        a
    };
    env.ok(&args("trainer.experiment_name=a"));
    let mut child = env.spawn(&args("trainer.experiment_name=b"));
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for(
        "run b's checkpoint at step 2",
        Duration::from_secs(300),
        || {
            rt.block_on(store.checkpoints(2))
                .map(|c| c.iter().any(|c| c.step == 2))
                .unwrap_or(false)
        },
    );
    std::thread::sleep(Duration::from_millis(150));
    child.kill().unwrap(); // SIGKILL, in the middle of step 3 or a later one
    child.wait().unwrap();
    let b = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(
        b.status, "running",
        "a killed process cannot record its end"
    );
    let last = rt
        .block_on(store.checkpoints(2))
        .unwrap()
        .last()
        .unwrap()
        .step;
    assert!(
        last < 8,
        "the run finished before the kill; nothing was tested"
    );
    wait_for("run b to be seen dead", Duration::from_secs(10), || {
        rt.block_on(store.run(2))
            .map(|r| r.is_some_and(|r| r.effective_status() == "dead"))
            .unwrap_or(false)
    });
    env.ok(&["resume", "b"]);
    let a_metrics = metrics_of(&rt, &store, 1);
    let b_metrics = metrics_of(&rt, &store, 2);
    assert!(a_metrics.len() > 100, "{}", a_metrics.len());
    assert_eq!(
        a_metrics, b_metrics,
        "the resumed GRPO run differs from the uninterrupted one"
    );
    let b = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(
        (b.status.as_str(), b.resumed_from),
        ("finished", Some(last))
    );
    let path = rt
        .block_on(store.checkpoints(2))
        .unwrap()
        .last()
        .unwrap()
        .path
        .clone();
    (env, path)
}

/// `reward_model.enable`: a reward model's score and the rule score, combined as configured
/// (`rm_coef * rm + rule_coef * rule`), with each part logged.
#[test]
fn a_reward_model_combined_with_the_rule_reward_scores_the_rollouts() {
    let env = Env::new();
    tiny_llm(&env, 64, 16);
    let rm_dir = env.path().join("models/tiny-rm");
    let _generator = rl_workers::hold_generator();
    tch::manual_seed(3);
    let rm = rl_workers::roles::reward_model_from_lm(
        env.path().join("models/tiny-llama"),
        tch::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
    rm.save_pretrained(&rm_dir).unwrap();
    let grpo = repo_root().join("experiments/quickstart.toml");
    let grpo = grpo.to_str().unwrap();
    let common = [
        "actor_rollout_ref.model.path=models/tiny-llama",
        "trainer.total_training_steps=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "reward_model.enable=true",
    ];
    let mut args = vec!["train", grpo];
    args.extend(common);
    let err = env.fails(&args);
    assert!(err.contains("reward_model.model.path"), "{err}");
    args.extend([
        "reward_model.model.path=models/tiny-rm",
        "reward_model.rm_coef=0.5",
        "reward_model.rule_coef=2.0",
    ]);
    env.ok(&args);
    let (rt, store) = env.store();
    let m = rt.block_on(store.all_metrics(2)).unwrap();
    let at1 = |key: &str| {
        m.iter()
            .find(|(s, k, _, _)| *s == 1 && k == key)
            .map(|x| x.2)
            .unwrap_or_else(|| panic!("no {key} at step 1"))
    };
    let (rm_mean, rule_mean, score) = (
        at1("reward/rm_score/mean"),
        at1("reward/rule_score/mean"),
        at1("reward/score/mean"),
    );
    assert!(rm_mean != 0.0, "the reward model scored nothing");
    assert!(
        (score - (0.5 * rm_mean + 2.0 * rule_mean)).abs() < 1e-5,
        "{score} vs 0.5 * {rm_mean} + 2 * {rule_mean}"
    );
}

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

/// `trainer.cpu_gemm` picks the library of the f32 projections: oneDNN (the default) and libtorch's
/// own `linear` (MKL) train the same SFT run to the same figures up to rounding, and the key has an
/// effect (the two round differently somewhere in 3 steps and their validations), while the same
/// library twice repeats the run to the bit.
#[test]
fn the_cpu_gemm_key_picks_the_library_and_both_train_alike() {
    let env = Env::new();
    tiny_llm(&env, 64, 64);
    let sft = repo_root().join("experiments/quickstart_sft.toml");
    let run = |name: &str, gemm: &str| {
        env.ok(&[
            "train",
            sft.to_str().unwrap(),
            &format!("trainer.experiment_name={name}"),
            &format!("trainer.cpu_gemm={gemm}"),
            "trainer.total_training_steps=3",
            "trainer.test_freq=3",
            "trainer.save_freq=-1",
        ]);
        let (rt, store) = env.store();
        let id = rt.block_on(store.resolve_run(name)).unwrap().id;
        metrics_of(&rt, &store, id)
    };
    let (onednn, again, blas) = (
        run("onednn", "onednn"),
        run("onednn-again", "onednn"),
        run("blas", "blas"),
    );
    assert!(!onednn.is_empty());
    assert_eq!(onednn, again, "the same library twice");
    let keys = |m: &[(i64, String, u64)]| -> Vec<(i64, String)> {
        m.iter().map(|(s, k, _)| (*s, k.clone())).collect()
    };
    assert_eq!(keys(&onednn), keys(&blas));
    assert_ne!(onednn, blas, "trainer.cpu_gemm changed nothing");
    for ((s, k, a), (_, _, b)) in onednn.iter().zip(&blas) {
        let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
            "step {s} {k}: oneDNN {a} against BLAS {b}"
        );
    }
}

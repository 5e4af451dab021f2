//! `trainer.algorithm = "reward_model"` through the `harness` binary: experiments/reward_model.toml
//! trains a Bradley–Terry reward model on the tiny preference pairs, a run stopped at a
//! checkpoint and resumed ends with the same weights as an uninterrupted one, a finished run
//! exports its reward model (`<run>/model`, `trainer.export_dir`) with the last checkpoint's
//! weights, and that folder is the reward role of a GRPO run (`reward_model.model.path`); two
//! ranks through `--nproc-per-node 2` follow the 1-rank run step for step; bad
//! `reward_model.train` / `preference_data` keys (and a batch of pairs that does not split over
//! the ranks) are refused before any model loads, naming the key.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{Env, max_abs_diff, one_thread_ok, repo_root, safetensors, train_ranks};
use tch::Tensor;

fn experiment() -> String {
    repo_root()
        .join("experiments/reward_model.toml")
        .to_string_lossy()
        .into_owned()
}

/// The quickstart's data with pairs, and a fresh tiny model as the SFT checkpoint.
fn setup() -> Env {
    let env = Env::new();
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
    env.ok(&["model", "init-tiny", "models/tiny-llama-sft", "--seed", "7"]);
    env
}

/// The reward model of run `run_dir`'s checkpoint at `step`.
fn rm_dir(run_dir: &str, step: u64) -> PathBuf {
    Path::new(run_dir).join(format!("checkpoints/global_step_{step}/trainer/rm"))
}

/// The tensors of `dir/model.safetensors` by name.
fn weights(dir: &Path) -> BTreeMap<String, Tensor> {
    safetensors(&dir.join("model.safetensors"))
}

/// Asserts that `dir` is an exported reward model: a one-label `*ForSequenceClassification`
/// `config.json`, the tokenizer, and exactly the weights of the checkpoint folder `ckpt`.
fn assert_exported(dir: &Path, ckpt: &Path) {
    let text = std::fs::read_to_string(dir.join("config.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    let arch = cfg["architectures"][0].as_str().unwrap_or_default();
    assert!(arch.ends_with("ForSequenceClassification"), "{text}");
    assert_eq!(
        cfg["id2label"].as_object().map(|m| m.len()),
        Some(1),
        "{text}"
    );
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.join(file).is_file(), "{} lacks {file}", dir.display());
    }
    let (exported, last) = (weights(dir), weights(ckpt));
    assert!(exported.contains_key("score.weight"));
    assert!(!exported.contains_key("lm_head.weight"));
    assert_eq!(
        max_abs_diff(&exported, &last),
        0.0,
        "{} differs from {}",
        dir.display(),
        ckpt.display()
    );
}

const SMALL: &[&str] = &[
    "preference_data.train_batch_size=4",
    "reward_model.train.micro_train_batch_size=2",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
];

#[test]
fn reward_model_trains_resumes_exactly_exports_and_scores_a_grpo_run() {
    let env = setup();
    let file = experiment();
    // run 1: 4 steps straight
    let mut args = vec![
        "train",
        file.as_str(),
        "trainer.total_training_steps=4",
        "trainer.experiment_name=a",
    ];
    args.extend(SMALL);
    let out = env.ok(&args);
    assert!(out.contains("val/rm/accuracy"), "{out}");
    // run 2: 2 steps, then resumed to 4, exporting to trainer.export_dir too
    let mut args = vec![
        "train",
        file.as_str(),
        "trainer.total_training_steps=2",
        "trainer.experiment_name=b",
        "trainer.export_dir=exported",
    ];
    args.extend(SMALL);
    env.ok(&args);
    env.ok(&["resume", "b", "trainer.total_training_steps=4"]);
    let (rt, store) = env.store();
    let (a, b) = (
        rt.block_on(store.run(1)).unwrap().unwrap(),
        rt.block_on(store.run(2)).unwrap().unwrap(),
    );
    assert_eq!(
        (a.status.as_str(), b.status.as_str()),
        ("finished", "finished")
    );
    assert_eq!(b.resumed_from, Some(2));
    let metrics = |id: i64| {
        let mut m: Vec<(i64, String, f64)> = rt
            .block_on(store.all_metrics(id))
            .unwrap()
            .into_iter()
            .filter(|(_, k, _, _)| !rl_core::is_wall_clock(k))
            .map(|(s, k, v, _)| (s, k, v))
            .collect();
        m.sort_by(|x, y| (x.0, &x.1).cmp(&(y.0, &y.1)));
        m
    };
    let (ma, mb) = (metrics(1), metrics(2));
    for key in ["rm/loss", "rm/accuracy", "rm/grad_norm", "val/rm/accuracy"] {
        assert!(ma.iter().any(|(_, k, _)| k == key), "run a lacks {key}");
    }
    assert_eq!(
        ma, mb,
        "the resumed run's metrics differ from the uninterrupted run's"
    );
    let (ra, rb) = (rm_dir(&a.run_dir, 4), rm_dir(&b.run_dir, 4));
    let read = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(ra.join("config.json").is_file(), "{}", ra.display());
    assert_eq!(read(&ra), read(&rb), "the resumed reward model differs");
    // a finished run exports the reward model, the last checkpoint's weights, to <run>/model
    // and to trainer.export_dir (the resumed run's, at its end)
    let exported_a = Path::new(&a.run_dir).join("model");
    assert_exported(&exported_a, &ra);
    assert_exported(&Path::new(&b.run_dir).join("model"), &rb);
    assert_exported(&env.path().join("exported"), &rb);
    // the exported folder is the reward role of a GRPO run, its only training reward
    let quickstart = repo_root().join("experiments/quickstart.toml");
    let rm_path = format!("reward_model.model.path={}", exported_a.display());
    env.ok(&[
        "train",
        quickstart.to_str().unwrap(),
        "actor_rollout_ref.model.path=models/tiny-llama-sft",
        "trainer.total_training_steps=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "reward_model.enable=true",
        &rm_path,
        "reward_model.rule_coef=0",
    ]);
    let m = rt.block_on(store.all_metrics(3)).unwrap();
    let has = |key: &str| m.iter().any(|(s, k, _, _)| *s == 1 && k == key);
    assert!(has("reward/rm_score/mean") && has("reward/rule_score/mean"));
    // validation scores with the rule reward alone: 0 or 1 per prompt
    let val: Vec<f64> = m
        .iter()
        .filter(|(_, k, _, _)| k == "val/test_score/arithmetic")
        .map(|x| x.2)
        .collect();
    assert!(
        !val.is_empty() && val.iter().all(|v| (0.0..=1.0).contains(v)),
        "{val:?}"
    );
}

#[test]
fn two_ranks_train_the_reward_model_of_one_rank_step_for_step() {
    let env = setup();
    let file = experiment();
    // 4 pairs a step: 2 per rank, one micro-batch of 2 pairs each
    let overrides = [
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=3",
        "trainer.max_ckpt_to_keep=10",
        "preference_data.train_batch_size=4",
        "reward_model.train.micro_train_batch_size=2",
    ];
    let solo = train_ranks(&env, &file, &overrides, 1);
    let pair = train_ranks(&env, &file, &overrides, 2);
    let (rt, store) = env.store();
    assert_eq!(
        rt.block_on(store.runs(None)).unwrap().len(),
        2,
        "one run each"
    );
    let ckpts = |run: i64| -> Vec<(i64, PathBuf)> {
        rt.block_on(store.checkpoints(run))
            .unwrap()
            .into_iter()
            .map(|c| (c.step, Path::new(&c.path).join("trainer/rm")))
            .collect()
    };
    let (one, two) = (ckpts(solo), ckpts(pair));
    assert_eq!(
        one.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "checkpoint steps of the 1-rank run"
    );
    assert_eq!(
        one.iter().map(|c| c.0).collect::<Vec<_>>(),
        two.iter().map(|c| c.0).collect::<Vec<_>>()
    );
    let moved = max_abs_diff(&weights(&one[0].1), &weights(&one[2].1));
    assert!(moved > 1e-4, "the weights did not move ({moved})");
    let mut worst = 0.0f64;
    for ((step, a), (_, b)) in one.iter().zip(&two) {
        let d = max_abs_diff(&weights(a), &weights(b));
        assert!(
            d < 1e-5,
            "step {step}: 1 and 2 ranks' weights differ by {d}"
        );
        worst = worst.max(d);
    }
    eprintln!("reward model, 1 vs 2 ranks: worst weight difference {worst:e}");
    let metrics = |run: i64| -> BTreeMap<(i64, String), f64> {
        rt.block_on(store.all_metrics(run))
            .unwrap()
            .into_iter()
            .filter(|(_, k, _, _)| !rl_core::is_wall_clock(k) && !k.starts_with("perf/"))
            .map(|(s, k, v, _)| ((s, k), v))
            .collect()
    };
    let (m1, m2) = (metrics(solo), metrics(pair));
    assert_eq!(
        m1.keys().collect::<Vec<_>>(),
        m2.keys().collect::<Vec<_>>(),
        "metric keys"
    );
    for key in ["rm/loss", "rm/accuracy", "rm/grad_norm", "val/rm/loss"] {
        assert!(m1.keys().any(|(_, k)| k == key), "no {key}");
    }
    for (k, a) in &m1 {
        let b = m2[k];
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(1.0),
            "{k:?}: 1 rank {a}, 2 ranks {b}"
        );
    }
    // rank 0 exported the trained reward model
    let run = rt.block_on(store.run(pair)).unwrap().unwrap();
    assert_exported(&Path::new(&run.run_dir).join("model"), &two[2].1);
    // the checkpoints resume at the other world size: the 2-rank run on one process and the
    // 1-rank run on 2 ranks, both to step 4, end with the same weights
    let (pair_id, solo_id) = (pair.to_string(), solo.to_string());
    let resume = |id: &str, nproc: &[&str]| {
        let mut args = vec!["resume", id, "trainer.total_training_steps=4"];
        args.extend_from_slice(nproc);
        one_thread_ok(&env, &args);
    };
    resume(&pair_id, &[]);
    resume(
        &solo_id,
        &["--nproc-per-node", "2", "--dist-timeout-s", "60"],
    );
    let last = |run: i64| ckpts(run).pop().unwrap();
    let ((s1, a), (s2, b)) = (last(pair), last(solo));
    assert_eq!((s1, s2), (4, 4));
    let d = max_abs_diff(&weights(&a), &weights(&b));
    assert!(
        d < 1e-5,
        "resumed across world sizes, step 4 differs by {d}"
    );
}

#[test]
fn bad_reward_model_keys_are_refused_naming_the_key() {
    let env = setup();
    let file = experiment();
    let cases: &[(&str, &str)] = &[
        ("preference_data.val_files=[]", "preference_data.val_files"),
        (
            "reward_model.train.micro_train_batch_size=3",
            "reward_model.train.micro_train_batch_size",
        ),
        ("reward_model.train.margin=-1", "margin"),
        ("reward_model.train.grad_clip=0", "grad_clip"),
        // an unknown key names itself and the group's keys
        ("reward_model.train.lr=0.1", "reward_model.train.lr"),
        ("reward_model.train.lr=0.1", "`optim`"),
    ];
    for (bad, key) in cases {
        let err = env.fails(&[
            "train",
            file.as_str(),
            "trainer.total_training_steps=2",
            bad,
        ]);
        assert!(err.contains(key), "{bad}: {err}");
        assert!(!err.contains("panicked"), "{bad}: {err}");
    }
    // on several ranks, the global batch of pairs must split over them
    let err = env.fails(&[
        "train",
        file.as_str(),
        "trainer.total_training_steps=2",
        "preference_data.train_batch_size=3",
        "--nproc-per-node",
        "2",
    ]);
    assert!(
        err.contains("preference_data.train_batch_size") && err.contains("data-parallel"),
        "{err}"
    );
    // nothing was recorded
    let (rt, store) = env.store();
    assert!(rt.block_on(store.runs(None)).unwrap().is_empty());
}

//! `trainer.algorithm = "reward_model"` through the `harness` binary: experiments/reward_model.toml
//! trains a Bradley–Terry reward model on the tiny preference pairs, a run stopped at a
//! checkpoint and resumed ends with the same weights as an uninterrupted one, the checkpoint's
//! `rm/` folder is the reward role of a GRPO run (`reward_model.model.path`), and bad
//! `reward_model.train` / `preference_data` keys are refused before any model loads, naming the
//! key.

mod common;

use std::path::{Path, PathBuf};

use common::{Env, repo_root};

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

const SMALL: &[&str] = &[
    "preference_data.train_batch_size=4",
    "reward_model.train.micro_train_batch_size=2",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
];

#[test]
fn reward_model_trains_resumes_exactly_and_scores_a_grpo_run() {
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
    // run 2: 2 steps, then resumed to 4
    let mut args = vec![
        "train",
        file.as_str(),
        "trainer.total_training_steps=2",
        "trainer.experiment_name=b",
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
            .filter(|(_, k, _, _)| !k.starts_with("timing_s/"))
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
    // the checkpoint's rm/ is the reward role of a GRPO run, its only training reward
    let quickstart = repo_root().join("experiments/quickstart.toml");
    let rm_path = format!("reward_model.model.path={}", ra.display());
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
        ("trainer.export_dir=out", "trainer.export_dir"),
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
}

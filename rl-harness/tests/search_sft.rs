//! The Search-R1 warm-up as the README walks it: `harness data search-task`, then
//! `harness train experiments/search_r1_sft.toml`, whose SFT batches mask the retriever's
//! observations out of the loss (`sft.mask_tags`).

mod common;

use std::sync::Arc;

use common::{Env, repo_root};
use rl_algos::trainer::BatchSource;
use rl_core::keys;
use rl_harness::config::{Sources, load};
use rl_harness::run::compose::{SftSource, sft_train_rows};

#[test]
fn search_r1_sft_trains_with_the_observations_masked() {
    let env = Env::new();
    env.ok(&[
        "data",
        "search-task",
        "data/search-task",
        "--train",
        "32",
        "--test",
        "8",
        "--topk",
        "1",
    ]);
    env.ok(&["model", "init-tiny", "models/tiny-llama", "--seed", "7"]);
    let file = repo_root().join("experiments/search_r1_sft.toml");
    let file = file.to_str().unwrap();
    let out = env.ok(&[
        "train",
        file,
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "sft.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    ]);
    assert!(out.contains("val/loss"), "{out}");
    assert!(
        env.path()
            .join("models/tiny-llama-search-sft/model.safetensors")
            .is_file(),
        "no exported policy: {out}"
    );

    // the batches the run trained on: the loss mask is 0 exactly on the observations
    let cfg = load(&Sources {
        file: Some(file.into()),
        env: false,
        overrides: vec![],
    })
    .unwrap();
    let mut data = cfg.data.clone();
    for f in data.train_files.iter_mut().chain(data.val_files.iter_mut()) {
        *f = env.path().join(&*f);
    }
    let tok = Arc::new(rl_data::Tokenizer::from_dir(env.path().join("models/tiny-llama")).unwrap());
    let cfg = rl_harness::config::ExperimentConfig { data, ..cfg };
    let rows = Arc::new(sft_train_rows(&cfg).unwrap());
    let mut source = SftSource::new(rows, tok.clone(), 8, 5)
        .unwrap()
        .with_mask_tags(cfg.sft.mask_tags.clone());
    let batch = source.next_batch().unwrap();
    let ids = Vec::<Vec<i64>>::try_from(batch.get(keys::INPUT_IDS).unwrap()).unwrap();
    let loss = Vec::<Vec<i64>>::try_from(batch.get(keys::LOSS_MASK).unwrap()).unwrap();
    let attn = Vec::<Vec<i64>>::try_from(batch.get(keys::ATTENTION_MASK).unwrap()).unwrap();
    for ((ids, loss), attn) in ids.iter().zip(&loss).zip(&attn) {
        let text = |keep: &dyn Fn(usize) -> bool| -> String {
            let kept: Vec<u32> = (0..ids.len())
                .filter(|&t| attn[t] == 1 && keep(t))
                .map(|t| ids[t] as u32)
                .collect();
            tok.decode(&kept, false).unwrap()
        };
        let trained = text(&|t| loss[t] == 1);
        let whole = text(&|_| true);
        assert!(
            trained.starts_with("<search>") && trained.contains("</search><answer>"),
            "trained on {trained:?}"
        );
        assert!(!trained.contains("information"), "{trained:?}");
        assert!(
            whole.contains("\n\n<information>Doc 1(Title: "),
            "{whole:?}"
        );
    }
}

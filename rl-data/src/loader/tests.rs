//! Tests for collation and the loader: padding, position ids, shuffling and exact resume.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::dataset::ReadOptions;
use crate::test_support::{fixture, tokenizer};

fn loader(batch_size: usize, drop_last: bool, shuffle: bool) -> DataLoader {
    let f = fixture("verl_parquet/rl.parquet");
    let ds = RlDataset::open(
        &[f.clone(), f],
        &ReadOptions {
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_samples: None,
        },
    )
    .unwrap();
    let cfg = DataConfig {
        train_batch_size: batch_size,
        drop_last,
        shuffle,
        seed: Some(42),
        max_prompt_length: 128,
        pad_to_max_prompt_length: false,
        ..DataConfig::default()
    };
    DataLoader::new(
        Arc::new(ds),
        Arc::new(tokenizer("smollm2")),
        LoaderOptions::train(&cfg),
    )
    .unwrap()
}

/// A comparable summary of a batch: uids, row indices and the padded ids.
fn summary(b: &PromptBatch) -> (Vec<String>, Vec<usize>, Vec<i64>) {
    (
        b.uid.clone(),
        b.index.clone(),
        Vec::<i64>::try_from(b.input_ids.flatten(0, -1)).unwrap(),
    )
}

#[test]
fn left_padding_and_position_ids_follow_verl() {
    let (ids, mask, pos) = collate_left_padded(&[vec![5, 6, 7], vec![9]], 0, None).unwrap();
    assert_eq!(ids.size(), vec![2, 3]);
    assert_eq!(ids.kind(), tch::Kind::Int64);
    assert_eq!(
        Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap(),
        vec![5, 6, 7, 0, 0, 9]
    );
    assert_eq!(
        Vec::<i64>::try_from(mask.flatten(0, -1)).unwrap(),
        vec![1, 1, 1, 0, 0, 1]
    );
    // verl: clip(cumsum(mask) - 1, min=0)
    let verl = (mask.cumsum(-1, tch::Kind::Int64) - 1).clamp_min(0);
    assert_eq!(pos, verl);
    let (ids, _, _) = collate_left_padded(&[vec![1]], 3, Some(4)).unwrap();
    assert_eq!(
        Vec::<i64>::try_from(ids.flatten(0, -1)).unwrap(),
        vec![3, 3, 3, 1]
    );
    assert!(collate_left_padded(&[vec![1, 2, 3]], 0, Some(2)).is_err());
}

proptest! {
    #[test]
    fn padding_keeps_tokens_and_masks_exactly(lens in proptest::collection::vec(0usize..20, 1..6), extra in 0usize..4) {
        let prompts: Vec<Vec<u32>> = lens.iter().enumerate()
            .map(|(i, &l)| (0..l as u32).map(|t| t + 10 * i as u32 + 1).collect()).collect();
        let longest = lens.iter().copied().max().unwrap();
        let (ids, mask, pos) = collate_left_padded(&prompts, 0, Some(longest + extra)).unwrap();
        let verl = (mask.cumsum(-1, tch::Kind::Int64) - 1).clamp_min(0);
        prop_assert_eq!(&pos, &verl);
        for (i, p) in prompts.iter().enumerate() {
            let row = Vec::<i64>::try_from(ids.get(i as i64)).unwrap();
            let m = Vec::<i64>::try_from(mask.get(i as i64)).unwrap();
            let kept: Vec<i64> = row.iter().zip(&m).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
            prop_assert_eq!(kept, p.iter().map(|&t| i64::from(t)).collect::<Vec<_>>());
            // Left padding: all zeros of the mask come first.
            let first_one = m.iter().position(|&x| x == 1).unwrap_or(m.len());
            prop_assert!(m[first_one..].iter().all(|&x| x == 1));
            prop_assert!(row[..first_one].iter().all(|&t| t == 0));
        }
    }
}

#[test]
fn epoch_order_is_a_permutation_that_changes_every_epoch() {
    let a = epoch_order(100, 7, 0, true);
    let b = epoch_order(100, 7, 1, true);
    assert_eq!(a.iter().copied().collect::<BTreeSet<_>>().len(), 100);
    assert_ne!(a, b);
    assert_eq!(a, epoch_order(100, 7, 0, true));
    assert_ne!(a, epoch_order(100, 8, 0, true));
    assert_eq!(epoch_order(5, 7, 3, false), vec![0, 1, 2, 3, 4]);
}

#[test]
fn batches_carry_columns_and_cover_the_epoch() {
    let mut l = loader(5, true, true);
    assert_eq!(l.batches_per_epoch(), 4);
    let mut seen = BTreeSet::new();
    let mut n = 0;
    while let Some(b) = l.next_batch().unwrap() {
        assert_eq!(b.len(), 5);
        assert_eq!(b.input_ids.size()[0], 5);
        assert_eq!(b.ground_truth.len(), 5);
        assert_eq!(b.raw_prompt.as_ref().unwrap().len(), 5);
        for (k, &i) in b.index.iter().enumerate() {
            let row = l.dataset().row(i).unwrap();
            assert_eq!(b.data_source[k], row.data_source);
            assert_eq!(b.ground_truth[k], row.ground_truth);
            assert_eq!(b.extra_info[k], row.extra_info);
            let text = l.tokenizer.apply_chat_template(&row.prompt, true).unwrap();
            let ids: Vec<i64> = l
                .tokenizer
                .encode(&text, false)
                .unwrap()
                .into_iter()
                .map(i64::from)
                .collect();
            assert_eq!(b.unpadded_ids(k), ids);
        }
        seen.extend(b.index.iter().copied());
        n += 1;
    }
    assert_eq!(n, 4);
    assert_eq!(seen.len(), 20); // 24 rows, drop_last drops 4
    assert_eq!(
        l.state(),
        LoaderState {
            epoch: 1,
            position: 0,
            seed: 42
        }
    );
    let mut no_drop = loader(5, false, false);
    let sizes: Vec<usize> = std::iter::from_fn(|| no_drop.next_batch().unwrap())
        .map(|b| b.len())
        .collect();
    assert_eq!(sizes, vec![5, 5, 5, 5, 4]);
}

#[test]
fn resume_mid_epoch_replays_the_same_batches_across_an_epoch_boundary() {
    let mut straight = loader(5, true, true);
    let all: Vec<_> = (0..10)
        .map(|_| summary(&straight.next_batch_cycling().unwrap()))
        .collect();

    let mut first = loader(5, true, true);
    let head: Vec<_> = (0..3)
        .map(|_| summary(&first.next_batch_cycling().unwrap()))
        .collect();
    let saved = serde_json::to_string(&first.state()).unwrap();
    drop(first);

    let mut resumed = loader(5, true, true);
    resumed
        .load_state(serde_json::from_str(&saved).unwrap())
        .unwrap();
    let tail: Vec<_> = (0..7)
        .map(|_| summary(&resumed.next_batch_cycling().unwrap()))
        .collect();
    assert_eq!([head, tail].concat(), all);
    // The run crossed into epoch 2 (4 batches per epoch), and epochs differ in order.
    assert_eq!(resumed.state().epoch, 2);
    assert_ne!(all[0].1, all[4].1);
}

#[test]
fn prompt_batch_becomes_an_rl_core_batch() {
    let mut l = loader(5, true, true);
    let b = l.next_batch().unwrap().unwrap();
    let (uids, gts) = (b.uid.clone(), b.ground_truth.clone());
    let batch = b.into_batch().unwrap();
    assert_eq!(batch.len(), 5);
    assert_eq!(
        batch.get(rl_core::keys::INPUT_IDS).unwrap().kind(),
        tch::Kind::Int64
    );
    let uid_col: Vec<String> = batch
        .column(rl_core::keys::UID)
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(uid_col, uids);
    assert_eq!(
        batch.column(rl_core::keys::GROUND_TRUTH).unwrap(),
        gts.as_slice()
    );
    assert_eq!(batch.column("raw_prompt").unwrap().len(), 5);
}

#[test]
fn bad_states_are_rejected() {
    let mut l = loader(5, true, true);
    let e = l
        .load_state(LoaderState {
            epoch: 0,
            position: 999,
            seed: 42,
        })
        .unwrap_err();
    assert!(e.to_string().contains("999"), "{e}");
    let e = l
        .load_state(LoaderState {
            epoch: 0,
            position: 0,
            seed: 1,
        })
        .unwrap_err();
    assert!(e.to_string().contains("seed"), "{e}");
}

#[test]
fn train_and_val_loaders_follow_the_data_config() {
    let f = fixture("verl_parquet/rl.parquet");
    let tok = Arc::new(tokenizer("smollm2"));
    let base = DataConfig {
        train_files: vec![f.clone()],
        val_files: vec![f],
        train_batch_size: 4,
        max_prompt_length: 4096,
        pad_to_max_prompt_length: false,
        ..DataConfig::default()
    };
    let mut train = DataLoader::train(&base, tok.clone()).unwrap();
    assert_eq!(train.batches_per_epoch(), 3);
    let val = DataLoader::val(&base, tok.clone()).unwrap();
    assert_eq!(val.batches_per_epoch(), 1); // val_batch_size = null: the whole set at once

    // filter_overlong_prompts drops the long system-prompt rows instead of failing.
    let lens: Vec<usize> = (0..12)
        .map(|i| {
            let row = train.dataset().row(i).unwrap();
            tok.encode(&tok.apply_chat_template(&row.prompt, true).unwrap(), false)
                .unwrap()
                .len()
        })
        .collect();
    let shortest = *lens.iter().min().unwrap();
    let filtered = DataConfig {
        max_prompt_length: shortest,
        filter_overlong_prompts: true,
        train_batch_size: 1,
        ..base.clone()
    };
    let l = DataLoader::train(&filtered, tok.clone()).unwrap();
    assert_eq!(
        l.dataset().len(),
        lens.iter().filter(|&&n| n <= shortest).count()
    );

    // A chat_template in apply_chat_template_kwargs replaces the tokenizer's.
    let mut kwargs = std::collections::BTreeMap::new();
    kwargs.insert(
        "chat_template".to_string(),
        serde_json::json!("{{ messages[0].content }}"),
    );
    let custom = DataConfig {
        apply_chat_template_kwargs: kwargs,
        return_full_prompt: true,
        ..base.clone()
    };
    let mut l = DataLoader::train(&custom, tok.clone()).unwrap();
    let b = l.next_batch().unwrap().unwrap();
    let row = l.dataset().row(b.index[0]).unwrap();
    assert_eq!(b.full_prompts.unwrap()[0], row.prompt[0].content);
    // The caller's tokenizer keeps its own template.
    assert!(
        tok.apply_chat_template(&row.prompt, true)
            .unwrap()
            .contains("<|im_start|>")
    );

    let bad = DataConfig {
        train_batch_size: 0,
        ..base
    };
    assert!(
        DataLoader::train(&bad, tok)
            .unwrap_err()
            .to_string()
            .contains("data.train_batch_size")
    );
    let _ = train.next_batch().unwrap();
}

#[test]
fn shards_partition_each_global_batch_and_keep_the_global_state() {
    // 2 x the fixture's rows; batch 4 without drop_last leaves a partial last batch
    let mut whole = loader(4, false, true);
    let rows = whole.dataset().len();
    for world in [2usize, 4] {
        let mut whole = loader(4, false, true);
        let mut ranks: Vec<DataLoader> = (0..world)
            .map(|r| loader(4, false, true).with_shard(r, world).unwrap())
            .collect();
        assert_eq!(ranks[1].shard(), (1, world));
        // two epochs, across the boundary
        for _ in 0..2 * rows.div_ceil(4) + 1 {
            let want = whole.next_batch().unwrap();
            let got: Vec<Option<PromptBatch>> =
                ranks.iter_mut().map(|l| l.next_batch().unwrap()).collect();
            match want {
                None => assert!(got.iter().all(Option::is_none)),
                Some(w) => {
                    let uid: Vec<String> = got
                        .iter()
                        .flat_map(|b| b.as_ref().unwrap().uid.clone())
                        .collect();
                    let index: Vec<usize> = got
                        .iter()
                        .flat_map(|b| b.as_ref().unwrap().index.clone())
                        .collect();
                    assert_eq!(uid, w.uid, "world {world}");
                    assert_eq!(index, w.index, "world {world}");
                }
            }
            for l in &ranks {
                assert_eq!(l.state(), whole.state(), "the state is global");
            }
        }
    }
    // a global batch that does not split over the ranks is an error naming the key
    let err = loader(4, false, true).with_shard(0, 3).unwrap_err();
    assert!(err.to_string().contains("data.train_batch_size"), "{err}");
    assert!(loader(4, false, true).with_shard(2, 2).is_err());
    // a state saved at one world size resumes at another
    let mut two = loader(4, true, true).with_shard(1, 2).unwrap();
    two.next_batch().unwrap();
    let saved = two.state();
    whole.load_state(saved).unwrap();
    let mut one = loader(4, true, true);
    one.load_state(saved).unwrap();
    let a = one.next_batch().unwrap().unwrap();
    let b = two.next_batch().unwrap().unwrap();
    assert_eq!(&a.uid[2..], &b.uid[..]);
}

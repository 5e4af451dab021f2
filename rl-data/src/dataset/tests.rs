//! Tests for reading verl-schema parquet: the pyarrow round trip and every bad input.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};

use super::*;
use crate::parquet_io::write_batches;
use crate::test_support::{fixture, tokenizer};

fn expected(file: &str) -> Vec<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("verl_parquet/expected.json")).unwrap(),
    )
    .unwrap();
    v[file].as_array().unwrap().clone()
}

fn opts(prompt_key: &str) -> ReadOptions {
    ReadOptions {
        prompt_key: prompt_key.into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    }
}

#[test]
fn round_trip_matches_pyarrow() {
    let ds = RlDataset::open(&[fixture("verl_parquet/rl.parquet")], &opts("prompt")).unwrap();
    let exp = expected("rl.parquet");
    assert_eq!(ds.len(), exp.len());
    for (i, e) in exp.iter().enumerate() {
        let row = ds.row(i).unwrap();
        let prompt: Vec<Message> = serde_json::from_value(e["prompt"].clone()).unwrap();
        assert_eq!(row.prompt, prompt, "row {i}");
        assert_eq!(row.data_source, e["data_source"].as_str().unwrap());
        assert_eq!(row.ability.as_deref(), e["ability"].as_str());
        assert_eq!(row.ground_truth, e["reward_model"]["ground_truth"]);
        assert_eq!(row.reward_style.as_deref(), Some("rule"));
        assert_eq!(row.extra_info, e["extra_info"], "row {i}");
        assert_eq!(row.source.row, i);
    }
}

#[test]
fn plain_string_prompt_key_and_list_ground_truth() {
    let ds = RlDataset::open(&[fixture("verl_parquet/plain.parquet")], &opts("question")).unwrap();
    let exp = expected("plain.parquet");
    assert_eq!(ds.len(), exp.len());
    for (i, e) in exp.iter().enumerate() {
        let row = ds.row(i).unwrap();
        assert_eq!(
            row.prompt,
            vec![Message::user(e["question"].as_str().unwrap())]
        );
        assert_eq!(row.ground_truth, e["reward_model"]["ground_truth"]);
        assert_eq!(row.extra_info, e["extra_info"]);
        assert_eq!(row.ability, None);
    }
}

#[test]
fn files_concatenate_and_max_samples_caps() {
    let f = fixture("verl_parquet/rl.parquet");
    let ds = RlDataset::open(&[f.clone(), f.clone()], &opts("prompt")).unwrap();
    assert_eq!(ds.len(), 24);
    assert_eq!(ds.row(12).unwrap().source.row, 0);
    assert_eq!(ds.row(12).unwrap().prompt, ds.row(0).unwrap().prompt);
    let capped = ReadOptions {
        max_samples: Some(15),
        ..opts("prompt")
    };
    let ds = RlDataset::open(&[f.clone(), f.clone()], &capped).unwrap();
    assert_eq!(ds.len(), 15);
    assert_eq!(ds.row(14).unwrap().source.row, 2);
    let streamed: Vec<RlRow> = stream_rows(&[f.clone(), f], &capped)
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(streamed.len(), 15);
    for (i, r) in streamed.iter().enumerate() {
        assert_eq!(r, &ds.row(i).unwrap());
    }
}

fn err_of(path: &Path, o: &ReadOptions) -> String {
    let e1 = RlDataset::open(&[path.to_path_buf()], o)
        .unwrap_err()
        .to_string();
    let e2 = stream_rows(&[path.to_path_buf()], o)
        .find_map(|r| r.err())
        .unwrap()
        .to_string();
    assert_eq!(e1, e2);
    e1
}

#[test]
fn missing_column_names_file_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nods.parquet");
    let schema = Arc::new(Schema::new(vec![Field::new(
        "prompt",
        DataType::Utf8,
        true,
    )]));
    let col: ArrayRef = Arc::new(StringArray::from(vec!["hi"]));
    write_batches(&p, &[RecordBatch::try_new(schema, vec![col]).unwrap()]).unwrap();
    let e = err_of(&p, &opts("prompt"));
    assert!(
        e.contains("nods.parquet") && e.contains("`data_source`") && e.contains("prompt"),
        "{e}"
    );
    let e = err_of(
        &p,
        &ReadOptions {
            reward_fn_key: "prompt".into(),
            ..opts("question")
        },
    );
    assert!(e.contains("missing column `question`"), "{e}");
}

#[test]
fn wrong_type_names_file_row_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("wrong.parquet");
    let schema = Arc::new(Schema::new(vec![
        Field::new("data_source", DataType::Utf8, true),
        Field::new("prompt", DataType::Int64, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec!["a", "b"])),
        Arc::new(Int64Array::from(vec![1, 2])),
    ];
    write_batches(&p, &[RecordBatch::try_new(schema, cols).unwrap()]).unwrap();
    let e = err_of(&p, &opts("prompt"));
    assert!(
        e.contains("wrong.parquet")
            && e.contains("row 0")
            && e.contains("`prompt`")
            && e.contains("int64"),
        "{e}"
    );
}

#[test]
fn null_prompt_names_its_row() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nulls.parquet");
    let schema = Arc::new(Schema::new(vec![
        Field::new("data_source", DataType::Utf8, true),
        Field::new("prompt", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec!["a", "b", "c"])),
        Arc::new(StringArray::from(vec![Some("x"), Some("y"), None])),
    ];
    write_batches(&p, &[RecordBatch::try_new(schema, cols).unwrap()]).unwrap();
    let e = err_of(&p, &opts("prompt"));
    assert!(
        e.contains("nulls.parquet") && e.contains("row 2") && e.contains("`prompt`"),
        "{e}"
    );
}

#[test]
fn empty_and_corrupt_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.parquet");
    std::fs::write(&empty, b"").unwrap();
    let e = err_of(&empty, &opts("prompt"));
    assert!(e.contains("empty.parquet") && e.contains("no rows"), "{e}");

    let zero_rows = dir.path().join("zero_rows.parquet");
    let schema = Arc::new(Schema::new(vec![
        Field::new("data_source", DataType::Utf8, true),
        Field::new("prompt", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(Vec::<&str>::new())),
        Arc::new(StringArray::from(Vec::<&str>::new())),
    ];
    write_batches(&zero_rows, &[RecordBatch::try_new(schema, cols).unwrap()]).unwrap();
    let e = err_of(&zero_rows, &opts("prompt"));
    assert!(
        e.contains("zero_rows.parquet") && e.contains("no rows"),
        "{e}"
    );

    let good = std::fs::read(fixture("verl_parquet/rl.parquet")).unwrap();
    let truncated = dir.path().join("truncated.parquet");
    std::fs::write(&truncated, &good[..good.len() / 2]).unwrap();
    let e = err_of(&truncated, &opts("prompt"));
    assert!(
        e.contains("truncated.parquet") && e.contains("parquet"),
        "{e}"
    );

    // Garbage in the data pages with an intact footer.
    let mut garbled = good.clone();
    for b in garbled.iter_mut().skip(4).take(good.len() / 2) {
        *b = 0xAB;
    }
    let bad = dir.path().join("garbled.parquet");
    std::fs::write(&bad, &garbled).unwrap();
    let e = err_of(&bad, &opts("prompt"));
    assert!(e.contains("garbled.parquet"), "{e}");

    let missing = dir.path().join("missing.parquet");
    let e = err_of(&missing, &opts("prompt"));
    assert!(e.contains("missing.parquet"), "{e}");
}

#[test]
fn prompt_over_limit_with_truncation_error_names_file_row_and_column() {
    let tok = tokenizer("smollm2");
    let ds = RlDataset::open(&[fixture("verl_parquet/rl.parquet")], &opts("prompt")).unwrap();
    let kwargs = BTreeMap::new();
    let enc = PromptEncoder {
        tokenizer: &tok,
        max_prompt_length: 16,
        truncation: Truncation::Error,
        template_kwargs: &kwargs,
    };
    let rows: Vec<RlRow> = (0..ds.len()).map(|i| ds.row(i).unwrap()).collect();
    let e = enc
        .encode(&rows[3..], ds.prompt_key())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rl.parquet") && e.contains("row 3") && e.contains("`prompt`"),
        "{e}"
    );
    for t in [Truncation::Left, Truncation::Right, Truncation::Middle] {
        let enc = PromptEncoder {
            truncation: t,
            ..enc
        };
        let out = enc.encode(&rows, "prompt").unwrap();
        assert!(out.iter().all(|p| p.ids.len() == 16));
    }
    let full = PromptEncoder {
        max_prompt_length: 10_000,
        ..enc
    };
    let out = full.encode(&rows, "prompt").unwrap();
    for (o, r) in out.iter().zip(&rows) {
        assert_eq!(o.text, tok.apply_chat_template(&r.prompt, true).unwrap());
        assert_eq!(o.ids, tok.encode(&o.text, false).unwrap());
    }
}

#[test]
fn filter_overlong_prompts_drops_only_long_rows() {
    let tok = tokenizer("smollm2");
    let mut ds = RlDataset::open(&[fixture("verl_parquet/rl.parquet")], &opts("prompt")).unwrap();
    let kwargs = BTreeMap::new();
    let lens = PromptEncoder {
        tokenizer: &tok,
        max_prompt_length: usize::MAX,
        truncation: Truncation::Error,
        template_kwargs: &kwargs,
    }
    .token_lens(
        &(0..ds.len())
            .map(|i| ds.row(i).unwrap())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let mut sorted = lens.clone();
    sorted.sort();
    let limit = sorted[0];
    let enc = PromptEncoder {
        tokenizer: &tok,
        max_prompt_length: limit,
        truncation: Truncation::Error,
        template_kwargs: &kwargs,
    };
    let dropped = ds.filter_overlong_prompts(&enc).unwrap();
    assert_eq!(dropped, lens.iter().filter(|&&l| l > limit).count());
    assert!(dropped > 0);
    let kept: Vec<RlRow> = (0..ds.len()).map(|i| ds.row(i).unwrap()).collect();
    assert!(enc.encode(&kept, "prompt").is_ok());
}

/// No files is an error naming the key that gave none, training or validation.
#[test]
fn no_files_names_the_key() {
    let cfg = DataConfig {
        train_files: vec![],
        val_files: vec![],
        ..DataConfig::default()
    };
    let t = RlDataset::train(&cfg).unwrap_err().to_string();
    let v = RlDataset::val(&cfg).unwrap_err().to_string();
    assert!(t.contains("`data.train_files`: no files given"), "{t}");
    assert!(v.contains("`data.val_files`: no files given"), "{v}");
}

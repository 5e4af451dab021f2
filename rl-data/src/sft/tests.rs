//! Tests for the SFT and preference datasets: loss masks on assistant tokens only, padding,
//! truncation errors, and the Batch adapters.

use std::sync::Arc;

use arrow::array::{ArrayRef, StringArray};
use arrow::datatypes::{DataType, Field, Schema};

use super::*;
use crate::config::MultiturnConfig;
use crate::parquet_io::{RlRecord, write_batches, write_rl_parquet};
use crate::test_support::tokenizer;

fn conversation() -> Vec<Message> {
    vec![
        Message::system("Be brief."),
        Message::user("What is 2 + 2?"),
        Message::assistant("4"),
        Message::user("And 3 + 3? 東京 🚀"),
        Message::assistant("It is 6."),
    ]
}

fn trained_text(tok: &Tokenizer, ex: &SftExample) -> String {
    let ids: Vec<u32> = ex
        .input_ids
        .iter()
        .zip(&ex.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    tok.decode(&ids, false).unwrap()
}

#[test]
fn conversation_mask_covers_assistant_content_only() {
    for case in ["smollm2", "qwen2_5", "llama3"] {
        let tok = tokenizer(case);
        let msgs = conversation();
        let ex = tokenize_conversation(&tok, &msgs).unwrap();
        let full = tok.apply_chat_template(&msgs, false).unwrap();
        assert_eq!(tok.decode(&ex.input_ids, false).unwrap(), full, "{case}");
        let trained = trained_text(&tok, &ex);
        assert!(
            trained.contains('4') && trained.contains("It is 6."),
            "{case}: {trained:?}"
        );
        for not_trained in ["Be brief", "2 + 2", "東京", "assistant", "user"] {
            assert!(
                !trained.contains(not_trained),
                "{case}: {not_trained:?} in {trained:?}"
            );
        }
    }
}

#[test]
fn non_prefix_preserving_templates_are_an_error() {
    let mut tok = tokenizer("smollm2");
    tok.set_chat_template(
        "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let e = tokenize_conversation(&tok, &conversation())
        .unwrap_err()
        .to_string();
    assert!(e.contains("prefix-preserving"), "{e}");
}

fn single_turn_file(dir: &Path) -> PathBuf {
    let p = dir.join("sft.parquet");
    let schema = Arc::new(Schema::new(vec![
        Field::new("question", DataType::Utf8, true),
        Field::new("answer", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec![
            "What is 2 + 2?",
            "Name a colour.",
            &"long ".repeat(500),
        ])),
        Arc::new(StringArray::from(vec!["4", "Blue.", "ok"])),
    ];
    write_batches(&p, &[RecordBatch::try_new(schema, cols).unwrap()]).unwrap();
    p
}

#[test]
fn single_turn_sft_masks_the_response_and_pads_right() {
    let dir = tempfile::tempdir().unwrap();
    let f = single_turn_file(dir.path());
    let tok = tokenizer("smollm2");
    let cfg = SftDataConfig {
        max_length: 256,
        truncation: Truncation::Right,
        ..SftDataConfig::default()
    };
    let ds = SftDataset::open(std::slice::from_ref(&f), &cfg).unwrap();
    assert_eq!(ds.len(), 3);
    let ex = ds.example(0, &tok).unwrap();
    assert_eq!(trained_text(&tok, &ex), "4<|im_end|>");
    let prompt = tok
        .apply_chat_template(&[Message::user("What is 2 + 2?")], true)
        .unwrap();
    let n_prompt = tok.encode(&prompt, false).unwrap().len();
    assert!(ex.loss_mask[..n_prompt].iter().all(|&m| m == 0));
    assert!(ex.loss_mask[n_prompt..].iter().all(|&m| m == 1));

    let b = ds.batch(&[0, 1, 2], &tok).unwrap();
    assert_eq!(b.input_ids.size(), vec![3, 256]);
    let att = Vec::<i64>::try_from(b.attention_mask.get(0)).unwrap();
    let real = ex.input_ids.len();
    assert!(att[..real].iter().all(|&a| a == 1) && att[real..].iter().all(|&a| a == 0));
    let pos = b.position_ids.get(0);
    assert_eq!(
        pos,
        (b.attention_mask.get(0).cumsum(-1, tch::Kind::Int64) - 1).clamp_min(0)
    );
    let loss = Vec::<i64>::try_from(b.loss_mask.get(0)).unwrap();
    assert!(loss[real..].iter().all(|&m| m == 0));
    let batch = b.into_batch().unwrap();
    assert_eq!(
        batch.get(rl_core::keys::LOSS_MASK).unwrap().size(),
        vec![3, 256]
    );

    let strict = SftDataset::open(
        &[f],
        &SftDataConfig {
            max_length: 256,
            ..SftDataConfig::default()
        },
    )
    .unwrap();
    let e = strict.example(2, &tok).unwrap_err().to_string();
    assert!(
        e.contains("sft.parquet") && e.contains("row 2") && e.contains("data.max_length = 256"),
        "{e}"
    );
}

#[test]
fn multiturn_sft_reads_message_lists() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mt.parquet");
    let rec = RlRecord {
        data_source: "chat".into(),
        prompt: conversation(),
        ability: "chat".into(),
        style: "rule".into(),
        ground_truth: serde_json::Value::Null,
        extra_info: serde_json::Map::new(),
    };
    write_rl_parquet(&p, &[rec.clone(), rec]).unwrap();
    let cfg = SftDataConfig {
        multiturn: MultiturnConfig {
            enable: true,
            messages_key: "prompt".into(),
        },
        max_length: 256,
        ..SftDataConfig::default()
    };
    let ds = SftDataset::open(&[p], &cfg).unwrap();
    let tok = tokenizer("qwen2_5");
    assert_eq!(ds.messages(1).unwrap(), conversation());
    assert_eq!(
        ds.example(0, &tok).unwrap(),
        tokenize_conversation(&tok, &conversation()).unwrap()
    );
    let missing =
        SftDataset::open(&[dir.path().join("mt.parquet")], &SftDataConfig::default()).unwrap_err();
    assert!(
        missing.to_string().contains("missing column `question`"),
        "{missing}"
    );
}

#[test]
fn preference_pairs_share_the_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("pref.parquet");
    let schema = Arc::new(Schema::new(vec![
        Field::new("prompt", DataType::Utf8, true),
        Field::new("chosen", DataType::Utf8, true),
        Field::new("rejected", DataType::Utf8, true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(vec!["What is 2 + 2?", "Say hi."])),
        Arc::new(StringArray::from(vec!["4", "Hi!"])),
        Arc::new(StringArray::from(vec![
            "5, I think, but I am not at all sure",
            "No.",
        ])),
    ];
    write_batches(&p, &[RecordBatch::try_new(schema, cols).unwrap()]).unwrap();
    let tok = tokenizer("smollm2");
    let ds = PreferenceDataset::open(&[p], &PreferenceDataConfig::default()).unwrap();
    let ex = ds.example(0, &tok).unwrap();
    let n_prompt = ex.chosen.loss_mask.iter().take_while(|&&m| m == 0).count();
    assert_eq!(
        ex.chosen.input_ids[..n_prompt],
        ex.rejected.input_ids[..n_prompt]
    );
    assert_eq!(trained_text(&tok, &ex.chosen), "4<|im_end|>");
    assert_eq!(
        trained_text(&tok, &ex.rejected),
        "5, I think, but I am not at all sure<|im_end|>"
    );
    let b = ds.batch(&[0, 1], &tok).unwrap();
    assert_eq!(b.chosen.input_ids.size(), b.rejected.input_ids.size());
    let batch = b.into_batch().unwrap();
    for k in [
        "chosen_input_ids",
        "chosen_loss_mask",
        "rejected_attention_mask",
        "rejected_position_ids",
    ] {
        assert!(batch.contains(k), "{k}");
    }
}

#[test]
fn observation_segments_cut_tool_spans_with_their_whitespace() {
    let tags = vec!["information".to_string(), "result".to_string()];
    let trace = "<search>Toga color</search>\n\n<information>Toga color is green.</information>\n\n\
                 think <calculator>1+1</calculator>\n<result>2</result>\n<answer>green</answer>";
    assert_eq!(
        observation_segments(trace, &tags),
        vec![
            ("<search>Toga color</search>", true),
            (
                "\n\n<information>Toga color is green.</information>\n\n",
                false
            ),
            ("think <calculator>1+1</calculator>", true),
            ("\n<result>2</result>\n", false),
            ("<answer>green</answer>", true),
        ]
    );
    // an unclosed observation runs to the end; no tags, one generated segment
    assert_eq!(
        observation_segments("a <information>b", &tags),
        vec![("a", true), (" <information>b", false)]
    );
    assert_eq!(observation_segments("plain", &[]), vec![("plain", true)]);
}

#[test]
fn a_trace_is_tokenised_by_segment_and_its_observations_are_masked() {
    let tok = tokenizer("smollm2");
    let prompt = [Message::user("What is the color of Toga?")];
    let trace = "<search>Toga</search>\n\n<information>Toga is green.</information>\n\n<answer>green</answer>";
    let tags = vec!["information".to_string()];
    let ex = tokenize_prompt_trace(&tok, &prompt, trace, &tags).unwrap();
    let plain = tokenize_prompt_response(&tok, &prompt, trace).unwrap();
    let masked: String = ex
        .input_ids
        .iter()
        .zip(&ex.loss_mask)
        .filter(|(_, m)| **m == 0)
        .map(|(&id, _)| tok.decode(&[id], false).unwrap())
        .collect();
    let prompt_text = tok.apply_chat_template(&prompt, true).unwrap();
    assert_eq!(
        masked,
        format!("{prompt_text}\n\n<information>Toga is green.</information>\n\n")
    );
    let eos = tok.special_tokens().eos.clone().unwrap();
    let trained: String = ex
        .input_ids
        .iter()
        .zip(&ex.loss_mask)
        .filter(|(_, m)| **m == 1)
        .map(|(&id, _)| tok.decode(&[id], false).unwrap())
        .collect();
    assert_eq!(
        trained,
        format!("<search>Toga</search><answer>green</answer>{eos}")
    );
    // without tags it is the plain single-turn example
    assert_eq!(
        tokenize_prompt_trace(&tok, &prompt, trace, &[]).unwrap(),
        plain
    );
}

/// verl's GSM8K parquet as its SFT examples read it: `prompt_key = extra_info` with
/// `prompt_dict_keys = [question]`, the answer likewise; a number is the response as text; a
/// missing field, a wrong type or a null names the file, row and the path at fault.
#[test]
fn dict_keys_descend_into_struct_columns_as_verls_sft_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("gsm8k.parquet");
    let record = |q: &str, a: serde_json::Value| RlRecord {
        data_source: "openai/gsm8k".into(),
        prompt: vec![Message::user(format!("{q} Think step by step."))],
        ability: "math".into(),
        style: "rule".into(),
        ground_truth: serde_json::json!(7),
        extra_info: serde_json::json!({"question": q, "answer": a, "index": 0})
            .as_object()
            .unwrap()
            .clone(),
    };
    write_rl_parquet(
        &f,
        &[
            record("What is 3 + 4?", serde_json::json!("3 + 4 = 7. #### 7")),
            record("What is 1 + 1?", serde_json::json!("#### 2")),
        ],
    )
    .unwrap();
    let tok = tokenizer("smollm2");
    let cfg = SftDataConfig {
        prompt_key: "extra_info".into(),
        prompt_dict_keys: vec!["question".into()],
        response_key: "extra_info".into(),
        response_dict_keys: vec!["answer".into()],
        ..SftDataConfig::default()
    };
    let ds = SftDataset::open(std::slice::from_ref(&f), &cfg).unwrap();
    assert_eq!(
        ds.messages(0).unwrap(),
        vec![
            Message::user("What is 3 + 4?"),
            Message::assistant("3 + 4 = 7. #### 7")
        ]
    );
    let ex = ds.example(1, &tok).unwrap();
    assert_eq!(trained_text(&tok, &ex), "#### 2<|im_end|>");

    // the RL columns: the messages of `prompt`, the number in `reward_model.ground_truth`
    let rl = SftDataset::open(
        std::slice::from_ref(&f),
        &SftDataConfig {
            prompt_key: "prompt".into(),
            response_key: "reward_model".into(),
            response_dict_keys: vec!["ground_truth".into()],
            ..SftDataConfig::default()
        },
    )
    .unwrap();
    assert_eq!(
        rl.messages(1).unwrap(),
        vec![
            Message::user("What is 1 + 1? Think step by step."),
            Message::assistant("7")
        ]
    );

    let err = |cfg: SftDataConfig| {
        SftDataset::open(std::slice::from_ref(&f), &cfg)
            .and_then(|d| d.messages(1))
            .unwrap_err()
            .to_string()
    };
    let e = err(SftDataConfig {
        prompt_dict_keys: vec!["query".into()],
        ..cfg.clone()
    });
    assert!(
        e.contains("gsm8k.parquet")
            && e.contains("row 1")
            && e.contains("`extra_info`")
            && e.contains("expected a field `query`, got the fields")
            && e.contains("question"),
        "{e}"
    );
    let e = err(SftDataConfig {
        response_dict_keys: vec!["answer".into(), "text".into()],
        ..cfg.clone()
    });
    assert!(
        e.contains("`extra_info.answer`") && e.contains("expected a field `text`, got \"#### 2\""),
        "{e}"
    );
    let e = err(SftDataConfig {
        response_dict_keys: vec![],
        ..cfg.clone()
    });
    assert!(
        e.contains("`extra_info`") && e.contains("expected string"),
        "{e}"
    );
    let e = err(SftDataConfig {
        prompt_dict_keys: vec!["index".into()],
        ..cfg
    });
    assert!(
        e.contains("`extra_info.index`") && e.contains("string or messages"),
        "{e}"
    );
}

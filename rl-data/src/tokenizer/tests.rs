//! Tests for the tokenizer and chat templates: parity with transformers on the committed fixtures.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

#[derive(Deserialize)]
struct Expected {
    tokenizer: String,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    pad_token_id: Option<u32>,
    vocab_size: usize,
    encodes: Vec<EncodeCase>,
    chats: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct EncodeCase {
    text: String,
    add_special_tokens: bool,
    ids: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<Message>,
    add_generation_prompt: bool,
    kwargs: BTreeMap<String, TemplateValue>,
    rendered: String,
    ids: Vec<u32>,
}

/// Lays out a model directory (tokenizer.json + tokenizer_config.json) for one fixture case.
fn case_dir(name: &str) -> (tempfile::TempDir, Expected) {
    let case = fixtures().join("cases").join(name);
    let expected: Expected =
        serde_json::from_str(&std::fs::read_to_string(case.join("expected.json")).unwrap())
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("tokenizers").join(&expected.tokenizer),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        case.join("tokenizer_config.json"),
        dir.path().join("tokenizer_config.json"),
    )
    .unwrap();
    (dir, expected)
}

fn check_case(name: &str) {
    let (dir, exp) = case_dir(name);
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.bos_token_id(), exp.bos_token_id, "{name}: bos");
    assert_eq!(tok.eos_token_id(), exp.eos_token_id, "{name}: eos");
    assert_eq!(tok.pad_token_id(), exp.pad_token_id, "{name}: pad");
    assert_eq!(tok.vocab_size(), exp.vocab_size, "{name}: vocab");
    for c in &exp.encodes {
        let ids = tok.encode(&c.text, c.add_special_tokens).unwrap();
        assert_eq!(
            ids, c.ids,
            "{name}: encode {:?} add_special={}",
            c.text, c.add_special_tokens
        );
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            c.decoded,
            "{name}: decode {:?}",
            c.text
        );
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            c.decoded_skip_special,
            "{name}: decode skip_special {:?}",
            c.text
        );
    }
    let plain: Vec<&EncodeCase> = exp
        .encodes
        .iter()
        .filter(|c| !c.add_special_tokens)
        .collect();
    let batch: Vec<String> = plain.iter().map(|c| c.text.clone()).collect();
    let ids = tok.encode_batch(&batch, false).unwrap();
    assert_eq!(ids.len(), plain.len());
    for (got, c) in ids.iter().zip(plain) {
        assert_eq!(got, &c.ids, "{name}: encode_batch {:?}", c.text);
    }
    let template = tok.chat_template().unwrap();
    for (i, c) in exp.chats.iter().enumerate() {
        let rendered = if c.kwargs.is_empty() {
            tok.apply_chat_template(&c.messages, c.add_generation_prompt)
                .unwrap()
        } else {
            template
                .render_with(&c.messages, c.add_generation_prompt, &c.kwargs)
                .unwrap()
        };
        assert_eq!(rendered, c.rendered, "{name}: chat #{i}");
        assert_eq!(
            tok.encode(&rendered, false).unwrap(),
            c.ids,
            "{name}: chat ids #{i}"
        );
    }
}

#[test]
fn parity_chatml_list_form_template() {
    check_case("chatml");
}

#[test]
fn parity_qwen2_5_with_tools() {
    check_case("qwen2_5");
}

#[test]
fn parity_qwen3_python_string_methods() {
    check_case("qwen3");
}

#[test]
fn parity_llama3() {
    check_case("llama3");
}

#[test]
fn parity_llama3_1() {
    check_case("llama3_1");
}

#[test]
fn parity_smollm2() {
    check_case("smollm2");
}

#[test]
fn named_template_can_be_selected() {
    let (dir, _) = case_dir("chatml");
    let mut tok = Tokenizer::from_dir(dir.path()).unwrap();
    tok.use_named_template("tool_use").unwrap();
    let s = tok
        .apply_chat_template(&[Message::user("hi")], true)
        .unwrap();
    assert!(s.starts_with("<|im_start|>system\nYou are Qwen"), "{s}");
    let err = tok.use_named_template("nope").unwrap_err().to_string();
    assert!(err.contains("nope") && err.contains("tool_use"), "{err}");
}

#[test]
fn raise_exception_becomes_an_error_with_the_message() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
        SpecialTokens::default(),
    )
    .unwrap();
    assert_eq!(t.render(&[Message::user("x")], false).unwrap(), "ok");
    let err = t
        .render(&[Message::assistant("x")], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("first must be user"), "{err}");
}

#[test]
fn bad_template_is_a_parse_error() {
    let err = ChatTemplate::new("{% for m in messages %}", SpecialTokens::default()).unwrap_err();
    assert!(err.to_string().contains("parse"), "{err}");
}

#[test]
fn missing_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn bad_chat_template_type_names_the_file_and_key() {
    let (dir, _) = case_dir("smollm2");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": 3}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("chat_template"),
        "{err}"
    );
}

#[test]
fn chat_template_jinja_file_and_special_tokens_map_are_read() {
    let (dir, _) = case_dir("smollm2");
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{{ eos_token }}",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("special_tokens_map.json"),
        r#"{"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&[], false).unwrap(),
        "<|im_start|><|im_end|>"
    );
    assert_eq!(tok.eos_token_id(), tok.token_to_id("<|im_end|>"));
    assert_eq!(tok.pad_token_id(), None);
    assert_eq!(tok.pad_id_or_eos().unwrap(), tok.eos_token_id().unwrap());
}

#[test]
fn tojson_matches_python_json_dumps() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 1.0 | tojson }}|{{ 'é\"\n' | tojson }}",
        SpecialTokens::default(),
    )
    .unwrap();
    let x: TemplateValue = serde_json::from_str(r#"{"b": [1, 2.5], "a": null, "c": {}}"#).unwrap();
    let kwargs = BTreeMap::from([("x".to_string(), x)]);
    let got = t.render_with(&[], false, &kwargs).unwrap();
    assert_eq!(
        got,
        "{\"b\": [1, 2.5], \"a\": null, \"c\": {}}|{\n  \"b\": [\n    1,\n    2.5\n  ],\n  \
         \"a\": null,\n  \"c\": {}\n}|1.0|\"é\\\"\\n\""
    );
}

#[test]
fn strftime_formats_known_dates() {
    // 2024-07-26 00:00:00 UTC, a Friday.
    assert_eq!(strftime(1_721_952_000, "%d %b %Y"), "26 Jul 2024");
    assert_eq!(
        strftime(1_721_952_000 + 3661, "%A %H:%M:%S %j %%"),
        "Friday 01:01:01 208 %"
    );
    assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
}

#[test]
fn segmented_encoding_equals_the_tokenizers_crate() {
    for name in [
        "chatml", "qwen2_5", "qwen3", "llama3", "llama3_1", "smollm2",
    ] {
        let (dir, exp) = case_dir(name);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(
            tok.segmenter.is_some(),
            "{name}: fixture tokenizers qualify for segmenting"
        );
        assert!(
            tok.fast.is_some(),
            "{name}: fixture tokenizers qualify for the byte-level shortcut"
        );
        let mut texts: Vec<String> = exp.encodes.iter().map(|c| c.text.clone()).collect();
        texts.extend(exp.chats.iter().map(|c| c.rendered.clone()));
        let batch = tok.encode_batch(&texts, false).unwrap();
        for (t, ids) in texts.iter().zip(batch) {
            assert_eq!(ids, tok.encode_plain(t, false).unwrap(), "{name}: {t:?}");
        }
    }
}

proptest::proptest! {
    #[test]
    fn segmented_encoding_equals_plain_on_random_text(
        parts in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::string::string_regex("[ a-zA-Z0-9.,!?\n\t'é東🚀]{0,12}").unwrap(),
                proptest::sample::select(vec![
                    "<|im_start|>".to_string(), "<|im_end|>".to_string(), "<|endoftext|>".to_string(),
                    "<|im_start".to_string(), " <|im_end|> ".to_string(), "\n".to_string(),
                ]),
            ],
            0..12,
        )
    ) {
        let tok = crate::test_support::tokenizer("smollm2");
        let text: String = parts.concat();
        let seg = tok.encode_batch(std::slice::from_ref(&text), false).unwrap().remove(0);
        proptest::prop_assert_eq!(seg, tok.encode_plain(&text, false).unwrap());
    }
}

/// ASCII text heavy in what the pre-tokenizer regexes treat specially: whitespace runs before
/// words and line breaks, contractions in either case, digit runs, punctuation runs, control
/// bytes and DEL.
fn ascii_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::strategy::Strategy as _;
    proptest::collection::vec(
        proptest::prop_oneof![
            proptest::string::string_regex("[ \t\n\r]{1,4}").unwrap(),
            proptest::string::string_regex("[a-zA-Z]{1,8}").unwrap(),
            proptest::string::string_regex("[0-9]{1,6}").unwrap(),
            proptest::string::string_regex("[!-/:-@\\[-`{-~]{1,3}").unwrap(),
            proptest::string::string_regex("[\\x00-\\x7f]{1,4}").unwrap(),
            proptest::sample::select(vec![
                "'s",
                "'S",
                "'t",
                "'re",
                "'VE",
                "'m",
                "'ll",
                "'Ll",
                "'d",
                "'x",
                " '",
                "\r\n",
                "  \n",
                " \x0b\x0c ",
                "\x1c\x1d\x1e\x1f",
                "\x7f",
            ])
            .prop_map(str::to_string),
        ],
        0..24,
    )
    .prop_map(|parts| parts.concat())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
    /// The byte-level shortcut gives the tokenizers crate's ids on any ASCII text, for each
    /// pre-tokenizer it supports: GPT-2's regex after `Digits` (SmolLM2), Qwen2's and
    /// Llama-3's `Split` regexes.
    #[test]
    fn ascii_shortcut_equals_the_tokenizers_crate(text in ascii_text()) {
        for name in ["smollm2", "qwen2_5", "llama3"] {
            let tok = crate::test_support::tokenizer(name);
            let fast = tok.fast.as_ref().unwrap();
            let mut ids = Vec::new();
            fast.encode_into(tok.inner.get_model(), &text, &mut fast::WordCache::default(), &mut ids)
                .unwrap();
            proptest::prop_assert_eq!(&ids, &tok.encode_plain(&text, false).unwrap(), "{} {:?}", name, text);
            proptest::prop_assert_eq!(tok.encode(&text, false).unwrap(), ids);
        }
    }
}

#[test]
fn ascii_shortcut_only_for_the_pre_tokenizers_it_reproduces() {
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizers/smollm2.json")).unwrap(),
    )
    .unwrap();
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = base.clone();
        edit(&mut v);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, v.to_string()).unwrap();
        Tokenizer::from_files(&path, None).unwrap()
    };
    assert!(with(&|_| {}).fast.is_some());
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let unsupported: [(&str, Edit); 5] = [
        ("prefix space", &|v| {
            v["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true.into()
        }),
        ("lowercasing normalizer", &|v| {
            v["normalizer"] = serde_json::json!({"type": "Lowercase"})
        }),
        ("bpe dropout", &|v| v["model"]["dropout"] = 0.1.into()),
        ("another split regex", &|v| {
            v["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\w+|\\s+(?!\\S)|\\s+"},
                 "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": false}]})
        }),
        ("a stripped added token", &|v| {
            v["added_tokens"][0]["rstrip"] = true.into()
        }),
    ];
    for (what, edit) in unsupported {
        let tok = with(edit);
        assert!(tok.fast.is_none(), "{what}: no shortcut");
        if what == "bpe dropout" {
            // dropout samples merges at random, so two encodings of one text may differ
            continue;
        }
        let text = "Hello  world 123's\n\n <|im_start|>x";
        assert_eq!(
            tok.encode(text, false).unwrap(),
            tok.encode_plain(text, false).unwrap(),
            "{what}"
        );
    }
    let nfc = with(&|v| v["normalizer"] = serde_json::json!({"type": "NFC"}));
    assert!(nfc.fast.is_some(), "NFC is the identity on ASCII");
}

/// Many rendered prompts of every task generator, through every fixture chat template: the
/// batched encoder (segments, piece cache, ASCII shortcut, threads) equals the tokenizers
/// crate row by row.
#[test]
fn batched_prompts_equal_the_tokenizers_crate_over_many_rows() {
    use crate::dataset::{ReadOptions, RlDataset};
    use crate::tasks::{self, SplitSizes};
    let dir = tempfile::tempdir().unwrap();
    let sizes = SplitSizes {
        train: 400,
        test: 0,
    };
    let files = [
        tasks::generate_word_problems(
            &dir.path().join("wp"),
            &tasks::WordProblemsConfig::default(),
            sizes,
            3,
        )
        .unwrap(),
        tasks::generate_arithmetic(
            &dir.path().join("ar"),
            &tasks::ArithmeticConfig::default(),
            sizes,
            3,
        )
        .unwrap(),
        tasks::generate_countdown(
            &dir.path().join("cd"),
            &tasks::CountdownConfig::default(),
            sizes,
            3,
        )
        .unwrap(),
    ];
    let opts = ReadOptions {
        prompt_key: "prompt".into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    };
    let mut prompts = Vec::new();
    for f in &files {
        let ds = RlDataset::open(std::slice::from_ref(&f.train), &opts).unwrap();
        for i in 0..ds.len() {
            prompts.push(ds.row(i).unwrap().prompt);
        }
    }
    for name in [
        "chatml", "qwen2_5", "qwen3", "llama3", "llama3_1", "smollm2",
    ] {
        let tok = crate::test_support::tokenizer(name);
        let texts: Vec<String> = prompts
            .iter()
            .map(|p| tok.apply_chat_template(p, true).unwrap())
            .collect();
        let batch = tok.encode_batch(&texts, false).unwrap();
        for (t, ids) in texts.iter().zip(batch) {
            assert_eq!(ids, tok.encode_plain(t, false).unwrap(), "{name}: {t:?}");
        }
    }
}

/// Issue 19: a tokenizer folder without `tokenizer_config.json` says that file is missing (with
/// its path) when it comes to padding, not that its tokens are unset.
#[test]
fn a_missing_tokenizer_config_is_named_when_padding_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    crate::tasks::tiny_vocab::write_tiny_tokenizer(dir.path()).unwrap();
    let with = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(with.pad_id_or_eos().is_ok());
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    let without = Tokenizer::from_dir(dir.path()).unwrap();
    let err = without.pad_id_or_eos().unwrap_err().to_string();
    let path = dir.path().join("tokenizer_config.json");
    assert!(
        err.contains(&path.display().to_string()) && err.contains("the file is missing"),
        "{err}"
    );
}

//! GGUF import against transformers' own GGUF loader on a tiny llama.cpp-style file
//! (fixtures/tiny-llama-gguf, made by make_gguf_fixture.py).

use std::path::PathBuf;

use rl_workers::CausalLm;
use tch::{Device, Kind, Tensor};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama-gguf")
}

#[test]
fn imported_gguf_matches_transformers_gguf_loader_logits() {
    let out = tempfile::tempdir().unwrap();
    let report = rl_workers::gguf::import(fixture().join("tiny-llama.gguf"), out.path()).unwrap();
    assert!(
        report.tie_word_embeddings,
        "no output.weight means tied embeddings"
    );
    for ty in ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"] {
        assert!(
            report.source_types.contains_key(ty),
            "fixture covers {ty}: {:?}",
            report.source_types
        );
    }
    let e: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(fixture().join("expected.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let lm = CausalLm::from_pretrained(out.path(), Device::Cpu, Kind::Float).unwrap();
    assert!(lm.config().tie_word_embeddings);
    let logits = lm
        .forward(
            &e["input_ids"],
            &e["attention_mask"],
            &e["position_ids"],
            None,
        )
        .unwrap();
    let mask = e["attention_mask"].to_kind(Kind::Float).unsqueeze(-1);
    let err = ((logits - &e["logits"]).abs() * mask)
        .max()
        .double_value(&[]);
    assert!(err < 1e-4, "max-abs {err}");
}

#[test]
fn imported_tokenizer_splits_digits_and_keeps_the_chat_template() {
    let out = tempfile::tempdir().unwrap();
    rl_workers::gguf::import(fixture().join("tiny-llama.gguf"), out.path()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(out.path().join("tokenizer.json")).unwrap();
    let enc = tok.encode("the 12 in", false).unwrap();
    // the vocabulary merges "1 2" into "12"; SmolLM's pre-tokenizer must split digits first
    assert_eq!(enc.get_tokens(), ["t", "he", "Ġ", "1", "2", "Ġ", "in"]);
    let special = tok.encode("<|im_start|>hi<|im_end|>", false).unwrap();
    assert_eq!(special.get_ids()[0], 1);
    assert_eq!(*special.get_ids().last().unwrap(), 2);
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert!(
        cfg["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
    assert_eq!(
        (cfg["eos_token"].as_str(), cfg["bos_token"].as_str()),
        (Some("<|im_end|>"), Some("<|im_start|>"))
    );
}

#[test]
fn truncated_gguf_is_an_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture().join("tiny-llama.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let err = rl_workers::gguf::import(&cut, dir.path().join("out"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cut.gguf") && err.contains("truncated"),
        "{err}"
    );
}

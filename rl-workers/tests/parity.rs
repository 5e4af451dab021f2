//! Parity with Hugging Face transformers on the committed tiny fixtures (see fixtures/README.md).

use std::path::PathBuf;

use rl_workers::{CausalLm, GenerateOptions, RewardModel, RolloutConfig, generate};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(fixture(name).join("expected.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

/// Max |a - b| over the real (mask = 1) positions of `[batch, seq_len, ...]` tensors.
fn max_abs_on_mask(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let diff = (a - b).abs().amax(-1, false) * mask.to_kind(Kind::Float);
    diff.max().double_value(&[])
}

fn check_logits(name: &str) {
    let e = expected(name);
    let lm = CausalLm::from_pretrained(fixture(name), Device::Cpu, Kind::Float).unwrap();
    let logits = lm
        .forward(
            &e["input_ids"],
            &e["attention_mask"],
            &e["position_ids"],
            None,
        )
        .unwrap();
    let err = max_abs_on_mask(&logits, &e["logits"], &e["attention_mask"]);
    println!("{name}: f32 logits max-abs diff vs transformers {err:.3e}");
    assert!(err < 1e-4, "{name}: max-abs {err}");
}

#[test]
fn llama_logits_match_transformers_on_left_padded_batch() {
    check_logits("tiny-llama");
}

#[test]
fn qwen2_tied_with_biases_logits_match_transformers() {
    check_logits("tiny-qwen2");
}

fn check_greedy(name: &str) {
    let e = expected(name);
    let lm = CausalLm::from_pretrained(fixture(name), Device::Cpu, Kind::Float).unwrap();
    let want = &e["greedy"];
    let prompt_len = e["input_ids"].size()[1];
    let new = want.size()[1] - prompt_len;
    let cfg = RolloutConfig {
        do_sample: false,
        response_length: 12,
        ..RolloutConfig::default()
    };
    let mut opts = GenerateOptions::from_config(lm.config());
    let out = generate(
        &lm,
        &e["input_ids"],
        &e["attention_mask"],
        &e["position_ids"],
        &cfg,
        &mut opts,
    )
    .unwrap();
    // transformers stops when every row is done; we pad to response_length with the pad id
    let got = out.input_ids.narrow(1, 0, prompt_len + new);
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&got).unwrap(),
        Vec::<Vec<i64>>::try_from(want).unwrap(),
        "{name}"
    );
    let tail = out.responses.narrow(1, new, 12 - new);
    assert!(tail.eq(opts.pad_token_id).all().int64_value(&[]) == 1);
}

#[test]
fn llama_greedy_generation_matches_transformers_token_for_token() {
    check_greedy("tiny-llama");
}

#[test]
fn qwen2_greedy_generation_with_eos_matches_transformers() {
    check_greedy("tiny-qwen2");
}

#[test]
fn reward_model_scores_last_real_token_like_transformers() {
    let e = expected("tiny-llama-rm");
    let rm =
        RewardModel::from_pretrained(fixture("tiny-llama-rm"), Device::Cpu, Kind::Float).unwrap();
    let scores = rm
        .forward(&e["input_ids"], &e["attention_mask"], &e["position_ids"])
        .unwrap();
    let err = (scores - &e["scores"]).abs().max().double_value(&[]);
    assert!(err < 1e-4, "max-abs {err}");
}

#[test]
fn bf16_logits_stay_close_to_f32() {
    let e = expected("tiny-llama");
    let lm = CausalLm::from_pretrained(fixture("tiny-llama"), Device::Cpu, Kind::BFloat16).unwrap();
    assert_eq!(lm.kind(), Kind::BFloat16);
    let logits = lm
        .forward(
            &e["input_ids"],
            &e["attention_mask"],
            &e["position_ids"],
            None,
        )
        .unwrap();
    assert_eq!(logits.kind(), Kind::BFloat16);
    let err = max_abs_on_mask(
        &logits.to_kind(Kind::Float),
        &e["logits"],
        &e["attention_mask"],
    );
    assert!(err < 0.05, "bf16 max-abs {err}");
}

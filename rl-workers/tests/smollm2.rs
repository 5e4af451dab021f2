//! The imported SmolLM2-135M-Instruct against transformers (fixtures/smollm2-expected.safetensors)
//! and the Paris check. Runs only when `scripts/import-smollm2` has produced
//! `models/smollm2-135m-instruct/` (or `RL_SMOLLM2_DIR` names the directory); otherwise each test
//! prints why it was skipped and passes.

use std::path::PathBuf;

use rl_workers::{CausalLm, GenerateOptions, RolloutConfig, generate};
use tch::{Device, Kind, Tensor};

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("RL_SMOLLM2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-instruct")
        });
    if dir.join("model.safetensors").is_file() {
        Some(dir)
    } else {
        println!(
            "skipped: {} not found; run scripts/import-smollm2 first",
            dir.display()
        );
        None
    }
}

#[test]
fn smollm2_logits_match_transformers_within_1e_3() {
    let Some(dir) = model_dir() else { return };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/smollm2-expected.safetensors");
    let e: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect();
    let lm = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap();
    let cfg = lm.config();
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.n_kv_heads(),
            cfg.vocab_size
        ),
        (576, 30, 9, 3, 49152)
    );
    assert_eq!((cfg.rope_theta, cfg.tie_word_embeddings), (100000.0, true));
    let logits = tch::no_grad(|| {
        lm.forward(
            &e["input_ids"],
            &e["attention_mask"],
            &e["position_ids"],
            None,
        )
    })
    .unwrap();
    let vocab = logits.size()[2];
    let strided = logits.index_select(
        2,
        &Tensor::arange_start_step(0, vocab, 32, (Kind::Int64, Device::Cpu)),
    );
    let mask = e["attention_mask"].to_kind(Kind::Float);
    let err = ((strided - &e["logits_strided"]).abs().amax(-1, false) * &mask)
        .max()
        .double_value(&[]);
    println!("smollm2 f32 logits max-abs diff vs transformers: {err:.3e}");
    assert!(err < 1e-3, "max-abs {err}");
    let argmax_ok = logits
        .argmax(-1, false)
        .eq_tensor(&e["argmax"])
        .logical_or(&mask.eq(0.0));
    assert!(argmax_ok.all().int64_value(&[]) == 1);
}

#[test]
fn smollm2_answers_paris_under_greedy_decoding() {
    let Some(dir) = model_dir() else { return };
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    // the chat template's rendering of one user turn (the renderer lives in rl-data)
    let prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
                  <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let ids: Vec<i64> = tok
        .encode(prompt, false)
        .unwrap()
        .get_ids()
        .iter()
        .map(|&i| i as i64)
        .collect();
    let n = ids.len() as i64;
    let lm = CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap();
    let input_ids = Tensor::from_slice(&ids).view([1, n]);
    let mask = input_ids.ones_like();
    let pos = Tensor::arange(n, (Kind::Int64, Device::Cpu)).view([1, n]);
    let cfg = RolloutConfig {
        do_sample: false,
        response_length: 24,
        ..RolloutConfig::default()
    };
    let mut opts = GenerateOptions::from_config(lm.config());
    let out = generate(&lm, &input_ids, &mask, &pos, &cfg, &mut opts).unwrap();
    let len = out.response_mask.sum(Kind::Float).double_value(&[]) as usize;
    let resp: Vec<u32> = Vec::<i64>::try_from(&out.responses.get(0)).unwrap()[..len]
        .iter()
        .map(|&t| t as u32)
        .collect();
    let text = tok.decode(&resp, true).unwrap();
    println!("SmolLM2: {text:?}");
    assert!(text.contains("Paris"), "{text:?}");
    assert_eq!(*resp.last().unwrap() as i64, 2, "stops at <|im_end|>");
}

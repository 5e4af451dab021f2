//! LoRA adapters round-trip with the real PEFT (0.21, in the reference environment): our
//! loader runs PEFT's own adapter file to PEFT's logits, PEFT ran the adapter our writer made to
//! our logits, and transformers ran our merged export to our logits. The fixtures, made by
//! `tests/fixtures/peft/make_peft_fixtures.py` and `examples/lora_fixture.rs`, hold PEFT's and
//! transformers' outputs; see `tests/fixtures/peft/README.md`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rl_workers::CausalLm;
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read(path: PathBuf) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

/// Logits on tiny-llama's fixture inputs, and the max |difference| to `want` over real
/// (mask = 1) positions.
fn error(lm: &CausalLm, want: &Tensor) -> f64 {
    error_on("tiny-llama", lm, want)
}

/// [`error`] on the fixture inputs of the base model `base_name`.
fn error_on(base_name: &str, lm: &CausalLm, want: &Tensor) -> f64 {
    let e = read(fixtures().join(base_name).join("expected.safetensors"));
    let (ids, mask, pos) = (&e["input_ids"], &e["attention_mask"], &e["position_ids"]);
    let got = tch::no_grad(|| lm.forward(ids, mask, pos, None).unwrap());
    let diff = (got - want).abs().amax(-1, false) * mask.to_kind(Kind::Float);
    diff.max().double_value(&[])
}

fn base() -> PathBuf {
    fixtures().join("tiny-llama")
}

/// `lm`'s adapter written again into `out` (recording `base_name`) is byte for byte the
/// committed one at `ours`: the writer still writes what PEFT loaded.
fn assert_rewrites(lm: &CausalLm, base_name: &str, ours: &Path, out: &Path) {
    lm.save_adapter(out.join("adapter"), Some(base_name))
        .unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        assert_eq!(
            std::fs::read(out.join("adapter").join(file)).unwrap(),
            std::fs::read(ours.join(file)).unwrap(),
            "{file} differs from the one PEFT loaded"
        );
    }
}

#[test]
fn an_adapter_saved_by_peft_loads_and_computes_what_peft_computes() {
    let want = read(fixtures().join("peft/theirs_logits.safetensors"));
    let dir = fixtures().join("peft/theirs");
    let lm =
        CausalLm::from_pretrained_with_adapter(base(), &dir, Device::Cpu, Kind::Float).unwrap();
    let cfg = lm.lora().unwrap();
    assert_eq!((cfg.rank, cfg.alpha), (4, 8.0));
    let err = error(&lm, &want["adapter"]);
    assert!(err < 1e-5, "logits differ from PEFT's by {err}");
    // the adapter matters: the base model's logits are far from PEFT's
    let base_err = lm.without_adapters(|lm| error(lm, &want["adapter"]));
    assert!(base_err > 1e-2, "{base_err}");
    // our merge of PEFT's adapter equals PEFT's merge_and_unload
    let out = tempfile::tempdir().unwrap();
    lm.save_pretrained(out.path()).unwrap();
    let merged = CausalLm::from_pretrained(out.path(), Device::Cpu, Kind::Float).unwrap();
    let err = error(&merged, &want["merged"]);
    assert!(
        err < 1e-5,
        "merged logits differ from PEFT's merge by {err}"
    );
}

#[test]
fn peft_and_transformers_load_what_we_write_and_compute_what_we_compute() {
    let want = read(fixtures().join("peft/ours_logits.safetensors"));
    let ours = fixtures().join("peft/ours");
    let lm =
        CausalLm::from_pretrained_with_adapter(base(), &ours, Device::Cpu, Kind::Float).unwrap();
    let err = error(&lm, &want["peft"]);
    assert!(
        err < 1e-5,
        "PEFT's logits on our adapter differ from ours by {err}"
    );
    // the writer still writes what PEFT loaded, byte for byte
    let out = tempfile::tempdir().unwrap();
    assert_rewrites(&lm, "tiny-llama", &ours, out.path());
    // transformers ran the merged export our writer made to our logits (1e-4, the bar)
    let committed = fixtures().join("peft/merged");
    let merged = CausalLm::from_pretrained(&committed, Device::Cpu, Kind::Float).unwrap();
    let err = error(&merged, &want["transformers_merged"]);
    assert!(
        err < 1e-4,
        "transformers' logits on our merged export differ by {err}"
    );
    let err = error(&lm, &want["transformers_merged"]);
    assert!(err < 1e-4, "adapter vs merged: {err}");
    // and merging again here gives the committed weights
    lm.save_pretrained(out.path().join("merged")).unwrap();
    let (a, b) = (
        read(committed.join("model.safetensors")),
        read(out.path().join("merged/model.safetensors")),
    );
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let d = (t - &b[name]).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{name}: {d}");
    }
}

/// The tied set: adapters on every linear layer, on `lm_head` and on `embed_tokens` of
/// tiny-qwen2, whose head is tied to the embedding. PEFT's file holds the base weights of both
/// too (`*.base_layer.weight`, its `save_embedding_layers`), which we check against ours and
/// skip; PEFT's own merge of a tied head changes the embedding as well, so our merged export
/// (the head a weight of its own) is held to PEFT's adapter logits instead.
#[test]
fn adapters_on_a_tied_head_and_embedding_round_trip_with_peft_both_ways() {
    let qwen = fixtures().join("tiny-qwen2");
    let theirs = fixtures().join("peft/theirs_tied");
    let want = read(fixtures().join("peft/theirs_tied_logits.safetensors"));
    let lm =
        CausalLm::from_pretrained_with_adapter(&qwen, &theirs, Device::Cpu, Kind::Float).unwrap();
    assert!(lm.config().tie_word_embeddings && lm.head_adapted());
    assert!(
        lm.var_store()
            .variables()
            .contains_key("model.embed_tokens.lora_embedding_A")
    );
    let err = error_on("tiny-qwen2", &lm, &want["adapter"]);
    assert!(err < 1e-5, "logits differ from PEFT's by {err}");
    let base_err = lm.without_adapters(|lm| error_on("tiny-qwen2", lm, &want["adapter"]));
    assert!(base_err > 1e-2, "{base_err}");
    let out = tempfile::tempdir().unwrap();
    lm.save_pretrained(out.path().join("merged")).unwrap();
    let merged =
        CausalLm::from_pretrained(out.path().join("merged"), Device::Cpu, Kind::Float).unwrap();
    assert!(!merged.config().tie_word_embeddings);
    let err = error_on("tiny-qwen2", &merged, &want["adapter"]);
    assert!(err < 1e-5, "merged logits differ from PEFT's by {err}");

    // PEFT and transformers on what we wrote
    let want = read(fixtures().join("peft/ours_tied_logits.safetensors"));
    let ours = fixtures().join("peft/ours_tied");
    let lm =
        CausalLm::from_pretrained_with_adapter(&qwen, &ours, Device::Cpu, Kind::Float).unwrap();
    let err = error_on("tiny-qwen2", &lm, &want["peft"]);
    assert!(
        err < 1e-5,
        "PEFT's logits on our adapter differ from ours by {err}"
    );
    assert_rewrites(&lm, "tiny-qwen2", &ours, out.path());
    let committed = fixtures().join("peft/merged_tied");
    let merged = CausalLm::from_pretrained(&committed, Device::Cpu, Kind::Float).unwrap();
    let err = error_on("tiny-qwen2", &merged, &want["transformers_merged"]);
    assert!(
        err < 1e-4,
        "transformers' logits on our merged export differ by {err}"
    );
    let err = error_on("tiny-qwen2", &lm, &want["transformers_merged"]);
    assert!(err < 1e-4, "adapter vs merged: {err}");

    // PEFT's saved base weights must be this model's: another is refused, naming it
    for (tensor, shared) in [
        ("lm_head.base_layer.weight", "model.embed_tokens.weight"),
        (
            "model.embed_tokens.base_layer.weight",
            "model.embed_tokens.weight",
        ),
    ] {
        let bad = out.path().join("bad");
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::copy(
            theirs.join("adapter_config.json"),
            bad.join("adapter_config.json"),
        )
        .unwrap();
        let tensors: Vec<(String, Tensor)> = read(theirs.join("adapter_model.safetensors"))
            .into_iter()
            .map(|(n, t)| {
                let t = if n == format!("base_model.model.{tensor}") {
                    t + 0.5
                } else {
                    t
                };
                (n, t)
            })
            .collect();
        Tensor::write_safetensors(&tensors, bad.join("adapter_model.safetensors")).unwrap();
        let e = CausalLm::from_pretrained_with_adapter(&qwen, &bad, Device::Cpu, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(e.contains(tensor) && e.contains(shared), "{e}");
    }
}

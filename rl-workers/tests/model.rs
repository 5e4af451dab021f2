//! Model, checkpoint and rollout behaviour on tiny random models (no fixtures needed).

use std::path::PathBuf;

use rl_workers::{
    CausalLm, Config, Error, GenerateOptions, KvCache, RolloutConfig, ValueModel, generate,
};
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn tiny(seed: i64) -> CausalLm {
    tch::manual_seed(seed);
    let mut cfg = Config::tiny();
    cfg.initializer_range = 0.3; // peaked enough that sampling is not uniform noise
    CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap()
}

/// Three left-padded prompts of up to 6 tokens.
fn prompts() -> (Tensor, Tensor, Tensor) {
    let ids = Tensor::from_slice(&[
        5i64, 9, 17, 33, 4, 8, 0, 0, 11, 12, 13, 14, 0, 0, 0, 0, 40, 41,
    ])
    .view([3, 6]);
    let mask = ids.ne(0).to_kind(Kind::Int64);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    (ids, mask, pos)
}

#[test]
fn unknown_architecture_is_an_error_naming_architectures() {
    let dir = tempfile::tempdir().unwrap();
    let mut json: serde_json::Value = serde_json::to_value(Config::tiny()).unwrap();
    json["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
    let err = CausalLm::from_pretrained(dir.path(), Device::Cpu, Kind::Float).unwrap_err();
    assert!(matches!(err, Error::UnsupportedArchitecture { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("`architectures`") && msg.contains("GPTNeoXForCausalLM"),
        "{msg}"
    );
}

#[test]
fn missing_and_misshaped_tensors_are_errors_naming_them() {
    let lm = tiny(0);
    let dir = tempfile::tempdir().unwrap();
    lm.save_pretrained(dir.path()).unwrap();
    // drop one tensor, change another's shape
    let mut tensors = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    tensors.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight");
    Tensor::write_safetensors(&tensors, dir.path().join("model.safetensors")).unwrap();
    let msg = CausalLm::from_pretrained(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("missing tensor `model.layers.1.mlp.up_proj.weight`"),
        "{msg}"
    );
    for (n, t) in tensors.iter_mut() {
        if n == "model.norm.weight" {
            *t = Tensor::ones([31], (Kind::Float, Device::Cpu));
        }
    }
    tensors.push((
        "model.layers.1.mlp.up_proj.weight".into(),
        Tensor::zeros([64, 32], (Kind::Float, Device::Cpu)),
    ));
    Tensor::write_safetensors(&tensors, dir.path().join("model.safetensors")).unwrap();
    let msg = CausalLm::from_pretrained(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`model.norm.weight` has shape [31], expected [32]"),
        "{msg}"
    );
}

#[test]
fn save_then_load_round_trips_logits_and_config() {
    let lm = tiny(1);
    let dir = tempfile::tempdir().unwrap();
    lm.save_pretrained(dir.path()).unwrap();
    let back = CausalLm::from_pretrained(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let (ids, mask, pos) = prompts();
    let a = lm.forward(&ids, &mask, &pos, None).unwrap();
    let b = back.forward(&ids, &mask, &pos, None).unwrap();
    assert!(a.equal(&b));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["torch_dtype"], "float32");
}

#[test]
fn sharded_checkpoint_loads_through_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("tiny-llama");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let tensors = Tensor::read_safetensors(src.join("model.safetensors")).unwrap();
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        Tensor::write_safetensors(part, dir.path().join(file)).unwrap();
        for (n, _) in part {
            map.insert(n.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = CausalLm::from_pretrained(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let single = CausalLm::from_pretrained(&src, Device::Cpu, Kind::Float).unwrap();
    let (ids, mask, pos) = prompts();
    assert!(
        sharded
            .forward(&ids, &mask, &pos, None)
            .unwrap()
            .equal(&single.forward(&ids, &mask, &pos, None).unwrap())
    );
}

#[test]
fn kv_cached_decoding_matches_the_full_forward() {
    let lm = tiny(2);
    let (ids, mask, pos) = prompts();
    let full = lm.forward(&ids, &mask, &pos, None).unwrap();
    let mut cache = KvCache::new(lm.config(), 3, 6, Kind::Float, Device::Cpu);
    let first = lm
        .forward(
            &ids.narrow(1, 0, 3),
            &mask.narrow(1, 0, 3),
            &pos.narrow(1, 0, 3),
            Some(&mut cache),
        )
        .unwrap();
    let mut parts = vec![first];
    for t in 3..6 {
        let step = lm
            .forward(
                &ids.narrow(1, t, 1),
                &mask.narrow(1, 0, t + 1),
                &pos.narrow(1, t, 1),
                Some(&mut cache),
            )
            .unwrap();
        parts.push(step);
    }
    let cached = Tensor::cat(&parts, 1);
    let real = mask.to_kind(Kind::Float).unsqueeze(-1);
    let err = ((cached - full).abs() * real).max().double_value(&[]);
    assert!(err < 1e-5, "{err}");
    // a full cache refuses more tokens with an error, not a panic
    let longer = Tensor::cat(&[&mask, &mask.narrow(1, 0, 1)], 1);
    let err = lm
        .forward(
            &ids.narrow(1, 0, 1),
            &longer,
            &pos.narrow(1, 0, 1),
            Some(&mut cache),
        )
        .unwrap_err();
    assert!(err.to_string().contains("cache"), "{err}");
}

#[test]
fn bad_inputs_are_errors_naming_the_argument() {
    let lm = tiny(3);
    let (ids, mask, pos) = prompts();
    let err = lm
        .forward(&ids, &mask.narrow(1, 0, 5), &pos, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`attention_mask` has shape [3, 5]"), "{err}");
    let err = lm
        .forward(&ids.to_kind(Kind::Float), &mask, &pos, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`input_ids` has dtype Float"), "{err}");
    let err = lm
        .forward(&(ids.shallow_clone() + 1000), &mask, &pos, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("input_ids") && err.contains("vocab"), "{err}");
    let right_padded = mask.flip([1]);
    let cfg = RolloutConfig {
        response_length: 2,
        ..Default::default()
    };
    let err = generate(
        &lm,
        &ids,
        &right_padded,
        &pos,
        &cfg,
        &mut GenerateOptions::from_config(lm.config()),
    );
    assert!(err.unwrap_err().to_string().contains("left-padded"));
}

fn sample(lm: &CausalLm, cfg: &RolloutConfig, seed: u64) -> rl_workers::RolloutOutput {
    let (ids, mask, pos) = prompts();
    let mut opts = GenerateOptions::from_config(lm.config());
    opts.seed = seed;
    generate(lm, &ids, &mask, &pos, cfg, &mut opts).unwrap()
}

#[test]
fn sampling_is_reproducible_from_the_seed_alone() {
    let lm = tiny(4);
    let cfg = RolloutConfig {
        n: 2,
        response_length: 8,
        top_k: 20,
        top_p: 0.9,
        temperature: 0.8,
        ..Default::default()
    };
    tch::manual_seed(1);
    let a = sample(&lm, &cfg, 7);
    tch::manual_seed(999); // the global generator must not matter
    let b = sample(&lm, &cfg, 7);
    let c = sample(&lm, &cfg, 8);
    assert!(a.responses.equal(&b.responses) && a.rollout_log_probs.equal(&b.rollout_log_probs));
    assert!(!a.responses.equal(&c.responses));
}

#[test]
fn output_follows_verl_layout_with_n_interleaved_copies() {
    let lm = tiny(5);
    let cfg = RolloutConfig {
        n: 2,
        response_length: 5,
        ..Default::default()
    };
    let out = sample(&lm, &cfg, 3);
    let (ids, mask, pos) = prompts();
    assert_eq!(out.prompts.size(), [6, 6]);
    assert_eq!(out.responses.size(), [6, 5]);
    assert_eq!(out.input_ids.size(), [6, 11]);
    assert_eq!(
        (out.response_mask.kind(), out.rollout_log_probs.kind()),
        (Kind::Float, Kind::Float)
    );
    assert_eq!(out.attention_mask.kind(), Kind::Int64);
    let rep = Tensor::from_slice(&[0i64, 0, 1, 1, 2, 2]);
    assert!(out.prompts.equal(&ids.index_select(0, &rep)));
    assert!(
        out.attention_mask
            .narrow(1, 0, 6)
            .equal(&mask.index_select(0, &rep))
    );
    assert!(out.input_ids.narrow(1, 6, 5).equal(&out.responses));
    assert!(
        out.attention_mask
            .narrow(1, 6, 5)
            .to_kind(Kind::Float)
            .equal(&out.response_mask)
    );
    // positions continue from the last prompt position: 6, 4 and 2 real prompt tokens
    let resp_pos: Vec<Vec<i64>> = Vec::try_from(&out.position_ids.narrow(1, 6, 5)).unwrap();
    assert_eq!(resp_pos[0], vec![6, 7, 8, 9, 10]);
    assert_eq!(resp_pos[4], vec![2, 3, 4, 5, 6]);
    assert!(
        out.position_ids
            .narrow(1, 0, 6)
            .equal(&pos.index_select(0, &rep))
    );
    // masked positions hold pad and exactly-zero log-probs
    let off = out.response_mask.eq(0.0);
    assert!(
        out.rollout_log_probs
            .masked_select(&off)
            .eq(0.0)
            .all()
            .int64_value(&[])
            == 1
    );
}

#[test]
fn rows_stop_at_eos_and_pad_after_it() {
    let lm = tiny(6);
    let cfg = RolloutConfig {
        do_sample: false,
        response_length: 10,
        ..Default::default()
    };
    let free = sample(&lm, &cfg, 0);
    // make the 3rd greedy token of row 0 a stop token: row 0 must end there, others unchanged
    let stop = free.responses.int64_value(&[0, 2]);
    let (ids, mask, pos) = prompts();
    let mut steps = Vec::new();
    let mut hook = |p: &rl_workers::Progress| steps.push(p.step);
    let mut opts = GenerateOptions::from_config(lm.config());
    opts.eos_token_ids = vec![stop];
    opts.progress = Some(&mut hook);
    let out = generate(&lm, &ids, &mask, &pos, &cfg, &mut opts).unwrap();
    drop(opts);
    let row0: Vec<i64> = Vec::try_from(&out.responses.get(0)).unwrap();
    let first_stop = row0.iter().position(|&t| t == stop).unwrap();
    assert!(first_stop <= 2);
    assert!(row0[first_stop + 1..].iter().all(|&t| t == opts_pad(&lm)));
    assert_eq!(steps.first(), Some(&1));
    let m: Vec<f32> = Vec::try_from(&out.response_mask.get(0)).unwrap();
    assert_eq!(
        m.iter().filter(|&&x| x == 1.0).count(),
        first_stop + 1,
        "the eos itself is masked 1"
    );
    for r in 0..3 {
        let n = out.response_mask.get(r).sum(Kind::Float).double_value(&[]) as i64;
        let a = out.responses.get(r).narrow(0, 0, n);
        assert!(
            a.equal(&free.responses.get(r).narrow(0, 0, n)),
            "row {r} diverged after another row stopped"
        );
    }
}

fn opts_pad(lm: &CausalLm) -> i64 {
    GenerateOptions::from_config(lm.config()).pad_token_id
}

#[test]
fn rollout_log_probs_match_a_full_forward_at_temperature_one() {
    let lm = tiny(7);
    let cfg = RolloutConfig {
        response_length: 6,
        ..Default::default()
    };
    let out = sample(&lm, &cfg, 11);
    let logits = lm
        .forward(&out.input_ids, &out.attention_mask, &out.position_ids, None)
        .unwrap();
    let (p, r) = (6, 6);
    let logp = logits
        .narrow(1, p - 1, r)
        .log_softmax(-1, Kind::Float)
        .gather(2, &out.responses.unsqueeze(-1), false);
    let logp = logp.squeeze_dim(-1) * &out.response_mask;
    let err = (logp - &out.rollout_log_probs)
        .abs()
        .max()
        .double_value(&[]);
    assert!(err < 1e-4, "{err}");
}

#[test]
fn value_model_gets_a_fresh_head_from_an_lm_checkpoint_and_keeps_a_saved_one() {
    let dir = tempfile::tempdir().unwrap();
    tiny(8).save_pretrained(dir.path()).unwrap();
    let critic = ValueModel::from_pretrained(dir.path(), Device::Cpu, Kind::Float).unwrap();
    assert!(critic.fresh_head());
    let (ids, mask, pos) = prompts();
    let values = critic.forward(&ids, &mask, &pos).unwrap();
    assert_eq!(values.size(), [3, 6]);
    let saved = tempfile::tempdir().unwrap();
    critic.save_pretrained(saved.path()).unwrap();
    let back = ValueModel::from_pretrained(saved.path(), Device::Cpu, Kind::Float).unwrap();
    assert!(!back.fresh_head());
    assert!(back.forward(&ids, &mask, &pos).unwrap().equal(&values));
}

#[test]
fn gradient_checkpointing_gives_the_same_loss_and_gradients() {
    let (ids, mask, pos) = prompts();
    let loss_of = |logits: &Tensor| -> rl_workers::Result<Tensor> {
        let logp = logits.log_softmax(-1, Kind::Float).narrow(1, 0, 5);
        let picked = logp
            .gather(2, &ids.narrow(1, 1, 5).unsqueeze(-1), false)
            .squeeze_dim(-1);
        Ok(-(picked * mask.narrow(1, 1, 5).to_kind(Kind::Float)).mean(Kind::Float))
    };
    let grads = |lm: &CausalLm| -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = lm
            .var_store()
            .variables()
            .into_iter()
            .map(|(n, t)| (n, t.grad().copy()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let plain = tiny(10);
    // tests run in parallel and share tch's global seed, so copy the weights rather than re-seed
    let mut ckpt = tiny(10);
    ckpt.var_store_mut().copy(plain.var_store()).unwrap();
    let loss = loss_of(&plain.forward(&ids, &mask, &pos, None).unwrap()).unwrap();
    loss.backward();
    let loss2 = ckpt
        .forward_backward_checkpointed(&ids, &mask, &pos, loss_of)
        .unwrap();
    assert!((loss.double_value(&[]) - loss2.double_value(&[])).abs() < 1e-6);
    let (a, b) = (grads(&plain), grads(&ckpt));
    assert_eq!(a.len(), b.len());
    for ((name, ga), (_, gb)) in a.iter().zip(&b) {
        let err = (ga - gb).abs().max().double_value(&[]);
        assert!(err < 1e-6, "{name}: {err}");
        assert!(
            ga.abs().max().double_value(&[]) > 0.0
                || name.contains("layers.1.self_attn.o_proj.bias")
        );
    }
}

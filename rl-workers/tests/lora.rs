//! LoRA adapters: PEFT's initialisation leaves the model as it was, the base model is the
//! adapters switched off, merged exports and adapter files round-trip, only adapters train.

use rl_workers::roles::AdamW;
use rl_workers::roles::OptimConfig;
use rl_workers::{CausalLm, Config, LoraConfig, TargetModules, ValueModel, seeded};
use tch::{Device, Kind, Tensor};

fn inputs() -> (Tensor, Tensor, Tensor) {
    let ids = Tensor::from_slice(&[5i64, 9, 17, 3, 88, 4, 0, 0, 7, 1, 2, 3]).view([2, 6]);
    let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1]).view([2, 6]);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    (ids, mask, pos)
}

fn logits(lm: &CausalLm) -> Tensor {
    let (ids, mask, pos) = inputs();
    tch::no_grad(|| lm.forward(&ids, &mask, &pos, None).unwrap())
}

fn lora(rank: i64, targets: TargetModules) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        target_modules: targets,
        exclude_modules: Vec::new(),
        dropout: 0.0,
        use_rslora: false,
    }
}

/// A tiny model with adapters whose B is random (a fresh B is zero and changes nothing).
fn adapted(targets: TargetModules) -> CausalLm {
    seeded(3, || {
        let mut lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
        lm.add_lora(&lora(4, targets)).unwrap();
        tch::no_grad(|| {
            for (name, mut t) in lm.var_store().variables() {
                if name.contains(".lora_B.") {
                    t.copy_(&(Tensor::randn_like(&t) * 0.05));
                }
            }
        });
        lm
    })
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// The tiny model of seed 3, its head tied to the embedding or not.
fn tiny(tied: bool) -> CausalLm {
    let cfg = Config {
        tie_word_embeddings: tied,
        ..Config::tiny()
    };
    seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap())
}

/// Writes `lm`'s merged export and its adapter over `base` (saved beside it) into `dir`, and
/// checks that both come back computing `lm`'s logits: the merged folder (its head untied from
/// the embedding) to 1e-5, the base with the adapter exactly. Returns the merged model and the
/// adapter file's tensor names.
fn export_round_trip(
    lm: &CausalLm,
    base: &CausalLm,
    dir: &std::path::Path,
) -> (CausalLm, Vec<String>) {
    let want = logits(lm);
    lm.save_pretrained(dir.join("merged")).unwrap();
    let merged = CausalLm::from_pretrained(dir.join("merged"), Device::Cpu, Kind::Float).unwrap();
    assert!(!merged.config().tie_word_embeddings);
    assert!(max_diff(&logits(&merged), &want) < 1e-5);
    base.save_pretrained(dir.join("base")).unwrap();
    lm.save_adapter(dir.join("adapter"), None).unwrap();
    let names = Tensor::read_safetensors(dir.join("adapter/adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let back = CausalLm::from_pretrained_with_adapter(
        dir.join("base"),
        dir.join("adapter"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    assert!(logits(&back).equal(&want));
    (merged, names)
}

#[test]
fn fresh_adapters_change_nothing_and_switched_off_they_are_the_base_model() {
    let base = seeded(3, || {
        CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
    });
    let before = logits(&base);
    let mut lm = base;
    lm.add_lora(&lora(8, TargetModules::AllLinear)).unwrap();
    // PEFT's init: B = 0, so step 0 is the base model exactly
    assert!(logits(&lm).equal(&before));
    // A is Kaiming-uniform with bound 1/sqrt(in), B zero
    let vars = lm.var_store().variables();
    let a = &vars["model.layers.0.self_attn.q_proj.lora_A.weight"];
    assert_eq!(a.size(), vec![8, 32]);
    let bound = 1.0 / 32f64.sqrt();
    assert!(a.abs().max().double_value(&[]) <= bound);
    assert!(a.abs().max().double_value(&[]) > 0.5 * bound);
    assert_eq!(
        vars["model.layers.1.mlp.down_proj.lora_B.weight"].size(),
        vec![32, 8]
    );
    assert_eq!(
        vars.keys().filter(|n| n.contains(".lora_")).count(),
        2 * 7 * 2,
        "A and B on 7 linear layers of 2 decoder layers"
    );

    let lm = adapted(TargetModules::AllLinear);
    let base = seeded(3, || {
        CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
    });
    let with = logits(&lm);
    assert!(
        max_diff(&with, &logits(&base)) > 1e-3,
        "adapters must matter"
    );
    let off = lm.without_adapters(logits);
    assert!(off.equal(&logits(&base)), "adapters off = the base model");
    assert!(logits(&lm).equal(&with), "switched back on afterwards");
}

#[test]
fn only_adapters_train_and_the_base_stays_frozen() {
    let lm = adapted(TargetModules::Names(vec!["q_proj".into(), "v_proj".into()]));
    for (name, t) in lm.var_store().variables() {
        assert_eq!(t.requires_grad(), name.contains(".lora_"), "{name}");
    }
    let optim = AdamW::new(lm.var_store(), OptimConfig::default());
    assert_eq!(
        optim.params().len(),
        2 * 2 * 2,
        "A, B of q_proj, v_proj in 2 layers"
    );
    let (ids, mask, pos) = inputs();
    lm.forward(&ids, &mask, &pos, None)
        .unwrap()
        .sum(Kind::Float)
        .backward();
    let vars = lm.var_store().variables();
    assert!(
        !vars["model.layers.0.self_attn.q_proj.weight"]
            .grad()
            .defined()
    );
    assert!(
        vars["model.layers.0.self_attn.q_proj.lora_A.weight"]
            .grad()
            .defined()
    );
}

#[test]
fn target_modules_follow_peft_matching_and_a_miss_is_an_error_listing_the_layers() {
    let lm = adapted(TargetModules::Names(vec!["layers.1.mlp.up_proj".into()]));
    let names: Vec<String> = lm
        .var_store()
        .variables()
        .into_keys()
        .filter(|n| n.contains(".lora_A."))
        .collect();
    assert_eq!(names, vec!["model.layers.1.mlp.up_proj.lora_A.weight"]);
    // exclude_modules takes layers out of the targets, by the same rule
    let mut cfg = lora(2, TargetModules::AllLinear);
    cfg.exclude_modules = vec!["layers.0.mlp.down_proj".into(), "o_proj".into()];
    let mut lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
    lm.add_lora(&cfg).unwrap();
    let adapted: Vec<String> = lm
        .var_store()
        .variables()
        .into_keys()
        .filter(|n| n.contains(".lora_A."))
        .collect();
    assert_eq!(adapted.len(), 14 - 1 - 2);
    assert!(
        !adapted
            .iter()
            .any(|n| n.contains("o_proj") || n.contains("0.mlp.down_proj"))
    );
    let mut lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
    let e = lm
        .add_lora(&lora(4, TargetModules::Names(vec!["query".into()])))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"query\"") && e.contains("q_proj") && e.contains("all-linear"),
        "{e}"
    );
    let e = lm
        .add_lora(&lora(0, TargetModules::AllLinear))
        .unwrap_err()
        .to_string();
    assert!(e.contains("lora_rank"), "{e}");
}

#[test]
fn merged_export_and_adapter_files_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let lm = adapted(TargetModules::AllLinear);
    let want = logits(&lm);
    // the merged export is a plain Hugging Face folder
    lm.save_pretrained(dir.path().join("merged")).unwrap();
    let merged =
        CausalLm::from_pretrained(dir.path().join("merged"), Device::Cpu, Kind::Float).unwrap();
    assert!(merged.lora().is_none());
    assert!(
        merged
            .var_store()
            .variables()
            .keys()
            .all(|n| !n.contains("lora"))
    );
    assert!(max_diff(&logits(&merged), &want) < 1e-5);
    // the adapter alone, in PEFT's format, over the base weights
    let base = dir.path().join("base");
    let fresh = seeded(3, || {
        CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
    });
    fresh.save_pretrained(&base).unwrap();
    lm.save_adapter(dir.path().join("adapter"), Some("base"))
        .unwrap();
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    assert_eq!(config["task_type"], "CAUSAL_LM");
    assert_eq!(
        config["target_modules"],
        serde_json::json!([
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ])
    );
    let names: Vec<String> =
        Tensor::read_safetensors(dir.path().join("adapter/adapter_model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
    assert!(
        names.contains(
            &"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string()
        )
    );
    assert_eq!(names.len(), 28);
    let back = CausalLm::from_pretrained_with_adapter(
        &base,
        dir.path().join("adapter"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    assert!(logits(&back).equal(&want));
    // an adapter for other layers is refused, naming the tensor
    let other = adapted(TargetModules::Names(vec!["q_proj".into()]));
    let e = other
        .load_adapter(dir.path().join("adapter"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("down_proj.lora_A") && e.contains("adapter_model.safetensors"),
        "{e}"
    );
}

/// `lm_head` takes an adapter where `target_modules` names it (`all-linear` leaves it out, as
/// PEFT's does), tied to the embedding or not. It adds `scale · h·Aᵀ·Bᵀ` to the logits and
/// leaves the input embedding alone; switched off it is the base model; the adapter file names
/// it as PEFT does; the merged export gives the head a weight of its own (untied) with the
/// embedding unchanged, and loads back to the same logits.
#[test]
fn the_head_takes_an_adapter_tied_or_not_and_the_merged_export_unties_it() {
    for tied in [true, false] {
        let fresh = || tiny(tied);
        let base = fresh();
        let before = logits(&base);
        let (ids, mask, pos) = inputs();
        let hidden = tch::no_grad(|| base.model().forward(&ids, &mask, &pos, None).unwrap());
        let mut lm = base;
        lm.add_lora(&lora(4, TargetModules::Names(vec!["lm_head".into()])))
            .unwrap();
        assert!(lm.head_adapted());
        assert!(logits(&lm).equal(&before), "a fresh B changes nothing");
        let vars = lm.var_store().variables();
        assert_eq!(vars["lm_head.lora_A.weight"].size(), vec![4, 32]);
        assert_eq!(
            vars["lm_head.lora_B.weight"].size(),
            vec![Config::tiny().vocab_size, 4]
        );
        let trained: Vec<&String> = vars
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, _)| n)
            .collect();
        assert_eq!(trained.len(), 2, "{trained:?}");
        tch::no_grad(|| {
            let mut b = vars["lm_head.lora_B.weight"].shallow_clone();
            b.copy_(&seeded(5, || Tensor::randn_like(&b) * 0.05));
        });
        let (a, b) = (
            &vars["lm_head.lora_A.weight"],
            &vars["lm_head.lora_B.weight"],
        );
        let want = &before + hidden.matmul(&a.tr()).matmul(&b.tr()) * 2.0;
        let with = logits(&lm);
        assert!(
            max_diff(&with, &before) > 1e-3,
            "tied={tied}: the adapter must matter"
        );
        assert!(
            max_diff(&with, &want) < 1e-5,
            "tied={tied}: logits + scale·h·Aᵀ·Bᵀ"
        );
        assert!(lm.without_adapters(logits).equal(&before));

        let dir = tempfile::tempdir().unwrap();
        let (merged, names) = export_round_trip(&lm, &fresh(), dir.path());
        let embed = "model.embed_tokens.weight";
        assert!(merged.var_store().variables()[embed].equal(&vars[embed]));
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("adapter/adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["target_modules"], serde_json::json!(["lm_head"]));
        assert!(names.contains(&"base_model.model.lm_head.lora_B.weight".to_owned()));
    }
    // all-linear leaves the head out
    let lm = adapted(TargetModules::AllLinear);
    assert!(!lm.head_adapted());
    // a critic has no lm_head to adapt
    let mut critic = ValueModel::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
    let e = critic
        .add_lora(&lora(4, TargetModules::Names(vec!["lm_head".into()])))
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"lm_head\" matches no layer"), "{e}");
}

/// The input embedding takes an adapter where `target_modules` names `embed_tokens`, as PEFT
/// builds it (`lora_embedding_A` `[r, vocab]` zero, `lora_embedding_B` `[hidden, r]` standard
/// normal: a fresh adapter changes nothing), tied to the head or not. It trains through the
/// plain and the gradient-checkpointed backward alike; the merged export adds `scale·(B·A)ᵀ`
/// to the embedding and keeps the base embedding as the head's own weight where they were tied.
#[test]
fn the_embedding_takes_an_adapter_and_the_export_keeps_the_head_as_it_was() {
    for tied in [true, false] {
        let fresh = || tiny(tied);
        let base = fresh();
        let before = logits(&base);
        let base_embed = base.model().embed_tokens().copy();
        let mut lm = base;
        lm.add_lora(&lora(
            4,
            TargetModules::Names(vec!["embed_tokens".into(), "q_proj".into()]),
        ))
        .unwrap();
        assert!(
            logits(&lm).equal(&before),
            "a fresh adapter changes nothing"
        );
        let vars = lm.var_store().variables();
        let (a, b) = (
            &vars["model.embed_tokens.lora_embedding_A"],
            &vars["model.embed_tokens.lora_embedding_B"],
        );
        assert_eq!(a.size(), vec![4, Config::tiny().vocab_size]);
        assert_eq!(b.size(), vec![32, 4]);
        assert!(a.abs().max().double_value(&[]) == 0.0);
        assert!(b.std(true).double_value(&[]) > 0.5, "B is N(0, 1)");
        tch::no_grad(|| {
            a.shallow_clone()
                .copy_(&seeded(5, || Tensor::randn_like(a) * 0.05));
        });
        let with = logits(&lm);
        assert!(
            max_diff(&with, &before) > 1e-3,
            "tied={tied}: the adapter must matter"
        );
        assert!(lm.without_adapters(logits).equal(&before));

        // the plain backward and the checkpointed one give the adapter the same gradient
        let (ids, mask, pos) = inputs();
        lm.forward(&ids, &mask, &pos, None)
            .unwrap()
            .square()
            .sum(Kind::Float)
            .backward();
        let plain = a.grad().copy();
        assert!(plain.abs().max().double_value(&[]) > 0.0);
        let _ = a.grad().zero_();
        let _ = lm
            .forward_backward_checkpointed(&ids, &mask, &pos, |l| Ok(l.square().sum(Kind::Float)))
            .unwrap();
        assert!(max_diff(&a.grad(), &plain) <= 1e-5 * plain.abs().max().double_value(&[]));
        for (_, t) in lm.var_store().variables() {
            let mut g = t.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }

        let dir = tempfile::tempdir().unwrap();
        let (merged, names) = export_round_trip(&lm, &fresh(), dir.path());
        let mvars = merged.var_store().variables();
        let want = &base_embed + b.matmul(a).tr() * 2.0;
        assert!(max_diff(&mvars["model.embed_tokens.weight"], &want) < 1e-6);
        if tied {
            assert!(
                mvars["lm_head.weight"].equal(&base_embed),
                "the head as it was"
            );
        }
        assert!(
            names.contains(&"base_model.model.model.embed_tokens.lora_embedding_A".to_owned()),
            "{names:?}"
        );
    }
}

#[test]
fn peft_configs_we_cannot_run_are_refused_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let lm = adapted(TargetModules::AllLinear);
    lm.save_adapter(dir.path(), None).unwrap();
    let path = dir.path().join("adapter_config.json");
    let good = std::fs::read_to_string(&path).unwrap();
    for (key, value) in [
        ("use_dora", "true"),
        ("bias", "\"all\""),
        ("rank_pattern", "{\"q_proj\": 8}"),
        ("layers_to_transform", "[0]"),
        ("ensure_weight_tying", "true"),
        ("peft_type", "\"IA3\""),
    ] {
        let mut cfg: serde_json::Value = serde_json::from_str(&good).unwrap();
        cfg[key] = serde_json::from_str(value).unwrap();
        std::fs::write(&path, cfg.to_string()).unwrap();
        let e = rl_workers::lora::read_adapter_config(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(key) && e.contains("adapter_config.json"),
            "{key}: {e}"
        );
    }
}

#[test]
fn dropout_is_the_same_in_the_checkpointed_recompute_and_off_outside_training() {
    let mut cfg = lora(4, TargetModules::AllLinear);
    cfg.dropout = 0.3;
    let lm = seeded(5, || {
        let mut lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
        lm.add_lora(&cfg).unwrap();
        tch::no_grad(|| {
            for (name, mut t) in lm.var_store().variables() {
                if name.contains(".lora_B.") {
                    t.copy_(&(Tensor::randn_like(&t) * 0.05));
                }
            }
        });
        lm
    });
    let (ids, mask, pos) = inputs();
    let eval = logits(&lm);
    lm.set_lora_dropout_seed(Some(11));
    let train = logits(&lm);
    assert!(
        max_diff(&train, &eval) > 1e-4,
        "dropout acts while training"
    );
    assert!(
        logits(&lm).equal(&train),
        "the same seed drops the same inputs"
    );
    let grads = |checkpointed: bool| {
        for (_, t) in lm.var_store().variables() {
            let mut t = t;
            t.zero_grad();
        }
        if checkpointed {
            let _ = lm
                .forward_backward_checkpointed(&ids, &mask, &pos, |l| Ok(l.sum(Kind::Float)))
                .unwrap();
        } else {
            lm.forward(&ids, &mask, &pos, None)
                .unwrap()
                .sum(Kind::Float)
                .backward();
        }
        lm.var_store().variables()["model.layers.0.mlp.up_proj.lora_A.weight"]
            .grad()
            .copy()
    };
    let (plain, ckpt) = (grads(false), grads(true));
    assert!(max_diff(&plain, &ckpt) < 1e-5 * (1.0 + plain.abs().max().double_value(&[])));
    lm.set_lora_dropout_seed(None);
    assert!(logits(&lm).equal(&eval));
}

#[test]
fn a_critic_trains_adapters_and_its_value_head() {
    let mut critic = seeded(2, || {
        ValueModel::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
    });
    critic.add_lora(&lora(2, TargetModules::AllLinear)).unwrap();
    let trainable: Vec<String> = critic
        .var_store()
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .map(|(n, _)| n)
        .filter(|n| !n.contains(".lora_"))
        .collect();
    let mut trainable = trainable;
    trainable.sort();
    assert_eq!(trainable, vec!["score.bias", "score.weight"]);
}

#[test]
fn the_config_alone_names_the_layers_and_targets_the_model_builds() {
    let mut qwen = Config::tiny();
    qwen.architectures = vec!["Qwen2ForCausalLM".into()];
    qwen.model_type = "qwen2".into();
    for cfg in [Config::tiny(), qwen] {
        let mut lm = CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap();
        let vars = lm.var_store().variables();
        let layers = cfg.linear_layers();
        assert_eq!(layers.len(), 7 * 2);
        for l in &layers {
            assert_eq!(
                vars[&format!("{}.weight", l.name)].size(),
                vec![l.out_dim, l.in_dim]
            );
            assert_eq!(
                vars.contains_key(&format!("{}.bias", l.name)),
                l.bias,
                "{}",
                l.name
            );
        }
        let mut lora_cfg = lora(
            2,
            TargetModules::Names(vec![
                "v_proj".into(),
                "mlp.up_proj".into(),
                "lm_head".into(),
            ]),
        );
        lora_cfg.exclude_modules = vec!["layers.1.self_attn.v_proj".into()];
        let planned = rl_workers::lora::targets(&cfg, &lora_cfg, true).unwrap();
        lm.add_lora(&lora_cfg).unwrap();
        let mut built: Vec<String> = lm
            .var_store()
            .variables()
            .into_keys()
            .filter_map(|n| n.strip_suffix(".lora_A.weight").map(str::to_owned))
            .collect();
        built.sort();
        let mut planned: Vec<String> = planned.into_iter().map(|l| l.name).collect();
        planned.sort();
        assert_eq!(planned, built);
        assert_eq!(built.len(), 4);
        // a critic plans (and builds) no head adapter
        assert!(rl_workers::lora::targets(&cfg, &lora_cfg, false).is_err());
    }
}

//! LoRA adapters as PEFT builds them: a linear layer `W` gains `ΔW = scale · B·A` with `A`
//! `[r, in]` (Kaiming-uniform, PEFT's `a = √5`, i.e. U(−1/√in, 1/√in)) and `B` `[out, r]`
//! (zeros), `scale = alpha / r` (`alpha / √r` with rsLoRA), so a fresh adapter leaves the model
//! exactly as it was. The base weights are frozen; only `A`, `B` (and a classification head, as
//! PEFT's `modules_to_save`) train. The vocabulary layers take adapters where `target_modules`
//! names them: `lm_head` (a linear adapter on the logits, tied to the embedding or not) and
//! `embed_tokens` (PEFT's embedding adapter, `lora_embedding_A` `[r, vocab]` zero and
//! `lora_embedding_B` `[hidden, r]` standard normal); each model lists the layers it offers as
//! `Slot`s.
//!
//! Adapters are applied unmerged (`x·Wᵀ + scale · dropout(x)·Aᵀ·Bᵀ`), so the actor, the rollout
//! and the reference share one copy of the base weights: the reference is the same model with
//! its adapters switched off ([`LoraSwitch`]). Files are PEFT's: `adapter_config.json` and
//! `adapter_model.safetensors` with tensors named `base_model.model.<module>.lora_A.weight`,
//! so `peft.PeftModel.from_pretrained` loads ours and we load PEFT's; a merged export
//! (`W + scale · B·A`) is a plain Hugging Face folder.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value, json};
use tch::nn::{Init, VarStore};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::hf;
use crate::model::Model;

/// PEFT's adapter configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The prefix PEFT gives every tensor name of a saved adapter.
const PEFT_PREFIX: &str = "base_model.model.";
/// A causal language model's output layer, as PEFT names it: adapted only where
/// `target_modules` names it (`"all-linear"` leaves it out, as PEFT's does).
pub const HEAD: &str = "lm_head";

/// Which linear layers get adapters (PEFT's `target_modules`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TargetModules {
    /// Every linear layer of the decoder stack (PEFT's `"all-linear"`: all but the output
    /// layer); for Llama/Qwen2 `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
    /// `down_proj`.
    #[default]
    AllLinear,
    /// Layers whose name equals one of these or ends with `.` and one of these (PEFT's rule:
    /// `q_proj` is every layer's query projection, `layers.0.self_attn.q_proj` one of them).
    /// A causal language model's output layer is `lm_head` ([`HEAD`]), tied to the embedding
    /// or not: its adapter changes the logits only, never the input embedding (PEFT's
    /// behaviour without `ensure_weight_tying`).
    Names(Vec<String>),
}

impl Serialize for TargetModules {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            TargetModules::AllLinear => s.serialize_str("all-linear"),
            TargetModules::Names(names) => names.serialize(s),
        }
    }
}

impl TargetModules {
    /// Every layer of a Llama/Qwen2 causal language model that takes an adapter, by PEFT's
    /// names: the decoder's linear layers and both vocabulary layers (`lm_head`,
    /// `embed_tokens`).
    pub fn every_layer() -> TargetModules {
        TargetModules::Names(
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                HEAD,
                "embed_tokens",
            ]
            .map(str::to_owned)
            .to_vec(),
        )
    }
}

impl<'de> Deserialize<'de> for TargetModules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        match Raw::deserialize(d)? {
            Raw::One(s) if s == "all-linear" => Ok(TargetModules::AllLinear),
            Raw::One(s) => Err(serde::de::Error::custom(format!(
                "expected \"all-linear\" or a list of module names, got {s:?} (write [{s:?}] for one module)"
            ))),
            Raw::Many(names) => Ok(TargetModules::Names(names)),
        }
    }
}

/// A LoRA configuration (verl's `lora_rank`, `lora_alpha`, `target_modules`, plus PEFT's
/// `lora_dropout` and `use_rslora`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of `A` and `B`, > 0.
    pub rank: i64,
    /// `alpha`; the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Which linear layers get adapters.
    pub target_modules: TargetModules,
    /// Layers left without adapters among the targeted ones (PEFT's `exclude_modules`, the
    /// same matching rule).
    #[serde(default)]
    pub exclude_modules: Vec<String>,
    /// Dropout on the adapter's input while training, in `[0, 1)`.
    pub dropout: f64,
    /// rsLoRA: scale by `alpha / √r` instead.
    pub use_rslora: bool,
}

impl LoraConfig {
    /// The factor of `B·A`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Checks ranges; `prefix` is where the keys live (`actor_rollout_ref.model`), and the keys
    /// are verl's names (`lora_rank`, `lora_alpha`, `target_modules`, `lora_dropout`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        let bad = |k: &str, why: String| Err(Error::invalid(&format!("{prefix}.{k}"), why));
        if self.rank <= 0 {
            return bad("lora_rank", format!("must be positive, got {}", self.rank));
        }
        if !self.alpha.is_finite() || self.alpha <= 0.0 {
            return bad(
                "lora_alpha",
                format!("must be positive, got {}", self.alpha),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(
                "lora_dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            );
        }
        if let TargetModules::Names(names) = &self.target_modules {
            if names.is_empty() {
                return bad(
                    "target_modules",
                    "is empty: name at least one module, or \"all-linear\"".into(),
                );
            }
            if let Some(n) = names.iter().find(|n| n.is_empty() || n.contains(' ')) {
                return bad("target_modules", format!("{n:?} is not a module name"));
            }
        }
        Ok(())
    }
}

/// The state every adapter of one model shares: whether adapters apply (off = the base model,
/// which is how the reference policy runs), and the dropout seed of the current training
/// micro-batch (none = no dropout: log-probs, rollout, evaluation).
#[derive(Debug)]
pub struct LoraSwitch {
    enabled: AtomicBool,
    training: AtomicBool,
    seed: AtomicU64,
}

impl LoraSwitch {
    fn new() -> Self {
        Self {
            enabled: AtomicBool::new(true),
            training: AtomicBool::new(false),
            seed: AtomicU64::new(0),
        }
    }

    fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    fn dropout_seed(&self) -> Option<u64> {
        self.training
            .load(Ordering::Acquire)
            .then(|| self.seed.load(Ordering::Acquire))
    }
}

/// One layer's adapter: a linear layer's (`A` `[r, in]`, `B` `[out, r]`) or an embedding's
/// (PEFT's `lora_embedding_A` `[r, vocab]` and `lora_embedding_B` `[hidden, r]`).
#[derive(Debug)]
pub(crate) struct Adapter {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f64,
    /// Distinguishes the layers' dropout masks.
    id: u64,
    switch: Arc<LoraSwitch>,
}

impl Adapter {
    /// `scale · dropout(x)·Aᵀ·Bᵀ`, or `None` while adapters are off.
    pub(crate) fn delta(&self, xs: &Tensor) -> Option<Tensor> {
        if !self.switch.enabled() {
            return None;
        }
        let xs = match self.switch.dropout_seed() {
            Some(seed) if self.dropout > 0.0 => {
                xs * dropout_mask(&xs.size(), self.dropout, seed, self.id, xs)
            }
            _ => xs.shallow_clone(),
        };
        Some(
            xs.linear::<Tensor>(&self.a, None)
                .linear::<Tensor>(&self.b, None)
                * self.scale,
        )
    }

    /// An embedding's adapter on token ids: `scale · onehot(ids)·Aᵀ·Bᵀ` (rows of `Aᵀ` looked
    /// up, as PEFT's), or `None` while adapters are off. No dropout: PEFT's has none on an
    /// embedding either.
    pub(crate) fn embedding_delta(&self, ids: &Tensor) -> Option<Tensor> {
        if !self.switch.enabled() {
            return None;
        }
        Some(
            Tensor::embedding(&self.a.tr(), ids, -1, false, false).linear::<Tensor>(&self.b, None)
                * self.scale,
        )
    }
}

/// A dropout mask (`0` or `1 / (1 − p)`, in `like`'s dtype and device) that is a pure function
/// of `(seed, id, position)`: the checkpointed backward recomputes a layer and must drop the
/// same inputs as its first pass, and a resumed run must drop what the uninterrupted one did.
/// A few rounds of affine maps modulo a prime below 2³¹ (products stay below 2⁶², so no int64
/// overflow on any device) with xor-shifts between them.
fn dropout_mask(shape: &[i64], p: f64, seed: u64, id: u64, like: &Tensor) -> Tensor {
    const P: i64 = 2_147_483_629;
    let numel: i64 = shape.iter().product();
    let salt = ((seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)) % P as u64) as i64;
    let mut x = (Tensor::arange(numel, (Kind::Int64, like.device())) + salt).remainder(P);
    for (a, b, shift) in [
        (1_103_515_245i64, 12_345i64, 13i64),
        (2_024_028_671, 1_013_904_223, 16),
        (1_664_525, 2_147_001_325, 11),
    ] {
        x = (x * a + b).remainder(P);
        x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(shift));
    }
    let u = x.to_kind(Kind::Double) / P as f64;
    (u.ge(p).to_kind(Kind::Float) / (1.0 - p))
        .to_kind(like.kind())
        .view(shape)
}

/// A layer that can take an adapter: its name relative to the VarStore root
/// (`model.layers.0.self_attn.q_proj`, `lm_head`, `model.embed_tokens`), its weight's shape
/// (`[out, in]`; an embedding's `[vocab, hidden]`), the variable holding that weight
/// (`<name>.weight`, or the embedding for a tied `lm_head`), whether it is an embedding, and
/// where its adapter goes.
pub(crate) struct Slot<'a> {
    pub(crate) name: String,
    pub(crate) shape: [i64; 2],
    pub(crate) weight: String,
    pub(crate) embedding: bool,
    pub(crate) adapter: &'a mut Option<Adapter>,
}

/// The layers of the decoder stack `model`, built under `vs.root() / prefix`, that can take an
/// adapter, as [`Slot`]s: the input embedding (`embed_tokens`, where `target_modules` names
/// it) and every linear layer.
pub(crate) fn decoder_slots<'a>(model: &'a mut Model, prefix: &str) -> Vec<Slot<'a>> {
    let (embed, linears) = model.adaptable_mut();
    let size = embed.0.size();
    let mut slots = vec![Slot {
        name: format!("{prefix}.embed_tokens"),
        shape: [size[0], size[1]],
        weight: format!("{prefix}.embed_tokens.weight"),
        embedding: true,
        adapter: embed.1,
    }];
    slots.extend(linears.into_iter().map(|(n, linear)| {
        let size = linear.weight.size();
        Slot {
            name: format!("{prefix}.{n}"),
            shape: [size[0], size[1]],
            weight: format!("{prefix}.{n}.weight"),
            embedding: false,
            adapter: &mut linear.lora,
        }
    }));
    slots
}

/// A targeted layer: its name, the variable holding its base weight, and whether it is an
/// embedding (see [`Slot`]).
#[derive(Debug)]
struct Target {
    name: String,
    weight: String,
    embedding: bool,
}

impl Target {
    /// The variable names of its `A` and `B`, PEFT's: `<name>.lora_A.weight`, or
    /// `<name>.lora_embedding_A` for an embedding.
    fn adapter_names(&self) -> (String, String) {
        if self.embedding {
            (
                format!("{}.lora_embedding_A", self.name),
                format!("{}.lora_embedding_B", self.name),
            )
        } else {
            (
                format!("{}.lora_A.weight", self.name),
                format!("{}.lora_B.weight", self.name),
            )
        }
    }

    /// `scale · B·A` in float32, in the base weight's shape (an embedding's transposed).
    fn delta(&self, vars: &BTreeMap<String, Tensor>, scale: f64) -> Tensor {
        let (a, b) = self.adapter_names();
        let ba = vars[&b]
            .to_kind(Kind::Float)
            .matmul(&vars[&a].to_kind(Kind::Float));
        let ba = if self.embedding { ba.tr() } else { ba };
        ba * scale
    }
}

/// A model's adapters: the configuration, the shared switch, and the targeted layers.
#[derive(Debug)]
pub(crate) struct Attached {
    pub(crate) cfg: LoraConfig,
    switch: Arc<LoraSwitch>,
    targets: Vec<Target>,
    /// A language model's head tied to the embedding: the variable it shares (the export
    /// unties it when either side is adapted).
    tied_head: Option<String>,
    /// Trained in full beside the adapters (PEFT's `modules_to_save`), e.g. `score`.
    modules_to_save: Vec<String>,
}

/// Whether the variable `name` is an adapter tensor (a linear layer's or an embedding's).
fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.")
        || name.contains(".lora_B.")
        || name.ends_with(".lora_embedding_A")
        || name.ends_with(".lora_embedding_B")
}

/// Whether the variable `name` trains under LoRA (and goes into the adapter file): an adapter
/// tensor, or a module of `modules_to_save`.
fn is_trained(name: &str, modules_to_save: &[impl AsRef<str>]) -> bool {
    is_adapter(name)
        || modules_to_save
            .iter()
            .any(|m| name.starts_with(&format!("{}.", m.as_ref())))
}

/// Whether PEFT's rule picks the layer `name` for `key`.
fn matches(name: &str, key: &str) -> bool {
    name == key || name.ends_with(&format!(".{key}"))
}

/// The indices of `names` (full layer names, in order) that `cfg` targets: `all-linear` (the
/// decoder's linear layers: those of `decoder_linear`) or PEFT's matching of
/// `target_modules`, minus `exclude_modules`. A target matching nothing, or exclusions leaving
/// nothing, is an error naming the key.
fn select(names: &[String], decoder_linear: &[bool], cfg: &LoraConfig) -> Result<Vec<usize>> {
    let mut chosen: Vec<usize> = match &cfg.target_modules {
        TargetModules::AllLinear => (0..names.len()).filter(|&i| decoder_linear[i]).collect(),
        TargetModules::Names(keys) => {
            let mut chosen = Vec::new();
            for key in keys {
                let hits: Vec<usize> = (0..names.len())
                    .filter(|&i| matches(&names[i], key))
                    .collect();
                if hits.is_empty() {
                    let mut kinds: Vec<&str> = names
                        .iter()
                        .map(|n| n.rsplit('.').next().unwrap_or(n))
                        .collect();
                    kinds.sort_unstable();
                    kinds.dedup();
                    return Err(Error::invalid(
                        "target_modules",
                        format!(
                            "{key:?} matches no layer of the model that takes an adapter (its layers: {}; or \"all-linear\")",
                            kinds.join(", ")
                        ),
                    ));
                }
                chosen.extend(hits);
            }
            chosen
        }
    };
    chosen.retain(|&i| {
        !cfg.exclude_modules
            .iter()
            .any(|key| matches(&names[i], key))
    });
    if chosen.is_empty() {
        return Err(Error::invalid(
            "exclude_modules",
            format!("{:?} excludes every targeted layer", cfg.exclude_modules),
        ));
    }
    chosen.sort_unstable();
    chosen.dedup();
    Ok(chosen)
}

/// The layers `lora` puts adapters on in a model of `config`, computed from the config alone
/// by the same rules as [`CausalLm::add_lora`](crate::CausalLm::add_lora) (what `harness plan`
/// counts); `lm_head` is a candidate where `head` (a causal language model, not a critic).
pub fn targets(
    config: &crate::Config,
    lora: &LoraConfig,
    head: bool,
) -> Result<Vec<crate::LinearShape>> {
    lora.validate("lora")?;
    let (v, h) = (config.vocab_size, config.hidden_size);
    // the embedding's A [r, vocab] and B [hidden, r] count as a layer from vocab to hidden
    let mut layers = vec![crate::LinearShape {
        name: "model.embed_tokens".to_owned(),
        in_dim: v,
        out_dim: h,
        bias: false,
    }];
    layers.extend(config.linear_layers());
    if head {
        layers.push(crate::LinearShape {
            name: HEAD.to_owned(),
            in_dim: h,
            out_dim: v,
            bias: false,
        });
    }
    let names: Vec<String> = layers.iter().map(|l| l.name.clone()).collect();
    let decoder_linear: Vec<bool> = names
        .iter()
        .map(|n| n.starts_with("model.layers."))
        .collect();
    let chosen = select(&names, &decoder_linear, lora)?;
    Ok(chosen.into_iter().map(|i| layers[i].clone()).collect())
}

/// Adds adapters to the layers of `slots` (of the model whose variables `vs` holds) that
/// `cfg` targets, freezes every other variable of `vs` except those under `modules_to_save`,
/// and returns what was attached. Adapters are drawn in float32, then cast to `kind`.
pub(crate) fn attach(
    vs: &VarStore,
    mut slots: Vec<Slot<'_>>,
    cfg: &LoraConfig,
    modules_to_save: &[&str],
    kind: Kind,
) -> Result<Attached> {
    cfg.validate("lora")?;
    let switch = Arc::new(LoraSwitch::new());
    let names: Vec<String> = slots.iter().map(|s| s.name.clone()).collect();
    let decoder_linear: Vec<bool> = slots
        .iter()
        .map(|s| !s.embedding && s.name != HEAD)
        .collect();
    let chosen = select(&names, &decoder_linear, cfg)?;
    let tied_head = slots
        .iter()
        .find(|s| s.name == HEAD && s.weight != format!("{HEAD}.weight"))
        .map(|s| s.weight.clone());
    let _generator = crate::seed::hold_generator();
    let mut targets = Vec::with_capacity(chosen.len());
    for (id, &i) in chosen.iter().enumerate() {
        let slot = &mut slots[i];
        let mut path = vs.root();
        for segment in slot.name.split('.') {
            path = &path / segment;
        }
        let (mut a, mut b) = if slot.embedding {
            // PEFT's embedding adapter: A zero, B standard normal
            let [vocab, hidden] = slot.shape;
            let a = crate::seed::var(
                &path,
                "lora_embedding_A",
                &[cfg.rank, vocab],
                Init::Const(0.0),
            );
            let b = crate::seed::var(
                &path,
                "lora_embedding_B",
                &[hidden, cfg.rank],
                Init::Randn {
                    mean: 0.0,
                    stdev: 1.0,
                },
            );
            (a, b)
        } else {
            let [out_dim, in_dim] = slot.shape;
            let bound = 1.0 / (in_dim as f64).sqrt();
            let a = crate::seed::var(
                &(&path / "lora_A"),
                "weight",
                &[cfg.rank, in_dim],
                Init::Uniform {
                    lo: -bound,
                    up: bound,
                },
            );
            let b = crate::seed::var(
                &(&path / "lora_B"),
                "weight",
                &[out_dim, cfg.rank],
                Init::Const(0.0),
            );
            (a, b)
        };
        if kind != Kind::Float {
            tch::no_grad(|| {
                a.set_data(&a.to_kind(kind));
                b.set_data(&b.to_kind(kind));
            });
        }
        *slot.adapter = Some(Adapter {
            a,
            b,
            scale: cfg.scale(),
            dropout: cfg.dropout,
            id: id as u64,
            switch: switch.clone(),
        });
        targets.push(Target {
            name: slot.name.clone(),
            weight: slot.weight.clone(),
            embedding: slot.embedding,
        });
    }
    for (name, t) in vs.variables() {
        if !is_trained(&name, modules_to_save) {
            let _ = t.set_requires_grad(false);
        }
    }
    Ok(Attached {
        cfg: cfg.clone(),
        switch,
        targets,
        tied_head,
        modules_to_save: modules_to_save.iter().map(|m| m.to_string()).collect(),
    })
}

impl Attached {
    /// Runs `f` with the adapters off (the base model).
    pub(crate) fn disabled<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a LoraSwitch, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.enabled.store(self.1, Ordering::Release);
            }
        }
        let _restore = Restore(
            &self.switch,
            self.switch.enabled.swap(false, Ordering::AcqRel),
        );
        f()
    }

    /// Sets the dropout seed of the next training forwards; `None` turns dropout off.
    pub(crate) fn set_dropout_seed(&self, seed: Option<u64>) {
        if let Some(s) = seed {
            self.switch.seed.store(s, Ordering::Release);
        }
        self.switch
            .training
            .store(seed.is_some(), Ordering::Release);
    }

    /// The variables an adapter file holds, by VarStore name, sorted.
    fn saved_vars(&self, vs: &VarStore) -> BTreeMap<String, Tensor> {
        vs.variables()
            .into_iter()
            .filter(|(n, _)| is_trained(n, &self.modules_to_save))
            .collect()
    }

    /// The base model's tensors with each adapter merged in (`W + scale · B·A`, computed in
    /// float32 and cast back to `W`'s dtype) and without the adapter tensors: a plain Hugging
    /// Face checkpoint. Where the head is tied to the embedding and either is adapted, the head
    /// gets an `lm_head.weight` of its own: the base embedding plus the head's adapter, while
    /// `model.embed_tokens.weight` has the embedding's ([`Attached::unties_head`]).
    pub(crate) fn merged(&self, vs: &VarStore) -> Vec<(String, Tensor)> {
        let _guard = tch::no_grad_guard();
        let vars: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        let scale = self.cfg.scale();
        let mut out: BTreeMap<String, Tensor> = vars
            .iter()
            .filter(|(n, _)| !is_adapter(n))
            .map(|(n, t)| (n.clone(), t.detach()))
            .collect();
        if let Some(shared) = self.tied_head.as_ref().filter(|_| self.unties_head()) {
            out.insert(format!("{HEAD}.weight"), vars[shared].detach());
        }
        for t in &self.targets {
            let w = &vars[&t.weight];
            let merged = (w.to_kind(Kind::Float) + t.delta(&vars, scale)).to_kind(w.kind());
            out.insert(format!("{}.weight", t.name), merged);
        }
        out.into_iter().collect()
    }

    /// Whether the head is tied to the embedding and either has an adapter: the merged export
    /// then gives the head a weight of its own (`tie_word_embeddings` false).
    pub(crate) fn unties_head(&self) -> bool {
        self.tied_head.as_ref().is_some_and(|shared| {
            self.targets
                .iter()
                .any(|t| t.name == HEAD || &t.weight == shared)
        })
    }

    /// The `target_modules` PEFT records: the targeted layers' short names (`q_proj`, ...),
    /// sorted.
    fn target_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .targets
            .iter()
            .map(|t| t.name.rsplit('.').next().unwrap_or(&t.name).to_owned())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Writes PEFT's `adapter_config.json` and `adapter_model.safetensors` into `dir`.
    /// `task_type` is PEFT's (`CAUSAL_LM`, `TOKEN_CLS`, `SEQ_CLS`); `base` goes into
    /// `base_model_name_or_path`.
    pub(crate) fn save(
        &self,
        vs: &VarStore,
        dir: &Path,
        task_type: &str,
        base: Option<&str>,
    ) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tensors: Vec<(String, Tensor)> = self
            .saved_vars(vs)
            .into_iter()
            .map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t.detach()))
            .collect();
        hf::write_safetensors(&tensors, &dir.join(ADAPTER_WEIGHTS))?;
        let modules_to_save = if self.modules_to_save.is_empty() {
            Value::Null
        } else {
            json!(self.modules_to_save)
        };
        let exclude_modules = if self.cfg.exclude_modules.is_empty() {
            Value::Null
        } else {
            json!(self.cfg.exclude_modules)
        };
        let config = json!({
            "alpha_pattern": {},
            "auto_mapping": null,
            "base_model_name_or_path": base,
            "bias": "none",
            "exclude_modules": exclude_modules,
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "layers_pattern": null,
            "layers_to_transform": null,
            "lora_alpha": self.cfg.alpha,
            "lora_dropout": self.cfg.dropout,
            "modules_to_save": modules_to_save,
            "peft_type": "LORA",
            "r": self.cfg.rank,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.target_names(),
            "task_type": task_type,
            "use_dora": false,
            "use_rslora": self.cfg.use_rslora,
        });
        let path = dir.join(ADAPTER_CONFIG);
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::format(&path, e.to_string()))?;
        std::fs::write(&path, text + "\n").map_err(|e| Error::io(&path, e))
    }

    /// Loads the adapter tensors of `dir/adapter_model.safetensors` (PEFT's names, ours or
    /// PEFT's own file) into this model's adapters. Every adapter tensor must be there with its
    /// shape; a tensor for a layer this model has no adapter on is an error naming it.
    pub(crate) fn load(&self, vs: &VarStore, dir: &Path) -> Result<()> {
        let path = dir.join(ADAPTER_WEIGHTS);
        if !path.is_file() {
            return Err(Error::io(
                &path,
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
        let file: BTreeMap<String, Tensor> = Tensor::read_safetensors(&path)?
            .into_iter()
            .map(|(n, t)| {
                // PEFT keeps the adapter name in memory (`lora_A.default.weight`) but not on disk;
                // accept both, and modules_to_save's `modules_to_save.default.` wrapper
                let n = n
                    .strip_prefix(PEFT_PREFIX)
                    .unwrap_or(&n)
                    .replace(".lora_A.default.", ".lora_A.")
                    .replace(".lora_B.default.", ".lora_B.")
                    .replace(".lora_embedding_A.default", ".lora_embedding_A")
                    .replace(".lora_embedding_B.default", ".lora_embedding_B")
                    .replace(".modules_to_save.default.", ".");
                (n, t)
            })
            .collect();
        let mut file = file;
        let _guard = tch::no_grad_guard();
        self.check_saved_bases(vs, &path, &mut file)?;
        let vars = self.saved_vars(vs);
        if let Some(extra) = file.keys().find(|n| !vars.contains_key(*n)) {
            return Err(Error::format(
                &path,
                format!(
                    "holds `{PEFT_PREFIX}{extra}`, which this model has no adapter or trained module for (adapters on: {})",
                    self.target_names().join(", ")
                ),
            ));
        }
        for (name, var) in vars {
            let t = file.get(&name).ok_or_else(|| Error::MissingTensor {
                path: path.display().to_string(),
                name: format!("{PEFT_PREFIX}{name}"),
            })?;
            if t.size() != var.size() {
                return Err(Error::TensorShape {
                    path: path.display().to_string(),
                    name: format!("{PEFT_PREFIX}{name}"),
                    expected: var.size(),
                    got: t.size(),
                });
            }
            var.shallow_clone()
                .f_copy_(&t.to_kind(var.kind()).to_device(var.device()))?;
        }
        Ok(())
    }
}

impl Attached {
    /// Takes out of `file` the base weights PEFT saves beside an adapter on an embedding-like
    /// layer (`lm_head.base_layer.weight`: its `save_embedding_layers`, on whenever `lm_head` is
    /// targeted), after checking each equals the base weight this model holds: an adapter saved
    /// over other base weights (a resized vocabulary, another model) is refused naming the
    /// tensor, never applied to the wrong base.
    fn check_saved_bases(
        &self,
        vs: &VarStore,
        path: &Path,
        file: &mut BTreeMap<String, Tensor>,
    ) -> Result<()> {
        let vars = vs.variables();
        for Target { name, weight, .. } in &self.targets {
            let key = format!("{name}.base_layer.weight");
            let Some(saved) = file.remove(&key) else {
                continue;
            };
            let ours = &vars[weight];
            let same = saved.size() == ours.size()
                // in the model's dtype: a bfloat16 base is PEFT's float32 one rounded
                && saved
                    .to_kind(ours.kind())
                    .to_device(ours.device())
                    .equal(ours);
            if !same {
                return Err(Error::format(
                    path,
                    format!(
                        "holds `{PEFT_PREFIX}{key}`, a base weight that differs from this model's `{weight}`: the adapter was saved over another base (a resized vocabulary?); load it over the model it was made for"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Reads PEFT's `adapter_config.json` as a [`LoraConfig`], refusing what this crate does not
/// implement (DoRA, biases, per-layer ranks, ...) by name.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let raw: Map<String, Value> =
        serde_json::from_str(&text).map_err(|e| Error::format(&path, e.to_string()))?;
    let bad = |key: &str, why: String| Error::format(&path, format!("`{key}`: {why}"));
    let get = |key: &str| raw.get(key).filter(|v| !v.is_null());
    match get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => {
            return Err(bad(
                "peft_type",
                format!("only LORA is supported, got {other:?}"),
            ));
        }
    }
    let unsupported = [
        ("use_dora", Value::Bool(false)),
        ("fan_in_fan_out", Value::Bool(false)),
        ("bias", Value::from("none")),
        ("lora_bias", Value::Bool(false)),
        // adapters shared by a tied embedding and head: ours adapt the head only
        ("ensure_weight_tying", Value::Bool(false)),
    ];
    for (key, want) in unsupported {
        if let Some(v) = get(key)
            && *v != want
        {
            return Err(bad(key, format!("only {want} is supported, got {v}")));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if get(key)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(
                key,
                "per-layer ranks and alphas are not supported".into(),
            ));
        }
    }
    for key in [
        "target_parameters",
        "layer_replication",
        "trainable_token_indices",
    ] {
        if get(key).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(bad(
                key,
                "is not supported (LoRA on linear layers only)".into(),
            ));
        }
    }
    for key in ["layers_to_transform", "layers_pattern"] {
        if get(key).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(bad(
                key,
                "adapters on some layers only are not supported".into(),
            ));
        }
    }
    let rank = get("r")
        .and_then(Value::as_i64)
        .ok_or_else(|| bad("r", "missing or not an integer".into()))?;
    let alpha = get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("lora_alpha", "missing or not a number".into()))?;
    let target_modules: TargetModules = serde_json::from_value(
        get("target_modules")
            .cloned()
            .ok_or_else(|| bad("target_modules", "missing".into()))?,
    )
    .map_err(|e| bad("target_modules", e.to_string()))?;
    let exclude_modules = match get("exclude_modules") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(v) => {
            serde_json::from_value(v.clone()).map_err(|e| bad("exclude_modules", e.to_string()))?
        }
    };
    let cfg = LoraConfig {
        rank,
        alpha,
        target_modules,
        exclude_modules,
        dropout: get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0),
        use_rslora: get("use_rslora").and_then(Value::as_bool).unwrap_or(false),
    };
    cfg.validate(&path.display().to_string())?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_modules_read_all_linear_or_a_list_and_nothing_else() {
        let t: TargetModules = serde_json::from_str("\"all-linear\"").unwrap();
        assert_eq!(t, TargetModules::AllLinear);
        let t: TargetModules = serde_json::from_str("[\"q_proj\", \"v_proj\"]").unwrap();
        assert_eq!(
            t,
            TargetModules::Names(vec!["q_proj".into(), "v_proj".into()])
        );
        let e = serde_json::from_str::<TargetModules>("\"q_proj\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("[\"q_proj\"]"), "{e}");
    }

    #[test]
    fn dropout_masks_are_a_function_of_seed_layer_and_position() {
        let like = Tensor::zeros([4, 5, 64], (Kind::Float, tch::Device::Cpu));
        let m = |seed, id| dropout_mask(&[4, 5, 64], 0.25, seed, id, &like);
        assert!(m(7, 1).equal(&m(7, 1)));
        assert!(!m(7, 1).equal(&m(8, 1)));
        assert!(!m(7, 1).equal(&m(7, 2)));
        let kept = m(3, 0)
            .gt(0.0)
            .to_kind(Kind::Double)
            .mean(Kind::Double)
            .double_value(&[]);
        assert!((kept - 0.75).abs() < 0.03, "kept {kept}");
        let scaled = m(3, 0).max().double_value(&[]);
        assert!((scaled - 1.0 / 0.75).abs() < 1e-6);
    }
}

//! The heads over the decoder stack, each loadable from and savable to a Hugging Face directory:
//! [`CausalLm`] (`*ForCausalLM`), [`ValueModel`] (`*ForTokenClassification` with one label, the
//! critic) and [`RewardModel`] (`*ForSequenceClassification`, score at the last real token).

use std::path::Path;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result, expect_dims};
use crate::hf::{self, Checkpoint};
use crate::lora::{self, Attached, LoraConfig};
use crate::model::{Config, KvCache, Linear, Model};

/// The file holding the model's hyper-parameters.
pub const CONFIG_JSON: &str = "config.json";

fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Double => "float64",
        _ => "float32",
    }
}

fn check_kind(kind: Kind) -> Result<()> {
    match kind {
        Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double => Ok(()),
        other => Err(Error::invalid(
            "kind",
            format!("model dtype must be floating point, got {other:?}"),
        )),
    }
}

fn cast(vs: &mut VarStore, kind: Kind) {
    match kind {
        Kind::BFloat16 => vs.bfloat16(),
        Kind::Half => vs.half(),
        Kind::Double => vs.double(),
        _ => {}
    }
}

fn write_config(cfg: &Config, class_suffix: &str, kind: Kind, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut cfg = cfg.clone();
    let family = cfg.family()?;
    cfg.architectures = vec![format!("{}{class_suffix}", family.class_prefix())];
    cfg.model_type = family.model_type().to_owned();
    let key = if cfg.extra.contains_key("dtype") {
        "dtype"
    } else {
        "torch_dtype"
    };
    cfg.extra.insert(key.to_owned(), dtype_name(kind).into());
    let path = dir.join(CONFIG_JSON);
    let text =
        serde_json::to_string_pretty(&cfg).map_err(|e| Error::format(&path, e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|e| Error::io(&path, e))
}

fn read_config(dir: &Path) -> Result<Config> {
    Config::from_file(dir.join(CONFIG_JSON))
}

/// Whether a part of a model starts from fresh draws or is overwritten in full before use
/// (loaded or copied: [`crate::seed::to_be_filled`], which draws nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Weights {
    Drawn,
    Filled,
}

impl Weights {
    /// `f` (building variables of dtype `kind`) under this choice.
    fn build<T>(self, kind: Kind, f: impl FnOnce() -> T) -> T {
        match self {
            Weights::Drawn => f(),
            Weights::Filled => crate::seed::to_be_filled(kind, f),
        }
    }
}

/// Builds the stack (drawn or left to be filled, as `stack` says) plus whatever `head` adds
/// under the root, then casts to `kind`.
fn build<H>(
    cfg: &Config,
    device: Device,
    kind: Kind,
    stack: Weights,
    head: impl FnOnce(&tch::nn::Path, &Config) -> H,
) -> Result<(VarStore, Model, H)> {
    build_with_stack_in(cfg, device, kind, (stack, kind), head)
}

/// [`build`] with the stack in `stack_kind`. A stack in another dtype than the rest (a frozen
/// base loaded straight in mixed precision's compute dtype, under a float32 head and adapters)
/// must be left to be filled, in a float32 model: nothing is cast then.
fn build_with_stack_in<H>(
    cfg: &Config,
    device: Device,
    kind: Kind,
    (stack, stack_kind): (Weights, Kind),
    head: impl FnOnce(&tch::nn::Path, &Config) -> H,
) -> Result<(VarStore, Model, H)> {
    check_kind(kind)?;
    check_kind(stack_kind)?;
    if stack_kind != kind && (stack != Weights::Filled || kind != Kind::Float) {
        return Err(Error::invalid(
            "kind",
            format!(
                "a stack in {stack_kind:?} under a model in {kind:?}: only a loaded stack under a float32 model may differ"
            ),
        ));
    }
    // the initial draws come from torch's global generator: hold it (crate::seed)
    let _generator = crate::seed::hold_generator();
    let mut vs = VarStore::new(device);
    let model = stack.build(stack_kind, || Model::new(vs.root() / "model", cfg))?;
    let head = head(&vs.root(), cfg);
    cast(&mut vs, kind);
    Ok((vs, model, head))
}

/// [`build`] with a `score` head of `labels` outputs (the critic's and the reward model's);
/// `(stack, head)` say how the stack and the head start, `stack_kind` the stack's dtype.
fn build_scored(
    cfg: &Config,
    device: Device,
    (kind, stack_kind): (Kind, Kind),
    (stack, head): (Weights, Weights),
    labels: i64,
    bias: bool,
) -> Result<(VarStore, Model, Linear)> {
    build_with_stack_in(cfg, device, kind, (stack, stack_kind), |root, cfg| {
        head.build(kind, || {
            Linear::new(
                root / "score",
                cfg.hidden_size,
                labels,
                bias,
                cfg.initializer_range,
            )
        })
    })
}

/// A causal language model (`LlamaForCausalLM` / `Qwen2ForCausalLM`): the stack plus `lm_head`,
/// tied to `embed_tokens` when `tie_word_embeddings`.
#[derive(Debug)]
pub struct CausalLm {
    vs: VarStore,
    model: Model,
    lm_head: Option<Linear>,
    /// A LoRA adapter on the head (`lm_head` in `target_modules`), tied or not.
    head_lora: Option<lora::Adapter>,
    lora: Option<Attached>,
}

/// The tensors a Hugging Face folder of this model holds: the variables, with LoRA adapters
/// merged in when there are any.
fn export_tensors(vs: &VarStore, lora: Option<&Attached>) -> Vec<(String, Tensor)> {
    match lora {
        Some(l) => l.merged(vs),
        None => {
            let mut t: Vec<(String, Tensor)> = vs
                .variables()
                .into_iter()
                .map(|(n, t)| (n, t.detach()))
                .collect();
            t.sort_by(|a, b| a.0.cmp(&b.0));
            t
        }
    }
}

fn no_adapter() -> Error {
    Error::invalid("lora", "the model has no LoRA adapters".to_owned())
}

/// LoRA on a model of this crate: the adapters are attached to the decoder stack's linear
/// layers (`model.*`) and, where `target_modules` names it, a language model's `lm_head`; a
/// classification head trains in full beside them. The model's `lora_slots` says which layers
/// can take one.
macro_rules! lora_methods {
    ($task:literal, $keep:expr, decoder_only) => {
        lora_methods!($task, $keep);

        /// The layers that can take an adapter: the decoder stack's.
        fn lora_slots(&mut self) -> (&VarStore, Vec<lora::Slot<'_>>) {
            (&self.vs, lora::decoder_slots(&mut self.model, "model"))
        }
    };
    ($task:literal, $keep:expr) => {
        /// Adds LoRA adapters (PEFT's initialisation: the model computes exactly what it did)
        /// and freezes the base weights; only the adapters (and a classification head) train.
        pub fn add_lora(&mut self, cfg: &LoraConfig) -> Result<()> {
            let kind = self.model.embed_tokens().kind();
            self.add_lora_in(cfg, kind)
        }

        /// [`add_lora`](Self::add_lora) with the adapters in `kind` whatever the base's dtype:
        /// mixed precision's float32 adapters on a base loaded straight in bfloat16 (the
        /// masters are copied from the adapters, then the model is cast to the compute dtype:
        /// `AdamW::for_model`; until then the model cannot run). A frozen base needs no
        /// float32 copy, so it is never made.
        pub fn add_lora_in(&mut self, cfg: &LoraConfig, kind: Kind) -> Result<()> {
            if self.lora.is_some() {
                return Err(Error::invalid(
                    "lora",
                    "the model has adapters already".to_owned(),
                ));
            }
            let attached = {
                let (vs, slots) = self.lora_slots();
                lora::attach(vs, slots, cfg, $keep, kind)?
            };
            self.lora = Some(attached);
            Ok(())
        }

        /// The LoRA configuration, when the model has adapters.
        pub fn lora(&self) -> Option<&LoraConfig> {
            self.lora.as_ref().map(|l| &l.cfg)
        }

        /// Runs `f` with the adapters off: the base model (the reference policy of a LoRA
        /// run). Without adapters, simply runs `f`.
        pub fn without_adapters<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
            match &self.lora {
                Some(l) => l.disabled(|| f(self)),
                None => f(self),
            }
        }

        /// Sets the seed of the adapters' dropout masks for the following training forwards
        /// (`None`: no dropout, as for log-probs, rollout and evaluation).
        pub fn set_lora_dropout_seed(&self, seed: Option<u64>) {
            if let Some(l) = &self.lora {
                l.set_dropout_seed(seed);
            }
        }

        /// Writes the adapters in PEFT's format (`adapter_config.json`,
        /// `adapter_model.safetensors`); `base` is recorded as `base_model_name_or_path`.
        pub fn save_adapter(&self, dir: impl AsRef<Path>, base: Option<&str>) -> Result<()> {
            let l = self.lora.as_ref().ok_or_else(no_adapter)?;
            l.save(&self.vs, dir.as_ref(), $task, base)
        }

        /// ZeRO stage 3: shards the parameters over `group` ([`crate::ParamShards`]): each
        /// rank keeps its part and gathers a layer as it computes. Every rank must hold the
        /// same weights. Not with LoRA adapters.
        pub fn shard_params(&mut self, group: rl_core::dist::SharedCollective) -> Result<()> {
            if self.lora.is_some() {
                return Err(Error::invalid(
                    "zero_stage",
                    "stage 3 with LoRA adapters is not supported (the frozen base would need its own shards): use zero_stage 2",
                ));
            }
            self.model.shard(&self.vs, group)
        }

        /// Writes what training changes, for a checkpoint: with LoRA the adapters (and a
        /// trained head) in PEFT's format, else the whole model as a Hugging Face folder.
        /// Sharded (stage 3), every rank must hold the whole weights meanwhile
        /// (`Model::hold_all`).
        pub fn save_trained(&self, dir: impl AsRef<Path>) -> Result<()> {
            match &self.lora {
                Some(l) => l.save(&self.vs, dir.as_ref(), $task, None),
                None => self.save_pretrained(dir),
            }
        }

        /// Restores what [`save_trained`](Self::save_trained) wrote into this model (the
        /// same adapters, or the same architecture), naming a missing or mis-shaped tensor.
        pub fn load_trained(&self, dir: impl AsRef<Path>) -> Result<()> {
            // stage 3: every rank loads into the gathered weights, keeping its part
            let _all = self.model.hold_all()?;
            match &self.lora {
                Some(l) => l.load(&self.vs, dir.as_ref()),
                None => {
                    let ckpt = Checkpoint::open(dir.as_ref())?;
                    hf::load_into(&self.vs, &ckpt, &|_| false).map(|_| ())
                }
            }
        }

        /// Loads adapter weights in PEFT's format (ours or PEFT's) into this model's adapters,
        /// which must target the same layers with the same rank.
        pub fn load_adapter(&self, dir: impl AsRef<Path>) -> Result<()> {
            let l = self.lora.as_ref().ok_or_else(no_adapter)?;
            l.load(&self.vs, dir.as_ref())
        }
    };
}

impl CausalLm {
    lora_methods!("CAUSAL_LM", &[]);

    /// The layers that can take an adapter: the decoder stack's and `lm_head` (whose weight is
    /// the embedding's where tied).
    fn lora_slots(&mut self) -> (&VarStore, Vec<lora::Slot<'_>>) {
        let cfg = self.model.config();
        let shape = [cfg.vocab_size, cfg.hidden_size];
        let weight = if self.lm_head.is_some() {
            format!("{}.weight", lora::HEAD)
        } else {
            "model.embed_tokens.weight".to_owned()
        };
        let mut slots = lora::decoder_slots(&mut self.model, "model");
        slots.push(lora::Slot {
            name: lora::HEAD.to_owned(),
            shape,
            weight,
            embedding: false,
            adapter: &mut self.head_lora,
        });
        (&self.vs, slots)
    }

    /// Whether `lm_head` has a LoRA adapter.
    pub fn head_adapted(&self) -> bool {
        self.head_lora.is_some()
    }

    /// Whether the head is tied to the embedding and a LoRA adapter sits on either: the merged
    /// export ([`CausalLm::save_pretrained`]) then gives the head a weight of its own.
    pub fn export_unties_head(&self) -> bool {
        self.lora.as_ref().is_some_and(Attached::unties_head)
    }

    /// A base model from `dir` with the PEFT adapter of `adapter_dir` (its
    /// `adapter_config.json` says where the adapters go).
    pub fn from_pretrained_with_adapter(
        dir: impl AsRef<Path>,
        adapter_dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
    ) -> Result<CausalLm> {
        let cfg = lora::read_adapter_config(adapter_dir.as_ref())?;
        let mut lm = CausalLm::from_pretrained(dir, device, kind)?;
        lm.add_lora(&cfg)?;
        lm.load_adapter(adapter_dir)?;
        Ok(lm)
    }
}

impl CausalLm {
    /// A freshly initialised model (normal(0, `initializer_range`) like transformers; build it
    /// inside [`crate::seeded`] for a reproducible init).
    pub fn new(cfg: &Config, device: Device, kind: Kind) -> Result<CausalLm> {
        CausalLm::built(cfg, device, kind, Weights::Drawn)
    }

    /// A model whose every variable the caller overwrites before use (loads or copies), built
    /// without drawing from torch's generator ([`crate::seed::to_be_filled`]).
    pub(crate) fn to_be_filled(cfg: &Config, device: Device, kind: Kind) -> Result<CausalLm> {
        CausalLm::built(cfg, device, kind, Weights::Filled)
    }

    fn built(cfg: &Config, device: Device, kind: Kind, weights: Weights) -> Result<CausalLm> {
        let (vs, model, lm_head) = build(cfg, device, kind, weights, |root, cfg| {
            (!cfg.tie_word_embeddings).then(|| {
                weights.build(kind, || {
                    Linear::new(
                        root / "lm_head",
                        cfg.hidden_size,
                        cfg.vocab_size,
                        false,
                        cfg.initializer_range,
                    )
                })
            })
        })?;
        Ok(CausalLm {
            vs,
            model,
            lm_head,
            head_lora: None,
            lora: None,
        })
    }

    /// Loads `dir/config.json` and `dir/model.safetensors` (or its sharded index), converting
    /// the weights to `kind` on `device`. A missing or mis-shaped tensor is an error naming it.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: Device, kind: Kind) -> Result<CausalLm> {
        let dir = dir.as_ref();
        let cfg = read_config(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        // every variable is loaded, or this fails naming the missing one
        let lm = CausalLm::to_be_filled(&cfg, device, kind)?;
        hf::load_into(&lm.vs, &ckpt, &|_| false)?;
        Ok(lm)
    }

    /// Writes `config.json` (architectures `*ForCausalLM`) and `model.safetensors`, loadable by
    /// transformers' `from_pretrained`; LoRA adapters are merged into the weights (an adapted
    /// head tied to the embedding is written as a head of its own, untied).
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        self.model.check_whole()?;
        let mut cfg = self.config().clone();
        if self.export_unties_head() {
            cfg.tie_word_embeddings = false;
        }
        write_config(&cfg, "ForCausalLM", self.kind(), dir)?;
        hf::save_tensors(&export_tensors(&self.vs, self.lora.as_ref()), dir)
    }

    /// Replaces the weights, in place, with those of the Hugging Face folder `dir` (the same
    /// architecture: a tensor missing there or of another shape is an error naming it, and the
    /// weights may then be part old, part new); whatever shares this model sees the new
    /// weights. The serving engine's weight sync (`/update_weights_from_disk`).
    pub fn load_weights(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.model.check_whole()?;
        let ckpt = Checkpoint::open(dir.as_ref())?;
        hf::load_into(&self.vs, &ckpt, &|_| false)?;
        Ok(())
    }

    /// A copy of this model that shares no storage with it: the same config, device, LoRA
    /// adapters, and every variable equal in value and dtype (mixed precision's casts
    /// included), so it generates exactly what this model does. The asynchronous rollout's
    /// own policy, which keeps generating while this one trains.
    pub fn replica(&self) -> Result<CausalLm> {
        let snapshot = self.snapshot(|_| true)?;
        // every variable, adapters included, comes from the snapshot
        let mut lm = CausalLm::to_be_filled(self.config(), self.device(), self.kind())?;
        if let Some(cfg) = self.lora() {
            crate::seed::to_be_filled(self.kind(), || lm.add_lora(&cfg.clone()))?;
        }
        lm.load_snapshot(&snapshot)?;
        Ok(lm)
    }

    /// The variables training changes (those that require a gradient: all of them in full
    /// fine-tuning, a LoRA model's adapters) as detached copies, by name: what
    /// [`load_snapshot`](Self::load_snapshot) of a [`replica`](Self::replica) takes to follow
    /// this model (its frozen variables are the replica's own copies already).
    pub fn trained_snapshot(&self) -> Result<Vec<(String, Tensor)>> {
        self.snapshot(Tensor::requires_grad)
    }

    fn snapshot(&self, pick: impl Fn(&Tensor) -> bool) -> Result<Vec<(String, Tensor)>> {
        self.model.check_whole()?;
        let _no_grad = tch::no_grad_guard();
        let mut vars: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(_, t)| pick(t))
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(vars)
    }

    /// Overwrites, in place, each variable the snapshot names with its tensor (and its dtype).
    /// A name that is no variable of this model or a shape that differs is an error naming it,
    /// and nothing is written then.
    pub fn load_snapshot(&self, snapshot: &[(String, Tensor)]) -> Result<()> {
        self.model.check_whole()?;
        let vars = self.vs.variables();
        let mismatch = |what: String| Error::invalid("weights snapshot", what);
        for (name, t) in snapshot {
            match vars.get(name) {
                None => return Err(mismatch(format!("`{name}` is no variable of this model"))),
                Some(v) if v.size() != t.size() => {
                    return Err(mismatch(format!(
                        "`{name}` is {:?} here and {:?} in the snapshot",
                        v.size(),
                        t.size()
                    )));
                }
                Some(_) => {}
            }
        }
        let _no_grad = tch::no_grad_guard();
        for (name, t) in snapshot {
            let mut v = vars[name].shallow_clone();
            if v.kind() == t.kind() && v.device() == t.device() {
                v.copy_(t);
            } else {
                v.set_data(&t.to_device(v.device()).copy());
            }
        }
        Ok(())
    }

    /// SHA-256 over the tensors [`CausalLm::save_pretrained`] writes (a LoRA model's merged),
    /// in name order (each name, shape and float32 values): the same for the same weights
    /// whatever dtype they are held in. A trainer compares it with what a rollout server
    /// reports after loading the saved folder.
    pub fn weights_sha256(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut vars = export_tensors(&self.vs, self.lora.as_ref());
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut h = Sha256::new();
        for (name, t) in vars {
            h.update(name.as_bytes());
            for d in t.size() {
                h.update(d.to_le_bytes());
            }
            let values = t
                .to_kind(Kind::Float)
                .to_device(Device::Cpu)
                .contiguous()
                .view([-1]);
            for v in Vec::<f32>::try_from(&values).unwrap_or_default() {
                h.update(v.to_le_bytes());
            }
        }
        format!("{:x}", h.finalize())
    }

    /// Logits for every position.
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, seq_len]` i64
    /// - `attention_mask`: `[batch, past_len + seq_len]` i64, 1 = real token
    /// - `position_ids`: `[batch, seq_len]` i64
    /// - returns logits `[batch, seq_len, vocab]` in the model dtype
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let _root = self.model.hold_root()?;
        let hidden = self
            .model
            .forward(input_ids, attention_mask, position_ids, cache)?;
        Ok(self.logits(&hidden))
    }

    /// Forward and backward of `loss_fn(logits)` with per-layer gradient checkpointing (see
    /// [`Model::forward_backward_checkpointed`]); gradients accumulate into the weights as
    /// `loss.backward()` would. Returns the loss, detached.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq_len]` i64
    /// - `loss_fn` gets logits `[batch, seq_len, vocab]` and returns a scalar
    pub fn forward_backward_checkpointed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.model
            .forward_backward_checkpointed(input_ids, attention_mask, position_ids, |h| {
                loss_fn(&self.logits(h))
            })
    }

    /// Applies `lm_head` to hidden states.
    ///
    /// # Shapes
    /// - `hidden`: `[..., hidden]`; returns `[..., vocab]`
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        let logits = match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => crate::gemm::linear(hidden, self.model.embed_tokens(), None),
        };
        match self.head_lora.as_ref().and_then(|a| a.delta(hidden)) {
            Some(delta) => logits + delta,
            None => logits,
        }
    }

    /// The decoder stack.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Config {
        self.model.config()
    }

    /// The weights (for optimisers and checkpoints).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The weights, mutably (to freeze, cast or move them).
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// The dtype of the weights.
    pub fn kind(&self) -> Kind {
        self.model.embed_tokens().kind()
    }
}

/// The critic: the stack plus a one-label token-classification `score` (`weight` `[1, hidden]`,
/// `bias` `[1]`), as verl builds it with `AutoModelForTokenClassification`.
#[derive(Debug)]
pub struct ValueModel {
    vs: VarStore,
    model: Model,
    score: Linear,
    fresh_head: bool,
    lora: Option<Attached>,
}

impl ValueModel {
    lora_methods!("TOKEN_CLS", &["score"], decoder_only);

    /// A freshly initialised critic.
    pub fn new(cfg: &Config, device: Device, kind: Kind) -> Result<ValueModel> {
        ValueModel::built(cfg, device, (kind, kind), (Weights::Drawn, Weights::Drawn))
    }

    /// `kinds`: the model's dtype and the stack's; `weights`: how the stack and the head start.
    fn built(
        cfg: &Config,
        device: Device,
        kinds: (Kind, Kind),
        weights: (Weights, Weights),
    ) -> Result<ValueModel> {
        let (vs, model, score) = build_scored(cfg, device, kinds, weights, 1, true)?;
        Ok(ValueModel {
            vs,
            model,
            score,
            fresh_head: true,
            lora: None,
        })
    }

    /// Loads the stack from `dir`; the value head comes from `score.*` when the checkpoint has it
    /// (a saved critic) and is initialised fresh otherwise (e.g. from the actor's checkpoint).
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
    ) -> Result<ValueModel> {
        ValueModel::from_pretrained_stack_in(dir, device, kind, kind)
    }

    /// [`from_pretrained`](Self::from_pretrained) with the stack loaded in `stack_kind` and
    /// the value head in `kind` (float32 where they differ): a base that LoRA freezes, loaded
    /// straight in mixed precision's compute dtype, under a head and adapters
    /// ([`add_lora_in`](Self::add_lora_in)) in float32, the masters' source. The optimizer
    /// casts the trained variables (`AdamW::for_model`), as it would cast a float32 model.
    pub fn from_pretrained_stack_in(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
        stack_kind: Kind,
    ) -> Result<ValueModel> {
        let dir = dir.as_ref();
        let cfg = read_config(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let has_head = ckpt.contains("score.weight");
        // the stack is loaded (or this fails naming what is missing); the head too if there
        let head = if has_head {
            Weights::Filled
        } else {
            Weights::Drawn
        };
        let mut critic =
            ValueModel::built(&cfg, device, (kind, stack_kind), (Weights::Filled, head))?;
        let fresh = hf::load_into(&critic.vs, &ckpt, &|name| {
            !has_head && name.starts_with("score.")
        })?;
        critic.fresh_head = !fresh.is_empty();
        Ok(critic)
    }

    /// Whether the value head was initialised fresh rather than loaded.
    pub fn fresh_head(&self) -> bool {
        self.fresh_head
    }

    /// Writes `config.json` (architectures `*ForTokenClassification`, one label) and weights.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        self.model.check_whole()?;
        let mut cfg = self.config().clone();
        cfg.set_num_labels(1);
        write_config(
            &cfg,
            "ForTokenClassification",
            self.model.embed_tokens().kind(),
            dir,
        )?;
        hf::save_tensors(&export_tensors(&self.vs, self.lora.as_ref()), dir)
    }

    /// Values for every position.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq_len]` i64
    /// - returns values `[batch, seq_len]` f32
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
    ) -> Result<Tensor> {
        let _root = self.model.hold_root()?;
        let hidden = self
            .model
            .forward(input_ids, attention_mask, position_ids, None)?;
        Ok(self.values(&hidden))
    }

    /// Applies the value head to hidden states.
    ///
    /// # Shapes
    /// - `hidden`: `[..., hidden]`; returns values `[...]` f32
    pub fn values(&self, hidden: &Tensor) -> Tensor {
        self.score
            .forward(hidden)
            .squeeze_dim(-1)
            .to_kind(Kind::Float)
    }

    /// The decoder stack (for a packed forward, [`Model::forward_packed`]).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Config {
        self.model.config()
    }

    /// The weights.
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The weights, mutably.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }
}

/// A reward model (`*ForSequenceClassification`): `score.weight` `[num_labels, hidden]`, no
/// bias, read at the last real token of each row.
#[derive(Debug)]
pub struct RewardModel {
    vs: VarStore,
    model: Model,
    score: Linear,
    lora: Option<Attached>,
}

impl RewardModel {
    lora_methods!("SEQ_CLS", &["score"], decoder_only);

    /// A freshly initialised reward model with `cfg.num_labels()` outputs.
    pub fn new(cfg: &Config, device: Device, kind: Kind) -> Result<RewardModel> {
        RewardModel::built(cfg, device, (kind, kind), (Weights::Drawn, Weights::Drawn))
    }

    /// A reward model whose stack the caller overwrites before use (loads from a language
    /// model's checkpoint), built in `stack_kind` without drawing; the head is drawn, in `kind`
    /// (see [`ValueModel::from_pretrained_stack_in`] for a stack in another dtype).
    pub(crate) fn with_stack_to_be_filled(
        cfg: &Config,
        device: Device,
        kind: Kind,
        stack_kind: Kind,
    ) -> Result<RewardModel> {
        RewardModel::built(
            cfg,
            device,
            (kind, stack_kind),
            (Weights::Filled, Weights::Drawn),
        )
    }

    /// `kinds`: the model's dtype and the stack's; `weights`: how the stack and the head start.
    fn built(
        cfg: &Config,
        device: Device,
        kinds: (Kind, Kind),
        weights: (Weights, Weights),
    ) -> Result<RewardModel> {
        let (vs, model, score) =
            build_scored(cfg, device, kinds, weights, cfg.num_labels(), false)?;
        Ok(RewardModel {
            vs,
            model,
            score,
            lora: None,
        })
    }

    /// Loads a Hugging Face `*ForSequenceClassification` checkpoint; `score.weight` is required.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
    ) -> Result<RewardModel> {
        let dir = dir.as_ref();
        let cfg = read_config(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        // every variable is loaded, or this fails naming the missing one
        let rm = RewardModel::built(
            &cfg,
            device,
            (kind, kind),
            (Weights::Filled, Weights::Filled),
        )?;
        hf::load_into(&rm.vs, &ckpt, &|_| false)?;
        Ok(rm)
    }

    /// Writes `config.json` (architectures `*ForSequenceClassification`) and weights.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        self.model.check_whole()?;
        write_config(
            self.config(),
            "ForSequenceClassification",
            self.model.embed_tokens().kind(),
            dir,
        )?;
        hf::save_tensors(&export_tensors(&self.vs, self.lora.as_ref()), dir)
    }

    /// Scores at the last real token of each row (the last position whose mask is 1).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq_len]` i64
    /// - returns scores `[batch, num_labels]` f32
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
    ) -> Result<Tensor> {
        let size = expect_dims(
            "attention_mask",
            attention_mask,
            &[None, None],
            "[batch, seq_len]",
        )?;
        let _root = self.model.hold_root()?;
        let hidden = self
            .model
            .forward(input_ids, attention_mask, position_ids, None)?;
        let positions = Tensor::arange(size[1], (Kind::Int64, attention_mask.device()));
        let last = (positions * attention_mask.ne(0).to_kind(Kind::Int64)).argmax(-1, false);
        let hidden_size = hidden.size()[2];
        // [batch] -> [batch, 1, hidden] gather index
        let index = last
            .view([-1, 1, 1])
            .expand([size[0], 1, hidden_size], false);
        let at_last = hidden.gather(1, &index, false).squeeze_dim(1);
        Ok(self.score.forward(&at_last).to_kind(Kind::Float))
    }

    /// The decoder stack.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &Config {
        self.model.config()
    }

    /// The weights.
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The weights, mutably.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }
}

//! The Llama/Qwen2 decoder stack in tch, matching Hugging Face's `LlamaModel` / `Qwen2Model`
//! (RMSNorm, RoPE with `rope_theta`, grouped-query attention, SwiGLU MLP, Qwen2's q/k/v biases),
//! with the [`KvCache`] passed in so actor and rollout share one set of weights.

use std::cell::{Cell, RefCell};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tch::nn::{Init, Path as VarPath};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result, expect_dims, expect_kind};
use crate::fsdp::{Held, HeldAll, ParamShards, ROOT, layer_unit};
use crate::segments::{Blocks, Mask};

/// The model families this crate implements, picked from `architectures` / `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama (and SmolLM): optional `attention_bias` on q/k/v/o, optional `mlp_bias`.
    Llama,
    /// Qwen2: biases on q/k/v, none on o_proj.
    Qwen2,
}

impl Family {
    /// The Hugging Face class prefix (`"Llama"`, `"Qwen2"`).
    pub fn class_prefix(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Qwen2 => "Qwen2",
        }
    }

    /// The Hugging Face `model_type` (`"llama"`, `"qwen2"`).
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }
}

const HEADS: [&str; 4] = [
    "ForCausalLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "Model",
];

/// A token id or a list of them (`eos_token_id` is either in Hugging Face configs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(i64),
    /// Several ids.
    Many(Vec<i64>),
}

impl TokenIds {
    /// The ids as a vector.
    pub fn to_vec(&self) -> Vec<i64> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> i64 {
    2048
}
fn default_act() -> String {
    "silu".to_owned()
}
fn default_init_range() -> f64 {
    0.02
}

/// The model's hyper-parameters, deserialised from Hugging Face `config.json` with its field
/// names; keys this crate does not use are kept in `extra` and written back on save.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    /// Hugging Face class names, e.g. `["LlamaForCausalLM"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// `"llama"` or `"qwen2"`.
    #[serde(default)]
    pub model_type: String,
    /// Vocabulary size (rows of `embed_tokens`).
    pub vocab_size: i64,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: i64,
    /// Number of decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<i64>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<i64>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RoPE scaling; only `null` / `{"rope_type": "default"}` is supported.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// Longest sequence the model was trained for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: i64,
    /// Whether `lm_head` reuses `embed_tokens.weight`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama only: biases on q/k/v/o projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Llama only: biases on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Activation of the MLP; only `"silu"` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Std-dev of the normal init of fresh weights.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
    /// Qwen2 only: sliding-window attention (unsupported when true).
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Beginning-of-sequence token.
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    /// End-of-sequence token(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Padding token.
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    /// Every other key of config.json, kept verbatim so a save round-trips.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Config {
    /// Reads and checks `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let cfg: Config =
            serde_json::from_str(&text).map_err(|e| Error::format(path, e.to_string()))?;
        cfg.family_at(path)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// A tiny random-init Llama config for tests: vocab 128, hidden 32, 2 layers, 4 heads, 2 KV heads.
    pub fn tiny() -> Config {
        Config {
            architectures: vec!["LlamaForCausalLM".to_owned()],
            model_type: "llama".to_owned(),
            vocab_size: 128,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 256,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: "silu".to_owned(),
            initializer_range: 0.02,
            use_sliding_window: false,
            bos_token_id: Some(1),
            eos_token_id: Some(TokenIds::One(2)),
            pad_token_id: Some(0),
            extra: Map::new(),
        }
    }

    /// The family, from `architectures` (or `model_type` when that is absent).
    pub fn family(&self) -> Result<Family> {
        self.family_at(Path::new("config.json"))
    }

    fn family_at(&self, path: &Path) -> Result<Family> {
        let families = [Family::Llama, Family::Qwen2];
        let unsupported = || {
            let supported: Vec<String> = families
                .iter()
                .flat_map(|f| {
                    HEADS
                        .iter()
                        .map(move |h| format!("{}{h}", f.class_prefix()))
                })
                .collect();
            let got = if self.architectures.is_empty() {
                vec![self.model_type.clone()]
            } else {
                self.architectures.clone()
            };
            Error::UnsupportedArchitecture {
                path: path.display().to_string(),
                got,
                supported: supported.join(", "),
            }
        };
        match self.architectures.first() {
            Some(arch) => families
                .into_iter()
                .find(|f| {
                    arch.strip_prefix(f.class_prefix())
                        .is_some_and(|h| HEADS.contains(&h))
                })
                .ok_or_else(unsupported),
            None => families
                .into_iter()
                .find(|f| f.model_type() == self.model_type)
                .ok_or_else(unsupported),
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, reason: String| {
            Err(Error::Config {
                key: key.to_owned(),
                reason,
            })
        };
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.n_kv_heads()),
            ("head_dim", self.head_dim()),
        ] {
            if v <= 0 {
                return bad(key, format!("must be positive, got {v}"));
            }
        }
        if self.head_dim.is_none() && self.hidden_size % self.num_attention_heads != 0 {
            return bad(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            );
        }
        if self.num_attention_heads % self.n_kv_heads() != 0 {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.n_kv_heads(),
                    self.num_attention_heads
                ),
            );
        }
        if self.head_dim() % 2 != 0 {
            return bad(
                "head_dim",
                format!("RoPE needs an even head_dim, got {}", self.head_dim()),
            );
        }
        if self.hidden_act != "silu" {
            return bad(
                "hidden_act",
                format!("only \"silu\" is supported, got {:?}", self.hidden_act),
            );
        }
        if let Some(scaling) = &self.rope_scaling {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(Value::as_str);
            if !scaling.is_null() && kind != Some("default") {
                return bad(
                    "rope_scaling",
                    format!("only null or rope_type \"default\" is supported, got {scaling}"),
                );
            }
        }
        if self.use_sliding_window {
            return bad(
                "use_sliding_window",
                "sliding-window attention is not supported".to_owned(),
            );
        }
        Ok(())
    }

    /// Key/value heads.
    pub fn n_kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// `num_labels` as Hugging Face derives it from `id2label` (2 when absent).
    pub fn num_labels(&self) -> i64 {
        match self.extra.get("id2label").and_then(Value::as_object) {
            Some(map) => map.len() as i64,
            None => self
                .extra
                .get("num_labels")
                .and_then(Value::as_i64)
                .unwrap_or(2),
        }
    }

    /// Sets `id2label`/`label2id` for `n` labels, as Hugging Face writes them.
    pub fn set_num_labels(&mut self, n: i64) {
        let id2label: Map<String, Value> = (0..n)
            .map(|i| (i.to_string(), Value::from(format!("LABEL_{i}"))))
            .collect();
        let label2id: Map<String, Value> = (0..n)
            .map(|i| (format!("LABEL_{i}"), Value::from(i)))
            .collect();
        self.extra
            .insert("id2label".to_owned(), Value::Object(id2label));
        self.extra
            .insert("label2id".to_owned(), Value::Object(label2id));
    }

    /// The decoder stack's linear layers, as [`Model`] builds them: per layer q, k, v, o,
    /// gate, up, down, named as in Hugging Face checkpoints (`model.layers.0.self_attn.q_proj`).
    /// Computed from the config alone (what `harness plan` counts without loading weights).
    pub fn linear_layers(&self) -> Vec<LinearShape> {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (q, kv) = (self.num_attention_heads * hd, self.n_kv_heads() * hd);
        (0..self.num_hidden_layers)
            .flat_map(|l| {
                [
                    ("self_attn.q_proj", h, q, self.qkv_bias()),
                    ("self_attn.k_proj", h, kv, self.qkv_bias()),
                    ("self_attn.v_proj", h, kv, self.qkv_bias()),
                    ("self_attn.o_proj", q, h, self.o_bias()),
                    ("mlp.gate_proj", h, i, self.mlp_bias),
                    ("mlp.up_proj", h, i, self.mlp_bias),
                    ("mlp.down_proj", i, h, self.mlp_bias),
                ]
                .map(|(name, in_dim, out_dim, bias)| LinearShape {
                    name: format!("model.layers.{l}.{name}"),
                    in_dim,
                    out_dim,
                    bias,
                })
            })
            .collect()
    }

    /// Whether q, k and v projections have biases (Qwen2 always, Llama with `attention_bias`).
    pub fn qkv_bias(&self) -> bool {
        self.family().map(|f| f == Family::Qwen2).unwrap_or(false) || self.attention_bias
    }

    /// Whether the output projection has a bias (Llama with `attention_bias`).
    pub fn o_bias(&self) -> bool {
        self.family().map(|f| f == Family::Llama).unwrap_or(true) && self.attention_bias
    }
}

/// One linear layer of the stack by its config: name and widths ([`Config::linear_layers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearShape {
    /// The checkpoint name without `.weight` (`model.layers.0.self_attn.q_proj`).
    pub name: String,
    /// Input width.
    pub in_dim: i64,
    /// Output width.
    pub out_dim: i64,
    /// Whether it has a bias.
    pub bias: bool,
}

/// A dense projection with Hugging Face's `weight` `[out, in]` and optional `bias` `[out]`.
#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    /// A LoRA adapter applied unmerged ([`crate::lora`]).
    pub(crate) lora: Option<crate::lora::Adapter>,
}

impl Linear {
    pub(crate) fn new(p: VarPath, in_dim: i64, out_dim: i64, bias: bool, std: f64) -> Linear {
        let weight = crate::seed::var(
            &p,
            "weight",
            &[out_dim, in_dim],
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let bias = bias.then(|| crate::seed::var(&p, "bias", &[out_dim], Init::Const(0.0)));
        Linear {
            weight,
            bias,
            lora: None,
        }
    }

    pub(crate) fn forward(&self, xs: &Tensor) -> Tensor {
        let ys = crate::gemm::linear(xs, &self.weight, self.bias.as_ref());
        self.with_adapter(xs, ys)
    }

    /// `ys` (this layer's base product of `xs`) plus its LoRA adapter's, if any.
    fn with_adapter(&self, xs: &Tensor, ys: Tensor) -> Tensor {
        match self.lora.as_ref().and_then(|l| l.delta(xs)) {
            Some(delta) => ys + delta,
            None => ys,
        }
    }

    /// `xs` through several layers that share it as input (q, k and v; gate and up): one
    /// product with their weights concatenated where a packed scope allows it
    /// ([`crate::gemm::linear_fused`]: a rollout's decode steps), else each on its own. Each
    /// layer's LoRA adapter applies to its own part either way.
    fn forward_shared<const N: usize>(layers: [&Linear; N], xs: &Tensor) -> [Tensor; N] {
        let parts = layers.map(|l| (&l.weight, l.bias.as_ref()));
        match crate::gemm::linear_fused(xs, &parts) {
            Some(ys) => {
                let mut ys = ys.into_iter();
                layers.map(|l| l.with_adapter(xs, ys.next().expect("one output a layer")))
            }
            None => layers.map(|l| l.forward(xs)),
        }
    }
}

/// RMSNorm as Hugging Face computes it: in f32, cast back, then scaled by `weight`.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(p: VarPath, size: i64, eps: f64) -> RmsNorm {
        RmsNorm {
            weight: crate::seed::var(&p, "weight", &[size], Init::Const(1.0)),
            eps,
        }
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        if let Some(ys) = crate::fused::rms_norm(xs, &self.weight, self.eps) {
            return ys;
        }
        let kind = xs.kind();
        let xs = xs.to_kind(Kind::Float);
        let variance = xs.square().mean_dim(-1, true, Kind::Float);
        let xs = (xs * (variance + self.eps).rsqrt()).to_kind(kind);
        &self.weight * xs
    }

    /// `(xs + residual, the norm of that sum)`: one kernel where [`crate::fused`] applies.
    fn forward_added(&self, xs: &Tensor, residual: &Tensor) -> (Tensor, Tensor) {
        if let Some(both) = crate::fused::add_rms_norm(xs, residual, &self.weight, self.eps) {
            return both;
        }
        let sum = xs + residual;
        let normed = self.forward(&sum);
        (sum, normed)
    }
}

/// SwiGLU MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))`.
#[derive(Debug)]
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(p: VarPath, cfg: &Config) -> Mlp {
        let (h, i, b, std) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.mlp_bias,
            cfg.initializer_range,
        );
        Mlp {
            gate_proj: Linear::new(&p / "gate_proj", h, i, b, std),
            up_proj: Linear::new(&p / "up_proj", h, i, b, std),
            down_proj: Linear::new(&p / "down_proj", i, h, b, std),
        }
    }

    fn forward(&self, xs: &Tensor) -> Tensor {
        let [gate, up] = Linear::forward_shared([&self.gate_proj, &self.up_proj], xs);
        let act = crate::fused::silu_mul(&gate, &up).unwrap_or_else(|| gate.silu() * up);
        self.down_proj.forward(&act)
    }
}

/// Rotary position embedding tables for one forward.
#[derive(Debug)]
struct Rope {
    /// `[batch, 1, seq_len, head_dim]`
    cos: Tensor,
    /// `[batch, 1, seq_len, head_dim]`
    sin: Tensor,
}

fn rotate_half(xs: &Tensor) -> Tensor {
    let half = xs.size()[3] / 2;
    Tensor::cat(&[-xs.narrow(3, half, half), xs.narrow(3, 0, half)], 3)
}

impl Rope {
    fn apply(&self, xs: &Tensor) -> Tensor {
        xs * &self.cos + rotate_half(xs) * &self.sin
    }
}

/// Grouped-query self-attention through `scaled_dot_product_attention`.
#[derive(Debug)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: i64,
    n_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(p: VarPath, cfg: &Config) -> Attention {
        let (h, hd, std) = (cfg.hidden_size, cfg.head_dim(), cfg.initializer_range);
        let (n_heads, n_kv_heads) = (cfg.num_attention_heads, cfg.n_kv_heads());
        Attention {
            q_proj: Linear::new(&p / "q_proj", h, n_heads * hd, cfg.qkv_bias(), std),
            k_proj: Linear::new(&p / "k_proj", h, n_kv_heads * hd, cfg.qkv_bias(), std),
            v_proj: Linear::new(&p / "v_proj", h, n_kv_heads * hd, cfg.qkv_bias(), std),
            o_proj: Linear::new(&p / "o_proj", n_heads * hd, h, cfg.o_bias(), std),
            n_heads,
            n_kv_heads,
            head_dim: hd,
        }
    }

    /// `mask`: dense `[batch, 1, seq_len, kv_len]` (bool, true = may attend, or additive), or
    /// the blocks of packed rows (never with a cache).
    fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Mask,
        cache: Option<(&Tensor, &Tensor, i64)>,
    ) -> Tensor {
        let (b, s, _) = xs.size3().unwrap();
        let hd = self.head_dim;
        // [batch, seq_len, n_heads * head_dim] -> [batch, n_heads, seq_len, head_dim]
        let [q, k, v] = Linear::forward_shared([&self.q_proj, &self.k_proj, &self.v_proj], xs);
        let heads = |t: &Tensor, n: i64| t.view([b, s, n, hd]).transpose(1, 2);
        // the rotary embedding and the cache writes as one kernel where it applies
        let slots = cache.map(|(k_cache, v_cache, past)| {
            (k_cache.narrow(2, past, s), v_cache.narrow(2, past, s))
        });
        let kv_slots = match &slots {
            Some((keys, values)) => crate::fused::KvSlots::Cache { keys, values },
            None => crate::fused::KvSlots::Fresh,
        };
        let (nh, nkv) = (self.n_heads, self.n_kv_heads);
        // `k`: this call's rotated keys, `[batch, n_kv_heads, seq_len, head_dim]`
        let (q, k) = crate::fused::rope_qkv(&q, &k, &v, &rope.cos, &rope.sin, kv_slots, nh, nkv)
            .unwrap_or_else(|| {
                let (q, k) = (rope.apply(&heads(&q, nh)), rope.apply(&heads(&k, nkv)));
                if let Some((keys, values)) = &slots {
                    keys.shallow_clone().copy_(&k);
                    values.shallow_clone().copy_(&heads(&v, nkv));
                }
                (q, k)
            });
        let (k, v) = match cache {
            // this step's keys/values are in place; attend over [0, past + seq_len)
            Some((k_cache, v_cache, past)) => (
                k_cache.narrow(2, 0, past + s),
                v_cache.narrow(2, 0, past + s),
            ),
            None => (k, heads(&v, nkv)),
        };
        let ys = match mask {
            Mask::Blocks(blocks) => blocks.attend(&q, &k, &v),
            Mask::Dense(mask) => {
                let scale = (hd as f64).powf(-0.5);
                let gqa = self.n_kv_heads != self.n_heads;
                let ys = crate::attention::one_query(&q, &k, &v, mask, scale)
                    .unwrap_or_else(|| crate::attention::sdpa(&q, &k, &v, mask, gqa));
                // [batch, n_heads, seq_len, head_dim] -> [batch, seq_len, n_heads * head_dim]
                ys.transpose(1, 2).reshape([b, s, self.n_heads * hd])
            }
        };
        self.o_proj.forward(&ys)
    }
}

#[derive(Debug)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// The layer's linear projections with their Hugging Face names (`self_attn.q_proj`, ...).
    fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 7] {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        [
            ("self_attn.q_proj", &mut a.q_proj),
            ("self_attn.k_proj", &mut a.k_proj),
            ("self_attn.v_proj", &mut a.v_proj),
            ("self_attn.o_proj", &mut a.o_proj),
            ("mlp.gate_proj", &mut m.gate_proj),
            ("mlp.up_proj", &mut m.up_proj),
            ("mlp.down_proj", &mut m.down_proj),
        ]
    }

    fn new(p: VarPath, cfg: &Config) -> DecoderLayer {
        DecoderLayer {
            self_attn: Attention::new(&p / "self_attn", cfg),
            mlp: Mlp::new(&p / "mlp", cfg),
            input_layernorm: RmsNorm::new(
                &p / "input_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            ),
            post_attention_layernorm: RmsNorm::new(
                &p / "post_attention_layernorm",
                cfg.hidden_size,
                cfg.rms_norm_eps,
            ),
        }
    }

    fn forward(
        &self,
        xs: &Tensor,
        rope: &Rope,
        mask: &Mask,
        cache: Option<(&Tensor, &Tensor, i64)>,
    ) -> Tensor {
        let attn = self
            .self_attn
            .forward(&self.input_layernorm.forward(xs), rope, mask, cache);
        let (xs, normed) = self.post_attention_layernorm.forward_added(xs, &attn);
        &xs + self.mlp.forward(&normed)
    }
}

/// Per-layer keys and values of past tokens, preallocated to a capacity and filled in place, so
/// a decode step never re-concatenates the whole cache.
#[derive(Debug)]
pub struct KvCache {
    /// Per layer `[batch, n_kv_heads, capacity, head_dim]`.
    keys: Vec<Tensor>,
    /// Per layer `[batch, n_kv_heads, capacity, head_dim]`.
    values: Vec<Tensor>,
    len: i64,
}

impl KvCache {
    /// An empty cache for `batch` rows of up to `capacity` tokens, in the model's dtype and device.
    pub fn new(cfg: &Config, batch: i64, capacity: i64, kind: Kind, device: Device) -> KvCache {
        let shape = [batch, cfg.n_kv_heads(), capacity, cfg.head_dim()];
        let make = || {
            (0..cfg.num_hidden_layers)
                .map(|_| Tensor::zeros(shape, (kind, device)))
                .collect()
        };
        KvCache {
            keys: make(),
            values: make(),
            len: 0,
        }
    }

    /// Tokens held per row (including left padding).
    pub fn len(&self) -> i64 {
        self.len
    }

    /// Whether nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows of the cache.
    pub fn batch(&self) -> i64 {
        self.keys.first().map_or(0, |k| k.size()[0])
    }

    /// Tokens the cache can hold per row.
    pub fn capacity(&self) -> i64 {
        self.keys.first().map_or(0, |k| k.size()[2])
    }

    /// Keeps only the rows `rows` (in that order; repeats allowed), e.g. to drop finished rows
    /// or to repeat a prefilled prompt `n` times. Only the filled part is copied.
    ///
    /// # Shapes
    /// - `rows`: `[new_batch]` i64 indices into `0..batch`
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        expect_dims("rows", rows, &[None], "[new_batch]")?;
        expect_kind("rows", rows, &[Kind::Int64])?;
        let batch = self.batch();
        if rows.numel() > 0 {
            let (lo, hi) = (rows.min().int64_value(&[]), rows.max().int64_value(&[]));
            if lo < 0 || hi >= batch {
                return Err(Error::invalid(
                    "rows",
                    format!("indices {lo}..={hi} outside 0..{batch}"),
                ));
            }
        }
        let rows = rows.to_device(self.keys.first().map_or(Device::Cpu, Tensor::device));
        let (n, len) = (rows.size()[0], self.len);
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let mut size = t.size();
            size[0] = n;
            // positions past `len` are never read, so they may stay uninitialised
            let fresh = Tensor::empty(size, (t.kind(), t.device()));
            fresh
                .narrow(2, 0, len)
                .copy_(&t.narrow(2, 0, len).index_select(0, &rows));
            *t = fresh;
        }
        Ok(())
    }

    /// Rebuilds the cache from some of its rows and, per row, some of its columns, into a
    /// fresh cache of `capacity` tokens: new row `i` holds old row `rows[i]`, and its column `j`
    /// is old column `columns[i, j]`. Keys are stored after RoPE, so moving a token to another
    /// column changes nothing it computes as long as the attention mask moves with it; the
    /// multi-turn rollout uses this to squeeze out the masked holes between turns.
    ///
    /// # Shapes
    /// - `rows`: `[new_batch]` i64 indices into `0..batch`
    /// - `columns`: `[new_batch, new_len]` i64 indices into `0..len()`, `new_len <= capacity`
    pub fn gather_columns(&mut self, rows: &Tensor, columns: &Tensor, capacity: i64) -> Result<()> {
        let n = expect_dims("rows", rows, &[None], "[new_batch]")?[0];
        expect_kind("rows", rows, &[Kind::Int64])?;
        let new_len = expect_dims("columns", columns, &[Some(n), None], "[new_batch, new_len]")?[1];
        expect_kind("columns", columns, &[Kind::Int64])?;
        if new_len > capacity {
            return Err(Error::invalid(
                "capacity",
                format!("{capacity} tokens cannot hold {new_len} gathered columns"),
            ));
        }
        for (name, t, hi) in [("rows", rows, self.batch()), ("columns", columns, self.len)] {
            if t.numel() > 0 {
                let (lo, top) = (t.min().int64_value(&[]), t.max().int64_value(&[]));
                if lo < 0 || top >= hi {
                    return Err(Error::invalid(
                        name,
                        format!("indices {lo}..={top} outside 0..{hi}"),
                    ));
                }
            }
        }
        let device = self.keys.first().map_or(Device::Cpu, Tensor::device);
        let (rows, columns) = (rows.to_device(device), columns.to_device(device));
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let size = t.size();
            let (heads, hd) = (size[1], size[3]);
            // [new_batch, new_len] -> [new_batch, n_kv_heads, new_len, head_dim]
            let index = columns
                .view([n, 1, new_len, 1])
                .expand([n, heads, new_len, hd], false);
            let fresh = Tensor::empty([n, heads, capacity, hd], (t.kind(), t.device()));
            fresh.narrow(2, 0, new_len).copy_(
                &t.narrow(2, 0, self.len)
                    .index_select(0, &rows)
                    .gather(2, &index, false),
            );
            *t = fresh;
        }
        self.len = new_len;
        Ok(())
    }
}

impl KvCache {
    /// Stacks `other`'s rows under this cache's into a fresh cache of `capacity` tokens, each
    /// part right-aligned to the longer part's length: the shorter part's rows gain zeroed
    /// columns on their left, which the caller masks out (a row joining a running batch is
    /// left-padded to the batch's length). Continuous batching admits requests this way.
    ///
    /// # Shapes
    /// - the result holds `batch() + other.batch()` rows and `max(len(), other.len())` tokens
    pub fn join(&mut self, other: &KvCache, capacity: i64) -> Result<()> {
        let len = self.len.max(other.len);
        if len > capacity {
            return Err(Error::invalid(
                "capacity",
                format!("{capacity} tokens cannot hold the {len} of the joined caches"),
            ));
        }
        if self.keys.len() != other.keys.len() {
            return Err(Error::invalid(
                "cache",
                format!(
                    "{} layers cannot join {}",
                    self.keys.len(),
                    other.keys.len()
                ),
            ));
        }
        let (mine, theirs) = (self.len, other.len);
        let pairs = self
            .keys
            .iter_mut()
            .zip(&other.keys)
            .chain(self.values.iter_mut().zip(&other.values));
        for (t, o) in pairs {
            let (a, b) = (t.size()[0], o.size()[0]);
            let mut size = t.size();
            size[0] = a + b;
            size[2] = capacity;
            let fresh = Tensor::zeros(size, (t.kind(), t.device()));
            fresh
                .narrow(0, 0, a)
                .narrow(2, len - mine, mine)
                .copy_(&t.narrow(2, 0, mine));
            fresh
                .narrow(0, a, b)
                .narrow(2, len - theirs, theirs)
                .copy_(&o.narrow(2, 0, theirs));
            *t = fresh;
        }
        self.len = len;
        Ok(())
    }

    /// Drops the first `count` columns of every row (masked padding that no row reads any
    /// more), keeping the capacity: the held length shrinks by `count`.
    pub fn drop_leading(&mut self, count: i64) -> Result<()> {
        if !(0..=self.len).contains(&count) {
            return Err(Error::invalid(
                "count",
                format!("cannot drop {count} of {} held columns", self.len),
            ));
        }
        if count == 0 {
            return Ok(());
        }
        let keep = self.len - count;
        for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let fresh = Tensor::empty(t.size(), (t.kind(), t.device()));
            fresh.narrow(2, 0, keep).copy_(&t.narrow(2, count, keep));
            *t = fresh;
        }
        self.len = keep;
        Ok(())
    }
}

/// The decoder stack (`model.*` weights): embeddings, layers and the final norm.
#[derive(Debug)]
pub struct Model {
    embed_tokens: Tensor,
    /// A LoRA adapter on the input embedding (`embed_tokens` in `target_modules`).
    embed_lora: Option<crate::lora::Adapter>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[head_dim / 2]` f32
    inv_freq: Tensor,
    cfg: Config,
    /// ZeRO stage 3: the model's parameters sharded over the data-parallel ranks
    /// ([`crate::fsdp`]), gathered a unit at a time as the stack computes.
    shards: Option<ParamShards>,
    /// Stage 3 training: the forwards whose layers' backward [`Model::finish_backward`] runs.
    tapes: RefCell<Vec<Tape>>,
    /// Stage 3 training: whether the root unit is held from a training forward until
    /// [`Model::finish_backward`] (the loss's backward through the heads needs it).
    train_root: Cell<bool>,
}

/// What a stage-3 training forward keeps for its layers' backward: each layer's input (the
/// layers ran without a graph) and the last layer's output, the leaf the loss's backward
/// reaches.
#[derive(Debug)]
struct Tape {
    input_ids: Tensor,
    inputs: Vec<Tensor>,
    last: Tensor,
    rope: Rope,
    mask: Mask,
}

/// The elementwise maximum of `values` over the shards' group.
fn dist_max(s: &ParamShards, values: &mut [f64]) -> Result<()> {
    let mut g = rl_core::dist::lock(s.group()).map_err(Error::Core)?;
    rl_core::dist::all_reduce_f64(&mut *g, values, rl_core::dist::ReduceOp::Max)
        .map_err(Error::Core)
}

/// Which way a stage-3 pass walks the layers (what to prefetch).
#[derive(Debug, Clone, Copy)]
enum Pass {
    Forward,
    Backward,
}

/// The `[batch, 1, seq_len, kv_len]` boolean mask: causal, keys must be real tokens, and every
/// query sees at least itself (so padding rows stay finite).
fn attention_mask_4d(attention_mask: &Tensor, seq_len: i64, past: i64) -> Tensor {
    let device = attention_mask.device();
    let kv_len = past + seq_len;
    let q_pos = Tensor::arange_start(past, kv_len, (Kind::Int64, device)).unsqueeze(1);
    let k_pos = Tensor::arange(kv_len, (Kind::Int64, device)).unsqueeze(0);
    let causal = k_pos.le_tensor(&q_pos);
    let own = k_pos.eq_tensor(&q_pos);
    let keys = attention_mask.ne(0).unsqueeze(1).unsqueeze(1);
    causal
        .unsqueeze(0)
        .unsqueeze(0)
        .logical_and(&keys)
        .logical_or(&own.unsqueeze(0).unsqueeze(0))
}

/// The additive form (0 where `mask` is true, -inf elsewhere, float32) of a boolean attention
/// mask, for the layers of a float32 forward of several positions a row on the CPU to share;
/// `None` where the boolean mask is used as it is (one position a row: the decode kernel reads
/// it; another dtype: the queries' dtype may differ from the stack's, as with LoRA on a bf16
/// base, and the mask must match it; other devices: their attention backends convert it their
/// own way). `scaled_dot_product_attention` makes this tensor from a boolean mask on every call,
/// so the attention is unchanged up to float rounding (a test checks the tensor and the
/// attention; some CPUs take another kernel path for a boolean mask) while a forward over
/// `[rows, 1, s, s]` converts once instead of once a layer, and a training forward saves one
/// mask for the backward instead of one a layer.
pub(crate) fn sdpa_mask(mask: &Tensor, seq_len: i64, stack: Kind) -> Option<Tensor> {
    let applies = seq_len > 1
        && stack == Kind::Float
        && mask.device() == Device::Cpu
        && mask.kind() == Kind::Bool;
    applies.then(|| {
        Tensor::zeros(mask.size(), (Kind::Float, Device::Cpu))
            .masked_fill(&mask.logical_not(), f64::NEG_INFINITY)
    })
}

/// The `[rows, 1, width, width]` boolean mask of packed rows: a query sees the keys up to
/// itself of its own sequence (equal segment id, not 0) and of the prefix its sequence extends
/// (`prefix_ids`: the segment id of a shared prompt, 0 for none), and always itself (so padding
/// stays finite).
fn packed_mask_4d(segment_ids: &Tensor, prefix_ids: &Tensor) -> Tensor {
    let device = segment_ids.device();
    let width = segment_ids.size()[1];
    let pos = Tensor::arange(width, (Kind::Int64, device));
    let causal = pos.unsqueeze(0).le_tensor(&pos.unsqueeze(1));
    let own = pos.unsqueeze(0).eq_tensor(&pos.unsqueeze(1));
    let keys = segment_ids.unsqueeze(1);
    let same = segment_ids.unsqueeze(2).eq_tensor(&keys);
    let prefix = prefix_ids.unsqueeze(2).eq_tensor(&keys);
    let real = segment_ids.ne(0).unsqueeze(1);
    same.logical_or(&prefix)
        .logical_and(&real)
        .logical_and(&causal.unsqueeze(0))
        .logical_or(&own.unsqueeze(0))
        .unsqueeze(1)
}

impl Model {
    /// Builds the stack under `p` (normally `root / "model"`), with Hugging Face's normal init.
    pub fn new(p: VarPath, cfg: &Config) -> Result<Model> {
        cfg.validate()?;
        let std = cfg.initializer_range;
        let embed_tokens = crate::seed::var(
            &(&p / "embed_tokens"),
            "weight",
            &[cfg.vocab_size, cfg.hidden_size],
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
        );
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(&p / "layers" / i, cfg))
            .collect();
        let norm = RmsNorm::new(&p / "norm", cfg.hidden_size, cfg.rms_norm_eps);
        let hd = cfg.head_dim();
        let exponent = Tensor::arange_start_step(0, hd, 2, (Kind::Int64, p.device()))
            .to_kind(Kind::Float)
            / hd as f64;
        let inv_freq = Tensor::pow_scalar(cfg.rope_theta, &exponent).reciprocal();
        Ok(Model {
            embed_tokens,
            embed_lora: None,
            layers,
            norm,
            inv_freq,
            cfg: cfg.clone(),
            shards: None,
            tapes: RefCell::new(Vec::new()),
            train_root: Cell::new(false),
        })
    }

    /// Shards the variables of `vs` (the whole model this stack is part of, heads included)
    /// over `group`: ZeRO stage 3 ([`crate::fsdp`]). Every rank must hold the same weights.
    pub(crate) fn shard(
        &mut self,
        vs: &tch::nn::VarStore,
        group: rl_core::dist::SharedCollective,
    ) -> Result<()> {
        if self.shards.is_some() {
            return Err(Error::invalid(
                "zero_stage",
                "the parameters are sharded already",
            ));
        }
        self.shards = Some(ParamShards::new(vs, group)?);
        Ok(())
    }

    /// The stage-3 shards of the parameters, when sharded.
    pub fn param_shards(&self) -> Option<&ParamShards> {
        self.shards.as_ref()
    }

    /// Stage 3: holds the root unit (embeddings, final norm, heads) until the guard drops (a
    /// collective when it is not held yet); `None` when not sharded.
    pub(crate) fn hold_root(&self) -> Result<Option<Held<'_>>> {
        self.shards.as_ref().map(|s| s.hold(ROOT)).transpose()
    }

    /// Stage 3: every unit gathered (a collective: every rank calls it), for whole-weight reads
    /// and writes (checkpoints, replica checks); writes reach the shards when the guard drops.
    /// `None` when not sharded.
    pub fn hold_all(&self) -> Result<Option<HeldAll<'_>>> {
        self.shards.as_ref().map(ParamShards::hold_all).transpose()
    }

    /// Stage 3: gathers every unit (a collective: every rank calls it) and keeps them whole
    /// until [`Model::release_whole`], for reading whole weights across calls that cannot hold
    /// a guard (an export under a lock taken per call). Writes meanwhile are not kept. A no-op
    /// when not sharded.
    pub fn gather_whole(&self) -> Result<()> {
        self.shards.as_ref().map_or(Ok(()), ParamShards::gather_all)
    }

    /// Ends [`Model::gather_whole`].
    pub fn release_whole(&self) {
        if let Some(s) = &self.shards {
            s.release_all(false);
        }
    }

    /// Fails when the parameters are sharded and not all gathered (a whole-weight write would
    /// read the released ones).
    pub(crate) fn check_whole(&self) -> Result<()> {
        match &self.shards {
            Some(s) if !s.all_held() => Err(Error::invalid(
                "zero_stage",
                "the weights are sharded (stage 3): gather them on every rank first (Model::hold_all)",
            )),
            _ => Ok(()),
        }
    }

    /// Stage 3: makes the collectives of one forward without computing it, for a rank that
    /// has no rows where the others still compute. A no-op when not sharded.
    pub(crate) fn idle_forward(&self) -> Result<()> {
        let Some(s) = &self.shards else {
            return Ok(());
        };
        let _root = s.hold(ROOT)?;
        for i in 0..self.layers.len() {
            self.hold_layer(s, i, Pass::Forward)?;
        }
        Ok(())
    }

    /// Stage 3, before `count` forwards without gradient (micro-batches): the most any rank
    /// will run (a collective; `count` when not sharded). After its own, a rank makes
    /// [`Model::idle_forward`]s up to it.
    pub(crate) fn most_forwards(&self, count: usize) -> Result<usize> {
        let Some(s) = &self.shards else {
            return Ok(count);
        };
        let mut most = [count as f64];
        dist_max(s, &mut most)?;
        Ok(most[0] as usize)
    }

    /// Stage 3, at each decode step of a generation: whether every rank is done (`done` is
    /// this rank's word; a collective). Without shards, `done`.
    pub(crate) fn all_done(&self, done: bool) -> Result<bool> {
        let Some(s) = &self.shards else {
            return Ok(done);
        };
        let mut running = [if done { 0.0 } else { 1.0 }];
        dist_max(s, &mut running)?;
        Ok(running[0] == 0.0)
    }

    /// Stage 3: the collectives of one training micro-batch (forward, backward, gradient
    /// reduce-scatter) contributing nothing, for a rank with fewer micro-batches than the
    /// others. A no-op when not sharded.
    pub(crate) fn idle_train_round(&self) -> Result<()> {
        let Some(s) = &self.shards else {
            return Ok(());
        };
        {
            let _root = s.hold(ROOT)?;
            self.hold_train_root(s)?;
            for i in 0..self.layers.len() {
                self.hold_layer(s, i, Pass::Forward)?;
            }
        }
        self.finish_backward()
    }

    /// Stage 3: holds layer `i` for its turn in `pass` and starts gathering the layer that
    /// comes next in it (FSDP's forward and backward prefetch), so that gather runs while
    /// layer `i` computes.
    fn hold_layer<'s>(&self, s: &'s ParamShards, i: usize, pass: Pass) -> Result<Held<'s>> {
        let held = s.hold(layer_unit(i))?;
        let next = match pass {
            Pass::Forward => (i + 1 < self.layers.len()).then_some(i + 1),
            Pass::Backward => i.checked_sub(1),
        };
        if let Some(next) = next {
            s.prefetch(layer_unit(next))?;
        }
        Ok(held)
    }

    fn hold_train_root(&self, s: &ParamShards) -> Result<()> {
        if !self.train_root.get() {
            s.gather(ROOT)?;
            self.train_root.set(true);
        }
        Ok(())
    }

    /// Stage 3, after the loss's backward (which reached the last layer's output and the
    /// root's parameters): back-propagates through the layers, last first, each gathered,
    /// recomputed from its saved input and reduce-scattered into this rank's gradient part
    /// (then freed), then the embeddings; finally reduce-scatters the root's gradient and
    /// releases the root. Every rank calls it once per training micro-batch. A no-op when not
    /// sharded.
    pub(crate) fn finish_backward(&self) -> Result<()> {
        let Some(s) = &self.shards else {
            return Ok(());
        };
        let tapes = std::mem::take(&mut *self.tapes.borrow_mut());
        let mut grads: Vec<Tensor> = tapes.iter().map(|t| t.last.grad()).collect();
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let u = layer_unit(i);
            {
                let _layer = self.hold_layer(s, i, Pass::Backward)?;
                for (t, g) in tapes.iter().zip(&mut grads) {
                    if !g.defined() {
                        continue;
                    }
                    let xs = t.inputs[i].detach().set_requires_grad(true);
                    let out = layer.forward(&xs, &t.rope, &t.mask, None);
                    (out * &*g).sum(Kind::Float).f_backward()?;
                    *g = xs.grad();
                }
            }
            s.reduce_grads(u)?;
        }
        if self.embedding_trains() {
            for (t, g) in tapes.iter().zip(&grads) {
                if g.defined() {
                    let embedded = self.embed(&t.input_ids);
                    (embedded * g).sum(Kind::Float).f_backward()?;
                }
            }
        }
        s.reduce_grads(ROOT)?;
        if self.train_root.replace(false) {
            s.release(ROOT);
        }
        Ok(())
    }

    /// The config the stack was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The input embedding matrix `[vocab, hidden]` (also the tied `lm_head`).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The layers that can take a LoRA adapter: the embedding (its matrix and its adapter's
    /// place), and every linear layer of the stack with its Hugging Face name relative to the
    /// stack (`layers.0.self_attn.q_proj`), in layer order.
    #[allow(clippy::type_complexity)]
    pub(crate) fn adaptable_mut(
        &mut self,
    ) -> (
        (&Tensor, &mut Option<crate::lora::Adapter>),
        Vec<(String, &mut Linear)>,
    ) {
        let linears = self
            .layers
            .iter_mut()
            .enumerate()
            .flat_map(|(i, layer)| {
                layer
                    .linears_mut()
                    .into_iter()
                    .map(move |(n, l)| (format!("layers.{i}.{n}"), l))
            })
            .collect();
        ((&self.embed_tokens, &mut self.embed_lora), linears)
    }

    /// The input embeddings of `input_ids`, with the embedding's LoRA adapter where it has one.
    fn embed(&self, input_ids: &Tensor) -> Tensor {
        let xs = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        match self
            .embed_lora
            .as_ref()
            .and_then(|a| a.embedding_delta(input_ids))
        {
            Some(delta) => xs + delta,
            None => xs,
        }
    }

    /// Whether the embedding gets gradients: trained in full, or through its adapter.
    fn embedding_trains(&self) -> bool {
        self.embed_tokens.requires_grad() || self.embed_lora.is_some()
    }

    fn rope(&self, position_ids: &Tensor, kind: Kind) -> Rope {
        // [batch, seq_len, 1] * [head_dim / 2] -> [batch, seq_len, head_dim / 2]
        let freqs = position_ids.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1);
        Rope {
            cos: emb.cos().to_kind(kind),
            sin: emb.sin().to_kind(kind),
        }
    }

    /// Checks the documented shapes, dtypes and id range of a forward's inputs; returns
    /// `(batch, seq_len)`.
    fn check_inputs(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        past: i64,
    ) -> Result<(i64, i64)> {
        let size = expect_dims("input_ids", input_ids, &[None, None], "[batch, seq_len]")?;
        let (b, s) = (size[0], size[1]);
        expect_kind("input_ids", input_ids, &[Kind::Int64])?;
        let mask_doc = "[batch, past_len + seq_len]";
        expect_dims(
            "attention_mask",
            attention_mask,
            &[Some(b), Some(past + s)],
            mask_doc,
        )?;
        expect_kind(
            "attention_mask",
            attention_mask,
            &[Kind::Int64, Kind::Int, Kind::Bool],
        )?;
        expect_dims(
            "position_ids",
            position_ids,
            &[Some(b), Some(s)],
            "[batch, seq_len]",
        )?;
        expect_kind("position_ids", position_ids, &[Kind::Int64])?;
        if s == 0 || b == 0 {
            return Err(Error::invalid(
                "input_ids",
                format!("needs at least one token, got {size:?}"),
            ));
        }
        let (lo, hi) = (
            input_ids.min().int64_value(&[]),
            input_ids.max().int64_value(&[]),
        );
        if lo < 0 || hi >= self.cfg.vocab_size {
            return Err(Error::invalid(
                "input_ids",
                format!(
                    "token ids {lo}..={hi} fall outside the vocab of {}",
                    self.cfg.vocab_size
                ),
            ));
        }
        Ok((b, s))
    }

    /// Forward and backward with gradient checkpointing: the layers first run without a graph,
    /// keeping only each layer's input; `head` gets the final normed hidden states with a graph
    /// and returns a scalar loss, which is back-propagated; then each layer is recomputed from
    /// its saved input, last first, and back-propagated with the incoming gradient. Parameter
    /// gradients accumulate exactly as one `loss.backward()` would, holding one layer's
    /// activations at a time. Returns the loss, detached.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, seq_len]` i64
    /// - `head` gets `[batch, seq_len, hidden]` and returns a scalar
    pub fn forward_backward_checkpointed(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if self.shards.is_some() {
            return Err(Error::invalid(
                "zero_stage",
                "stage 3 checkpoints its layers itself: call forward and then finish_backward",
            ));
        }
        let size = expect_dims("input_ids", input_ids, &[None, None], "[batch, seq_len]")?;
        expect_dims(
            "attention_mask",
            attention_mask,
            &[Some(size[0]), Some(size[1])],
            "[batch, seq_len]",
        )?;
        // validates ids, kinds and shapes the same way as `forward`, on a cheap no-grad pass
        let kind = self.embed_tokens.kind();
        let rope = self.rope(position_ids, kind);
        let mask = attention_mask_4d(attention_mask, size[1], 0);
        let mask = Mask::Dense(sdpa_mask(&mask, size[1], kind).unwrap_or(mask));
        let mut inputs = Vec::with_capacity(self.layers.len());
        let last = tch::no_grad(|| -> Result<Tensor> {
            self.check_inputs(input_ids, attention_mask, position_ids, 0)?;
            let mut xs = self.embed(input_ids);
            for layer in &self.layers {
                inputs.push(xs.shallow_clone());
                xs = layer.forward(&xs, &rope, &mask, None);
            }
            Ok(xs)
        })?;
        let last = last.detach().set_requires_grad(true);
        let loss = head(&self.norm.forward(&last))?;
        if loss.numel() != 1 {
            return Err(Error::invalid(
                "head",
                format!("must return a scalar loss, got {:?}", loss.size()),
            ));
        }
        loss.f_backward()?;
        let mut grad = last.grad();
        for (layer, xs) in self.layers.iter().zip(&inputs).rev() {
            let xs = xs.detach().set_requires_grad(true);
            let out = layer.forward(&xs, &rope, &mask, None);
            (out * &grad).sum(Kind::Float).f_backward()?;
            grad = xs.grad();
        }
        // frozen under LoRA without an adapter on it: nothing to back-propagate into
        if self.embedding_trains() {
            let embedded = self.embed(input_ids);
            (embedded * &grad).sum(Kind::Float).f_backward()?;
        }
        Ok(loss.detach())
    }

    /// Runs the stack; with a cache, writes this call's keys/values after its `len()` tokens.
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, seq_len]` i64
    /// - `attention_mask`: `[batch, past_len + seq_len]` i64 or bool, 1 = real token, where
    ///   `past_len` = `cache.len()` (0 without a cache)
    /// - `position_ids`: `[batch, seq_len]` i64
    /// - returns hidden states `[batch, seq_len, hidden]` after the final norm, in the model dtype
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        position_ids: &Tensor,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let past = cache.as_ref().map_or(0, |c| c.len);
        let (b, s) = self.check_inputs(input_ids, attention_mask, position_ids, past)?;
        if let Some(c) = cache.as_ref()
            && (c.batch() != b || past + s > c.capacity() || c.keys.len() != self.layers.len())
        {
            return Err(Error::invalid(
                "cache",
                format!(
                    "cache of {} rows x {} tokens ({} held) cannot take {b} rows x {s} more",
                    c.batch(),
                    c.capacity(),
                    past
                ),
            ));
        }
        let mask = attention_mask_4d(attention_mask, s, past);
        self.run_layers(input_ids, position_ids, &Mask::Dense(mask), cache)
    }

    /// Forward of sequences packed into rows without padding (verl's `use_remove_padding`):
    /// each row holds whole sequences one after another, each attending only to itself
    /// (causally) and to the prefix it extends, with its own positions; the tail of a row is
    /// padding (segment 0). A prefix (a prompt that several responses share, verl's
    /// `use_prefix_grouper`) is a sequence of its own placed before the sequences that extend
    /// it, which name it in `prefix_ids`: it is computed once for all of them, and the hidden
    /// state of every token is its padded forward's, up to rounding.
    ///
    /// # Shapes
    /// - `input_ids`: `[rows, width]` i64
    /// - `segment_ids`: `[rows, width]` i64: 0 = padding, else the id of the token's sequence,
    ///   whose tokens are contiguous in the row
    /// - `prefix_ids`: `[rows, width]` i64: the segment id of the prefix the token's sequence
    ///   extends (placed earlier in the same row), 0 for none
    /// - `position_ids`: `[rows, width]` i64, restarting with each sequence (continuing its
    ///   prefix's for a sequence that extends one)
    /// - returns hidden states `[rows, width, hidden]` after the final norm, in the model dtype
    pub fn forward_packed(
        &self,
        input_ids: &Tensor,
        segment_ids: &Tensor,
        prefix_ids: &Tensor,
        position_ids: &Tensor,
    ) -> Result<Tensor> {
        let (b, s) = self.check_inputs(input_ids, segment_ids, position_ids, 0)?;
        expect_dims(
            "prefix_ids",
            prefix_ids,
            &[Some(b), Some(s)],
            "[rows, width]",
        )?;
        expect_kind("prefix_ids", prefix_ids, &[Kind::Int64])?;
        let kind = self.embed_tokens.kind();
        let mask = match Blocks::new(segment_ids, prefix_ids, kind, input_ids.device())? {
            Some(blocks) => Mask::Blocks(Box::new(blocks)),
            // no real token: every position sees itself only
            None => Mask::Dense(packed_mask_4d(segment_ids, prefix_ids)),
        };
        self.run_layers(input_ids, position_ids, &mask, None)
    }

    /// Embeds `input_ids` and runs every layer under the attention `mask` (dense boolean
    /// `[batch, 1, seq_len, kv_len]`, or packed rows' blocks), through `cache` when given (dense
    /// masks only); then the final norm.
    /// Sharded (stage 3), each layer is gathered for its turn, and a training forward keeps a
    /// [`Tape`] for [`Model::finish_backward`] instead of a graph through the layers.
    fn run_layers(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        mask: &Mask,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let _root = self.hold_root()?;
        let past = cache.as_ref().map_or(0, |c| c.len);
        let s = input_ids.size()[1];
        let kind = self.embed_tokens.kind();
        let rope = self.rope(position_ids, kind);
        let mask = match mask {
            Mask::Dense(dense) => match sdpa_mask(dense, s, kind) {
                Some(additive) => Mask::Dense(additive),
                None => mask.shallow_clone(),
            },
            Mask::Blocks(_) if cache.is_some() => {
                return Err(Error::invalid(
                    "cache",
                    "a packed forward's blocks cannot write a KV cache",
                ));
            }
            Mask::Blocks(_) => mask.shallow_clone(),
        };
        let mask = &mask;
        if let Some(shards) = &self.shards
            && cache.is_none()
            && crate::ffi::grad_mode_enabled()
        {
            self.hold_train_root(shards)?;
            let (inputs, last) = tch::no_grad(|| -> Result<(Vec<Tensor>, Tensor)> {
                let mut xs = self.embed(input_ids);
                let mut inputs = Vec::with_capacity(self.layers.len());
                for (i, layer) in self.layers.iter().enumerate() {
                    let _layer = self.hold_layer(shards, i, Pass::Forward)?;
                    inputs.push(xs.shallow_clone());
                    xs = layer.forward(&xs, &rope, mask, None);
                }
                Ok((inputs, xs))
            })?;
            let last = last.detach().set_requires_grad(true);
            let out = self.norm.forward(&last);
            self.tapes.borrow_mut().push(Tape {
                input_ids: input_ids.shallow_clone(),
                inputs,
                last,
                rope,
                mask: mask.shallow_clone(),
            });
            return Ok(out);
        }
        let hold = |i: usize| -> Result<Option<Held<'_>>> {
            self.shards
                .as_ref()
                .map(|sh| self.hold_layer(sh, i, Pass::Forward))
                .transpose()
        };
        let mut xs = self.embed(input_ids);
        match cache {
            Some(c) => {
                for (i, layer) in self.layers.iter().enumerate() {
                    let _layer = hold(i)?;
                    xs = layer.forward(&xs, &rope, mask, Some((&c.keys[i], &c.values[i], past)));
                }
                c.len += s;
            }
            None => {
                for (i, layer) in self.layers.iter().enumerate() {
                    let _layer = hold(i)?;
                    xs = layer.forward(&xs, &rope, mask, None);
                }
            }
        }
        Ok(self.norm.forward(&xs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared additive mask is the tensor PyTorch documents SDPA making of a boolean mask
    /// (0 where a key is seen, -inf where not; checked element by element), and SDPA's output
    /// and gradients under it are the boolean mask's. Those are compared within float rounding,
    /// not to the bit: on some CPUs libtorch takes another kernel path for a boolean mask than
    /// for a float one (CI's machine differed in the last bits; this one does not). A libtorch
    /// whose conversion changed meaning (another fill, the mask read the other way) fails here
    /// rather than the results drifting.
    #[test]
    fn the_shared_additive_mask_is_what_sdpa_makes_of_the_boolean_one() {
        // both runs draw the same q, k and v from the global generator: no other test may
        // draw from it in between
        let _generator = crate::hold_generator();
        tch::manual_seed(3);
        let (b, heads, s, d) = (3, 2, 7, 16);
        let opts = (Kind::Float, Device::Cpu);
        // rows left-padded by 0, 2 and 4 tokens
        let pads = Tensor::from_slice(&[0i64, 2, 4]).view([b, 1]);
        let real = Tensor::arange(s, (Kind::Int64, Device::Cpu))
            .view([1, s])
            .ge_tensor(&pads);
        let boolean = attention_mask_4d(&real, s, 0);
        let additive = sdpa_mask(&boolean, s, Kind::Float).expect("a float32 CPU prefill");
        assert_eq!(additive.kind(), Kind::Float);
        assert_eq!(additive.size(), boolean.size());
        let seen = additive.eq(0.0);
        let hidden = additive.eq(f64::NEG_INFINITY);
        assert!(
            seen.equal(&boolean),
            "0 exactly where the boolean mask sees a key"
        );
        assert!(
            hidden.equal(&boolean.logical_not()),
            "-inf exactly where it does not"
        );
        let run = |mask: &Tensor| {
            // the same q, k and v for both masks
            tch::manual_seed(5);
            let [q, k, v] =
                [0, 1, 2].map(|_| Tensor::randn([b, heads, s, d], opts).set_requires_grad(true));
            let ys = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                Some(mask),
                0.0,
                false,
                None,
                false,
            );
            (&ys * &ys).sum(Kind::Float).backward();
            (ys.detach(), q.grad(), k.grad(), v.grad())
        };
        let (ya, qa, ka, va) = run(&boolean);
        let (yb, qb, kb, vb) = run(&additive);
        for (name, x, y) in [
            ("out", ya, yb),
            ("dq", qa, qb),
            ("dk", ka, kb),
            ("dv", va, vb),
        ] {
            assert!(
                x.isfinite().all().int64_value(&[]) == 1,
                "{name} is not finite"
            );
            let scale = x.abs().max().double_value(&[]).max(1.0);
            let diff = (&x - &y).abs().max().double_value(&[]);
            assert!(
                diff <= 1e-5 * scale,
                "{name} differs by {diff} (largest magnitude {scale})"
            );
        }
        // where it does not apply
        assert!(sdpa_mask(&boolean, 1, Kind::Float).is_none());
        assert!(sdpa_mask(&boolean, s, Kind::BFloat16).is_none());
        assert!(sdpa_mask(&additive, s, Kind::Float).is_none());
    }
}

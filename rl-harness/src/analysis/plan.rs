//! `harness plan`: the memory a run of the on-policy trainer needs, estimated from the
//! resolved experiment config and the model's `config.json` alone (no weights are read), so a
//! user knows whether a run fits before starting it.
//!
//! The estimate follows what the code allocates:
//! - **held through the run**: the policy's weights (in `model.dtype`, or bf16 under
//!   `actor.mixed_precision`), its gradients (trainable parameters in the compute dtype, plus
//!   float32 accumulators under mixed precision; allocated by the first backward and kept,
//!   zeroed, afterwards), AdamW's two float32 moments per trainable parameter (plus float32
//!   master weights under mixed precision), the reference model (a full copy for full
//!   fine-tuning when `use_kl_loss` or `use_kl_in_reward`; none with LoRA, whose reference is
//!   the base with its adapters off), the critic when `adv_estimator` needs one (GAE), and a
//!   scoring reward model when `reward_model.enable`;
//! - **one phase at a time** on top of that, the largest of which makes the peak: building
//!   (weights as loaded, optimizer state made before the mixed-precision cast, the
//!   reference's copy, built in the policy's dtype), the rollout (the KV cache of
//!   `data.train_batch_size x rollout.n` rows of prompt + response tokens, the sampler's
//!   `[rows, vocab]` temporaries), the log-prob forwards (no graph: the `[rows, response,
//!   vocab]` logits, log-softmax and entropy in float32), the update (the autograd graph of
//!   one micro-batch: the actor's update is *not* gradient-checkpointed, so every layer's
//!   saved tensors count, plus the float32 log-softmax over the vocabulary and its
//!   gradients), and the optimizer step (float32 temporaries of the largest trained tensor).
//!
//! Left out: libtorch's own memory (code, thread pools, allocator caches and fragmentation),
//! the tokenizer, the dataset and the `Batch` tensors, and sequences shorter than the
//! configured maxima (the estimate uses `data.max_prompt_length + rollout.response_length`
//! for every row, an upper bound).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use rl_workers::{Config, Family, LinearShape, LoraConfig};
use serde_json::{Map, Value};

use crate::config::groups::Dtype;
use crate::config::{ExperimentConfig, TrainerKind};

/// Public Qwen2.5 Instruct shapes for `harness plan --model-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelSize {
    /// Qwen2.5-0.5B-Instruct (494M parameters, tied embeddings).
    #[value(name = "0.5b")]
    Qwen05b,
    /// Qwen2.5-1.5B-Instruct (1.54B parameters, tied embeddings).
    #[value(name = "1.5b")]
    Qwen15b,
    /// Qwen2.5-7B-Instruct (7.62B parameters).
    #[value(name = "7b")]
    Qwen7b,
}

impl ModelSize {
    /// The model's name on the Hugging Face hub.
    pub fn name(self) -> &'static str {
        match self {
            ModelSize::Qwen05b => "Qwen/Qwen2.5-0.5B-Instruct",
            ModelSize::Qwen15b => "Qwen/Qwen2.5-1.5B-Instruct",
            ModelSize::Qwen7b => "Qwen/Qwen2.5-7B-Instruct",
        }
    }

    /// The hyper-parameters of the model's public `config.json` (the keys this estimate reads).
    pub fn config(self) -> Config {
        // (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
        let (hidden, layers, heads, kv, inter, vocab, tied) = match self {
            ModelSize::Qwen05b => (896, 24, 14, 2, 4864, 151_936, true),
            ModelSize::Qwen15b => (1536, 28, 12, 2, 8960, 151_936, true),
            // the 7B's embedding has 152064 rows (its config.json), not the tokenizer's 151936
            ModelSize::Qwen7b => (3584, 28, 28, 4, 18944, 152_064, false),
        };
        let mut extra = Map::new();
        extra.insert("torch_dtype".into(), Value::from("bfloat16"));
        Config {
            architectures: vec!["Qwen2ForCausalLM".into()],
            model_type: "qwen2".into(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv),
            head_dim: None,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 32768,
            tie_word_embeddings: tied,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            initializer_range: 0.02,
            use_sliding_window: false,
            bos_token_id: None,
            eos_token_id: None,
            pad_token_id: None,
            extra,
        }
    }
}

/// What sits on top of the decoder stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// `lm_head` `[vocab, hidden]`, none when the embeddings are tied (`CausalLm`).
    Lm,
    /// A `score` layer `[labels, hidden]` with a bias (`ValueModel`: one label).
    Score {
        /// Output labels.
        labels: i64,
        /// Whether the layer has a bias.
        bias: bool,
    },
}

fn family(cfg: &Config) -> Family {
    cfg.family().unwrap_or(Family::Llama)
}

/// Parameters of one decoder layer.
fn layer_params(cfg: &Config) -> i64 {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.n_kv_heads() * hd);
    let qkv_b = if cfg.qkv_bias() { q + 2 * kv } else { 0 };
    let o_b = if cfg.o_bias() { h } else { 0 };
    let mlp_b = if cfg.mlp_bias { 2 * i + h } else { 0 };
    h * (q + 2 * kv) + qkv_b + q * h + o_b + 3 * h * i + mlp_b + 2 * h
}

/// Parameters of the model without adapters: embeddings, layers, final norm and `head`.
pub fn base_params(cfg: &Config, head: Head) -> i64 {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let head = match head {
        Head::Lm if cfg.tie_word_embeddings => 0,
        Head::Lm => v * h,
        Head::Score { labels, bias } => labels * h + if bias { labels } else { 0 },
    };
    v * h + cfg.num_hidden_layers * layer_params(cfg) + h + head
}

/// The largest single tensor of the model (the embedding, normally).
fn largest_tensor(cfg: &Config) -> i64 {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    (cfg.vocab_size * h)
        .max(h * i)
        .max(h * cfg.num_attention_heads * hd)
}

/// The linear layers `lora` puts adapters on: rl-workers' own selection
/// ([`rl_workers::lora::targets`]), computed from the config; `lm_head` is a candidate for a
/// language model's `head`.
pub fn lora_targets(cfg: &Config, lora: &LoraConfig, head: Head) -> Result<Vec<LinearShape>> {
    Ok(rl_workers::lora::targets(
        cfg,
        lora,
        matches!(head, Head::Lm),
    )?)
}

/// Parameters of the adapters: `A` `[r, in]` and `B` `[out, r]` of each targeted layer.
pub fn lora_params(cfg: &Config, lora: &LoraConfig, head: Head) -> Result<i64> {
    Ok(lora_targets(cfg, lora, head)?
        .iter()
        .map(|l| lora.rank * (l.in_dim + l.out_dim))
        .sum())
}

/// How one trained model (policy or critic) holds its weights.
#[derive(Debug, Clone)]
struct Trained {
    /// Parameters without adapters.
    base: i64,
    /// Adapter parameters (0 without LoRA).
    adapters: i64,
    /// Trained parameters (all, or the adapters plus a trained head).
    trainable: i64,
    /// Bytes per weight while training (the compute dtype).
    weight_bytes: u64,
    /// Bytes per weight as loaded (`model.dtype`), before a mixed-precision cast; a frozen base
    /// under LoRA and mixed precision (the policy's, the critic's) loads straight in bf16
    /// (compose's `frozen_base_kind`; the adapters and a score head, a small share, in float32).
    load_bytes: u64,
    /// Mixed precision: float32 master weights and gradient accumulators.
    mixed: bool,
    lora: Option<LoraConfig>,
}

impl Trained {
    fn params(&self) -> i64 {
        self.base + self.adapters
    }
    fn weights(&self) -> u64 {
        self.params() as u64 * self.weight_bytes
    }
    fn grads(&self) -> u64 {
        self.trainable as u64 * (self.weight_bytes + if self.mixed { 4 } else { 0 })
    }
    /// AdamW's state: two float32 moments, plus float32 masters under mixed precision (the
    /// float32 gradient accumulators are counted with the gradients).
    fn optimizer(&self) -> u64 {
        self.trainable as u64 * if self.mixed { 12 } else { 8 }
    }
    /// What the optimizer allocates when it is built (moments, and under mixed precision the
    /// masters and the accumulators too).
    fn optimizer_at_build(&self) -> u64 {
        self.trainable as u64 * if self.mixed { 16 } else { 8 }
    }
}

fn dtype_bytes(d: Dtype) -> u64 {
    match d {
        Dtype::Float32 => 4,
        Dtype::Bfloat16 => 2,
    }
}

fn dtype_name(bytes: u64) -> &'static str {
    if bytes == 2 { "bf16" } else { "float32" }
}

/// Bytes per element of the weights stored in the checkpoint, from `torch_dtype`.
fn file_bytes(cfg: &Config) -> u64 {
    match cfg.extra.get("torch_dtype").and_then(Value::as_str) {
        Some("bfloat16" | "float16") => 2,
        _ => 4,
    }
}

/// Bytes the update's autograd graph keeps per token and decoder layer, in compute dtype
/// `c` bytes, as rl-workers' `DecoderLayer::forward` records it:
/// - each RMSNorm: its float32 input (`4h`; the residual stream itself under float32), the
///   normalised states before and after the weight (`2ch`);
/// - attention: q, k, v (`c(nh + 2nkv)hd`), RoPE's `rotate_half` copies and rotated q, k
///   (`2c(nh + nkv)hd`), the attention output and its contiguous reshape for `o_proj`
///   (`2c nh hd`), the kernel's float32 log-sum-exp (`4nh`);
/// - the MLP: gate, `silu(gate)`, up and their product (`4ci`).
fn layer_bytes_per_token(cfg: &Config, c: u64) -> u64 {
    let (h, i, hd) = (
        cfg.hidden_size as u64,
        cfg.intermediate_size as u64,
        cfg.head_dim() as u64,
    );
    let (nh, nkv) = (cfg.num_attention_heads as u64, cfg.n_kv_heads() as u64);
    let norms = 2 * (4 * h + 2 * c * h);
    let attention = c * ((nh + 2 * nkv) * hd + 2 * (nh + nkv) * hd + 2 * nh * hd) + 4 * nh;
    norms + attention + 4 * c * i
}

/// What each adapter adds to the graph per token: its `[r]` intermediate, and with dropout the
/// mask and the dropped input (`[in]` each).
fn adapter_bytes_per_token(targets: &[LinearShape], lora: &LoraConfig, c: u64) -> u64 {
    targets
        .iter()
        .map(|l| {
            let dropout = if lora.dropout > 0.0 {
                2 * c * l.in_dim as u64
            } else {
                0
            };
            c * lora.rank as u64 + dropout
        })
        .sum()
}

/// One line of the estimate: what, how many bytes, how it was counted.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// What it is.
    pub what: String,
    /// Bytes.
    pub bytes: u64,
    /// The arithmetic.
    pub how: String,
}

fn line(what: &str, bytes: u64, how: impl Into<String>) -> Line {
    Line {
        what: what.into(),
        bytes,
        how: how.into(),
    }
}

/// The estimate for one config.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Lines describing the model and the shapes.
    pub header: Vec<String>,
    /// Parameters of the policy, with adapters.
    pub params: i64,
    /// Trained parameters of the policy.
    pub trainable: i64,
    /// What stays allocated through the run.
    pub held: Vec<Line>,
    /// Building: the largest moment while the models and optimizers are made (absolute).
    pub building: Line,
    /// The phases of a step, each on top of `held`.
    pub phases: Vec<Line>,
    /// The peak: the larger of building and `held` plus the largest phase.
    pub peak: u64,
    /// The phase that makes the peak.
    pub peak_phase: String,
}

impl Plan {
    /// Bytes held through the run.
    pub fn held_bytes(&self) -> u64 {
        self.held.iter().map(|l| l.bytes).sum()
    }

    /// The table `harness plan` prints.
    pub fn render(&self) -> String {
        let mut s = String::new();
        for h in &self.header {
            let _ = writeln!(s, "{h}");
        }
        let pct = 100.0 * self.trainable as f64 / self.params.max(1) as f64;
        let _ = writeln!(
            s,
            "\nparameters {} total, {} trainable ({pct:.2}%)",
            count(self.params),
            count(self.trainable)
        );
        let _ = writeln!(s, "\nheld through the run");
        for l in &self.held {
            let b = if l.bytes == 0 {
                "-".to_string()
            } else {
                bytes(l.bytes)
            };
            let _ = writeln!(s, "  {:<22} {:>11}  {}", l.what, b, l.how);
        }
        let _ = writeln!(s, "  {:<22} {:>11}", "subtotal", bytes(self.held_bytes()));
        let _ = writeln!(s, "\nphases (each on top of what is held; one at a time)");
        for l in &self.phases {
            let _ = writeln!(
                s,
                "  {:<22} {:>11}  {}",
                l.what,
                format!("+{}", bytes(l.bytes)),
                l.how
            );
        }
        let b = &self.building;
        let _ = writeln!(
            s,
            "  {:<22} {:>11}  {} (in all, not on top)",
            b.what,
            bytes(b.bytes),
            b.how
        );
        let _ = writeln!(
            s,
            "\npeak estimate {} ({} bytes), during {}",
            bytes(self.peak),
            self.peak,
            self.peak_phase
        );
        let _ = writeln!(
            s,
            "left out: libtorch's own memory (its code, thread pools, allocator caches and \
             fragmentation), the tokenizer, the dataset and the batch tensors; every sequence is \
             counted at the configured maxima (max_prompt_length + response_length), an upper \
             bound"
        );
        s
    }
}

/// `1,234,567`.
fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// `512.0 MiB`, `2.51 GiB`.
pub fn bytes(b: u64) -> String {
    let mib = b as f64 / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.2} GiB", mib / 1024.0)
    } else {
        format!("{mib:.1} MiB")
    }
}

/// `134.5M`, `7.62B`.
fn short(n: i64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}K", n / 1e3)
    } else {
        format!("{n}")
    }
}

/// The models whose shapes the estimate reads.
#[derive(Debug, Clone)]
pub struct Models {
    /// The policy's `config.json` (or a `--model-size` shape).
    pub policy: Config,
    /// Where it came from, for the header.
    pub policy_source: String,
    /// The critic's, when the estimator needs one.
    pub critic: Option<Config>,
    /// The scoring reward model's, when `reward_model.enable`.
    pub reward: Option<Config>,
}

/// The estimate for `exp` with the models' shapes `m`.
pub fn estimate(exp: &ExperimentConfig, m: &Models) -> Result<Plan> {
    if exp.trainer.algorithm != TrainerKind::OnPolicy {
        bail!(
            "harness plan estimates the on-policy trainer (trainer.algorithm = \"on_policy\": PPO, \
             GRPO and their family); this config's trainer.algorithm is {:?}",
            exp.trainer.algorithm
        );
    }
    let arr = &exp.actor_rollout_ref;
    let cfg = &m.policy;
    let model_bytes = dtype_bytes(arr.model.dtype);
    let lora = match &arr.model.lora_adapter_path {
        Some(dir) => Some(rl_workers::lora::read_adapter_config(dir).with_context(|| {
            format!(
                "actor_rollout_ref.model.lora_adapter_path {}",
                dir.display()
            )
        })?),
        None => arr.model.lora()?,
    };
    let trained = |cfg: &Config,
                   head: Head,
                   lora: Option<LoraConfig>,
                   mixed: bool,
                   keep: i64|
     -> Result<Trained> {
        let base = base_params(cfg, head);
        let adapters = match &lora {
            Some(l) => lora_params(cfg, l, head)?,
            None => 0,
        };
        Ok(Trained {
            base,
            adapters,
            trainable: if lora.is_some() {
                adapters + keep
            } else {
                base
            },
            weight_bytes: if mixed { 2 } else { model_bytes },
            load_bytes: if lora.is_some() && mixed {
                2
            } else {
                model_bytes
            },
            mixed,
            lora,
        })
    };
    let policy = trained(
        cfg,
        Head::Lm,
        lora.clone(),
        arr.actor.mixed_precision.enabled(),
        0,
    )?;
    let c = policy.weight_bytes;
    let (h, v) = (cfg.hidden_size as u64, cfg.vocab_size as u64);
    let layers = cfg.num_hidden_layers as u64;

    // shapes
    let n = arr.rollout.n as u64;
    let prompts = exp.data.train_batch_size as u64;
    let rows = prompts * n;
    let prompt_len = exp.data.max_prompt_length as u64;
    let resp = arr.rollout.response_length.max(0) as u64;
    let seq = prompt_len + resp;
    let mini_rows = arr.actor.ppo_mini_batch_size as u64 * n;
    // tokens of one update micro-batch, and its rows at full length
    let (micro_tokens, micro_what) = if arr.actor.use_dynamic_bsz {
        let t = (arr.actor.ppo_max_token_len_per_gpu as u64).min(mini_rows * seq);
        (t, format!("{t} tokens (ppo_max_token_len_per_gpu)"))
    } else {
        let r = arr
            .actor
            .ppo_micro_batch_size_per_gpu
            .map_or(mini_rows, |r| r as u64)
            .min(mini_rows);
        (r * seq, format!("{r} rows x {seq} tokens"))
    };
    let micro_rows = micro_tokens.div_ceil(seq.max(1));
    let lp_rows = arr
        .actor
        .log_prob_micro_batch_size_per_gpu
        .map_or(rows, |r| r as u64)
        .min(rows);
    let need_ref = arr.actor_loss.use_kl_loss || exp.algorithm.use_kl_in_reward;
    let ref_copy = need_ref && policy.lora.is_none();
    let ref_rows = arr
        .ref_micro_batch_size
        .map_or(rows, |r| r as u64)
        .min(rows);
    let entropy = arr.actor_loss.entropy_coeff != 0.0;

    let mut header = vec![
        format!(
            "model    {}: {}, {} layers, hidden {}, {} heads ({} kv) x {}, intermediate {}, vocab {}{}",
            m.policy_source,
            family(cfg).model_type(),
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.n_kv_heads(),
            cfg.head_dim(),
            cfg.intermediate_size,
            cfg.vocab_size,
            if cfg.tie_word_embeddings {
                ", tied embeddings"
            } else {
                ""
            }
        ),
        format!(
            "training {}, weights {}{}",
            match &policy.lora {
                Some(l) => format!(
                    "LoRA r={} on {} layers (alpha {}{})",
                    l.rank,
                    lora_targets(cfg, l, Head::Lm)?.len(),
                    l.alpha,
                    if l.dropout > 0.0 {
                        format!(", dropout {}", l.dropout)
                    } else {
                        String::new()
                    }
                ),
                None => "full fine-tuning".into(),
            },
            dtype_name(c),
            if policy.mixed {
                " with float32 master weights (actor.mixed_precision.param_dtype = bf16)"
            } else {
                " (actor_rollout_ref.model.dtype)"
            }
        ),
        format!(
            "shapes   rollout {rows} rows ({prompts} prompts x n {n}) x {seq} tokens ({prompt_len} prompt + {resp} response); \
             update micro-batch {micro_what}; log-prob micro-batch {lp_rows} rows"
        ),
    ];

    // held through the run
    let p = policy.params();
    let mut held = vec![
        line(
            "policy weights",
            policy.weights(),
            format!("{} x {c} B ({})", short(p), dtype_name(c)),
        ),
        line(
            "policy gradients",
            policy.grads(),
            if policy.mixed {
                format!(
                    "{} trainable x (2 B bf16 + 4 B float32 accumulator)",
                    short(policy.trainable)
                )
            } else {
                format!("{} trainable x {c} B", short(policy.trainable))
            },
        ),
        line(
            "optimizer state",
            policy.optimizer(),
            if policy.mixed {
                format!(
                    "{} trainable x (2 AdamW moments + master weights) x 4 B",
                    short(policy.trainable)
                )
            } else {
                format!(
                    "{} trainable x 2 AdamW moments x 4 B",
                    short(policy.trainable)
                )
            },
        ),
    ];
    held.push(if ref_copy {
        line(
            "reference model",
            policy.base as u64 * c,
            format!(
                "a frozen copy, {} x {c} B ({})",
                short(policy.base),
                if arr.actor_loss.use_kl_loss {
                    "use_kl_loss"
                } else {
                    "use_kl_in_reward"
                }
            ),
        )
    } else if need_ref {
        line(
            "reference model",
            0,
            "none: the LoRA policy's base with its adapters off",
        )
    } else {
        line("reference model", 0, "none: no KL term")
    });
    let critic = if exp.algorithm.adv_estimator.needs_critic() {
        let ccfg = m
            .critic
            .as_ref()
            .context("the critic's config.json (adv_estimator = gae)")?;
        let keep = cfg.hidden_size + 1;
        let t = trained(
            ccfg,
            Head::Score {
                labels: 1,
                bias: true,
            },
            exp.critic.model.lora("critic.model")?,
            exp.critic.worker.mixed_precision.enabled(),
            keep,
        )?;
        held.push(line(
            "critic",
            t.weights() + t.grads() + t.optimizer(),
            format!(
                "{} weights x {} B + gradients and optimizer state of {} trainable{}",
                short(t.params()),
                t.weight_bytes,
                short(t.trainable),
                if t.mixed { " (mixed precision)" } else { "" }
            ),
        ));
        Some((t, ccfg.clone()))
    } else {
        held.push(line("critic", 0, "none: adv_estimator needs no critic"));
        None
    };
    let reward_weights = match (&m.reward, exp.reward_model.own.enable) {
        (Some(rcfg), true) => {
            let p = base_params(
                rcfg,
                Head::Score {
                    labels: rcfg.num_labels(),
                    bias: false,
                },
            );
            held.push(line(
                "reward model",
                p as u64 * model_bytes,
                format!("{} x {model_bytes} B (scoring only)", short(p)),
            ));
            p as u64 * model_bytes
        }
        _ => 0,
    };

    // phases on top
    let kv_heads = cfg.n_kv_heads() as u64;
    let hd = cfg.head_dim() as u64;
    let kv = 2 * layers * kv_heads * hd * rows * seq * c;
    let sampling = rows * v * 28;
    let rollout_how = format!(
        "KV cache 2 x {layers} layers x {kv_heads} kv heads x {hd} x {rows} rows x {seq} tokens x {c} B = {}; \
         sampling {rows} rows x {v} vocab x 28 B (float32 logits, log-softmax, probabilities, float64 cumulative sum)",
        bytes(kv)
    );
    let mut phases = if exp.async_training.enable {
        // the background rollout generates beside every phase of the step: held, not a phase
        held.push(line(
            "background rollout",
            policy.weights() + policy.trainable as u64 * c + kv + sampling,
            format!(
                "async_training: a replica of the policy ({} x {c} B), a snapshot of the trained \
                 variables in flight ({} x {c} B), and its generation beside the update: {rollout_how}",
                short(policy.params()),
                short(policy.trainable)
            ),
        ));
        vec![line(
            "rollout",
            0,
            "in the background thread (async_training): counted as held",
        )]
    } else {
        vec![line("rollout", kv + sampling, rollout_how)]
    };
    // a forward without a graph holds about one layer's temporaries (the MLP's four
    // [rows, seq, intermediate] tensors) and the float32 logits, log-softmax and entropy terms
    let one_layer = |r: u64| r * seq * (4 * cfg.intermediate_size as u64 + 4 * h) * c;
    let lp = |r: u64, per: u64| r * resp * v * per + one_layer(r);
    phases.push(line(
        "log-prob forward",
        lp(lp_rows, 16).max(if need_ref { lp(ref_rows, 8) } else { 0 }),
        format!(
            "{lp_rows} rows: logits [{lp_rows}, {resp}, {v}] x 16 B (float32 logits, log-softmax, \
             entropy terms) + one layer's temporaries"
        ),
    ));
    let targets = match &policy.lora {
        Some(l) => lora_targets(cfg, l, Head::Lm)?,
        None => Vec::new(),
    };
    let per_token = layers * layer_bytes_per_token(cfg, c)
        + policy
            .lora
            .as_ref()
            .map_or(0, |l| adapter_bytes_per_token(&targets, l, c))
        // the final norm's saved tensors
        + 4 * h + 2 * c * h;
    let acts = micro_tokens * per_token;
    let logit_bytes = if entropy { 20 } else { 12 };
    let logits = micro_rows * resp * v * logit_bytes;
    phases.push(line(
        "update",
        acts + logits,
        format!(
            "the autograd graph of one micro-batch ({micro_what}; the update is not gradient-checkpointed): \
             {layers} layers x {} B per token (+ adapters, final norm) = {}; log-softmax over the vocabulary and its gradients \
             [{micro_rows}, {resp}, {v}] x {logit_bytes} B = {}",
            layer_bytes_per_token(cfg, c),
            bytes(acts),
            bytes(logits)
        ),
    ));
    if let Some((t, ccfg)) = &critic {
        let crows = exp
            .critic
            .worker
            .ppo_micro_batch_size_per_gpu
            .map_or(exp.critic.worker.ppo_mini_batch_size as u64 * n, |r| {
                r as u64
            });
        let cc = t.weight_bytes;
        let ctargets = match &t.lora {
            Some(l) => lora_targets(
                ccfg,
                l,
                Head::Score {
                    labels: 1,
                    bias: true,
                },
            )?,
            None => Vec::new(),
        };
        let per = ccfg.num_hidden_layers as u64 * layer_bytes_per_token(ccfg, cc)
            + t.lora
                .as_ref()
                .map_or(0, |l| adapter_bytes_per_token(&ctargets, l, cc));
        phases.push(line(
            "critic update",
            crows * seq * per,
            format!(
                "the autograd graph of {crows} rows x {seq} tokens x {} layers",
                ccfg.num_hidden_layers
            ),
        ));
    }
    let largest_trained = if let Some(l) = &policy.lora {
        targets
            .iter()
            .map(|t| (t.in_dim.max(t.out_dim) * l.rank) as u64)
            .max()
            .unwrap_or(0)
    } else {
        largest_tensor(cfg) as u64
    };
    phases.push(line(
        "optimizer step",
        // AdamW::step holds three float32 tensors of a parameter's size at once (the
        // denominator, the update, the new value), one parameter at a time
        largest_trained * 3 * 4,
        format!(
            "AdamW's float32 temporaries (denominator, update, new value) of the largest trained tensor ({} x 3 x 4 B)",
            short(largest_trained as i64)
        ),
    ));

    // building, in compose's order: the policy (and its adapters) loaded in model.dtype, the
    // critic loaded, the actor's optimizer (made before the mixed-precision cast), the
    // reference's copy (allocated in the policy's dtype, nothing drawn), the critic's optimizer
    // loading the largest tensor of `cfg` into `load` bytes a weight (the policy's base may
    // load in bf16: LoRA with mixed precision)
    let load_transient = |cfg: &Config, load: u64| {
        let f = file_bytes(cfg);
        largest_tensor(cfg) as u64 * (2 * f + if f != load { load } else { 0 })
    };
    let critic_loaded = critic
        .as_ref()
        .map_or(0, |(t, _)| t.params() as u64 * t.load_bytes);
    let policy_loaded = policy.params() as u64 * policy.load_bytes;
    let mut moments = vec![
        policy_loaded + load_transient(cfg, policy.load_bytes),
        policy_loaded + critic_loaded + policy.optimizer_at_build() + reward_weights,
    ];
    if let Some((t, ccfg)) = &critic {
        moments.push(policy_loaded + critic_loaded + load_transient(ccfg, t.load_bytes));
    }
    let after_cast = policy.weights() + critic_loaded + policy.optimizer_at_build();
    if ref_copy {
        moments.push(after_cast + policy.base as u64 * c);
    }
    if let Some((t, _)) = &critic {
        moments.push(
            after_cast
                + if ref_copy { policy.base as u64 * c } else { 0 }
                + t.optimizer_at_build()
                + reward_weights,
        );
    }
    let building_bytes = moments.into_iter().max().unwrap_or(0);
    let building = line(
        "building",
        building_bytes,
        format!(
            "weights as loaded ({}){}{}",
            dtype_name(policy.load_bytes),
            if policy.mixed {
                ", optimizer state made before the bf16 cast"
            } else {
                ", optimizer state"
            },
            if ref_copy {
                ", the reference's copy"
            } else {
                ""
            }
        ),
    );

    let held_bytes: u64 = held.iter().map(|l| l.bytes).sum();
    let top = phases
        .iter()
        .max_by_key(|l| l.bytes)
        .cloned()
        .unwrap_or_else(|| line("-", 0, ""));
    let (peak, peak_phase) = if building.bytes > held_bytes + top.bytes {
        (building.bytes, "building".to_string())
    } else {
        (held_bytes + top.bytes, top.what.clone())
    };
    if let Some(l) = &policy.lora {
        header.push(format!(
            "adapters {} A and B matrices of rank {}",
            targets.len(),
            l.rank
        ));
    }
    Ok(Plan {
        header,
        params: p,
        trainable: policy.trainable,
        held,
        building,
        phases,
        peak,
        peak_phase,
    })
}

/// `config.json` of a model folder.
fn read_config(dir: &Path, key: &str) -> Result<Config> {
    let path = dir.join(rl_workers::CONFIG_JSON);
    Config::from_file(&path).with_context(|| format!("config key `{key}`: {}", path.display()))
}

/// The models' shapes for `exp`: from the folders' `config.json`, or the policy (and a critic
/// defaulting to it) from `size`.
pub fn models(exp: &ExperimentConfig, size: Option<ModelSize>) -> Result<Models> {
    let policy_dir = &exp.actor_rollout_ref.model.path;
    let (policy, policy_source) = match size {
        Some(s) => (s.config(), format!("{} (--model-size)", s.name())),
        None => (
            read_config(policy_dir, "actor_rollout_ref.model.path")?,
            policy_dir
                .join(rl_workers::CONFIG_JSON)
                .display()
                .to_string(),
        ),
    };
    let critic = if exp.algorithm.adv_estimator.needs_critic() {
        Some(match &exp.critic.model.path {
            Some(dir) => read_config(dir, "critic.model.path")?,
            None => policy.clone(),
        })
    } else {
        None
    };
    let reward = match (
        &exp.reward_model.own.model.path,
        exp.reward_model.own.enable,
    ) {
        (Some(dir), true) => Some(read_config(dir, "reward_model.model.path")?),
        _ => None,
    };
    Ok(Models {
        policy,
        policy_source,
        critic,
        reward,
    })
}

/// `harness plan CONFIG [overrides] [--model-size S]`: prints the estimate.
pub fn run(
    config: PathBuf,
    overrides: Vec<crate::config::Override>,
    size: Option<ModelSize>,
) -> Result<()> {
    let exp = crate::config::load(&crate::config::Sources {
        file: Some(config.clone()),
        env: true,
        overrides,
    })?;
    crate::config::checks::check(&exp)?;
    let plan = estimate(&exp, &models(&exp, size)?)?;
    let name = |v: serde_json::Result<Value>| match v {
        Ok(Value::String(s)) => s,
        _ => "?".into(),
    };
    outln!(
        "harness plan: {} (trainer.algorithm {}, adv_estimator {})",
        config.display(),
        name(serde_json::to_value(exp.trainer.algorithm)),
        name(serde_json::to_value(exp.algorithm.adv_estimator))
    );
    out!("{}", plan.render());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rl_workers::{CausalLm, TargetModules};
    use tch::{Device, Kind};

    fn numel(vs: &tch::nn::VarStore, pick: impl Fn(&str) -> bool) -> i64 {
        vs.variables()
            .iter()
            .filter(|(n, _)| pick(n))
            .map(|(_, t)| t.numel() as i64)
            .sum()
    }

    fn qwen_tiny() -> Config {
        let mut c = Config::tiny();
        c.architectures = vec!["Qwen2ForCausalLM".into()];
        c.model_type = "qwen2".into();
        c
    }

    fn lora(rank: i64, targets: TargetModules, exclude: &[&str]) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 16.0,
            target_modules: targets,
            exclude_modules: exclude.iter().map(|s| s.to_string()).collect(),
            dropout: 0.0,
            use_rslora: false,
        }
    }

    fn names(n: &[&str]) -> TargetModules {
        TargetModules::Names(n.iter().map(|s| s.to_string()).collect())
    }

    /// The parameter count is what rl-workers builds (Llama, tied or not, and Qwen2's biases).
    #[test]
    fn parameter_count_matches_the_built_model() {
        let mut tied = Config::tiny();
        tied.tie_word_embeddings = true;
        let mut biased = Config::tiny();
        biased.attention_bias = true;
        biased.mlp_bias = true;
        for cfg in [Config::tiny(), tied, qwen_tiny(), biased] {
            let lm = CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap();
            assert_eq!(
                base_params(&cfg, Head::Lm),
                numel(lm.var_store(), |_| true),
                "{cfg:?}"
            );
        }
    }

    /// The LoRA trainable count equals the `.lora_` variables rl-workers creates, for
    /// all-linear, a suffix list, a full name and exclusions.
    #[test]
    fn lora_count_matches_the_adapters_rl_workers_creates() {
        for (cfg, l) in [
            (Config::tiny(), lora(16, TargetModules::AllLinear, &[])),
            (qwen_tiny(), lora(4, TargetModules::AllLinear, &[])),
            (Config::tiny(), lora(8, names(&["q_proj", "v_proj"]), &[])),
            // the head, untied and tied to the embedding
            (Config::tiny(), lora(4, names(&["q_proj", "lm_head"]), &[])),
            (
                Config {
                    tie_word_embeddings: true,
                    ..qwen_tiny()
                },
                lora(4, names(&["lm_head"]), &[]),
            ),
            (
                Config::tiny(),
                lora(2, names(&["layers.1.mlp.down_proj", "k_proj"]), &[]),
            ),
            (
                Config::tiny(),
                lora(
                    3,
                    TargetModules::AllLinear,
                    &["layers.0.self_attn.q_proj", "gate_proj"],
                ),
            ),
        ] {
            let mut lm = CausalLm::new(&cfg, Device::Cpu, Kind::Float).unwrap();
            lm.add_lora(&l).unwrap();
            let created = numel(lm.var_store(), |n| n.contains(".lora_"));
            // what AdamW trains: the variables that require a gradient
            let trainable: i64 = lm
                .var_store()
                .variables()
                .values()
                .filter(|t| t.requires_grad())
                .map(|t| t.numel() as i64)
                .sum();
            assert_eq!(lora_params(&cfg, &l, Head::Lm).unwrap(), created, "{l:?}");
            assert_eq!(created, trainable, "{l:?}");
        }
        // a key matching nothing is refused, as add_lora refuses it
        let bad = lora(4, names(&["c_attn"]), &[]);
        assert!(lora_params(&Config::tiny(), &bad, Head::Lm).is_err());
        let mut lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
        assert!(lm.add_lora(&bad).is_err());
    }

    /// The critic's head: `score` `[1, hidden]` plus its bias, no `lm_head`.
    #[test]
    fn critic_count_matches_the_value_model() {
        let cfg = Config::tiny();
        let vm = rl_workers::ValueModel::new(&cfg, Device::Cpu, Kind::Float).unwrap();
        assert_eq!(
            base_params(
                &cfg,
                Head::Score {
                    labels: 1,
                    bias: true
                }
            ),
            numel(vm.var_store(), |_| true)
        );
    }

    /// The Qwen2.5 shapes give the published parameter counts.
    #[test]
    fn qwen_sizes_have_their_published_parameter_counts() {
        for (size, want) in [
            (ModelSize::Qwen05b, 494_032_768),
            (ModelSize::Qwen15b, 1_543_714_304),
            (ModelSize::Qwen7b, 7_615_616_512),
        ] {
            let cfg = size.config();
            cfg.family().unwrap();
            assert_eq!(base_params(&cfg, Head::Lm), want, "{size:?}");
        }
    }

    fn grpo(lora_rank: i64, mixed: bool) -> ExperimentConfig {
        let mut exp = ExperimentConfig::default();
        exp.trainer.algorithm = TrainerKind::OnPolicy;
        exp.algorithm.adv_estimator = rl_algos::AdvEstimator::Grpo;
        exp.data.train_batch_size = 8;
        exp.data.max_prompt_length = 64;
        let arr = &mut exp.actor_rollout_ref;
        arr.rollout.n = 4;
        arr.rollout.response_length = 32;
        arr.actor.ppo_mini_batch_size = 8;
        arr.actor.ppo_micro_batch_size_per_gpu = Some(8);
        arr.actor_loss.use_kl_loss = true;
        arr.model.lora_rank = lora_rank;
        if mixed {
            arr.actor.mixed_precision.param_dtype = rl_workers::roles::ParamDtype::Bf16;
        }
        exp
    }

    fn held(plan: &Plan, what: &str) -> u64 {
        plan.held.iter().find(|l| l.what == what).unwrap().bytes
    }

    /// Asynchronous training holds a replica of the policy, a snapshot of what trains, and the
    /// rollout's cache beside every phase: its bytes move from the rollout phase to held.
    #[test]
    fn async_training_holds_the_replica_and_the_rollout() {
        let cfg = ModelSize::Qwen05b.config();
        let p = base_params(&cfg, Head::Lm) as u64;
        for (lora, mixed) in [(0, false), (16, true)] {
            let sync_cfg = grpo(lora, mixed);
            let mut async_cfg = sync_cfg.clone();
            async_cfg.async_training.enable = true;
            let sync = estimate(&sync_cfg, &models(cfg.clone())).unwrap();
            let asynchronous = estimate(&async_cfg, &models(cfg.clone())).unwrap();
            let rollout = |plan: &Plan| {
                plan.phases
                    .iter()
                    .find(|l| l.what == "rollout")
                    .unwrap()
                    .bytes
            };
            let c = if mixed { 2 } else { 4 };
            // LoRA: the base and the adapters (what trains); full: the base, all of it trained
            let replica = c * (p + if lora > 0 { sync.trainable as u64 } else { 0 });
            assert_eq!(
                held(&asynchronous, "background rollout"),
                replica + c * sync.trainable as u64 + rollout(&sync),
                "lora {lora}, mixed {mixed}"
            );
            assert_eq!(rollout(&asynchronous), 0);
            assert!(asynchronous.peak > sync.peak);
        }
    }

    fn models(cfg: Config) -> Models {
        Models {
            policy: cfg,
            policy_source: "test".into(),
            critic: None,
            reward: None,
        }
    }

    /// Full fine-tuning in float32: 8 B of AdamW state and 4 B of gradient per parameter, and
    /// a float32 reference copy; mixed precision adds 4 B of masters to the optimizer and 4 B
    /// of float32 accumulators to the 2 B bf16 gradient, and halves the weights and reference.
    #[test]
    fn optimizer_and_gradient_bytes() {
        let cfg = ModelSize::Qwen05b.config();
        let p = base_params(&cfg, Head::Lm) as u64;
        let full = estimate(&grpo(0, false), &models(cfg.clone())).unwrap();
        assert_eq!(held(&full, "optimizer state"), 8 * p);
        assert_eq!(held(&full, "policy gradients"), 4 * p);
        assert_eq!(held(&full, "policy weights"), 4 * p);
        assert_eq!(held(&full, "reference model"), 4 * p);
        let mixed = estimate(&grpo(0, true), &models(cfg.clone())).unwrap();
        assert_eq!(held(&mixed, "optimizer state"), 12 * p);
        assert_eq!(held(&mixed, "policy gradients"), 6 * p);
        assert_eq!(held(&mixed, "policy weights"), 2 * p);
        assert_eq!(held(&mixed, "reference model"), 2 * p);
        // LoRA: the adapters alone train; the reference is the base, no copy
        let l = estimate(&grpo(16, false), &models(cfg.clone())).unwrap();
        let adapters = lora_params(
            &cfg,
            &grpo(16, false)
                .actor_rollout_ref
                .model
                .lora()
                .unwrap()
                .unwrap(),
            Head::Lm,
        )
        .unwrap() as u64;
        assert_eq!(l.trainable as u64, adapters);
        assert_eq!(held(&l, "optimizer state"), 8 * adapters);
        assert_eq!(held(&l, "reference model"), 0);
        assert_eq!(held(&l, "policy weights"), 4 * (p + adapters));
        // all-linear r=16 on 24 layers: 16 x (in + out) summed over q, k, v, o, gate, up, down
        let per_layer = 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896) + 3 * (896 + 4864));
        assert_eq!(adapters, 24 * per_layer);
        // the peak is held plus the largest phase, or building
        for plan in [&full, &mixed, &l] {
            let top = plan.phases.iter().map(|l| l.bytes).max().unwrap();
            assert_eq!(
                plan.peak,
                (plan.held_bytes() + top).max(plan.building.bytes)
            );
        }
    }

    /// The rollout's KV cache: 2 x layers x kv heads x head_dim x rows x tokens x bytes.
    #[test]
    fn kv_cache_bytes() {
        let cfg = ModelSize::Qwen7b.config();
        let plan = estimate(&grpo(0, false), &models(cfg)).unwrap();
        let rollout = plan.phases.iter().find(|l| l.what == "rollout").unwrap();
        let kv = 2 * 28 * 4 * 128 * 32 * (64 + 32) * 4;
        assert_eq!(rollout.bytes, kv + 32 * 152_064 * 28);
    }

    #[test]
    fn other_trainers_are_refused() {
        let mut exp = grpo(0, false);
        exp.trainer.algorithm = TrainerKind::Sft;
        let err = estimate(&exp, &models(Config::tiny())).unwrap_err();
        assert!(err.to_string().contains("on-policy"), "{err}");
    }

    #[test]
    fn formats() {
        assert_eq!(count(1_234_567), "1,234,567");
        assert_eq!(count(12), "12");
        assert_eq!(bytes(512 << 20), "512.0 MiB");
        assert_eq!(bytes(3 << 30), "3.00 GiB");
    }
}

//! The batched rollout engine: KV-cached generation over left-padded prompts with greedy,
//! temperature, top-k and top-p sampling, `n` samples per prompt, per-row stops, and verl's
//! output keys (`prompts`, `responses`, `input_ids`, `attention_mask`, `position_ids`,
//! `response_mask`, `rollout_log_probs`).
//!
//! # Reproducibility
//! Sampling never touches libtorch's global generator. Each output row `r` draws its uniforms
//! from its own ChaCha8 stream seeded by [`GenerateOptions::seed`] with stream id
//! `row_offset + r` ([`GenerateOptions::row_offset`]: a data-parallel rank passes the global
//! index of its first row, so a row samples the same tokens whichever rank holds it), and picks
//! its token by inverse CDF over the processed distribution. So the same model, prompts,
//! config and seed give the same tokens on the same device and thread count, whatever else
//! seeds `tch::manual_seed`, and a row's samples do not depend on when other rows finish.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{Error, Result, expect_dims, expect_kind};
use crate::gemm::PackedWeights;
use crate::heads::CausalLm;
use crate::model::KvCache;

/// The values of `actor_rollout_ref.rollout.name`: the server API of `server_url` (`vllm`,
/// `sglang`), or `hf` (verl's in-process Hugging Face rollout; here the built-in engine).
pub(crate) const ROLLOUT_NAMES: &[&str] = &["vllm", "sglang", "hf"];

/// Sampling settings of the rollout, with verl's names and defaults
/// (`actor_rollout_ref.rollout`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Responses sampled per prompt (rows are repeated interleaved: prompt 0 n times, then 1...); >= 1.
    pub n: usize,
    /// Softmax temperature, > 0 when sampling; 0 means greedy.
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens; -1 (or 0) = off.
    pub top_k: i64,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`, in (0, 1].
    pub top_p: f64,
    /// Maximum new tokens per response (= `max_new_tokens`); responses are padded to it.
    pub response_length: i64,
    /// Sample (true) or decode greedily (false).
    pub do_sample: bool,
    /// Base seed of the sampler; see [`RolloutConfig::seed_for`].
    pub seed: u64,
    /// Log the `rollout_corr/*` diagnostics of the rollout against the trained policy even with
    /// rollout correction off (verl's switch for returning the rollout's own log-probs, which
    /// are always returned here). Default false.
    pub calculate_log_probs: bool,
    /// For testing rollout correction only: Gaussian noise of this standard deviation is added
    /// to the returned `rollout_log_probs` (on response tokens, seeded by the generation's
    /// seed), as if an engine computed them differently from the trainer; >= 0. Default 0.
    pub debug_logprob_noise: f64,
    /// Which engine's API the servers of `server_url` speak (verl's key and default): `vllm`
    /// (weights synced through vLLM's RL control plane: `/pause`, `/start_weight_update`,
    /// `/update_weights` from a safetensors folder, `/finish_weight_update`, `/resume`, then
    /// `/weight_checker`'s digests compared with the folder's), `sglang` (SGLang's
    /// `/update_weights_from_disk`), or `hf`; `harness serve` speaks both. Without
    /// `server_url` the rollout runs in-process whatever the name.
    pub name: String,
    /// Generate on these OpenAI-compatible servers instead of the in-process engine (one
    /// request a prompt, round-robin), syncing the policy's weights into them before each
    /// step's generation through the API `name` says (`http://HOST:PORT`, without `/v1`).
    /// Empty (the default): in-process.
    pub server_url: Vec<String>,
    /// Seconds a server may take over one call (a generation or a weight sync) before the step
    /// fails naming it; > 0. Default 600.
    pub server_timeout_s: f64,
    /// Where the policy's weights are written for the servers to load (a folder they can
    /// read: the same machine, or a shared file system). Default: a folder under the system's
    /// temporary directory, one per process.
    pub weight_sync_dir: Option<std::path::PathBuf>,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            n: 1,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            response_length: 512,
            do_sample: true,
            seed: 0,
            calculate_log_probs: false,
            debug_logprob_noise: 0.0,
            name: "vllm".to_owned(),
            server_url: Vec::new(),
            server_timeout_s: 600.0,
            weight_sync_dir: None,
        }
    }
}

impl RolloutConfig {
    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, reason: String| Err(Error::invalid(name, reason));
        if self.n == 0 {
            return bad("n", "must be at least 1".to_owned());
        }
        if self.response_length < 1 {
            return bad(
                "response_length",
                format!("must be at least 1, got {}", self.response_length),
            );
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "temperature",
                format!("must be >= 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(self.debug_logprob_noise >= 0.0 && self.debug_logprob_noise.is_finite()) {
            return bad(
                "debug_logprob_noise",
                format!("must be finite and >= 0, got {}", self.debug_logprob_noise),
            );
        }
        if !(self.server_timeout_s > 0.0 && self.server_timeout_s.is_finite()) {
            return bad(
                "server_timeout_s",
                format!("must be > 0 seconds, got {}", self.server_timeout_s),
            );
        }
        if !ROLLOUT_NAMES.contains(&self.name.as_str()) {
            return bad(
                "name",
                format!(
                    "{:?} is not a rollout engine here: expected one of {}",
                    self.name,
                    ROLLOUT_NAMES.join(", ")
                ),
            );
        }
        if self.name == "hf" && !self.server_url.is_empty() {
            return bad(
                "name",
                "\"hf\" generates in-process; the servers of server_url speak \"vllm\" or \"sglang\""
                    .to_owned(),
            );
        }
        if let Some(u) = self
            .server_url
            .iter()
            .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
        {
            return bad(
                "server_url",
                format!("{u:?} is not an http:// or https:// address"),
            );
        }
        if self.top_k < -1 {
            return bad(
                "top_k",
                format!("must be -1 (off) or >= 0, got {}", self.top_k),
            );
        }
        Ok(())
    }

    /// Whether tokens are sampled (false: greedy argmax).
    pub fn sampling(&self) -> bool {
        self.do_sample && self.temperature > 0.0
    }

    /// The seed for the `call`-th generation (e.g. the global step): a splitmix64 mix of `seed`
    /// and `call`, so successive steps draw different samples and a resumed run the same ones.
    pub fn seed_for(&self, call: u64) -> u64 {
        let mut z = self.seed ^ call.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// `rollout_log_probs + std * N(0, 1)` on the masked-in positions; row `r` draws from its own
/// splitmix64 stream of `(seed, row_offset + r)` (Box–Muller), so a data-parallel rank perturbs
/// its rows as one process would, independently of torch's generator; see
/// [`RolloutConfig::debug_logprob_noise`].
pub(crate) fn perturb_log_probs(
    log_probs: &Tensor,
    mask: &Tensor,
    std: f64,
    seed: u64,
    row_offset: u64,
) -> Tensor {
    let size = log_probs.size();
    let (rows, width) = (size[0], size.get(1).copied().unwrap_or(1));
    let mut noise = Vec::with_capacity((rows * width) as usize);
    for r in 0..rows as u64 {
        let mut state = seed ^ (row_offset + r).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            // 53 random bits, shifted into (0, 1]
            (((z ^ (z >> 31)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64
        };
        for _ in 0..width {
            let (u1, u2) = (next(), next());
            noise.push((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * std);
        }
    }
    let noise = Tensor::from_slice(&noise)
        .view(size.as_slice())
        .to_kind(log_probs.kind())
        .to_device(log_probs.device());
    log_probs + noise * mask.to_kind(log_probs.kind())
}

/// Where a generation stands, passed to the progress hook after every decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Response tokens produced so far per unfinished row (1..=`max_steps`).
    pub step: i64,
    /// `response_length`.
    pub max_steps: i64,
    /// Rows (prompts x n) in the generation.
    pub total_rows: i64,
    /// Rows that have stopped.
    pub finished_rows: i64,
    /// Response tokens generated so far, over all rows.
    pub generated_tokens: i64,
}

/// Per-call settings that are not user config: stop tokens, padding, the seed and a hook.
pub struct GenerateOptions<'a> {
    /// A row stops after producing any of these (kept in the response, masked 1).
    pub eos_token_ids: Vec<i64>,
    /// Fills responses after their stop.
    pub pad_token_id: i64,
    /// Seed of this call (e.g. `cfg.seed_for(global_step)`).
    pub seed: u64,
    /// Global index of this call's first output row (0 in one process): row `r` samples from
    /// stream `row_offset + r`.
    pub row_offset: u64,
    /// Called after every decode step (drive a progress bar from it).
    pub progress: Option<&'a mut dyn FnMut(&Progress)>,
}

impl std::fmt::Debug for GenerateOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerateOptions")
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token_id", &self.pad_token_id)
            .field("seed", &self.seed)
            .field("row_offset", &self.row_offset)
            .field("progress", &self.progress.is_some())
            .finish()
    }
}

impl<'a> GenerateOptions<'a> {
    /// Stop and pad tokens from the model's config (`eos_token_id`, `pad_token_id`, falling
    /// back to the first eos id), with seed 0 and no hook.
    pub fn from_config(cfg: &crate::model::Config) -> GenerateOptions<'a> {
        let eos_token_ids = cfg
            .eos_token_id
            .as_ref()
            .map(|e| e.to_vec())
            .unwrap_or_default();
        let pad_token_id = cfg
            .pad_token_id
            .or(eos_token_ids.first().copied())
            .unwrap_or(0);
        GenerateOptions {
            eos_token_ids,
            pad_token_id,
            seed: 0,
            row_offset: 0,
            progress: None,
        }
    }
}

/// The generation, in verl's layout: `batch` = prompts x n rows (interleaved).
#[derive(Debug)]
pub struct RolloutOutput {
    /// `[batch, prompt_len]` i64, the left-padded prompts (repeated n times).
    pub prompts: Tensor,
    /// `[batch, response_len]` i64, right-padded with the pad id; `response_len` = `response_length`.
    pub responses: Tensor,
    /// `[batch, prompt_len + response_len]` i64: prompts then responses.
    pub input_ids: Tensor,
    /// `[batch, prompt_len + response_len]` i64, 1 = real token.
    pub attention_mask: Tensor,
    /// `[batch, prompt_len + response_len]` i64; responses continue from the last prompt position.
    pub position_ids: Tensor,
    /// `[batch, response_len]` f32, 1.0 = real response token (including the stopping EOS).
    pub response_mask: Tensor,
    /// `[batch, response_len]` f32, log-prob of each sampled token under the distribution it
    /// was drawn from (after temperature, top-k, top-p; the raw softmax when greedy); 0 where masked.
    pub rollout_log_probs: Tensor,
}

/// One ChaCha8 stream per output row: seeded by `opts.seed`, stream `opts.row_offset + r`.
pub(crate) fn row_rngs(opts: &GenerateOptions<'_>, rows: usize) -> Vec<ChaCha8Rng> {
    (0..rows as u64)
        .map(|r| {
            let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
            rng.set_stream(opts.row_offset + r);
            rng
        })
        .collect()
}

/// The uniforms of one sampling step: one draw from the stream of each row that `draws`
/// (in compute-batch order), 0 for the others; `None` when greedy.
///
/// # Shapes
/// - returns `[rows, 1]` f64 on `device`
pub(crate) fn step_uniforms(
    cfg: &RolloutConfig,
    rngs: &mut [ChaCha8Rng],
    rows: impl Iterator<Item = (usize, bool)>,
    device: tch::Device,
) -> Option<Tensor> {
    cfg.sampling().then(|| {
        let u: Vec<f64> = rows
            .map(|(r, draws)| if draws { rngs[r].random::<f64>() } else { 0.0 })
            .collect();
        Tensor::from_slice(&u).view([-1, 1]).to_device(device)
    })
}

/// Turns last-position logits into tokens and their log-probs.
///
/// # Shapes
/// - `logits`: `[rows, vocab]` f32
/// - `uniforms`: `[rows, 1]` f64 in [0, 1) (ignored when greedy)
/// - returns `(tokens, log_probs)`: `[rows]` i64 and `[rows]` f32
pub(crate) fn pick(
    logits: &Tensor,
    cfg: &RolloutConfig,
    uniforms: Option<&Tensor>,
) -> (Tensor, Tensor) {
    let Some(uniforms) = uniforms.filter(|_| cfg.sampling()) else {
        if let Some(picked) = crate::fused::greedy_pick(logits) {
            return picked;
        }
        let tokens = logits.argmax(-1, true);
        let log_probs = logits
            .log_softmax(-1, Kind::Float)
            .gather(1, &tokens, false);
        return (tokens.squeeze_dim(1), log_probs.squeeze_dim(1));
    };
    let vocab = logits.size()[1];
    let top_k = cfg.top_k > 0 && cfg.top_k < vocab;
    if !top_k
        && cfg.top_p >= 1.0
        && let Some(picked) = crate::fused::sample_pick(logits, uniforms, cfg.temperature)
    {
        return picked;
    }
    let mut logits = logits / cfg.temperature;
    if top_k {
        let (top, _) = logits.topk(cfg.top_k, -1, true, true);
        let kth = top.narrow(1, cfg.top_k - 1, 1);
        logits = logits.masked_fill(&logits.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if cfg.top_p < 1.0 {
        // as transformers' TopPLogitsWarper: drop the ascending-sorted tokens whose cumulative
        // probability stays <= 1 - top_p, always keeping the most likely one
        let (sorted, indices) = logits.sort(-1, false);
        let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let remove = cumulative.le(1.0 - cfg.top_p);
        let _ = remove.narrow(1, vocab - 1, 1).fill_(0);
        let remove = remove.zeros_like().scatter(1, &indices, &remove);
        logits = logits.masked_fill(&remove, f64::NEG_INFINITY);
    }
    let log_probs = logits.log_softmax(-1, Kind::Float);
    let cdf = log_probs
        .exp()
        .to_kind(Kind::Double)
        .cumsum(-1, Kind::Double);
    let target = uniforms * cdf.narrow(1, vocab - 1, 1);
    let tokens = target
        .searchsorted(&cdf, false, true, "right", None::<Tensor>)
        .clamp_max(vocab - 1);
    let picked = log_probs.gather(1, &tokens, false);
    (tokens.squeeze_dim(1), picked.squeeze_dim(1))
}

/// The prompts prefilled into a fresh cache of `capacity` tokens per row, repeated for `n`
/// samples each (interleaved): the cache, the next-token logits and the prompt tensors
/// (`input_ids`, `attention_mask`, `position_ids`) of every output row.
pub(crate) struct Prefilled {
    pub cache: KvCache,
    pub logits: Tensor,
    pub prompt: (Tensor, Tensor, Tensor),
}

/// Prefills once per prompt (on the model's device), then repeats the cache rows for the `n`
/// samples; shared by [`generate`] and the multi-turn rollout.
pub(crate) fn prefill_repeated(
    lm: &CausalLm,
    (input_ids, attention_mask, position_ids): (&Tensor, &Tensor, &Tensor),
    n: i64,
    capacity: i64,
) -> Result<Prefilled> {
    let device = lm.device();
    let (prompts, prompt_len) = (input_ids.size()[0], input_ids.size()[1]);
    let (input_ids, attention_mask, position_ids) = (
        input_ids.to_device(device),
        attention_mask.to_device(device),
        position_ids.to_device(device),
    );
    let mut cache = KvCache::new(lm.config(), prompts, capacity, lm.kind(), device);
    let root = lm.model().hold_root()?;
    let hidden =
        lm.model()
            .forward(&input_ids, &attention_mask, &position_ids, Some(&mut cache))?;
    let mut logits = lm
        .logits(&hidden.narrow(1, prompt_len - 1, 1).squeeze_dim(1))
        .to_kind(Kind::Float);
    drop(root);
    let repeat =
        Tensor::arange(prompts, (Kind::Int64, device)).repeat_interleave_self_int(n, 0, None);
    let prompt = if n > 1 {
        cache.select_rows(&repeat)?;
        logits = logits.index_select(0, &repeat);
        (
            input_ids.index_select(0, &repeat),
            attention_mask.index_select(0, &repeat),
            position_ids.index_select(0, &repeat),
        )
    } else {
        (input_ids, attention_mask, position_ids)
    };
    Ok(Prefilled {
        cache,
        logits,
        prompt,
    })
}

/// Generates up to `cfg.response_length` tokens for each of `cfg.n` copies of every prompt.
///
/// The prompts are prefilled once (copies share it), then decoded step by step against a
/// preallocated [`KvCache`]; a row stops at any of `opts.eos_token_ids`, and finished rows are
/// dropped from the compute batch as they accumulate. Runs without gradients.
///
/// # Shapes
/// - `input_ids`: `[prompts, prompt_len]` i64, left-padded
/// - `attention_mask`: `[prompts, prompt_len]` i64, 1 = real token; the last column must be 1
/// - `position_ids`: `[prompts, prompt_len]` i64
/// - returns a [`RolloutOutput`] of `prompts * n` rows
pub fn generate(
    lm: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    position_ids: &Tensor,
    cfg: &RolloutConfig,
    opts: &mut GenerateOptions<'_>,
) -> Result<RolloutOutput> {
    check_prompts(input_ids, attention_mask, position_ids, cfg)?;
    // every decode step runs every projection: packed once, read at each step
    PackedWeights::default()
        .scope(|| generate_inner(lm, input_ids, attention_mask, position_ids, cfg, opts))
}

/// The input checks of [`generate`] (and the multi-turn rollout): shapes, dtypes, a valid
/// config, left padding.
pub(crate) fn check_prompts(
    input_ids: &Tensor,
    attention_mask: &Tensor,
    position_ids: &Tensor,
    cfg: &RolloutConfig,
) -> Result<()> {
    let size = expect_dims(
        "input_ids",
        input_ids,
        &[None, None],
        "[prompts, prompt_len]",
    )?;
    let (prompts, prompt_len) = (size[0], size[1]);
    expect_kind("input_ids", input_ids, &[Kind::Int64])?;
    expect_dims(
        "attention_mask",
        attention_mask,
        &[Some(prompts), Some(prompt_len)],
        "[prompts, prompt_len]",
    )?;
    expect_kind("attention_mask", attention_mask, &[Kind::Int64])?;
    expect_dims(
        "position_ids",
        position_ids,
        &[Some(prompts), Some(prompt_len)],
        "[prompts, prompt_len]",
    )?;
    expect_kind("position_ids", position_ids, &[Kind::Int64])?;
    cfg.validate()?;
    if prompts == 0 || prompt_len == 0 {
        return Err(Error::invalid(
            "input_ids",
            format!("needs at least one prompt token, got {size:?}"),
        ));
    }
    if attention_mask
        .narrow(1, prompt_len - 1, 1)
        .ne(1)
        .any()
        .int64_value(&[])
        != 0
    {
        return Err(Error::invalid(
            "attention_mask",
            "prompts must be left-padded (last column all 1)",
        ));
    }
    Ok(())
}

fn generate_inner(
    lm: &CausalLm,
    input_ids: &Tensor,
    attention_mask: &Tensor,
    position_ids: &Tensor,
    cfg: &RolloutConfig,
    opts: &mut GenerateOptions<'_>,
) -> Result<RolloutOutput> {
    let device = lm.device();
    let (prompts, prompt_len) = (input_ids.size()[0], input_ids.size()[1]);
    let n = cfg.n as i64;
    let rows = prompts * n;
    let max_new = cfg.response_length;
    let Prefilled {
        mut cache,
        mut logits,
        prompt: (prompt_ids, prompt_mask, prompt_pos),
    } = prefill_repeated(
        lm,
        (input_ids, attention_mask, position_ids),
        n,
        prompt_len + max_new,
    )?;
    let last_pos = prompt_pos.narrow(1, prompt_len - 1, 1);

    let mut rngs = row_rngs(opts, rows as usize);
    let mut tokens_out: Vec<Vec<i64>> = vec![Vec::new(); rows as usize];
    let mut logps_out: Vec<Vec<f32>> = vec![Vec::new(); rows as usize];
    // `active[i]` = output row held at compute-batch position i; `done[i]` = it has stopped
    let mut active: Vec<usize> = (0..rows as usize).collect();
    let mut done = vec![false; rows as usize];
    let mut mask = prompt_mask.shallow_clone();
    let mut next_pos = &last_pos + 1;
    let mut finished = 0i64;
    let mut generated = 0i64;

    for step in 0..max_new {
        let uniforms = step_uniforms(cfg, &mut rngs, active.iter().map(|&r| (r, true)), device);
        let (tokens, log_probs) = pick(&logits, cfg, uniforms.as_ref());
        let tokens_cpu = Vec::<i64>::try_from(&tokens.to_device(tch::Device::Cpu))?;
        let logps_cpu = Vec::<f32>::try_from(&log_probs.to_device(tch::Device::Cpu))?;
        for (i, &r) in active.iter().enumerate() {
            if done[r] {
                continue;
            }
            tokens_out[r].push(tokens_cpu[i]);
            logps_out[r].push(logps_cpu[i]);
            generated += 1;
            if opts.eos_token_ids.contains(&tokens_cpu[i]) {
                done[r] = true;
                finished += 1;
            }
        }
        if let Some(hook) = opts.progress.as_mut() {
            hook(&Progress {
                step: step + 1,
                max_steps: max_new,
                total_rows: rows,
                finished_rows: finished,
                generated_tokens: generated,
            });
        }
        let stop = finished == rows || step + 1 == max_new;
        // ZeRO stage 3: every decode step is a collective, so the ranks stop together
        if lm.model().all_done(stop)? {
            break;
        }
        if stop {
            // this rank's rows all ended while another rank's decode: keep in step with it
            loop {
                lm.model().idle_forward()?;
                if lm.model().all_done(true)? {
                    break;
                }
            }
            break;
        }
        // drop finished rows once they are an eighth of the compute batch
        let stopped = active.iter().filter(|&&r| done[r]).count();
        let mut tokens = tokens;
        if stopped > 0 && stopped * 8 >= active.len() {
            let keep: Vec<i64> = (0..active.len() as i64)
                .filter(|&i| !done[active[i as usize]])
                .collect();
            let keep_t = Tensor::from_slice(&keep).to_device(device);
            cache.select_rows(&keep_t)?;
            mask = mask.index_select(0, &keep_t);
            next_pos = next_pos.index_select(0, &keep_t);
            tokens = tokens.index_select(0, &keep_t);
            active.retain(|&r| !done[r]);
        }
        let a = active.len() as i64;
        mask = Tensor::cat(&[&mask, &Tensor::ones([a, 1], (Kind::Int64, device))], 1);
        let _root = lm.model().hold_root()?;
        let hidden =
            lm.model()
                .forward(&tokens.view([a, 1]), &mask, &next_pos, Some(&mut cache))?;
        logits = lm.logits(&hidden.squeeze_dim(1)).to_kind(Kind::Float);
        next_pos += 1;
    }

    Ok(assemble(
        &tokens_out,
        &logps_out,
        &prompt_ids,
        &prompt_mask,
        &prompt_pos,
        max_new,
        opts.pad_token_id,
    ))
}

/// verl's layout from each row's response tokens and their log-probs, right-padded to
/// `response_len` with `pad`.
///
/// # Shapes
/// - `prompt_ids`, `prompt_mask`, `prompt_pos`: `[rows, prompt_len]` i64
/// - `tokens[r]`, `log_probs[r]`: at most `response_len` each
pub(crate) fn assemble(
    tokens: &[Vec<i64>],
    log_probs: &[Vec<f32>],
    prompt_ids: &Tensor,
    prompt_mask: &Tensor,
    prompt_pos: &Tensor,
    response_len: i64,
    pad: i64,
) -> RolloutOutput {
    let device = prompt_ids.device();
    let rows = tokens.len();
    let width = response_len as usize;
    let mut responses = vec![pad; rows * width];
    let mut response_mask = vec![0f32; rows * width];
    let mut rollout_log_probs = vec![0f32; rows * width];
    for r in 0..rows {
        for (t, (&tok, &lp)) in tokens[r].iter().zip(&log_probs[r]).enumerate() {
            responses[r * width + t] = tok;
            response_mask[r * width + t] = 1.0;
            rollout_log_probs[r * width + t] = lp;
        }
    }
    let shape = [rows as i64, response_len];
    let responses = Tensor::from_slice(&responses).view(shape).to_device(device);
    let response_mask = Tensor::from_slice(&response_mask)
        .view(shape)
        .to_device(device);
    let rollout_log_probs = Tensor::from_slice(&rollout_log_probs)
        .view(shape)
        .to_device(device);
    let prompt_len = prompt_pos.size()[1];
    let last_pos = prompt_pos.narrow(1, prompt_len - 1, 1);
    let delta = Tensor::arange_start(1, response_len + 1, (Kind::Int64, device)).unsqueeze(0);
    RolloutOutput {
        input_ids: Tensor::cat(&[prompt_ids, &responses], 1),
        attention_mask: Tensor::cat(&[prompt_mask, &response_mask.to_kind(Kind::Int64)], 1),
        position_ids: Tensor::cat(&[prompt_pos, &(&last_pos + delta)], 1),
        prompts: prompt_ids.shallow_clone(),
        responses,
        response_mask,
        rollout_log_probs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uniform(rows: i64, u: f64) -> Tensor {
        Tensor::full([rows, 1], u, (Kind::Double, tch::Device::Cpu))
    }

    #[test]
    fn config_defaults_are_verl_and_unknown_keys_fail() {
        let cfg: RolloutConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, RolloutConfig::default());
        assert_eq!(
            (cfg.n, cfg.top_k, cfg.top_p, cfg.temperature, cfg.do_sample),
            (1, -1, 1.0, 1.0, true)
        );
        let err = serde_json::from_str::<RolloutConfig>(r#"{"topk": 3}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("topk"), "{err}");
        let bad = RolloutConfig {
            top_p: 0.0,
            ..RolloutConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("top_p"));
        assert_ne!(cfg.seed_for(0), cfg.seed_for(1));
    }

    #[test]
    fn greedy_picks_argmax_with_raw_log_prob() {
        let logits = Tensor::from_slice(&[0.0f32, 2.0, 1.0, 5.0, 0.0, 0.0]).view([2, 3]);
        let cfg = RolloutConfig {
            do_sample: false,
            ..RolloutConfig::default()
        };
        let (tokens, lp) = pick(&logits, &cfg, None);
        assert_eq!(Vec::<i64>::try_from(&tokens).unwrap(), vec![1, 0]);
        let want = logits.log_softmax(-1, Kind::Float);
        assert!((lp.double_value(&[0]) - want.double_value(&[0, 1])).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_with_log_prob_zero() {
        let logits = Tensor::from_slice(&[0.3f32, 2.0, 1.0, -1.0]).view([1, 4]);
        let cfg = RolloutConfig {
            top_k: 1,
            ..RolloutConfig::default()
        };
        for u in [0.0, 0.5, 0.999] {
            let (tokens, lp) = pick(&logits, &cfg, Some(&uniform(1, u)));
            assert_eq!(tokens.int64_value(&[0]), 1);
            assert!(lp.double_value(&[0]).abs() < 1e-6);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_renormalises() {
        // probs 0.5, 0.3, 0.2: top_p 0.6 keeps {0, 1}
        let probs = Tensor::from_slice(&[0.5f32, 0.3, 0.2]).view([1, 3]);
        let cfg = RolloutConfig {
            top_p: 0.6,
            ..RolloutConfig::default()
        };
        let mut seen = [false; 3];
        for i in 0..50 {
            let (t, lp) = pick(&probs.log(), &cfg, Some(&uniform(1, i as f64 / 50.0)));
            let t = t.int64_value(&[0]) as usize;
            seen[t] = true;
            let want = [0.625f64, 0.375][t].ln();
            assert!((lp.double_value(&[0]) - want).abs() < 1e-5, "token {t}");
        }
        assert_eq!(seen, [true, true, false]);
    }

    #[test]
    fn inverse_cdf_follows_the_temperature_scaled_distribution() {
        let logits = Tensor::from_slice(&[0.0f32, 1.0]).view([1, 2]);
        let cfg = RolloutConfig {
            temperature: 0.5,
            ..RolloutConfig::default()
        };
        // p(1) = e^2 / (1 + e^2) = 0.8808: u below 1 - 0.8808 picks token 0
        let (t0, _) = pick(&logits, &cfg, Some(&uniform(1, 0.11)));
        let (t1, lp1) = pick(&logits, &cfg, Some(&uniform(1, 0.12)));
        assert_eq!((t0.int64_value(&[0]), t1.int64_value(&[0])), (0, 1));
        assert!((lp1.double_value(&[0]) - 0.880_797f64.ln()).abs() < 1e-5);
    }
}

//! Continuous batching over the KV-cached decoder (issue 23's serving engine): requests join
//! the running decode batch between steps and leave it as they finish, each with its own
//! sampling settings, stop tokens and seed.
//!
//! Each [`Engine::step`] decodes one token for every running request (one forward over the
//! batch), prefills the requests admitted since (one forward over their prompts, left-padded
//! among themselves), joins their caches to the running one right-aligned
//! ([`KvCache::join`]), and samples every row by [`crate::rollout`]'s own `pick`. A request's
//! tokens are therefore those of [`crate::generate`] on its prompt alone: the same ids when
//! greedy, and when sampling with seed `s` and stream `r` the same as row `r` of `generate`
//! with `opts.seed = s` (one draw per generated token), whatever else shares the batch. Finished rows
//! leave the cache at once, and the columns that only finished rows used are dropped, so a busy
//! engine's cache stays as long as its longest running request.

use std::collections::VecDeque;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::gemm::PackedWeights;
use crate::heads::CausalLm;
use crate::model::KvCache;
use crate::rollout::{RolloutConfig, pick};

/// One request's sampling settings (OpenAI's and vLLM's names).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate, >= 1.
    pub max_tokens: i64,
    /// Softmax temperature; 0 = greedy.
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens; -1 = off.
    pub top_k: i64,
    /// Nucleus sampling mass, in (0, 1].
    pub top_p: f64,
    /// Seed of the request's sampler (ChaCha8).
    pub seed: u64,
    /// The sampler's stream: `generate`'s row `r` samples from stream `r`, so the `n` samples
    /// of one prompt with one seed are streams `0..n`.
    pub stream: u64,
    /// The request stops after producing any of these (kept as its last token).
    pub stop_token_ids: Vec<i64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            seed: 0,
            stream: 0,
            stop_token_ids: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// The rollout settings `pick` samples with.
    fn rollout(&self) -> RolloutConfig {
        RolloutConfig {
            n: 1,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            response_length: self.max_tokens,
            do_sample: self.temperature > 0.0,
            seed: self.seed,
            ..RolloutConfig::default()
        }
    }

    /// Checks the ranges documented on each field (errors name the field: `max_tokens` for
    /// the length).
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens < 1 {
            return Err(Error::invalid(
                "max_tokens",
                format!("must be at least 1, got {}", self.max_tokens),
            ));
        }
        self.rollout().validate()
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// It produced one of its stop tokens.
    Stop,
    /// It produced `max_tokens` tokens.
    Length,
}

/// A token one request produced in a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Emitted {
    /// The request's id ([`Engine::submit`]).
    pub request: u64,
    /// The token.
    pub token: i64,
    /// Its log-probability under the distribution it was drawn from (after temperature,
    /// top-k and top-p; the raw softmax when greedy), as `rollout_log_probs`.
    pub log_prob: f32,
    /// Set on the request's last token.
    pub finish: Option<Finish>,
}

struct Waiting {
    request: u64,
    prompt: Vec<i64>,
    params: SamplingParams,
}

struct Running {
    request: u64,
    params: SamplingParams,
    cfg: RolloutConfig,
    rng: ChaCha8Rng,
    produced: i64,
    /// The position of the next token fed in (the prompt's length, then + 1 a step).
    next_pos: i64,
    /// The token sampled last, fed in at the next step.
    last: i64,
}

/// The continuous-batching engine over one model; see the module's documentation.
pub struct Engine<'a> {
    lm: &'a CausalLm,
    max_rows: usize,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    /// The running rows' keys and values, right-aligned; `None` when nothing runs.
    cache: Option<KvCache>,
    /// `[running, cache.len()]` i64, 1 = a real token of the row.
    mask: Option<Tensor>,
    next_request: u64,
    /// No request joins the batch while paused (a weight update waits for it to drain).
    paused: bool,
    /// The weights packed for oneDNN, kept across steps (repacked when changed in place).
    packed: PackedWeights,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("max_rows", &self.max_rows)
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .field("cache_len", &self.cache.as_ref().map(KvCache::len))
            .finish()
    }
}

impl<'a> Engine<'a> {
    /// An engine decoding at most `max_rows` requests at once (more wait their turn).
    pub fn new(lm: &'a CausalLm, max_rows: usize) -> Result<Engine<'a>> {
        if max_rows == 0 {
            return Err(Error::invalid("max_rows", "must be at least 1".to_owned()));
        }
        Ok(Engine {
            lm,
            max_rows,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: None,
            mask: None,
            next_request: 0,
            paused: false,
            packed: PackedWeights::default(),
        })
    }

    /// Queues a request; it joins the batch at the next step with room. Returns its id.
    pub fn submit(&mut self, prompt: Vec<i64>, params: SamplingParams) -> Result<u64> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::invalid(
                "prompt",
                "needs at least one token".to_owned(),
            ));
        }
        let vocab = self.lm.config().vocab_size;
        if let Some(&t) = prompt.iter().find(|&&t| !(0..vocab).contains(&t)) {
            return Err(Error::invalid(
                "prompt",
                format!("token id {t} is outside the vocabulary 0..{vocab}"),
            ));
        }
        let request = self.next_request;
        self.next_request += 1;
        self.waiting.push_back(Waiting {
            request,
            prompt,
            params,
        });
        Ok(request)
    }

    /// Drops a waiting or running request (a client that went away); false if unknown.
    pub fn cancel(&mut self, request: u64) -> Result<bool> {
        if let Some(i) = self.waiting.iter().position(|w| w.request == request) {
            self.waiting.remove(i);
            return Ok(true);
        }
        let Some(i) = self.running.iter().position(|r| r.request == request) else {
            return Ok(false);
        };
        let keep: Vec<usize> = (0..self.running.len()).filter(|&j| j != i).collect();
        self.keep_rows(&keep)?;
        Ok(true)
    }

    /// Requests queued, not yet in the batch.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in the decode batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Stops (or restarts) admitting waiting requests: the running ones finish, the waiting
    /// ones wait. A weight update pauses until nothing runs, so that no sample mixes two
    /// policies.
    pub fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
    }

    /// Nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// One token for every running request and the first for every request admitted now.
    pub fn step(&mut self) -> Result<Vec<Emitted>> {
        let mut packed = std::mem::take(&mut self.packed);
        let out = packed.scope(|| self.step_inner());
        self.packed = packed;
        out
    }

    fn step_inner(&mut self) -> Result<Vec<Emitted>> {
        let mut logits = Vec::with_capacity(2);
        if !self.running.is_empty() {
            logits.push(self.decode()?);
        }
        let room = if self.paused {
            0
        } else {
            self.max_rows - self.running.len()
        };
        let admitted: Vec<Waiting> = (0..room).map_while(|_| self.waiting.pop_front()).collect();
        if !admitted.is_empty() {
            logits.push(self.admit(admitted)?);
        }
        if logits.is_empty() {
            return Ok(Vec::new());
        }
        let logits = Tensor::cat(&logits, 0);
        let (tokens, log_probs) = self.sample(&logits)?;
        let mut out = Vec::with_capacity(self.running.len());
        let mut keep = Vec::with_capacity(self.running.len());
        for (i, row) in self.running.iter_mut().enumerate() {
            row.produced += 1;
            row.last = tokens[i];
            let finish = if row.params.stop_token_ids.contains(&tokens[i]) {
                Some(Finish::Stop)
            } else if row.produced >= row.params.max_tokens {
                Some(Finish::Length)
            } else {
                keep.push(i);
                None
            };
            out.push(Emitted {
                request: row.request,
                token: tokens[i],
                log_prob: log_probs[i],
                finish,
            });
        }
        if keep.len() < self.running.len() {
            self.keep_rows(&keep)?;
        }
        Ok(out)
    }

    /// Feeds every running row its last token: the next-token logits, `[running, vocab]`.
    fn decode(&mut self) -> Result<Tensor> {
        let device = self.lm.device();
        let a = self.running.len() as i64;
        let (Some(cache), Some(mask)) = (self.cache.as_mut(), self.mask.as_mut()) else {
            return Err(Error::invalid(
                "engine",
                "rows run without a cache".to_owned(),
            ));
        };
        if cache.len() + 1 > cache.capacity() {
            let headroom = self
                .running
                .iter()
                .map(|r| r.params.max_tokens - r.produced)
                .max()
                .unwrap_or(1);
            grow(self.lm, cache, cache.len() + headroom.max(1))?;
        }
        *mask = Tensor::cat(&[&*mask, &Tensor::ones([a, 1], (Kind::Int64, device))], 1);
        let last: Vec<i64> = self.running.iter().map(|r| r.last).collect();
        let pos: Vec<i64> = self.running.iter().map(|r| r.next_pos).collect();
        let tokens = Tensor::from_slice(&last).view([a, 1]).to_device(device);
        let pos = Tensor::from_slice(&pos).view([a, 1]).to_device(device);
        let _root = self.lm.model().hold_root()?;
        let hidden = self.lm.model().forward(&tokens, mask, &pos, Some(cache))?;
        for r in &mut self.running {
            r.next_pos += 1;
        }
        Ok(self.lm.logits(&hidden.squeeze_dim(1)).to_kind(Kind::Float))
    }

    /// Prefills `admitted` (left-padded among themselves, positions from 0 at each prompt's
    /// first token), joins their cache to the running one and appends them to the batch: their
    /// first-token logits, `[admitted, vocab]`.
    fn admit(&mut self, admitted: Vec<Waiting>) -> Result<Tensor> {
        let device = self.lm.device();
        let k = admitted.len() as i64;
        let width = admitted.iter().map(|w| w.prompt.len()).max().unwrap_or(1) as i64;
        let mut ids = vec![0i64; (k * width) as usize];
        let mut mask = vec![0i64; (k * width) as usize];
        let mut pos = vec![0i64; (k * width) as usize];
        for (r, w) in admitted.iter().enumerate() {
            let pad = width as usize - w.prompt.len();
            let row = r * width as usize;
            for (j, &t) in w.prompt.iter().enumerate() {
                ids[row + pad + j] = t;
                mask[row + pad + j] = 1;
                pos[row + pad + j] = j as i64;
            }
        }
        let shape = [k, width];
        let tensor = |v: &[i64]| Tensor::from_slice(v).view(shape).to_device(device);
        let (ids, new_mask, pos) = (tensor(&ids), tensor(&mask), tensor(&pos));
        let headroom = admitted
            .iter()
            .map(|w| w.params.max_tokens)
            .chain(
                self.running
                    .iter()
                    .map(|r| r.params.max_tokens - r.produced),
            )
            .max()
            .unwrap_or(1);
        // into an empty engine the prefill's own cache is the batch's: room for the decode too
        let capacity = if self.cache.is_none() {
            width + headroom
        } else {
            width
        };
        let mut fresh = KvCache::new(self.lm.config(), k, capacity, self.lm.kind(), device);
        let hidden = {
            let _root = self.lm.model().hold_root()?;
            self.lm
                .model()
                .forward(&ids, &new_mask, &pos, Some(&mut fresh))?
        };
        let logits = self
            .lm
            .logits(&hidden.narrow(1, width - 1, 1).squeeze_dim(1))
            .to_kind(Kind::Float);
        match (self.cache.as_mut(), self.mask.as_ref()) {
            (Some(cache), Some(mask)) => {
                let len = cache.len().max(width);
                let joined = Tensor::cat(&[&left_pad(mask, len), &left_pad(&new_mask, len)], 0);
                cache.join(&fresh, len + headroom)?;
                self.mask = Some(joined);
            }
            _ => {
                self.cache = Some(fresh);
                self.mask = Some(new_mask);
            }
        }
        for w in admitted {
            let cfg = w.params.rollout();
            self.running.push(Running {
                request: w.request,
                rng: {
                    let mut rng = ChaCha8Rng::seed_from_u64(w.params.seed);
                    rng.set_stream(w.params.stream);
                    rng
                },
                cfg,
                next_pos: w.prompt.len() as i64,
                params: w.params,
                produced: 0,
                last: 0,
            });
        }
        Ok(logits)
    }

    /// Each row's token and log-prob from `logits` (`[running, vocab]`): one `pick` over the
    /// batch when the rows share their settings, else one a row; one uniform from each
    /// sampling row's stream.
    fn sample(&mut self, logits: &Tensor) -> Result<(Vec<i64>, Vec<f32>)> {
        let device = logits.device();
        let uniform = |r: &mut Running| {
            if r.cfg.sampling() {
                r.rng.random::<f64>()
            } else {
                0.0
            }
        };
        let first = &self.running[0].cfg;
        let shared = self.running.iter().all(|r| {
            (r.cfg.temperature, r.cfg.top_k, r.cfg.top_p, r.cfg.do_sample)
                == (first.temperature, first.top_k, first.top_p, first.do_sample)
        });
        let (tokens, log_probs) = if shared {
            let cfg = first.clone();
            let u: Vec<f64> = self.running.iter_mut().map(uniform).collect();
            let u = Tensor::from_slice(&u).view([-1, 1]).to_device(device);
            pick(logits, &cfg, Some(&u))
        } else {
            let mut tokens = Vec::with_capacity(self.running.len());
            let mut log_probs = Vec::with_capacity(self.running.len());
            for (i, r) in self.running.iter_mut().enumerate() {
                let u = Tensor::from_slice(&[uniform(r)])
                    .view([1, 1])
                    .to_device(device);
                let (t, lp) = pick(&logits.narrow(0, i as i64, 1), &r.cfg, Some(&u));
                tokens.push(t);
                log_probs.push(lp);
            }
            (Tensor::cat(&tokens, 0), Tensor::cat(&log_probs, 0))
        };
        Ok((
            Vec::<i64>::try_from(&tokens.to_device(Device::Cpu))?,
            Vec::<f32>::try_from(&log_probs.to_device(Device::Cpu))?,
        ))
    }

    /// Keeps the running rows `keep` (in order), then drops the cache's leading columns that
    /// no remaining row uses; an empty batch frees the cache.
    fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        if keep.is_empty() {
            self.running.clear();
            self.cache = None;
            self.mask = None;
            return Ok(());
        }
        let (Some(cache), Some(mask)) = (self.cache.as_mut(), self.mask.as_mut()) else {
            return Err(Error::invalid(
                "engine",
                "rows run without a cache".to_owned(),
            ));
        };
        let index: Vec<i64> = keep.iter().map(|&i| i as i64).collect();
        let index = Tensor::from_slice(&index).to_device(mask.device());
        cache.select_rows(&index)?;
        *mask = mask.index_select(0, &index);
        let mut i = 0;
        self.running.retain(|_| {
            let kept = keep.contains(&i);
            i += 1;
            kept
        });
        // the first column any remaining row reads
        let used = mask.sum_dim_intlist(&[0i64][..], false, Kind::Int64).gt(0);
        let lead = used.to_kind(Kind::Int64).argmax(0, false).int64_value(&[]);
        if lead > 0 {
            cache.drop_leading(lead)?;
            let len = mask.size()[1];
            *mask = mask.narrow(1, lead, len - lead);
        }
        Ok(())
    }
}

/// `mask` (`[rows, len]`) with zero columns on its left to `width` columns.
fn left_pad(mask: &Tensor, width: i64) -> Tensor {
    let size = mask.size();
    let pad = width - size[1];
    if pad == 0 {
        return mask.shallow_clone();
    }
    let zeros = Tensor::zeros([size[0], pad], (mask.kind(), mask.device()));
    Tensor::cat(&[&zeros, mask], 1)
}

/// Reallocates `cache` with room for `capacity` tokens a row (its contents kept).
fn grow(lm: &CausalLm, cache: &mut KvCache, capacity: i64) -> Result<()> {
    let empty = KvCache::new(lm.config(), 0, 0, lm.kind(), lm.device());
    cache.join(&empty, capacity)
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

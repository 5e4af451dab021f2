//! Left-padded collation into a [`PromptBatch`] and the resumable, seeded [`DataLoader`].
//!
//! The loader's whole position is [`LoaderState`] `{ epoch, position, seed }`: the order of an
//! epoch is a function of `(seed, epoch)` only, so restoring a saved state replays exactly the
//! batches an uninterrupted run would have seen, across epoch boundaries. `uid`s are
//! `"{seed}-{epoch}-{position}"` strings, equally reproducible.
//!
//! Data parallel ([`DataLoader::with_shard`], [`Sampler::set_shard`]): every rank draws the same
//! global order and takes its contiguous share of each global batch (`data.train_batch_size`
//! stays the global batch, verl's convention). The state stays global, so a checkpoint written
//! at one world size resumes at any other, and `uid`s are the global positions.

use std::collections::BTreeMap;
use std::sync::Arc;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::Tensor;

use crate::config::{DataConfig, Truncation};
use crate::dataset::{PromptEncoder, RlDataset};
use crate::error::{Error, Result};
use crate::tokenizer::{Message, TemplateValue, Tokenizer};

/// Left-pads token id lists into `(input_ids, attention_mask, position_ids)`.
///
/// `position_ids` are verl's `compute_position_id_with_mask`: `clip(cumsum(mask) - 1, 0)`, so
/// the first real token is position 0 whatever the padding.
///
/// # Shapes
/// - `prompts`: `batch` lists of at most `prompt_len` ids
/// - returns `(input_ids, attention_mask, position_ids)`: `[batch, prompt_len]` i64 each, with
///   `prompt_len = pad_to` or the longest prompt when `pad_to` is `None`
pub fn collate_left_padded(
    prompts: &[Vec<u32>],
    pad_id: u32,
    pad_to: Option<usize>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let prompt_len = pad_to.unwrap_or(longest);
    if longest > prompt_len {
        return Err(Error::Config {
            key: "pad_to".into(),
            message: format!("a prompt of {longest} tokens does not fit in {prompt_len}"),
        });
    }
    let batch = prompts.len();
    let mut ids = vec![i64::from(pad_id); batch * prompt_len];
    let mut mask = vec![0i64; batch * prompt_len];
    let mut pos = vec![0i64; batch * prompt_len];
    for (b, p) in prompts.iter().enumerate() {
        let off = b * prompt_len + (prompt_len - p.len());
        for (j, &t) in p.iter().enumerate() {
            ids[off + j] = i64::from(t);
            mask[off + j] = 1;
            pos[off + j] = j as i64;
        }
    }
    let shape = [batch as i64, prompt_len as i64];
    Ok((
        Tensor::from_slice(&ids).view(shape),
        Tensor::from_slice(&mask).view(shape),
        Tensor::from_slice(&pos).view(shape),
    ))
}

/// A batch of prompts ready for rollout, with the non-tensor columns carried along.
#[derive(Debug)]
pub struct PromptBatch {
    /// `[batch, prompt_len]` i64, left-padded with the pad id.
    pub input_ids: Tensor,
    /// `[batch, prompt_len]` i64, 1 = real token.
    pub attention_mask: Tensor,
    /// `[batch, prompt_len]` i64, `clip(cumsum(mask) - 1, 0)`.
    pub position_ids: Tensor,
    /// `data_source` per row.
    pub data_source: Vec<String>,
    /// `reward_model.ground_truth` per row.
    pub ground_truth: Vec<Value>,
    /// `extra_info` per row.
    pub extra_info: Vec<Value>,
    /// `ability` per row (`Null` when absent).
    pub ability: Vec<Value>,
    /// A unique, reproducible id per prompt: `"{seed}-{epoch}-{position}"`.
    pub uid: Vec<String>,
    /// Dataset row index per prompt.
    pub index: Vec<usize>,
    /// The chat messages (when `return_raw_chat`).
    pub raw_prompt: Option<Vec<Vec<Message>>>,
    /// The rendered prompt strings (when `return_full_prompt`).
    pub full_prompts: Option<Vec<String>>,
}

impl PromptBatch {
    /// Number of prompts.
    pub fn len(&self) -> usize {
        self.uid.len()
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.uid.is_empty()
    }

    /// Moves everything into an [`rl_core::Batch`]: tensors `input_ids`, `attention_mask`,
    /// `position_ids`; columns `data_source`, `ground_truth`, `extra_info`, `ability`, `uid`,
    /// `index`, and `raw_prompt` / `full_prompts` when carried (verl's names).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`, `position_ids`: `[batch, prompt_len]` i64
    pub fn into_batch(self) -> Result<rl_core::Batch> {
        use rl_core::keys;
        use rl_core::shape::{Dim, expect_dims, expect_same_shape};
        let n = self.len() as i64;
        expect_dims(
            keys::INPUT_IDS,
            &self.input_ids,
            &[Dim::Is(n), Dim::Any("prompt_len")],
        )?;
        expect_same_shape(
            keys::ATTENTION_MASK,
            &self.attention_mask,
            keys::INPUT_IDS,
            &self.input_ids,
        )?;
        expect_same_shape(
            keys::POSITION_IDS,
            &self.position_ids,
            keys::INPUT_IDS,
            &self.input_ids,
        )?;
        let mut b = rl_core::Batch::new();
        b.insert(keys::INPUT_IDS, self.input_ids)?;
        b.insert(keys::ATTENTION_MASK, self.attention_mask)?;
        b.insert(keys::POSITION_IDS, self.position_ids)?;
        b.insert_column(
            keys::DATA_SOURCE,
            self.data_source.into_iter().map(Value::String).collect(),
        )?;
        b.insert_column(keys::GROUND_TRUTH, self.ground_truth)?;
        b.insert_column(keys::EXTRA_INFO, self.extra_info)?;
        b.insert_column(keys::ABILITY, self.ability)?;
        b.insert_column(keys::UID, self.uid.into_iter().map(Value::String).collect())?;
        b.insert_column("index", self.index.into_iter().map(Value::from).collect())?;
        if let Some(raw) = self.raw_prompt {
            let raw = raw
                .iter()
                .map(|m| serde_json::to_value(m).unwrap_or(Value::Null))
                .collect();
            b.insert_column("raw_prompt", raw)?;
        }
        if let Some(full) = self.full_prompts {
            b.insert_column(
                "full_prompts",
                full.into_iter().map(Value::String).collect(),
            )?;
        }
        Ok(b)
    }

    /// Token ids of row `i` without padding (a test and debugging aid).
    pub fn unpadded_ids(&self, i: usize) -> Vec<i64> {
        let ids = Vec::<i64>::try_from(self.input_ids.get(i as i64)).unwrap_or_default();
        let mask = Vec::<i64>::try_from(self.attention_mask.get(i as i64)).unwrap_or_default();
        ids.into_iter()
            .zip(mask)
            .filter(|(_, m)| *m == 1)
            .map(|(t, _)| t)
            .collect()
    }
}

/// The loader's resumable position: saved in checkpoints, restored with
/// [`DataLoader::load_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Rows of this epoch's order already handed out.
    pub position: usize,
    /// The shuffle seed.
    pub seed: u64,
}

/// How a [`DataLoader`] batches, orders, renders and pads.
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    /// Prompts per batch.
    pub batch_size: usize,
    /// Shuffle with a new order every epoch.
    pub shuffle: bool,
    /// Drop the last incomplete batch of an epoch.
    pub drop_last: bool,
    /// Shuffle seed.
    pub seed: u64,
    /// Prompt limit in tokens.
    pub max_prompt_length: usize,
    /// Over-long prompt rule.
    pub truncation: Truncation,
    /// Pad every batch to `max_prompt_length` (verl) instead of to the longest prompt.
    pub pad_to_max_prompt_length: bool,
    /// Carry `raw_prompt`.
    pub return_raw_chat: bool,
    /// Carry `full_prompts`.
    pub return_full_prompt: bool,
    /// Extra chat-template variables.
    pub template_kwargs: BTreeMap<String, TemplateValue>,
}

fn template_kwargs(cfg: &DataConfig) -> BTreeMap<String, TemplateValue> {
    cfg.apply_chat_template_kwargs
        .iter()
        .filter(|(k, _)| k.as_str() != "chat_template")
        .map(|(k, v)| (k.clone(), TemplateValue::from(minijinja::value::Serde(v))))
        .collect()
}

impl LoaderOptions {
    /// Training options from `cfg` (`train_batch_size`, `shuffle`, `drop_last`, `seed`).
    pub fn train(cfg: &DataConfig) -> Self {
        Self {
            batch_size: cfg.train_batch_size,
            shuffle: cfg.shuffle,
            drop_last: cfg.drop_last,
            seed: cfg.effective_seed(),
            max_prompt_length: cfg.max_prompt_length,
            truncation: cfg.truncation,
            pad_to_max_prompt_length: cfg.pad_to_max_prompt_length,
            return_raw_chat: cfg.return_raw_chat,
            return_full_prompt: cfg.return_full_prompt,
            template_kwargs: template_kwargs(cfg),
        }
    }

    /// Validation options: `val_batch_size` (or the whole set), `validation_shuffle`, no drop.
    pub fn val(cfg: &DataConfig, dataset_len: usize) -> Self {
        Self {
            batch_size: cfg.val_batch_size.unwrap_or(dataset_len.max(1)),
            shuffle: cfg.validation_shuffle,
            drop_last: false,
            ..Self::train(cfg)
        }
    }
}

/// Seeded, resumable batches of row indices: the ordering half of a loader, shared by the RL,
/// SFT and preference loaders.
#[derive(Debug, Clone)]
pub struct Sampler {
    len: usize,
    batch_size: usize,
    shuffle: bool,
    drop_last: bool,
    state: LoaderState,
    order: Vec<u32>,
    rank: usize,
    world_size: usize,
}

impl Sampler {
    /// A sampler over `len` rows at epoch 0, position 0.
    pub fn new(
        len: usize,
        batch_size: usize,
        shuffle: bool,
        drop_last: bool,
        seed: u64,
    ) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::Config {
                key: "data.train_batch_size".into(),
                message: "must be at least 1".into(),
            });
        }
        if len == 0 {
            return Err(Error::Config {
                key: "data.train_files".into(),
                message: "the dataset has no rows (after max_samples and filtering)".into(),
            });
        }
        if drop_last && len < batch_size {
            return Err(Error::Config {
                key: "data.train_batch_size".into(),
                message: format!(
                    "{batch_size} is larger than the dataset ({len} rows) and drop_last is set: no batch would be produced"
                ),
            });
        }
        let state = LoaderState {
            epoch: 0,
            position: 0,
            seed,
        };
        Ok(Self {
            len,
            batch_size,
            shuffle,
            drop_last,
            state,
            order: epoch_order(len, seed, 0, shuffle),
            rank: 0,
            world_size: 1,
        })
    }

    /// Makes this sampler hand out rank `rank`'s share of every global batch of a
    /// `world_size`-rank data-parallel job: the contiguous rows `[rank * b / w, (rank + 1) * b / w)`
    /// of each global batch of `b` rows (a last, partial batch without `drop_last` is split as
    /// evenly as possible). The state stays the global one.
    ///
    /// Errors when `data.train_batch_size` is not a multiple of `world_size`, or `rank` is not
    /// below it.
    pub fn set_shard(&mut self, rank: usize, world_size: usize) -> Result<()> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config {
                key: "RANK".into(),
                message: format!("rank {rank} is not in a data-parallel world of {world_size}"),
            });
        }
        if !self.batch_size.is_multiple_of(world_size) {
            return Err(Error::Config {
                key: "data.train_batch_size".into(),
                message: format!(
                    "{} prompts do not split over {world_size} data-parallel ranks (it is the global batch; make it a multiple of the world size)",
                    self.batch_size
                ),
            });
        }
        self.rank = rank;
        self.world_size = world_size;
        Ok(())
    }

    /// `(rank, world_size)` of the shard this sampler hands out; `(0, 1)` without sharding.
    pub fn shard(&self) -> (usize, usize) {
        (self.rank, self.world_size)
    }

    /// Batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        if self.drop_last {
            self.len / self.batch_size
        } else {
            self.len.div_ceil(self.batch_size)
        }
    }

    /// The current position.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Restores a saved position.
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        if state.position > self.len {
            return Err(Error::LoaderState(format!(
                "position {} is past the end of a dataset of {} rows",
                state.position, self.len
            )));
        }
        if state.seed != self.state.seed {
            return Err(Error::LoaderState(format!(
                "saved with seed {} but this loader uses seed {} (data.seed)",
                state.seed, self.state.seed
            )));
        }
        self.order = epoch_order(self.len, state.seed, state.epoch, self.shuffle);
        self.state = state;
        Ok(())
    }

    /// The next batch of row indices with the state it was drawn at, or `None` at the end of
    /// an epoch (the state then points at the next epoch's start).
    ///
    /// With a shard ([`set_shard`](Self::set_shard)) the indices are this rank's share of the
    /// global batch, the returned state's `position` is the global position of its first row,
    /// and the sampler's own state advances by the whole global batch.
    pub fn next_indices(&mut self) -> Option<(Vec<usize>, LoaderState)> {
        let pos = self.state.position;
        let left = self.len - pos;
        if left == 0 || (self.drop_last && left < self.batch_size) {
            self.state.epoch += 1;
            self.state.position = 0;
            self.order = epoch_order(self.len, self.state.seed, self.state.epoch, self.shuffle);
            return None;
        }
        let take = left.min(self.batch_size);
        let share = rl_core::dist::shard_range(take, self.rank, self.world_size);
        let at = LoaderState {
            position: pos + share.start,
            ..self.state
        };
        let idx = self.order[pos + share.start..pos + share.end]
            .iter()
            .map(|&i| i as usize)
            .collect();
        self.state.position += take;
        Some((idx, at))
    }
}

/// Seeded, resumable batches of prompts from an [`RlDataset`].
#[derive(Debug)]
pub struct DataLoader {
    dataset: Arc<RlDataset>,
    tokenizer: Arc<Tokenizer>,
    opts: LoaderOptions,
    sampler: Sampler,
    pad_id: u32,
}

/// The order of rows in `epoch`: a Fisher–Yates shuffle driven by ChaCha8 seeded with `seed`
/// on stream `epoch` (our own shuffle, so the order never changes with a `rand` upgrade).
pub fn epoch_order(len: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<u32> {
    let mut order: Vec<u32> = (0..len as u32).collect();
    if shuffle {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(epoch);
        for i in (1..len).rev() {
            let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
            order.swap(i, j);
        }
    }
    order
}

impl DataLoader {
    /// A loader at epoch 0, position 0. Fails on a zero batch size, an empty dataset, a batch
    /// larger than the dataset with `drop_last`, or a tokenizer with neither pad nor eos token.
    pub fn new(
        dataset: Arc<RlDataset>,
        tokenizer: Arc<Tokenizer>,
        opts: LoaderOptions,
    ) -> Result<Self> {
        let sampler = Sampler::new(
            dataset.len(),
            opts.batch_size,
            opts.shuffle,
            opts.drop_last,
            opts.seed,
        )?;
        let pad_id = tokenizer.pad_id_or_eos()?;
        Ok(Self {
            dataset,
            tokenizer,
            opts,
            sampler,
            pad_id,
        })
    }

    /// The training loader as verl builds it from `data:`: opens `train_files` (capped by
    /// `train_max_samples`), drops over-long prompts when `filter_overlong_prompts` is set, and
    /// batches with `train_batch_size`, `shuffle`, `drop_last` and `seed`. A
    /// `apply_chat_template_kwargs.chat_template` string replaces the tokenizer's template.
    pub fn train(cfg: &DataConfig, tokenizer: Arc<Tokenizer>) -> Result<Self> {
        cfg.validate()?;
        Self::build(
            RlDataset::train(cfg)?,
            cfg,
            tokenizer,
            LoaderOptions::train(cfg),
        )
    }

    /// The validation loader: `val_files`, `val_max_samples`, `val_batch_size` (default: the
    /// whole set), `validation_shuffle`, no `drop_last`.
    pub fn val(cfg: &DataConfig, tokenizer: Arc<Tokenizer>) -> Result<Self> {
        cfg.validate()?;
        let ds = RlDataset::val(cfg)?;
        let opts = LoaderOptions::val(cfg, ds.len());
        Self::build(ds, cfg, tokenizer, opts)
    }

    fn build(
        mut ds: RlDataset,
        cfg: &DataConfig,
        mut tokenizer: Arc<Tokenizer>,
        opts: LoaderOptions,
    ) -> Result<Self> {
        if let Some(t) = cfg.apply_chat_template_kwargs.get("chat_template") {
            let src = t.as_str().ok_or_else(|| Error::Config {
                key: "data.apply_chat_template_kwargs.chat_template".into(),
                message: "must be a string".into(),
            })?;
            Arc::make_mut(&mut tokenizer).set_chat_template(src)?;
        }
        if cfg.filter_overlong_prompts {
            let encoder = PromptEncoder {
                tokenizer: &tokenizer,
                max_prompt_length: cfg.max_prompt_length,
                truncation: cfg.truncation,
                template_kwargs: &opts.template_kwargs,
            };
            ds.filter_overlong_prompts(&encoder)?;
        }
        Self::new(Arc::new(ds), tokenizer, opts)
    }

    /// Batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.sampler.batches_per_epoch()
    }

    /// Makes this loader yield rank `rank`'s share of each global batch of a `world_size`-rank
    /// data-parallel job (see [`Sampler::set_shard`]): the same global order on every rank, a
    /// global state, `uid`s of the global positions. Errors name `data.train_batch_size` when it
    /// does not split over the ranks.
    pub fn with_shard(mut self, rank: usize, world_size: usize) -> Result<Self> {
        self.sampler.set_shard(rank, world_size)?;
        Ok(self)
    }

    /// `(rank, world_size)` of this loader's shard; `(0, 1)` without sharding.
    pub fn shard(&self) -> (usize, usize) {
        self.sampler.shard()
    }

    /// The dataset.
    pub fn dataset(&self) -> &RlDataset {
        &self.dataset
    }

    /// The options.
    pub fn options(&self) -> &LoaderOptions {
        &self.opts
    }

    /// The current position, for a checkpoint.
    pub fn state(&self) -> LoaderState {
        self.sampler.state()
    }

    /// Restores a saved position; the next batch is the one that would have followed it.
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        self.sampler.load_state(state)
    }

    /// The next batch of this epoch, or `None` when the epoch is over (the state then points
    /// at the start of the next epoch, so calling again starts it).
    pub fn next_batch(&mut self) -> Result<Option<PromptBatch>> {
        let before = self.sampler.state();
        let Some((idx, at)) = self.sampler.next_indices() else {
            return Ok(None);
        };
        match self.make_batch(&idx, at) {
            Ok(b) => Ok(Some(b)),
            Err(e) => {
                // Leave the position where it was, so a caller may fix things and retry.
                self.sampler.load_state(before)?;
                Err(e)
            }
        }
    }

    /// The next batch, moving into the next epoch when this one is over: an endless stream.
    pub fn next_batch_cycling(&mut self) -> Result<PromptBatch> {
        match self.next_batch()? {
            Some(b) => Ok(b),
            None => self
                .next_batch()?
                .ok_or_else(|| Error::LoaderState("an epoch produced no batch".into())),
        }
    }

    fn make_batch(&self, idx: &[usize], at: LoaderState) -> Result<PromptBatch> {
        let rows = idx
            .iter()
            .map(|&i| self.dataset.row(i))
            .collect::<Result<Vec<_>>>()?;
        let encoder = PromptEncoder {
            tokenizer: &self.tokenizer,
            max_prompt_length: self.opts.max_prompt_length,
            truncation: self.opts.truncation,
            template_kwargs: &self.opts.template_kwargs,
        };
        let encoded = encoder.encode(&rows, self.dataset.prompt_key())?;
        let ids: Vec<Vec<u32>> = encoded.iter().map(|e| e.ids.clone()).collect();
        let pad_to = self
            .opts
            .pad_to_max_prompt_length
            .then_some(self.opts.max_prompt_length);
        let (input_ids, attention_mask, position_ids) =
            collate_left_padded(&ids, self.pad_id, pad_to)?;
        let s = at;
        let pos = at.position;
        Ok(PromptBatch {
            input_ids,
            attention_mask,
            position_ids,
            data_source: rows.iter().map(|r| r.data_source.clone()).collect(),
            ground_truth: rows.iter().map(|r| r.ground_truth.clone()).collect(),
            extra_info: rows.iter().map(|r| r.extra_info.clone()).collect(),
            ability: rows
                .iter()
                .map(|r| r.ability.clone().map_or(Value::Null, Value::String))
                .collect(),
            uid: (0..idx.len())
                .map(|k| format!("{}-{}-{}", s.seed, s.epoch, pos + k))
                .collect(),
            index: idx.to_vec(),
            raw_prompt: self
                .opts
                .return_raw_chat
                .then(|| rows.iter().map(|r| r.prompt.clone()).collect()),
            full_prompts: self
                .opts
                .return_full_prompt
                .then(|| encoded.into_iter().map(|e| e.text).collect()),
        })
    }
}

#[cfg(test)]
mod tests;

//! The reward-model roles over a [`RewardModel`] (`*ForSequenceClassification`):
//! [`RewardModelWorker`] scores responses (verl's `reward_model` worker, a [`Reward`] role) and
//! [`RmWorker`] trains one with its own AdamW (driven as a [`Critic`] by rl-algos' `RmTrainer`).

use std::path::Path;
use std::sync::{Arc, Mutex};

use rl_core::dist::{self, SharedCollective};
use rl_core::roles::{Critic, Metrics, Reward, ValueObjective};
use rl_core::{Batch, keys};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::heads::{CONFIG_JSON, RewardModel};
use crate::hf::{self, Checkpoint};
use crate::model::Config;
use crate::roles::MixedPrecision;
use crate::roles::actor::{
    broadcast_from_rank0, lock, save_trained_state, sorted_vars, update_loop, update_loop_dp,
};
use crate::roles::config::{ActorConfig, OptimConfig};
use crate::roles::micro;
use crate::roles::optim::AdamW;
use crate::roles::role_err;
use crate::roles::zero::ZeroStage;

/// Column with each row's reward-model score (f64), next to `rm_scores` (the trainers' `score`).
const SCORE: &str = "score";

fn default_forward_tokens() -> usize {
    32768
}

/// verl's `reward_model` worker keys: how the scoring forward is micro-batched. (`enable`,
/// `model.path` and the weight of the reward-model score against the rule rewards belong to
/// the composer; see rl-algos' `CombinedReward`.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardModelConfig {
    /// Rows per scoring forward; `None` = the whole batch. Default none.
    pub micro_batch_size_per_gpu: Option<usize>,
    /// Split the forward by token count instead of rows. Default false.
    pub use_dynamic_bsz: bool,
    /// Token budget of a dynamic micro-batch (prompt + response tokens). Default 32768.
    #[serde(default = "default_forward_tokens")]
    pub forward_max_token_len_per_gpu: usize,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        RewardModelConfig {
            micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            forward_max_token_len_per_gpu: default_forward_tokens(),
        }
    }
}

impl RewardModelConfig {
    /// Checks ranges; `prefix` names the group (`reward_model`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        if self.micro_batch_size_per_gpu == Some(0) {
            return Err(Error::invalid(
                &format!("{prefix}.micro_batch_size_per_gpu"),
                "must be at least 1 (or null)",
            ));
        }
        if self.use_dynamic_bsz && self.forward_max_token_len_per_gpu == 0 {
            return Err(Error::invalid(
                &format!("{prefix}.forward_max_token_len_per_gpu"),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Checks that `model` has one output, the scalar reward.
fn check_one_label(model: &RewardModel) -> Result<()> {
    let n = model.config().num_labels();
    if n != 1 {
        return Err(Error::invalid(
            "num_labels",
            format!("a reward model needs exactly one label (a scalar score), got {n}"),
        ));
    }
    Ok(())
}

/// A reward model whose decoder stack comes from the Hugging Face folder `dir` (a causal LM
/// such as the SFT policy, or a saved reward model) and whose one-label `score` head is loaded
/// when `dir` has `score.weight` and initialised fresh (normal(0, `initializer_range`); seed
/// with `tch::manual_seed`) otherwise, as verl and OpenRLHF initialise a reward model from the
/// SFT checkpoint. An `lm_head` in `dir` is ignored.
pub fn reward_model_from_lm(
    dir: impl AsRef<Path>,
    device: Device,
    kind: Kind,
) -> Result<RewardModel> {
    reward_model_from_lm_stack_in(dir, device, kind, kind)
}

/// [`reward_model_from_lm`] with the stack loaded in `stack_kind` and the head in `kind`
/// (float32 where they differ): LoRA's frozen base straight in mixed precision's compute
/// dtype, as [`crate::ValueModel::from_pretrained_stack_in`].
pub fn reward_model_from_lm_stack_in(
    dir: impl AsRef<Path>,
    device: Device,
    kind: Kind,
    stack_kind: Kind,
) -> Result<RewardModel> {
    let dir = dir.as_ref();
    let mut cfg = Config::from_file(dir.join(CONFIG_JSON))?;
    cfg.set_num_labels(1);
    let ckpt = Checkpoint::open(dir)?;
    // the stack is loaded (or this fails naming what is missing), the head drawn
    let rm = RewardModel::with_stack_to_be_filled(&cfg, device, kind, stack_kind)?;
    hf::load_into(rm.var_store(), &ckpt, &|name| name.starts_with("score."))?;
    Ok(rm)
}

/// Each row's scalar reward on its last response token, 0 elsewhere (verl's `rm_scores`
/// layout); gradients flow when the caller allows them.
///
/// # Shapes
/// - `micro`: `input_ids`, `attention_mask`, `position_ids` `[batch, seq_len]` i64,
///   `response_mask` `[batch, response_len]`
/// - returns `([batch, response_len] f32, [batch] f32)`: the token layout and the scores
fn scores(
    model: &RewardModel,
    micro: &Batch,
    role: &'static str,
) -> rl_core::Result<(Tensor, Tensor)> {
    let mask = micro.get(keys::RESPONSE_MASK)?;
    let (batch, _) = rl_core::shape::expect_2d(keys::RESPONSE_MASK, mask)?;
    let input_ids = micro.get(keys::INPUT_IDS)?;
    rl_core::shape::expect_dims(
        keys::INPUT_IDS,
        input_ids,
        &[
            rl_core::shape::Dim::Is(batch),
            rl_core::shape::Dim::Any("seq_len"),
        ],
    )?;
    let device = model.var_store().device();
    let out = model
        .forward(
            &input_ids.to_device(device),
            &micro.get(keys::ATTENTION_MASK)?.to_device(device),
            &micro.get(keys::POSITION_IDS)?.to_device(device),
        )
        .map_err(role_err(role))?;
    // [batch, 1] -> [batch]
    let score = out.select(1, 0).to_device(mask.device());
    let len = mask
        .ne(0.0)
        .to_kind(Kind::Int64)
        .sum_dim_intlist([1].as_slice(), false, Kind::Int64);
    let last = (&len - 1).clamp_min(0).unsqueeze(-1);
    let placed = score.unsqueeze(-1) * len.gt(0).unsqueeze(-1).to_kind(Kind::Float);
    let tokens = mask
        .zeros_like()
        .to_kind(Kind::Float)
        .scatter(1, &last, &placed);
    Ok((tokens, score))
}

/// Runs [`scores`] over micro-batches without gradient and reassembles them in row order.
fn scores_no_grad(
    model: &RewardModel,
    batch: &Batch,
    rows: Option<usize>,
    tokens: Option<usize>,
    role: &'static str,
) -> rl_core::Result<(Tensor, Tensor)> {
    let _guard = tch::no_grad_guard();
    let (mut token_parts, mut score_parts, mut order) = (Vec::new(), Vec::new(), Vec::new());
    for m in micro::split(batch, rows, tokens)? {
        let (t, s) = scores(model, &m.batch, role)?;
        token_parts.push(t);
        score_parts.push(s);
        order.push(m.rows);
    }
    if token_parts.is_empty() {
        let mask = batch.get(keys::RESPONSE_MASK)?;
        return Ok((
            mask.zeros_like().to_kind(Kind::Float),
            Tensor::zeros([0], (Kind::Float, mask.device())),
        ));
    }
    Ok((
        micro::reassemble(&token_parts, &order),
        micro::reassemble(&score_parts, &order),
    ))
}

/// verl's reward-model worker as a [`Reward`] role: scores each (prompt, response) row with a
/// [`RewardModel`] read at the row's last real token, without gradient, micro-batched, on the
/// model's device; writes `rm_scores` and `token_level_scores` (`[batch, response_len]` f32,
/// the score on the last response token, 0 elsewhere; all zero for an empty response) and the
/// column [`SCORE`].
///
/// The rows are scored as they are (`input_ids`, `attention_mask`, `position_ids`), so the
/// reward model must share the policy's tokenizer (verl re-tokenises with the reward model's
/// chat template when they differ; that path is not here). To combine its score with rule
/// rewards, wrap it in rl-algos' `CombinedReward`.
#[derive(Debug)]
pub struct RewardModelWorker {
    model: RewardModel,
    cfg: RewardModelConfig,
}

impl RewardModelWorker {
    /// A worker over `model`, which must have one label.
    pub fn new(model: RewardModel, cfg: RewardModelConfig) -> rl_core::Result<Self> {
        cfg.validate("reward_model")
            .map_err(role_err("reward_model"))?;
        check_one_label(&model).map_err(role_err("reward_model"))?;
        Ok(RewardModelWorker { model, cfg })
    }

    /// Loads a Hugging Face `*ForSequenceClassification` folder (`score.weight` required).
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: Device,
        kind: Kind,
        cfg: RewardModelConfig,
    ) -> rl_core::Result<Self> {
        let model =
            RewardModel::from_pretrained(dir, device, kind).map_err(role_err("reward_model"))?;
        Self::new(model, cfg)
    }

    /// The model.
    pub fn model(&self) -> &RewardModel {
        &self.model
    }
}

impl Reward for RewardModelWorker {
    fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let (tokens, score) = scores_no_grad(
            &self.model,
            batch,
            self.cfg.micro_batch_size_per_gpu,
            self.cfg
                .use_dynamic_bsz
                .then_some(self.cfg.forward_max_token_len_per_gpu),
            "reward_model",
        )?;
        let rows = Vec::<f64>::try_from(score.to_kind(Kind::Double))?;
        let mut out = Batch::new();
        out.insert(keys::RM_SCORES, tokens.shallow_clone())?;
        out.insert(keys::TOKEN_LEVEL_SCORES, tokens)?;
        out.insert_column(SCORE, rows.into_iter().map(Value::from).collect())?;
        Ok(out)
    }
}

fn default_rm_lr_optim() -> OptimConfig {
    OptimConfig {
        lr: 9e-6,
        weight_decay: 0.0,
        ..OptimConfig::default()
    }
}

/// The reward-model trainer's worker keys (OpenRLHF's `train_rm` names where verl has none).
/// Batches hold (chosen, rejected) row pairs, so sizes count pairs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmWorkerConfig {
    /// Pairs per optimiser step; a training batch holds a whole number of these. Default 128.
    pub train_batch_size: usize,
    /// Pairs per micro-batch (gradient accumulation); `None` = the whole mini-batch.
    /// Default none.
    pub micro_train_batch_size: Option<usize>,
    /// Global gradient-norm clip (OpenRLHF's `max_norm`), > 0. Default 1.0.
    pub grad_clip: f64,
    /// AdamW and LR schedule; defaults `lr` 9e-6 and `weight_decay` 0 (OpenRLHF's).
    #[serde(default = "default_rm_lr_optim")]
    pub optim: OptimConfig,
    /// Mixed precision of the reward model's weights. Default off (float32).
    pub mixed_precision: MixedPrecision,
    /// ZeRO stage over the data-parallel ranks (0, 1 or 2, see [`ZeroStage`]). Default 0.
    pub zero_stage: u8,
}

impl Default for RmWorkerConfig {
    fn default() -> Self {
        RmWorkerConfig {
            train_batch_size: 128,
            micro_train_batch_size: None,
            grad_clip: 1.0,
            optim: default_rm_lr_optim(),
            mixed_precision: MixedPrecision::default(),
            zero_stage: 0,
        }
    }
}

impl RmWorkerConfig {
    /// The shared update loop's settings: rows are pairs times 2, no shuffle, one epoch.
    fn as_actor(&self) -> ActorConfig {
        ActorConfig {
            ppo_mini_batch_size: self.train_batch_size,
            ppo_micro_batch_size_per_gpu: self.micro_train_batch_size.map(|p| 2 * p),
            use_dynamic_bsz: false,
            ppo_epochs: 1,
            shuffle: false,
            grad_clip: self.grad_clip,
            log_prob_micro_batch_size_per_gpu: self.micro_train_batch_size.map(|p| 2 * p),
            optim: self.optim.clone(),
            mixed_precision: self.mixed_precision.clone(),
            zero_stage: self.zero_stage,
            ..ActorConfig::default()
        }
    }

    /// Checks ranges; `prefix` names the group (`reward_model`).
    pub fn validate(&self, prefix: &str) -> Result<()> {
        if self.micro_train_batch_size == Some(0) {
            return Err(Error::invalid(
                &format!("{prefix}.micro_train_batch_size"),
                "must be at least 1 (or null)",
            ));
        }
        if self.train_batch_size == 0 {
            return Err(Error::invalid(
                &format!("{prefix}.train_batch_size"),
                "must be at least 1",
            ));
        }
        self.as_actor().validate(prefix)
    }
}

/// A trainable reward model with its own AdamW, driven as a [`Critic`] so rl-algos' `RmTrainer`
/// needs no model type: `compute_values` writes `values` as each row's reward on its last
/// response token (0 elsewhere), and `update` runs the shared mini/micro-batch loop (rows in
/// (chosen, rejected) pairs, never split) with the objective's loss, logging `rm/grad_norm`,
/// `rm/lr` and `rm/skipped_steps` next to the objective's metrics. `save_state` writes a
/// Hugging Face `*ForSequenceClassification` folder (loadable by [`RewardModelWorker`] and
/// transformers) plus the optimiser state.
///
/// Data parallel with [`with_group`](Self::with_group), as the actor: each rank updates on its
/// share of the pairs and the gradients are averaged over the ranks before clip and step.
pub struct RmWorker {
    model: Arc<Mutex<RewardModel>>,
    cfg: RmWorkerConfig,
    optim: AdamW,
    group: Option<SharedCollective>,
}

impl std::fmt::Debug for RmWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RmWorker")
            .field("cfg", &self.cfg)
            .field("optim", &self.optim)
            .field("data_parallel", &self.group.is_some())
            .finish_non_exhaustive()
    }
}

impl RmWorker {
    /// A worker training `model`, which must have one label.
    pub fn new(model: RewardModel, cfg: RmWorkerConfig) -> rl_core::Result<Self> {
        cfg.validate("reward_model")
            .map_err(role_err("reward_model"))?;
        check_one_label(&model).map_err(role_err("reward_model"))?;
        let mut model = model;
        let optim = AdamW::for_model(
            model.var_store_mut(),
            cfg.optim.clone(),
            &cfg.mixed_precision,
        )
        .map_err(role_err("reward_model"))?;
        Ok(RmWorker {
            model: Arc::new(Mutex::new(model)),
            cfg,
            optim,
            group: None,
        })
    }

    /// Makes the worker data-parallel over `group`, as `ActorWorker::with_group`:
    /// `train_batch_size` becomes the global pairs of an optimiser step (each rank updates on
    /// its `1 / world_size` share, the objective normalising by the global pair count times
    /// `meta_info.dp_size`), gradients are averaged over the ranks before clipping and
    /// stepping, and rank 0's weights are broadcast now, so replicas start equal. A collective:
    /// every rank calls it.
    ///
    /// Errors when `train_batch_size` pairs do not split over the ranks.
    pub fn with_group(mut self, group: SharedCollective) -> rl_core::Result<Self> {
        let world = dist::lock(&group)?.world_size();
        if !self.cfg.train_batch_size.is_multiple_of(world) {
            return Err(role_err("reward_model")(Error::invalid(
                "train_batch_size",
                format!(
                    "{} pairs per step do not split over {world} data-parallel ranks (it is the \
                     global batch; make it a multiple of the world size)",
                    self.cfg.train_batch_size
                ),
            )));
        }
        broadcast_from_rank0(
            &group,
            &sorted_vars(lock(&self.model, "reward_model")?.var_store()),
        )?;
        let stage = ZeroStage::from_config("reward_model.train.zero_stage", self.cfg.zero_stage)
            .map_err(role_err("reward_model"))?;
        if stage == ZeroStage::Parameters {
            return Err(role_err("reward_model")(Error::invalid(
                "reward_model.train.zero_stage",
                "stage 3 is built for the actor, critic and reference, not yet for reward-model training: use 0, 1 or 2",
            )));
        }
        self.optim.broadcast_masters(&mut *dist::lock(&group)?)?;
        self.optim.shard(group.clone(), stage)?;
        self.group = Some(group);
        Ok(self)
    }

    /// The model, shared with the worker: its weights move as the worker trains (the harness
    /// exports a finished run's reward model through this handle).
    pub fn model(&self) -> Arc<Mutex<RewardModel>> {
        self.model.clone()
    }

    /// The optimiser (for its counters).
    pub fn optimizer(&self) -> &AdamW {
        &self.optim
    }
}

impl Critic for RmWorker {
    fn compute_values(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let rows = self.cfg.micro_train_batch_size.map(|p| 2 * p);
        let model = lock(&self.model, "reward_model")?;
        let (tokens, _) = scores_no_grad(&model, batch, rows, None, "reward_model")?;
        let mut out = Batch::new();
        out.insert(keys::VALUES, tokens)?;
        Ok(out)
    }

    fn update(
        &mut self,
        batch: &Batch,
        objective: &dyn ValueObjective,
    ) -> rl_core::Result<Metrics> {
        let cfg = self.cfg.as_actor();
        let model = lock(&self.model, "reward_model")?;
        let loss = |m: &Batch, info| {
            let (tokens, _) = scores(&model, m, "reward_model")?;
            objective.loss(m, &tokens, info)
        };
        match &self.group {
            Some(g) => update_loop_dp(
                &cfg,
                2,
                batch,
                &mut self.optim,
                "rm",
                Some(g),
                model.model(),
                loss,
                || Ok(()),
            ),
            None => update_loop(&cfg, 2, batch, &mut self.optim, "rm", model.model(), loss),
        }
    }

    fn save_state(&self, dir: &Path) -> rl_core::Result<()> {
        let model = lock(&self.model, "reward_model")?;
        save_trained_state(
            "reward_model",
            self.group.as_ref(),
            &self.optim,
            dir,
            model.model(),
            |d| model.save_trained(d),
        )
    }

    fn load_state(&mut self, dir: &Path) -> rl_core::Result<()> {
        lock(&self.model, "reward_model")?
            .load_trained(dir)
            .map_err(role_err("reward_model"))?;
        self.optim.load(dir).map_err(role_err("reward_model"))
    }

    fn weights_digest(&self) -> rl_core::Result<Option<u64>> {
        let model = lock(&self.model, "reward_model")?;
        Ok(Some(dist::digest(&sorted_vars(model.var_store()))?))
    }

    fn data_parallel_ranks(&self) -> usize {
        self.group
            .as_ref()
            .and_then(|g| g.lock().ok().map(|g| g.world_size()))
            .unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Config;

    fn tiny_rm(seed: i64) -> RewardModel {
        let _generator = crate::hold_generator();
        tch::manual_seed(seed);
        let mut cfg = Config::tiny();
        cfg.set_num_labels(1);
        RewardModel::new(&cfg, Device::Cpu, Kind::Float).unwrap()
    }

    /// Two rows: prompt `[pad, 5]` / `[6, 7]`, responses of 2 and 1 tokens.
    fn rows() -> Batch {
        let mut b = Batch::new();
        let ids = Tensor::from_slice(&[0i64, 5, 8, 9, 6, 7, 10, 0]).view([2, 4]);
        let am = Tensor::from_slice(&[0i64, 1, 1, 1, 1, 1, 1, 0]).view([2, 4]);
        let pos = Tensor::from_slice(&[0i64, 0, 1, 2, 0, 1, 2, 3]).view([2, 4]);
        b.insert(keys::INPUT_IDS, ids.shallow_clone()).unwrap();
        b.insert(keys::ATTENTION_MASK, am).unwrap();
        b.insert(keys::POSITION_IDS, pos).unwrap();
        b.insert(keys::RESPONSES, ids.narrow(1, 2, 2)).unwrap();
        b.insert(
            keys::RESPONSE_MASK,
            Tensor::from_slice(&[1f32, 1., 1., 0.]).view([2, 2]),
        )
        .unwrap();
        b
    }

    #[test]
    fn scores_sit_on_the_last_response_token_and_match_the_model() {
        let rm = tiny_rm(3);
        let b = rows();
        let direct = rm
            .forward(
                b.get(keys::INPUT_IDS).unwrap(),
                b.get(keys::ATTENTION_MASK).unwrap(),
                b.get(keys::POSITION_IDS).unwrap(),
            )
            .unwrap()
            .squeeze_dim(1);
        let mut w = RewardModelWorker::new(
            rm,
            RewardModelConfig {
                micro_batch_size_per_gpu: Some(1),
                ..RewardModelConfig::default()
            },
        )
        .unwrap();
        let out = w.score(&b).unwrap();
        let t = out.get(keys::TOKEN_LEVEL_SCORES).unwrap();
        let d = Vec::<f32>::try_from(&direct).unwrap();
        let got = Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
        assert_eq!(got[0], 0.0);
        assert_eq!(got[3], 0.0);
        assert!(
            (got[1] - d[0]).abs() < 1e-5 && (got[2] - d[1]).abs() < 1e-5,
            "{got:?} {d:?}"
        );
        assert!(out.get(keys::RM_SCORES).unwrap().equal(t));
        assert!((out.column(SCORE).unwrap()[1].as_f64().unwrap() - d[1] as f64).abs() < 1e-5);
    }

    #[test]
    fn two_labels_are_refused_by_name() {
        let _generator = crate::hold_generator();
        tch::manual_seed(0);
        let mut cfg = Config::tiny();
        cfg.set_num_labels(2);
        let rm = RewardModel::new(&cfg, Device::Cpu, Kind::Float).unwrap();
        let e = RewardModelWorker::new(rm, RewardModelConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_labels"), "{e}");
        let e = serde_json::from_str::<RmWorkerConfig>(r#"{"train_batch": 3}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("train_batch"), "{e}");
    }

    /// A loss that raises row 0's reward: `-values.sum()` over the first row.
    struct RaiseFirst;
    impl ValueObjective for RaiseFirst {
        fn loss(
            &self,
            micro: &Batch,
            values: &Tensor,
            _info: rl_core::roles::MiniBatchInfo,
        ) -> rl_core::Result<(Tensor, Metrics)> {
            let _ = micro;
            let l = -values.narrow(0, 0, 1).sum(Kind::Float);
            let mut m = Metrics::new();
            m.push("rm/loss", l.double_value(&[]));
            Ok((l, m))
        }
    }

    #[test]
    fn updates_move_the_score_and_state_round_trips() {
        let cfg = RmWorkerConfig {
            train_batch_size: 1,
            optim: OptimConfig {
                lr: 1e-2,
                ..OptimConfig::default()
            },
            ..RmWorkerConfig::default()
        };
        let mut w = RmWorker::new(tiny_rm(4), cfg.clone()).unwrap();
        let b = rows();
        let before = w
            .compute_values(&b)
            .unwrap()
            .get(keys::VALUES)
            .unwrap()
            .sum(Kind::Double)
            .double_value(&[]);
        let first = |w: &mut RmWorker| {
            w.compute_values(&b)
                .unwrap()
                .get(keys::VALUES)
                .unwrap()
                .get(0)
                .sum(Kind::Double)
                .double_value(&[])
        };
        let v0 = first(&mut w);
        let m = w.update(&b, &RaiseFirst).unwrap();
        assert!(m.mean().contains_key("rm/grad_norm"));
        assert!(first(&mut w) > v0, "{before}");
        let dir = tempfile::tempdir().unwrap();
        w.save_state(dir.path()).unwrap();
        let mut other = RmWorker::new(tiny_rm(5), cfg).unwrap();
        other.load_state(dir.path()).unwrap();
        assert_eq!(other.optimizer().counters(), w.optimizer().counters());
        assert_eq!(first(&mut other), first(&mut w));
        // the saved folder is a reward model checkpoint
        let loaded = RewardModelWorker::from_pretrained(
            dir.path(),
            Device::Cpu,
            Kind::Float,
            RewardModelConfig::default(),
        )
        .unwrap();
        assert_eq!(loaded.model().config().num_labels(), 1);
        let lm = reward_model_from_lm(dir.path(), Device::Cpu, Kind::Float).unwrap();
        let a = lm.var_store().variables()["score.weight"].shallow_clone();
        let trained = w.model();
        let trained = trained.lock().unwrap();
        assert!(a.equal(&trained.var_store().variables()["score.weight"]));
    }
}

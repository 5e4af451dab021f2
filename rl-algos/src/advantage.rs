//! Advantage estimators: GAE, GRPO, RLOO, REINFORCE++, ReMax, OPO, GPG and GRPO pass@k.
//!
//! Each matches a `compute_*_advantage*` function of `verl/trainer/ppo/core_algos.py`.
//!
//! Outcome estimators group the rows of a batch by prompt: `index` holds one integer group id
//! per row (the trainer maps verl's `uid` strings to ids, e.g. with [`group_index`]); the ids
//! need not be dense or sorted. Group statistics are computed with scatter/index operations,
//! never with a loop over rows. Everything here runs without gradient tracking.

use std::collections::HashMap;

use rl_core::shape::Dim;
use tch::{Kind, Tensor};

use crate::check::{self, Groups};
use crate::config::{AdvEstimator, AlgoConfig};
use crate::error::{Error, Result};
use crate::masked;

/// The `epsilon` verl adds to group standard deviations (`1e-6`, its default everywhere).
pub const EPSILON: f64 = 1e-6;

/// Dense group ids for string uids, in order of first appearance (`["b", "a", "b"]` ->
/// `[0, 1, 0]`), for the `index` argument of the outcome estimators.
///
/// # Shapes
/// - returns: `[batch]` int64 on the CPU
pub fn group_index<S: AsRef<str>>(uids: &[S]) -> Tensor {
    let mut ids: HashMap<&str, i64> = HashMap::new();
    let dense: Vec<i64> = uids
        .iter()
        .map(|u| {
            let next = ids.len() as i64;
            *ids.entry(u.as_ref()).or_insert(next)
        })
        .collect();
    Tensor::from_slice(&dense)
}

/// The tensors an estimator may read, named as in verl's batch.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// `[batch, response_len]` float: the rewards, usually non-zero only at the last token.
    pub token_level_rewards: &'a Tensor,
    /// `[batch, response_len]` binary: 1 for response tokens.
    pub response_mask: &'a Tensor,
    /// `[batch, response_len]` float: the critic's values (GAE only).
    pub values: Option<&'a Tensor>,
    /// `[batch]` int64: the group (prompt) of each row (outcome estimators).
    pub index: Option<&'a Tensor>,
    /// `[batch]` float: the reward of the greedy response (ReMax only).
    pub reward_baselines: Option<&'a Tensor>,
    /// `[batch, response_len]` float: the training policy's log-probs (optimal token baseline).
    pub old_log_probs: Option<&'a Tensor>,
    /// `[batch, response_len]` float: `Σπ²` over the vocabulary at each position (optimal token
    /// baseline).
    pub sum_pi_squared: Option<&'a Tensor>,
    /// `[batch, response_len]` float: rollout-correction importance weights, when computed (the
    /// optimal token baseline scales its path variance by their square).
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// Runs the estimator chosen in `cfg`, as verl's `compute_advantage` does, returning
/// `(advantages, returns)`.
///
/// # Shapes
/// - see [`AdvantageInputs`]
/// - returns: `(advantages, returns)`, `[batch, response_len]` each
pub fn compute<'a>(inputs: &AdvantageInputs<'a>, cfg: &AlgoConfig) -> Result<(Tensor, Tensor)> {
    let r = inputs.token_level_rewards;
    let m = inputs.response_mask;
    let est = cfg.adv_estimator;
    let need = |t: Option<&'a Tensor>, name: &'static str| -> Result<&'a Tensor> {
        t.ok_or_else(|| Error::invalid(name, format!("adv_estimator `{est}` needs `{name}`")))
    };
    match cfg.adv_estimator {
        AdvEstimator::Gae => gae(r, need(inputs.values, "values")?, m, cfg.gamma, cfg.lam),
        AdvEstimator::Grpo => grpo(
            r,
            m,
            need(inputs.index, "index")?,
            cfg.norm_adv_by_std_in_grpo,
            cfg.grpo_epsilon,
        ),
        AdvEstimator::ReinforcePlusPlus => reinforce_plus_plus(r, m, cfg.gamma),
        AdvEstimator::ReinforcePlusPlusBaseline => {
            reinforce_plus_plus_baseline(r, m, need(inputs.index, "index")?)
        }
        AdvEstimator::Remax => remax(r, need(inputs.reward_baselines, "reward_baselines")?, m),
        AdvEstimator::Rloo => rloo(r, m, need(inputs.index, "index")?),
        AdvEstimator::Opo => opo(r, m, need(inputs.index, "index")?),
        AdvEstimator::GrpoPassk => grpo_passk(
            r,
            m,
            need(inputs.index, "index")?,
            cfg.norm_adv_by_std_in_grpo,
            cfg.grpo_epsilon,
        ),
        AdvEstimator::Gpg => gpg(r, m, need(inputs.index, "index")?, cfg.gpg_f_norm),
        AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline => {
            let otb = OtbInputs {
                old_log_probs: need(inputs.old_log_probs, "old_log_probs")?,
                sum_pi_squared: need(inputs.sum_pi_squared, "sum_pi_squared")?,
                rollout_is_weights: inputs.rollout_is_weights,
            };
            let index = need(inputs.index, "index")?;
            let multi_turn = est == AdvEstimator::TirOptimalTokenBaseline;
            let zero_tail = cfg.otb_handle_zero_tail.unwrap_or(multi_turn);
            if multi_turn {
                tir_optimal_token_baseline(r, m, index, &otb, zero_tail, cfg.otb_epsilon)
            } else {
                optimal_token_baseline(r, m, index, &otb, zero_tail, cfg.otb_epsilon)
            }
        }
    }
}

/// Checks rewards and mask; returns the mask in the rewards' dtype and the batch size.
fn rewards_and_mask(rewards: &Tensor, mask: &Tensor) -> Result<(Tensor, i64)> {
    let size = check::float(
        "token_level_rewards",
        rewards,
        &[Dim::Any("batch"), Dim::Any("response_len")],
    )?;
    let mask = check::mask("response_mask", mask, "token_level_rewards", rewards)?;
    Ok((mask, size[0]))
}

fn outcome_groups(rewards: &Tensor, mask: &Tensor, index: &Tensor) -> Result<(Tensor, Groups)> {
    let (mask, batch) = rewards_and_mask(rewards, mask)?;
    let groups = check::groups("index", index, batch, rewards.kind())?;
    Ok((mask, groups))
}

/// Per-row sequence scores: the rewards summed over every position (verl does not mask here).
fn scores(rewards: &Tensor) -> Tensor {
    rewards.sum_dim_intlist([-1].as_slice(), false, None::<Kind>)
}

/// Group means with verl's singleton rule: a group of one has mean 0.
fn group_mean_or_zero(groups: &Groups, scores: &Tensor) -> Tensor {
    let mean = groups.sum(scores) / &groups.counts;
    mean.where_scalarother(&groups.counts.gt(1.0), 0.0)
}

/// Generalised advantage estimation, matching `compute_gae_advantage_return`.
///
/// Runs the TD(λ) recursion backwards over response positions, skipping masked positions
/// (their value and TD error are not used, and the running terms carry across them); then
/// `returns = advantages + values` and the advantages are whitened over the mask with
/// [`masked::whiten`] (so the mask must select at least two tokens).
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `values`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: `(advantages, returns)`, `[batch, response_len]` each
pub fn gae(
    token_level_rewards: &Tensor,
    values: &Tensor,
    response_mask: &Tensor,
    gamma: f64,
    lam: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, _) = rewards_and_mask(token_level_rewards, response_mask)?;
    check::float_like("values", values, "token_level_rewards", token_level_rewards)?;
    let _guard = tch::no_grad_guard();
    let values = values.to_kind(token_level_rewards.kind());
    // [batch, response_len] -> [response_len, batch]: each step reads one contiguous row.
    let r = token_level_rewards.transpose(0, 1).contiguous();
    let v = values.transpose(0, 1).contiguous();
    let m = mask.transpose(0, 1).contiguous();
    let (len, batch) = (r.size()[0], r.size()[1]);
    let opts = (r.kind(), r.device());
    let mut next_values = Tensor::zeros([batch], opts);
    let mut last_gae_lam = Tensor::zeros([batch], opts);
    let advantages = Tensor::zeros([len, batch], opts);
    let gamma_lam = gamma * lam;
    for t in (0..len).rev() {
        let (v_t, m_t) = (v.get(t), m.get(t));
        let delta = r.get(t) + gamma * &next_values - &v_t;
        let gae_t = delta + gamma_lam * &last_gae_lam;
        // verl's `x * m + (1 - m) * y` for a binary m is `lerp(y, x, m)`, exactly, in one kernel;
        // masked positions carry the running terms over
        let _ = next_values.lerp_tensor_(&v_t, &m_t);
        let row = advantages.get(t);
        let _ = last_gae_lam.lerp_tensor_out(&row, &gae_t, &m_t);
        last_gae_lam = row;
    }
    let advantages = advantages.transpose(0, 1);
    let returns = &advantages + &values;
    let advantages = masked::whiten_(&advantages, &mask, true)?;
    Ok((advantages, returns))
}

/// GRPO outcome advantages, matching `compute_grpo_outcome_advantage`.
///
/// Each row's score is its rewards summed over all positions; the advantage is
/// `(score - group_mean) / (group_std + epsilon)` (unbiased std; verl's default `epsilon` is
/// [`EPSILON`]), or `score - group_mean` when `norm_adv_by_std_in_grpo` is false (Dr. GRPO). A
/// group of one row has mean 0 and std 1, as in verl, where that std is a float32 tensor: its
/// advantage is `score / float32(1 + epsilon)` (`1.0000009536743164` for the default, not
/// `1.000001`) whatever the scores' dtype. The scalar is broadcast over the response and
/// multiplied by the mask. `returns` is the same tensor as `advantages`.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn grpo(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
    norm_adv_by_std_in_grpo: bool,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let (mean, std) = groups.mean_std(&scores);
    let single = groups.counts.eq(1.0);
    let mean = mean.where_scalarother(&single.logical_not(), 0.0);
    let centered = &scores - groups.rows(&mean);
    let scalars = if norm_adv_by_std_in_grpo {
        // verl's singleton std is `torch.tensor(1.0)`, float32: `std + epsilon` rounds there
        let singleton_divisor = f64::from(1.0f32 + epsilon as f32);
        let divisor = (std + epsilon).where_scalarother(&single.logical_not(), singleton_divisor);
        centered / groups.rows(&divisor)
    } else {
        centered
    };
    let advantages = scalars.unsqueeze(-1) * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// GRPO pass@k advantages, matching `compute_grpo_passk_outcome_advantage`.
///
/// Only the best row of each group gets a non-zero advantage, `r_max - r_second_max`, divided
/// by `group_std + epsilon` when `norm_adv_by_std_in_grpo`. Every group needs at least two rows
/// (verl raises otherwise). `returns` is the same tensor as `advantages`.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn grpo_passk(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
    norm_adv_by_std_in_grpo: bool,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let smallest = if groups.n > 0 {
        groups.counts.min().double_value(&[]) as i64
    } else {
        2
    };
    if smallest < 2 {
        return Err(Error::invalid(
            "index",
            format!("pass@k needs at least 2 samples per group, a group has {smallest}"),
        ));
    }
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let kind = scores.kind();
    let batch = scores.size()[0];
    let opts = (kind, scores.device());
    let r_max = groups.max(&scores);
    // the first row reaching the group maximum is the one that gets the advantage
    let rows = Tensor::arange(batch, (Kind::Double, scores.device()));
    let at_max = scores.eq_tensor(&groups.rows(&r_max));
    let first = groups
        .min(&rows.where_scalarother(&at_max, batch as f64))
        .to_kind(Kind::Int64);
    let best = Tensor::zeros([batch], (Kind::Bool, scores.device())).index_fill(0, &first, 1);
    let others = scores.where_scalarother(&best.logical_not(), f64::NEG_INFINITY);
    let r_second = groups.max(&others);
    let advantage = if norm_adv_by_std_in_grpo {
        let (_, std) = groups.mean_std(&scores);
        (&r_max - &r_second) / (std + epsilon)
    } else {
        &r_max - &r_second
    };
    let scalars = groups
        .rows(&advantage)
        .where_self(&best, &Tensor::zeros([batch], opts));
    let advantages = scalars.unsqueeze(-1) * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// RLOO advantages, matching `compute_rloo_outcome_advantage`.
///
/// For a group of `n > 1` rows the advantage is `score * n / (n - 1) - mean * n / (n - 1)`
/// (the score minus the mean of the other rows); a group of one keeps its raw score, as in
/// verl. `returns` is the same tensor as `advantages`.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn rloo(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let n = groups.rows(&groups.counts);
    let mean = groups.rows(&group_mean_or_zero(&groups, &scores));
    let loo = (&scores * &n) / (&n - 1.0) - (mean * &n) / (&n - 1.0);
    let scalars = loo.where_self(&n.gt(1.0), &scores);
    let advantages = scalars.unsqueeze(-1) * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// OPO advantages, matching `compute_opo_outcome_advantage`: the baseline of a group is the
/// mean score weighted by response length, `sum(len * score) / sum(len)`; a group of one has
/// baseline 0. `returns` is the same tensor as `advantages`.
///
/// A group whose responses are all empty has an undefined baseline (verl gets NaN); here it is
/// 0, which changes nothing because every position of such rows is masked.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn opo(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let lengths = mask.sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
    let total = groups.sum(&lengths);
    let baseline = groups.sum(&(&lengths * &scores)) / &total;
    let defined = groups.counts.gt(1.0).logical_and(&total.gt(0.0));
    let baseline = baseline.where_scalarother(&defined, 0.0);
    let advantages = (scores - groups.rows(&baseline)).unsqueeze(-1) * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// GPG advantages, matching `compute_gpg_outcome_advantage`: `alpha * (score - group_mean) /
/// f_norm` (verl's default `f_norm` is 1) where `alpha = batch / max(#rows with a non-zero
/// score, 1)`, computed in float32 as verl's torch does (the reciprocal of the count times the
/// batch size); a group of one has mean 0. `returns` is the same tensor as `advantages`.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn gpg(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
    f_norm: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    if !(f_norm != 0.0 && f_norm.is_finite()) {
        return Err(Error::invalid(
            "gpg_f_norm",
            format!("must be finite and non-zero, got {f_norm}"),
        ));
    }
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let batch = scores.size()[0];
    let nonzero = scores.count_nonzero(None::<i64>).int64_value(&[]).max(1);
    // verl's `bsz / m`: Python's int over an int64 tensor, which torch evaluates as
    // `m.reciprocal() * bsz` in float32 (9 / 7 comes out one float32 ulp above the quotient)
    let alpha = f64::from((1.0f32 / nonzero as f32) * batch as f32);
    let mean = groups.rows(&group_mean_or_zero(&groups, &scores));
    let advantages = ((alpha * (scores - mean)) / f_norm).unsqueeze(-1) * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// The actor's tensors the optimal-token baselines read.
#[derive(Debug, Clone, Copy)]
pub struct OtbInputs<'a> {
    /// `[batch, response_len]` float: the training policy's log-probs of the sampled tokens.
    pub old_log_probs: &'a Tensor,
    /// `[batch, response_len]` float: `Σπ²` over the vocabulary at each position.
    pub sum_pi_squared: &'a Tensor,
    /// `[batch, response_len]` float: rollout-correction importance weights, if any.
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// Returns-to-go and the cumulative path variance `W_t = Σ_{j<=t} w_j` with `w_j = 1 - 2π_j +
/// Σπ²` (times the squared importance weight when given), both over masked positions only.
fn otb_paths(rewards: &Tensor, mask: &Tensor, otb: &OtbInputs<'_>) -> Result<(Tensor, Tensor)> {
    check::float_like(
        "old_log_probs",
        otb.old_log_probs,
        "token_level_rewards",
        rewards,
    )?;
    check::float_like(
        "sum_pi_squared",
        otb.sum_pi_squared,
        "token_level_rewards",
        rewards,
    )?;
    if let Some(w) = otb.rollout_is_weights {
        check::float_like("rollout_is_weights", w, "token_level_rewards", rewards)?;
    }
    let kind = rewards.kind();
    let returns = (rewards * mask).flip([-1]).cumsum(-1, kind).flip([-1]);
    let pi = otb.old_log_probs.to_kind(kind).exp();
    let mut w = 1.0 - 2.0 * pi + otb.sum_pi_squared.to_kind(kind);
    if let Some(is) = otb.rollout_is_weights {
        w *= is.to_kind(kind).square();
    }
    let w_cum = (&w * mask).cumsum(-1, kind);
    Ok((returns, w_cum))
}

/// The per-row baselines `Σ_g G W / (Σ_g W + epsilon)` of each row's group, position by
/// position (`w` already zero where a row has no token); 0 for a group of one row.
fn otb_baselines(groups: &Groups, returns: &Tensor, w: &Tensor, epsilon: f64) -> Tensor {
    let num = groups.sum(&(returns * w));
    let den = groups.sum(w) + epsilon;
    let several = groups.counts.gt(1.0).unsqueeze(-1);
    (num / den)
        .where_scalarother(&several, 0.0)
        .index_select(0, &groups.inv)
}

/// verl's `handle_zero_tail`: in each group whose longest response is strictly the longest
/// (one row) and longer than the second longest, that row's baseline is 0 from the second
/// longest length on. `lengths` are the rows' token counts.
fn zero_tail(baselines: &Tensor, groups: &Groups, lengths: &Tensor) -> Tensor {
    let max = groups.rows(&groups.max(lengths));
    let at_max = lengths.eq_tensor(&max);
    let n_at_max = groups.rows(&groups.sum(&at_max.to_kind(lengths.kind())));
    let others = lengths.where_scalarother(&at_max.logical_not(), f64::NEG_INFINITY);
    let second = groups.rows(&groups.max(&others));
    // a group of two or more rows with one strict longest row
    let target = at_max
        .logical_and(&n_at_max.eq(1.0))
        .logical_and(&second.isfinite())
        .logical_and(&max.gt_tensor(&second));
    let width = baselines.size()[1];
    let pos = Tensor::arange(width, (lengths.kind(), lengths.device())).unsqueeze(0);
    let tail = pos
        .ge_tensor(&second.unsqueeze(-1))
        .logical_and(&target.unsqueeze(-1));
    baselines.masked_fill(&tail, 0.0)
}

/// The optimal token baseline, matching verl's `compute_optimal_token_baseline_advantage`.
///
/// Each position `t` of a group's responses gets the baseline `B_t = Σ G_t W_t / (Σ W_t +
/// epsilon)` over the group's rows, where `G_t` is the return-to-go and `W_t` the accumulated
/// path variance (see [`OtbInputs`]; with importance weights, `W` is scaled by their square).
/// A group of one row has no baseline. With `handle_zero_tail` the strictly longest response
/// of a group gets no baseline past the second longest's length. Returns `(advantages, returns)`
/// with `advantages = (G - B) * mask` and `returns = G`.
///
/// # Shapes
/// - `token_level_rewards`, `response_mask`: `[batch, response_len]`
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each
pub fn optimal_token_baseline(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
    otb: &OtbInputs<'_>,
    handle_zero_tail: bool,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let (returns, w_cum) = otb_paths(token_level_rewards, &mask, otb)?;
    let mut baselines = otb_baselines(&groups, &returns, &(&w_cum * &mask), epsilon);
    if handle_zero_tail {
        let lengths = mask.sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
        baselines = zero_tail(&baselines, &groups, &lengths);
    }
    let advantages = (&returns - baselines) * &mask;
    Ok((advantages, returns))
}

/// The optimal token baseline over multi-turn responses, matching verl's
/// `compute_multi_turn_optimal_token_baseline_advantage` (`tir_optimal_token_baseline`).
///
/// As [`optimal_token_baseline`], but the baseline is indexed by each row's own token count
/// rather than by position: the `k`-th policy token of every response in a group shares a
/// baseline, whatever observation tokens came between. Rows without tokens take part in no
/// group. verl's default for `handle_zero_tail` is true here.
///
/// # Shapes
/// - as [`optimal_token_baseline`]
pub fn tir_optimal_token_baseline(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
    otb: &OtbInputs<'_>,
    handle_zero_tail: bool,
    epsilon: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, _) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let (returns, w_cum) = otb_paths(token_level_rewards, &mask, otb)?;
    let kind = returns.kind();
    let device = returns.device();
    let keep = mask.gt(0.0);
    let lengths = mask.sum_dim_intlist([-1].as_slice(), false, None::<Kind>);
    let valid = lengths.gt(0.0);
    let width = if lengths.numel() > 0 {
        lengths.max().double_value(&[]) as i64
    } else {
        0
    };
    // the k-th policy token of each row at column k of a [batch, width] layout
    let nz = keep.nonzero();
    let (rows, cols) = (nz.select(1, 0), nz.select(1, 1));
    let slot = (mask.cumsum(-1, Kind::Int64) - 1).index(&[Some(&rows), Some(&cols)]);
    let batch = mask.size()[0];
    let compact = |x: &Tensor| {
        Tensor::zeros([batch, width], (kind, device)).index_put(
            &[Some(&rows), Some(&slot)],
            &x.index(&[Some(&rows), Some(&cols)]),
            false,
        )
    };
    let (r_c, w_c) = (compact(&returns), compact(&w_cum));
    // groups over the rows with tokens only (verl skips empty rows)
    let kept_rows = valid.nonzero().squeeze_dim(-1);
    let sub_groups = check::groups(
        "index",
        &index.index_select(0, &kept_rows.to_device(index.device())),
        kept_rows.size()[0],
        kind,
    )?;
    let (r_k, w_k) = (
        r_c.index_select(0, &kept_rows),
        w_c.index_select(0, &kept_rows),
    );
    let mut b_k = otb_baselines(&sub_groups, &r_k, &w_k, epsilon);
    if handle_zero_tail {
        b_k = zero_tail(&b_k, &sub_groups, &lengths.index_select(0, &kept_rows));
    }
    let adv_c =
        Tensor::zeros([batch, width], (kind, device)).index_copy(0, &kept_rows, &(r_k - b_k));
    let advantages = Tensor::zeros_like(&returns).index_put(
        &[Some(&rows), Some(&cols)],
        &adv_c.index(&[Some(&rows), Some(&slot)]),
        false,
    ) * &mask;
    Ok((advantages, returns))
}

/// REINFORCE++ advantages, matching `compute_reinforce_plus_plus_outcome_advantage`.
///
/// Discounted returns-to-go `G_t = r_t + gamma * G_{t+1}`, where the running return is reset
/// after every masked position; the advantages are the returns whitened over the mask, times
/// the mask. Returns `(advantages, returns)` with the returns not whitened.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary, at least two ones
/// - returns: `(advantages, returns)`, `[batch, response_len]` each
pub fn reinforce_plus_plus(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    gamma: f64,
) -> Result<(Tensor, Tensor)> {
    let (mask, batch) = rewards_and_mask(token_level_rewards, response_mask)?;
    let _guard = tch::no_grad_guard();
    // [batch, response_len] -> [response_len, batch]
    let r = token_level_rewards.transpose(0, 1).contiguous();
    let m = mask.transpose(0, 1).contiguous();
    let len = r.size()[0];
    let returns = Tensor::zeros([len, batch], (r.kind(), r.device()));
    let mut running = Tensor::zeros([batch], (r.kind(), r.device()));
    for t in (0..len).rev() {
        running = r.get(t) + gamma * &running;
        returns.get(t).copy_(&running);
        // reset after EOS
        running *= m.get(t);
    }
    let returns = returns.transpose(0, 1);
    let advantages = masked::whiten_(&returns, &mask, true)? * &mask;
    Ok((advantages, returns))
}

/// REINFORCE++ with a group-mean baseline, matching
/// `compute_reinforce_plus_plus_baseline_outcome_advantage`: `score - group_mean` (a group of
/// one has mean 0), broadcast over the response, times the mask, whitened over the mask and
/// multiplied by the mask again. `returns` is the same tensor as `advantages`.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `response_mask`: `[batch, response_len]`, binary, at least two ones
/// - `index`: `[batch]` int64 group ids
/// - returns: `(advantages, returns)`, `[batch, response_len]` each, zero where masked
pub fn reinforce_plus_plus_baseline(
    token_level_rewards: &Tensor,
    response_mask: &Tensor,
    index: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (mask, groups) = outcome_groups(token_level_rewards, response_mask, index)?;
    let _guard = tch::no_grad_guard();
    let scores = scores(token_level_rewards);
    let centered = &scores - groups.rows(&group_mean_or_zero(&groups, &scores));
    let tiled = centered.unsqueeze(-1).expand_as(token_level_rewards) * &mask;
    let advantages = masked::whiten_(&tiled, &mask, true)? * &mask;
    Ok((advantages.shallow_clone(), advantages))
}

/// ReMax advantages, matching `compute_remax_outcome_advantage`: `returns` are the masked
/// rewards summed to go, and `advantages = returns - reward_baselines * mask`, where the
/// baseline is the reward of the greedy response to the same prompt.
///
/// # Shapes
/// - `token_level_rewards`: `[batch, response_len]` float
/// - `reward_baselines`: `[batch]` float
/// - `response_mask`: `[batch, response_len]`, binary
/// - returns: `(advantages, returns)`, `[batch, response_len]` each
pub fn remax(
    token_level_rewards: &Tensor,
    reward_baselines: &Tensor,
    response_mask: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (mask, batch) = rewards_and_mask(token_level_rewards, response_mask)?;
    check::float("reward_baselines", reward_baselines, &[Dim::Is(batch)])?;
    let _guard = tch::no_grad_guard();
    let returns = (token_level_rewards * &mask)
        .flip([-1])
        .cumsum(-1, None::<Kind>)
        .flip([-1]);
    let baselines = reward_baselines
        .to_kind(token_level_rewards.kind())
        .unsqueeze(-1);
    let advantages = &returns - baselines * &mask;
    Ok((advantages, returns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configs_default_grpo_epsilon_is_this_modules() {
        assert_eq!(AlgoConfig::default().grpo_epsilon, EPSILON);
    }

    #[test]
    fn names_parse_and_unknown_names_list_the_valid_ones() {
        for e in AdvEstimator::ALL {
            assert_eq!(e.as_str().parse::<AdvEstimator>().unwrap(), e);
            assert_eq!(serde_json::to_string(&e).unwrap(), format!("\"{e}\""));
        }
        let err = "ppo".parse::<AdvEstimator>().unwrap_err().to_string();
        assert!(
            err.starts_with("unknown adv_estimator `ppo`; expected one of: gae, grpo,"),
            "{err}"
        );
    }

    #[test]
    fn group_index_is_dense_in_first_appearance_order() {
        let g = group_index(&["b", "a", "b", "c"]);
        assert_eq!(Vec::<i64>::try_from(&g).unwrap(), vec![0, 1, 0, 2]);
    }

    #[test]
    fn passk_rejects_singletons_and_bad_index() {
        let r = Tensor::ones([3, 2], (Kind::Double, tch::Device::Cpu));
        let err =
            grpo_passk(&r, &r, &Tensor::from_slice(&[0i64, 0, 1]), true, EPSILON).unwrap_err();
        assert!(
            err.to_string().contains("at least 2 samples per group"),
            "{err}"
        );
        assert!(grpo(&r, &r, &Tensor::from_slice(&[0i64, 0]), true, EPSILON).is_err());
        assert!(
            grpo(
                &r,
                &r,
                &Tensor::from_slice(&[0.0f64, 0.0, 1.0]),
                true,
                EPSILON
            )
            .is_err()
        );
    }
}

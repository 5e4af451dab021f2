//! The objectives the trainers hand to the actor and critic: verl's `update_policy` loss
//! (policy loss + KL loss − entropy bonus), the clipped value loss, and the SFT loss.
//!
//! Each micro-batch's loss uses the whole mini-batch's normalisers ([`MiniBatchInfo`]), so the
//! micro-batch losses add up to the mini-batch loss and gradient accumulation is exact for
//! every aggregation mode. Metrics ending in `_loss` are such shares (the actor sums them per
//! mini-batch); the others are per-micro-batch averages.
//!
//! Under data parallelism the counts are those of the global mini-batch (all ranks) and the
//! loss is multiplied by `dp_size` (`meta_info.dp_size`), verl's `agg_loss`: the ranks then
//! average their gradients, which gives the gradient of the whole global mini-batch.

use rl_core::roles::{Metrics, MiniBatchInfo, PolicyObjective, PolicyOutput, ValueObjective};
use rl_core::{Batch, keys};
use tch::Tensor;

use crate::agg::{self, GlobalBatchInfo};
use crate::kl;
use crate::loss::{self, PolicyLossInputs, PolicyLossMode};
use crate::rollout_corr::{self, BypassLossType, RolloutCorrectionConfig};
use crate::trainer::config::{ActorLossConfig, CriticLossConfig};

/// The normalisers of `micro`'s loss: the mini-batch counts of [`MiniBatchInfo`] (global over the
/// data-parallel ranks) and `dp_size` from `meta_info` (1 without data parallelism), as verl's
/// `global_batch_info`.
///
/// `seq-mean-token-sum-norm` ignores `dp_size` in verl, so its gradient would shrink with the
/// world size once ranks average; under data parallelism its divisor becomes
/// `response_len / dp_size` instead, which keeps the update independent of the world size.
fn norm(info: MiniBatchInfo, micro: &Batch) -> GlobalBatchInfo {
    let dp = rl_core::dist::dp_size(micro);
    let loss_scale_factor = if dp > 1 {
        micro
            .get(keys::RESPONSE_MASK)
            .ok()
            .map(|m| m.size()[1] as f64 / dp as f64)
    } else {
        None
    };
    GlobalBatchInfo {
        dp_size: dp as i64,
        batch_num_tokens: Some(info.tokens.max(1.0)),
        global_batch_size: Some(info.sequences.max(1.0)),
        loss_scale_factor,
    }
}

fn wrap(e: crate::Error) -> rl_core::Error {
    rl_core::Error::Role {
        role: "objective",
        source: Box::new(e),
    }
}

fn item(t: &Tensor) -> f64 {
    t.detach().double_value(&[])
}

/// verl's actor loss: the configured policy loss, plus `kl_loss_coef * KL` when `use_kl_loss`
/// (reads `ref_log_prob`), minus `entropy_coeff * entropy` when the coefficient is non-zero.
/// Reads `old_log_probs`, `advantages`, `response_mask` restricted by `loss_mask` when present
/// ([`keys::policy_mask`]: multi-turn observations contribute nothing to any term), and
/// `rollout_is_weights` when the trainer put them there (rollout correction, decoupled mode).
/// `rollout_log_probs` are read only as [`RolloutLoss`] says.
#[derive(Debug, Clone)]
pub struct PolicyLoss {
    /// The loss keys.
    pub cfg: ActorLossConfig,
    /// Rollout correction inside the loss (bypass mode) and its diagnostics.
    pub rollout: RolloutLoss,
}

/// What the actor loss does with the rollout's own log-probs.
#[derive(Debug, Clone, Default)]
pub struct RolloutLoss {
    /// verl's bypass mode: `old_log_probs` are the rollout's, and each micro-batch's loss is
    /// `rollout_correction.loss_type` (PPO-clip, or REINFORCE with the importance weights) on
    /// the response mask after rejection, with the `rollout_corr/*` metrics of the current
    /// policy against the rollout (verl's `compute_policy_loss_bypass_mode`).
    pub bypass: Option<RolloutCorrectionConfig>,
    /// Outside bypass mode: log the `rollout_corr/*` diagnostics of the current policy against
    /// `rollout_log_probs` per micro-batch (verl's `compute_rollout_corr_metrics_from_logprobs`).
    pub diagnostics: bool,
}

/// verl's `actor/entropy`: the per-token `entropy` of a batch aggregated over `mask` with the
/// loss's `loss_agg_mode` (and `loss_scale_factor`), normalised by the batch itself (the
/// trainer's `agg_loss` call on the old-log-prob forward's entropies); `None` when the mask
/// holds no token (verl's mean modes would give NaN).
pub(crate) fn entropy_metric(
    cfg: &ActorLossConfig,
    entropy: &Tensor,
    mask: &Tensor,
) -> rl_core::Result<Option<f64>> {
    if mask.count_nonzero(None).int64_value(&[]) == 0 {
        return Ok(None);
    }
    let info = GlobalBatchInfo {
        loss_scale_factor: cfg.loss_scale_factor,
        ..GlobalBatchInfo::local()
    };
    let agg = agg::aggregate(
        &entropy.detach().to_kind(tch::Kind::Double),
        mask,
        cfg.loss_agg_mode,
        &info,
    )
    .map_err(wrap)?;
    Ok(Some(agg.double_value(&[])))
}

impl PolicyObjective for PolicyLoss {
    fn needs_entropy(&self) -> bool {
        self.cfg.entropy_coeff != 0.0
    }

    fn entropy_metric(&self, entropy: &Tensor, mask: &Tensor) -> rl_core::Result<Option<f64>> {
        entropy_metric(&self.cfg, entropy, mask)
    }

    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = &keys::policy_mask(micro)?;
        let norm = norm(info, micro);
        let mut pl_cfg = self.cfg.policy_loss_config();
        let advantages = micro.get(keys::ADVANTAGES)?;
        let mut metrics = Metrics::new();
        let pg = match &self.rollout.bypass {
            Some(rc) => {
                // old_log_probs are the rollout's: weights and rejection of the current policy
                // against them, then PPO-clip (the ratio is the correction) or REINFORCE with
                // the weights
                let old_log_prob = micro.get(keys::OLD_LOG_PROBS)?;
                let c =
                    rollout_corr::correct(&out.log_prob, old_log_prob, mask, rc).map_err(wrap)?;
                let reinforce = rc.loss_type == BypassLossType::Reinforce;
                pl_cfg.policy_loss.loss_mode = if reinforce {
                    PolicyLossMode::Reinforce
                } else {
                    PolicyLossMode::Vanilla
                };
                let inputs = PolicyLossInputs {
                    old_log_prob,
                    log_prob: &out.log_prob,
                    advantages,
                    response_mask: &c.response_mask,
                    rollout_is_weights: if reinforce { c.weights.as_ref() } else { None },
                };
                let pg = loss::policy(&inputs, &pl_cfg, &norm).map_err(wrap)?;
                for (k, v) in c.metrics {
                    metrics.push(k, v);
                }
                pg
            }
            None => {
                // verl's actor: on-policy (one mini-batch, one epoch) the current log-probs,
                // detached, are the old ones; the batch then need not hold them at all
                let current;
                let old_log_prob = if info.on_policy {
                    current = out.log_prob.detach();
                    &current
                } else {
                    micro.get(keys::OLD_LOG_PROBS)?
                };
                let inputs = PolicyLossInputs {
                    old_log_prob,
                    log_prob: &out.log_prob,
                    advantages,
                    response_mask: mask,
                    rollout_is_weights: micro.get(keys::ROLLOUT_IS_WEIGHTS).ok(),
                };
                if self.rollout.diagnostics {
                    let rollout = micro.get(keys::ROLLOUT_LOG_PROBS)?;
                    let diag = rollout_corr::metrics_from_logprobs(&out.log_prob, rollout, mask)
                        .map_err(wrap)?;
                    for (k, v) in diag {
                        metrics.push(k, v);
                    }
                }
                loss::policy(&inputs, &pl_cfg, &norm).map_err(wrap)?
            }
        };
        metrics.push("actor/pg_loss", item(&pg.loss));
        for (k, v) in pg.metrics.to_vec() {
            metrics.push(k, v);
        }
        let mut total = pg.loss;
        if self.cfg.entropy_coeff != 0.0 {
            let entropy = out
                .entropy
                .as_ref()
                .ok_or_else(|| rl_core::Error::MissingKey {
                    key: "entropy".into(),
                    present: "the actor computed no entropy".into(),
                })?;
            let ent = agg::aggregate(entropy, mask, self.cfg.loss_agg_mode, &norm).map_err(wrap)?;
            metrics.push("actor/entropy_loss", item(&ent));
            total -= ent * self.cfg.entropy_coeff;
        }
        if self.cfg.use_kl_loss {
            let reference = micro.get(keys::REF_LOG_PROB)?;
            let kld = kl::penalty(&out.log_prob, reference, self.cfg.kl_loss_type).map_err(wrap)?;
            let kl_loss =
                agg::aggregate(&kld, mask, self.cfg.loss_agg_mode, &norm).map_err(wrap)?;
            metrics.push("actor/kl_loss", item(&kl_loss));
            metrics.push("actor/kl_coef", self.cfg.kl_loss_coef);
            total += kl_loss * self.cfg.kl_loss_coef;
        }
        Ok((total, metrics))
    }
}

/// verl's clipped value loss (`compute_value_loss`), reading `values` (rollout-time),
/// `returns` and `response_mask` restricted by `loss_mask` ([`keys::policy_mask`]).
#[derive(Debug, Clone, Copy)]
pub struct ValueLoss {
    /// The loss keys.
    pub cfg: CriticLossConfig,
}

impl ValueObjective for ValueLoss {
    fn loss(
        &self,
        micro: &Batch,
        vpreds: &Tensor,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = keys::policy_mask(micro)?;
        let out = loss::value(
            vpreds,
            micro.get(keys::RETURNS)?,
            micro.get(keys::VALUES)?,
            &mask,
            self.cfg.cliprange_value,
            self.cfg.loss_agg_mode,
            &norm(info, micro),
        )
        .map_err(wrap)?;
        let mut metrics = Metrics::new();
        metrics.push(loss::VF_LOSS, item(&out.loss));
        metrics.push(loss::VF_CLIPFRAC, out.vf_clipfrac);
        let vmean = (vpreds.detach() * &mask)
            .sum(tch::Kind::Double)
            .double_value(&[])
            / mask.sum(tch::Kind::Double).double_value(&[]).max(1.0);
        metrics.push("critic/vpred_mean", vmean);
        Ok((out.loss, metrics))
    }
}

/// SFT: the negative log-likelihood of the response tokens, `token-mean` over the mini-batch
/// (verl's `fsdp_sft_trainer` loss, with the prompt masked out, and with whatever `loss_mask`
/// masks, such as tool observations in multi-turn traces).
#[derive(Debug, Clone, Copy, Default)]
pub struct SftLoss;

impl PolicyObjective for SftLoss {
    fn needs_entropy(&self) -> bool {
        false
    }

    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = keys::policy_mask(micro)?;
        let nll = -&out.log_prob;
        let l = agg::aggregate(&nll, &mask, agg::LossAggMode::TokenMean, &norm(info, micro))
            .map_err(wrap)?;
        let mut metrics = Metrics::new();
        metrics.push("train/loss", item(&l));
        Ok((l, metrics))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agg::LossAggMode;
    use tch::{Device, Kind};

    /// Two rows of 6 response tokens: generated (g), observation (o) and padding (p):
    /// row 0 `g g o o g p`, row 1 `g o g g p p`; two prompt columns before them.
    fn multi_turn_micro() -> (Batch, Vec<bool>, Vec<bool>) {
        let generated = [
            true, true, false, false, true, false, true, false, true, true, false, false,
        ];
        let real = [
            true, true, true, true, true, false, true, true, true, true, false, false,
        ];
        let f = |v: &[bool]| {
            Tensor::from_slice(
                &v.iter()
                    .map(|&b| f32::from(u8::from(b)))
                    .collect::<Vec<_>>(),
            )
            .view([2, 6])
        };
        let mut loss_mask = vec![0i64; 16];
        for r in 0..2 {
            for t in 0..6 {
                loss_mask[r * 8 + 2 + t] = i64::from(generated[r * 6 + t]);
            }
        }
        let mut b = Batch::new();
        b.insert(keys::RESPONSE_MASK, f(&real)).unwrap();
        b.insert(keys::LOSS_MASK, Tensor::from_slice(&loss_mask).view([2, 8]))
            .unwrap();
        tch::manual_seed(3);
        let lp = || Tensor::randn([2, 6], (Kind::Float, Device::Cpu)) * 0.1 - 1.0;
        b.insert(keys::OLD_LOG_PROBS, lp()).unwrap();
        b.insert(keys::REF_LOG_PROB, lp()).unwrap();
        b.insert(
            keys::ADVANTAGES,
            Tensor::from_slice(&[1.0f32, -0.5])
                .view([2, 1])
                .repeat([1, 6]),
        )
        .unwrap();
        b.insert(
            keys::VALUES,
            Tensor::zeros([2, 6], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
        b.insert(
            keys::RETURNS,
            Tensor::ones([2, 6], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
        (b, generated.to_vec(), real.to_vec())
    }

    fn info(generated: &[bool]) -> MiniBatchInfo {
        MiniBatchInfo {
            tokens: generated.iter().filter(|&&g| g).count() as f64,
            sequences: 2.0,
            on_policy: false,
        }
    }

    /// Gradients at observation tokens are exactly zero and at generated tokens non-zero, for
    /// every term of the actor's loss (policy, entropy, KL) and every aggregation mode.
    #[test]
    fn actor_loss_gradient_is_zero_at_observations_and_non_zero_at_generated_tokens() {
        let (micro, generated, _) = multi_turn_micro();
        for mode in [
            LossAggMode::TokenMean,
            LossAggMode::SeqMeanTokenSum,
            LossAggMode::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm,
        ] {
            let objective = PolicyLoss {
                rollout: RolloutLoss::default(),
                cfg: ActorLossConfig {
                    loss_agg_mode: mode,
                    entropy_coeff: 0.01,
                    use_kl_loss: true,
                    kl_loss_coef: 0.1,
                    ..ActorLossConfig::default()
                },
            };
            // the log-probs move off the old ones so the ratio and the KL are not at a stationary point
            let log_prob = (micro.get(keys::OLD_LOG_PROBS).unwrap() + 0.05)
                .detach()
                .set_requires_grad(true);
            let entropy =
                Tensor::full([2, 6], 0.7, (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let out = PolicyOutput {
                log_prob: log_prob.shallow_clone(),
                entropy: Some(entropy.shallow_clone()),
            };
            let (loss, _) = objective.loss(&micro, &out, info(&generated)).unwrap();
            loss.backward();
            for grad in [log_prob.grad(), entropy.grad()] {
                let grad = Vec::<f32>::try_from(grad.flatten(0, -1)).unwrap();
                for (i, (&g, &is_gen)) in grad.iter().zip(&generated).enumerate() {
                    if is_gen {
                        assert!(g != 0.0, "{mode:?}: zero gradient at generated token {i}");
                    } else {
                        assert_eq!(g, 0.0, "{mode:?}: gradient {g} at masked token {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn value_and_sft_losses_ignore_observation_tokens() {
        let (micro, generated, _) = multi_turn_micro();
        let vpreds = Tensor::full([2, 6], 0.3, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (loss, _) = ValueLoss {
            cfg: CriticLossConfig::default(),
        }
        .loss(&micro, &vpreds, info(&generated))
        .unwrap();
        loss.backward();
        let log_prob =
            Tensor::full([2, 6], -1.0, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let out = PolicyOutput {
            log_prob: log_prob.shallow_clone(),
            entropy: None,
        };
        let (sft, _) = SftLoss.loss(&micro, &out, info(&generated)).unwrap();
        sft.backward();
        for grad in [vpreds.grad(), log_prob.grad()] {
            let grad = Vec::<f32>::try_from(grad.flatten(0, -1)).unwrap();
            for (&g, &is_gen) in grad.iter().zip(&generated) {
                assert_eq!(g != 0.0, is_gen, "{grad:?}");
            }
        }
    }
}

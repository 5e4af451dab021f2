//! Reward composition: [`CombinedReward`] (a weighted sum of reward roles, e.g. a reward model
//! plus rule functions, verl's `reward_model.enable` next to a reward function),
//! [`TrainValReward`] (verl's `reward_fn` / `val_reward_fn`) and [`reward_metrics`].

use rl_core::roles::Reward;
use rl_core::{Batch, StepMetrics, keys};
use serde_json::Value;
use tch::{Kind, Tensor};

/// Column a [`Reward`] role may add with each row's score (else the summed scores are used).
pub const SCORE_COLUMN: &str = "score";

/// Suffix of the per-part score columns [`CombinedReward`] writes (`rm_score`, `rule_score`).
pub const PART_SCORE_SUFFIX: &str = "_score";

/// One weighted part of a [`CombinedReward`].
pub struct RewardPart {
    /// Names the part's column `<name>_score` and its metrics `reward/<name>_score/*`.
    pub name: String,
    /// The weight of its scores in the sum, finite (0 scores it for its columns and metrics
    /// only).
    pub weight: f64,
    /// The role.
    pub reward: Box<dyn Reward>,
}

impl std::fmt::Debug for RewardPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardPart")
            .field("name", &self.name)
            .field("weight", &self.weight)
            .finish()
    }
}

/// A weighted sum of reward roles:
/// `token_level_scores = sum_k weight_k * token_level_scores_k`, token by token.
///
/// Every part puts its scalar on each row's last response token (the [`Reward`] contract, as
/// verl's reward managers and reward-model worker do), so the sum holds
/// `sum_k weight_k * score_k` at that token and 0 elsewhere; with a reward model `rm` and a
/// rule function `rule` this is `rm_coef * rm_score + rule_coef * rule_score`. A part with
/// weight 0 is still scored, for its columns and metrics, but adds nothing (not even a NaN).
///
/// The output holds `token_level_scores`, the column [`SCORE_COLUMN`] (each row's combined
/// score), one column `<name>_score` per part (the part's own `score` column, or its summed
/// `token_level_scores` when it writes none), and every other key the parts write (`acc`,
/// `rm_scores`, decoded texts); two parts writing one key with different values is an error
/// naming the key.
#[derive(Debug)]
pub struct CombinedReward {
    parts: Vec<RewardPart>,
}

fn invalid(name: &'static str, reason: String) -> rl_core::Error {
    rl_core::Error::InvalidArgument { name, reason }
}

impl CombinedReward {
    /// Combines `parts`; at least one, names distinct and non-empty, weights finite.
    pub fn new(parts: Vec<RewardPart>) -> rl_core::Result<Self> {
        if parts.is_empty() {
            return Err(invalid("parts", "needs at least one reward role".into()));
        }
        for (i, p) in parts.iter().enumerate() {
            if p.name.is_empty() {
                return Err(invalid(
                    "name",
                    format!("reward part {i} has an empty name"),
                ));
            }
            if parts[..i].iter().any(|q| q.name == p.name) {
                return Err(invalid(
                    "name",
                    format!("two reward parts are named `{}`", p.name),
                ));
            }
            if !p.weight.is_finite() {
                return Err(invalid(
                    "weight",
                    format!("reward part `{}` has weight {}", p.name, p.weight),
                ));
            }
        }
        Ok(CombinedReward { parts })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[RewardPart] {
        &self.parts
    }
}

/// Per-row sums of `[batch, response_len]` scores, as f64.
fn row_sums(t: &Tensor) -> rl_core::Result<Vec<f64>> {
    Ok(Vec::<f64>::try_from(t.sum_dim_intlist(
        [-1].as_slice(),
        false,
        Kind::Double,
    ))?)
}

impl Reward for CombinedReward {
    fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let mask = batch.get(keys::RESPONSE_MASK)?;
        let mut total = mask.zeros_like().to_kind(Kind::Float);
        let mut out = Batch::new();
        for part in &mut self.parts {
            let mut scored = part.reward.score(batch)?;
            let tls = scored.pop(keys::TOKEN_LEVEL_SCORES).map_err(|e| {
                invalid(
                    "reward",
                    format!(
                        "reward part `{}` wrote no token_level_scores: {e}",
                        part.name
                    ),
                )
            })?;
            rl_core::shape::expect_same_shape(
                keys::TOKEN_LEVEL_SCORES,
                &tls,
                keys::RESPONSE_MASK,
                mask,
            )?;
            let own: Vec<Value> = match scored.contains(SCORE_COLUMN) {
                true => scored.pop_column(SCORE_COLUMN)?,
                false => row_sums(&tls)?.into_iter().map(Value::from).collect(),
            };
            scored.insert_column(format!("{}{PART_SCORE_SUFFIX}", part.name), own)?;
            if part.weight != 0.0 {
                total += tls.to_kind(Kind::Float).to_device(total.device()) * part.weight;
            }
            out.union(scored)?;
        }
        let rows = row_sums(&total)?;
        out.insert(keys::TOKEN_LEVEL_SCORES, total)?;
        out.insert_column(SCORE_COLUMN, rows.into_iter().map(Value::from).collect())?;
        Ok(out)
    }
}

/// Rewards for training and for validation, as verl's `reward_fn` and `val_reward_fn`: a batch
/// whose `meta_info.validate` is true (what the trainers' validation rollouts carry) is scored
/// by `val`, every other by `train`. verl validates with rule rewards only, even when a reward
/// model trains the policy; this is how to say so.
pub struct TrainValReward {
    /// Scores training batches.
    pub train: Box<dyn Reward>,
    /// Scores validation batches.
    pub val: Box<dyn Reward>,
}

impl std::fmt::Debug for TrainValReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainValReward").finish_non_exhaustive()
    }
}

impl Reward for TrainValReward {
    fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let validate = batch
            .meta_info()
            .get("validate")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if validate {
            self.val.score(batch)
        } else {
            self.train.score(batch)
        }
    }
}

/// `reward/<column>/{mean,max,min}` over the rows of a scored batch, for the column
/// [`SCORE_COLUMN`] and every column ending in `_score` (the parts of a [`CombinedReward`]:
/// `reward/rm_score/mean`, `reward/rule_score/mean`). Non-numeric values are skipped.
pub fn reward_metrics(scored: &Batch) -> StepMetrics {
    let mut m = StepMetrics::new();
    for key in scored.column_keys() {
        if key != SCORE_COLUMN && !key.ends_with(PART_SCORE_SUFFIX) {
            continue;
        }
        let Ok(col) = scored.column(key) else {
            continue;
        };
        let vs: Vec<f64> = col.iter().filter_map(Value::as_f64).collect();
        if vs.is_empty() {
            continue;
        }
        let mean = vs.iter().sum::<f64>() / vs.len() as f64;
        let max = vs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let min = vs.iter().copied().fold(f64::INFINITY, f64::min);
        m.insert(format!("reward/{key}/mean"), mean);
        m.insert(format!("reward/{key}/max"), max);
        m.insert(format!("reward/{key}/min"), min);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// Puts fixed per-row scores on the last response token, with an `acc` column.
    struct Fixed {
        scores: Vec<f32>,
        with_score_column: bool,
    }

    impl Reward for Fixed {
        fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
            let mask = batch.get(keys::RESPONSE_MASK)?;
            let len = mask.sum_dim_intlist([1].as_slice(), false, Kind::Int64);
            let last = (len - 1).clamp_min(0).unsqueeze(-1);
            let vals = Tensor::from_slice(&self.scores).unsqueeze(-1);
            let tls = mask.zeros_like().scatter(1, &last, &vals);
            let mut out = Batch::new();
            out.insert(keys::TOKEN_LEVEL_SCORES, tls)?;
            if self.with_score_column {
                out.insert_column(
                    SCORE_COLUMN,
                    self.scores.iter().map(|&s| Value::from(s as f64)).collect(),
                )?;
            }
            Ok(out)
        }
    }

    fn batch() -> Batch {
        let mut b = Batch::new();
        let mask = Tensor::from_slice(&[1f32, 1., 1., 1., 0., 0.]).view([2, 3]);
        b.insert(keys::RESPONSE_MASK, mask).unwrap();
        b
    }

    #[test]
    fn the_sum_is_weighted_and_lands_on_the_last_token() {
        let rm = Fixed {
            scores: vec![0.5, -2.0],
            with_score_column: true,
        };
        let rule = Fixed {
            scores: vec![1.0, 0.0],
            with_score_column: false,
        };
        let mut c = CombinedReward::new(vec![
            RewardPart {
                name: "rm".into(),
                weight: 0.1,
                reward: Box::new(rm),
            },
            RewardPart {
                name: "rule".into(),
                weight: 1.0,
                reward: Box::new(rule),
            },
        ])
        .unwrap();
        let out = c.score(&batch()).unwrap();
        let tls = out.get(keys::TOKEN_LEVEL_SCORES).unwrap();
        let expect = Tensor::from_slice(&[0f32, 0., 0.05 + 1.0, -0.2, 0., 0.]).view([2, 3]);
        assert!(tls.allclose(&expect, 0.0, 1e-7, false), "{tls}");
        let score = out.column(SCORE_COLUMN).unwrap();
        assert!((score[0].as_f64().unwrap() - 1.05).abs() < 1e-6);
        assert_eq!(out.column("rm_score").unwrap()[1], Value::from(-2.0));
        assert_eq!(out.column("rule_score").unwrap()[0], Value::from(1.0));
        let m = reward_metrics(&out);
        assert_eq!(m["reward/rm_score/mean"], -0.75);
        assert_eq!(m["reward/rule_score/max"], 1.0);
        assert!(m.contains_key("reward/score/min"));
    }

    #[test]
    fn weight_zero_adds_nothing_even_for_nan() {
        let mut c = CombinedReward::new(vec![
            RewardPart {
                name: "rm".into(),
                weight: 1.0,
                reward: Box::new(Fixed {
                    scores: vec![2.0, 3.0],
                    with_score_column: false,
                }),
            },
            RewardPart {
                name: "rule".into(),
                weight: 0.0,
                reward: Box::new(Fixed {
                    scores: vec![f32::NAN, 1.0],
                    with_score_column: false,
                }),
            },
        ])
        .unwrap();
        let out = c.score(&batch()).unwrap();
        let rows = row_sums(out.get(keys::TOKEN_LEVEL_SCORES).unwrap()).unwrap();
        assert_eq!(rows, vec![2.0, 3.0]);
    }

    #[test]
    fn bad_parts_are_named() {
        let part = |name: &str, weight: f64| RewardPart {
            name: name.into(),
            weight,
            reward: Box::new(Fixed {
                scores: vec![0.0, 0.0],
                with_score_column: false,
            }),
        };
        let e = CombinedReward::new(vec![part("rm", 1.0), part("rm", 1.0)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`rm`"), "{e}");
        let e = CombinedReward::new(vec![part("rm", f64::NAN)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("weight"), "{e}");
        assert!(CombinedReward::new(Vec::new()).is_err());
    }

    #[test]
    fn validation_batches_go_to_the_val_reward() {
        let mut r = TrainValReward {
            train: Box::new(Fixed {
                scores: vec![1.0, 1.0],
                with_score_column: false,
            }),
            val: Box::new(Fixed {
                scores: vec![7.0, 7.0],
                with_score_column: false,
            }),
        };
        let mut b = batch();
        let s = |r: &mut TrainValReward, b: &Batch| {
            row_sums(r.score(b).unwrap().get(keys::TOKEN_LEVEL_SCORES).unwrap()).unwrap()[0]
        };
        assert_eq!(s(&mut r, &b), 1.0);
        b.meta_info_mut().insert("validate".into(), true.into());
        assert_eq!(s(&mut r, &b), 7.0);
        let _ = Device::Cpu;
    }
}

//! Invariants of the math, checked with proptest on random batches.

use proptest::prelude::*;
use rl_algos::advantage;
use rl_algos::agg::{self, GlobalBatchInfo, LossAggMode};
use rl_algos::dpo::{self, DpoConfig};
use rl_algos::kl;
use rl_algos::loss::{self, PolicyLossConfig, PolicyLossInputs};
use rl_algos::masked;
use tch::{Kind, Tensor};

fn t2(v: &[f64], rows: usize) -> Tensor {
    Tensor::from_slice(v).reshape([rows as i64, (v.len() / rows) as i64])
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

/// A `[rows, cols]` batch: values, and a binary mask with at least one non-empty row.
fn batch(max_rows: usize, max_cols: usize) -> impl Strategy<Value = (usize, Vec<f64>, Vec<f64>)> {
    (1..=max_rows, 1..=max_cols).prop_flat_map(|(rows, cols)| {
        let n = rows * cols;
        (
            Just(rows),
            prop::collection::vec(-5.0..5.0f64, n),
            prop::collection::vec(prop::bool::weighted(0.7), n).prop_map(move |mut bits| {
                bits[0] = true;
                bits.into_iter()
                    .map(|b| if b { 1.0 } else { 0.0 })
                    .collect()
            }),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn grpo_advantages_are_centred_per_group_and_zero_where_masked(
        sizes in prop::collection::vec(2usize..6, 1..5),
        cols in 1usize..7,
        norm in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let rows: usize = sizes.iter().sum();
        let index: Vec<i64> = sizes.iter().enumerate().flat_map(|(g, &s)| std::iter::repeat_n(g as i64 * 7 + 3, s)).collect();
        let mut rng = seed;
        let mut next = || { rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); rng >> 33 };
        // rewards from a small set so that ties and constant groups happen
        let rewards: Vec<f64> = (0..rows * cols).map(|_| [0.0, 1.0, 0.5, -1.0][(next() % 4) as usize]).collect();
        let mut mask: Vec<f64> = (0..rows * cols).map(|_| (next() % 3 != 0) as i64 as f64).collect();
        for r in 0..rows { mask[r * cols] = 1.0; }
        let (r, m) = (t2(&rewards, rows), t2(&mask, rows));
        let (adv, _) = advantage::grpo(&r, &m, &Tensor::from_slice(&index), norm, advantage::EPSILON).unwrap();
        let masked_part = max_abs(&(&adv * (1.0 - &m)));
        prop_assert_eq!(masked_part, 0.0);
        let first = adv.select(1, 0);
        let mut start = 0;
        for &s in &sizes {
            let mean = first.narrow(0, start as i64, s as i64).mean(Kind::Double).double_value(&[]);
            prop_assert!(mean.abs() < 1e-9, "group mean {}", mean);
            start += s;
        }
    }

    #[test]
    fn ppo_clip_is_the_plain_surrogate_inside_the_trust_region(
        (rows, adv, mask) in batch(6, 8),
        u in prop::collection::vec(0.0..1.0f64, 48),
        low in 0.05..0.4f64,
        high in 0.05..0.4f64,
        mode in prop::sample::select(LossAggMode::ALL.to_vec()),
    ) {
        let n = adv.len();
        let cols = n / rows;
        // log-ratios strictly inside [ln(1 - low), ln(1 + high)]
        let (a, b) = ((1.0 - low).ln() * 0.999, (1.0 + high).ln() * 0.999);
        let delta: Vec<f64> = (0..n).map(|i| a + (b - a) * u[i % u.len()]).collect();
        let old = t2(&vec![-1.0; n], rows);
        let lp = (&old + t2(&delta, rows)).set_requires_grad(true);
        let (adv, m) = (t2(&adv, rows), t2(&mask, rows));
        let cfg = PolicyLossConfig { clip_ratio_low: Some(low), clip_ratio_high: Some(high), loss_agg_mode: mode, ..Default::default() };
        let inputs = PolicyLossInputs { old_log_prob: &old, log_prob: &lp, advantages: &adv, response_mask: &m, rollout_is_weights: None };
        let out = loss::ppo_clip(&inputs, &cfg, &GlobalBatchInfo::local()).unwrap();
        let plain = agg::aggregate(&(-&adv * (&lp - &old).exp()), &m, mode, &GlobalBatchInfo::local()).unwrap();
        let (x, y) = (out.loss.double_value(&[]), plain.double_value(&[]));
        prop_assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{} vs {}", x, y);
        prop_assert_eq!(out.metrics.pg_clipfrac, Some(0.0));
        let g1 = Tensor::run_backward(&[&out.loss], &[&lp], true, false).pop().unwrap();
        let g2 = Tensor::run_backward(&[&plain], &[&lp], false, false).pop().unwrap();
        prop_assert!(max_abs(&(g1 - g2)) < 1e-12);
        let _ = cols;
    }

    #[test]
    fn kl_estimators_have_their_signs(
        (rows, a, _m) in batch(5, 8),
        d in prop::collection::vec(prop_oneof![-3.0..-1e-3f64, 1e-3..3.0f64], 40),
        equal in prop::collection::vec(any::<bool>(), 40),
    ) {
        let n = a.len();
        let lp = t2(&a, rows);
        let diff: Vec<f64> = (0..n).map(|i| if equal[i % 40] { 0.0 } else { d[i % 40] }).collect();
        let rf = &lp + t2(&diff, rows);
        let same = t2(&diff, rows).eq(0.0);
        prop_assert_eq!(max_abs(&(kl::k1(&lp, &rf).unwrap() + kl::k1(&rf, &lp).unwrap())), 0.0);
        for k in [kl::k2(&lp, &rf).unwrap(), kl::low_var_kl(&lp, &rf).unwrap()] {
            prop_assert!(k.min().double_value(&[]) >= 0.0);
            // zero exactly where the log-probs match
            prop_assert!(k.eq(0.0).eq_tensor(&same).all().int64_value(&[]) == 1);
        }
    }

    #[test]
    fn gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go((rows, r, m) in batch(6, 9)) {
        prop_assume!(m.iter().sum::<f64>() >= 2.0);
        let (r, m) = (t2(&r, rows), t2(&m, rows));
        let (adv, ret) = advantage::gae(&r, &r.zeros_like(), &m, 1.0, 1.0).unwrap();
        let to_go = (&r * &m).flip([-1]).cumsum(-1, Kind::Double).flip([-1]);
        prop_assert!(max_abs(&(&ret - &to_go)) < 1e-12);
        let whitened = masked::whiten(&to_go, &m, true).unwrap();
        prop_assert!(max_abs(&(adv - whitened)) < 1e-9);
    }

    #[test]
    fn aggregation_ignores_masked_values(
        (rows, x, m) in batch(6, 8),
        junk in prop::collection::vec(prop_oneof![Just(f64::NAN), Just(f64::INFINITY), -1e6..1e6f64], 48),
        mode in prop::sample::select(LossAggMode::ALL.to_vec()),
    ) {
        let n = x.len();
        let mask = t2(&m, rows);
        let clean = t2(&x, rows).set_requires_grad(true);
        let dirty_vals: Vec<f64> = (0..n).map(|i| if m[i] == 0.0 { junk[i % junk.len()] } else { x[i] }).collect();
        let dirty = t2(&dirty_vals, rows).set_requires_grad(true);
        let info = GlobalBatchInfo::local();
        let a = agg::aggregate(&clean, &mask, mode, &info).unwrap();
        let b = agg::aggregate(&dirty, &mask, mode, &info).unwrap();
        prop_assert_eq!(a.double_value(&[]), b.double_value(&[]));
        a.backward();
        b.backward();
        prop_assert!(clean.grad().equal(&dirty.grad()));
    }

    #[test]
    fn dpo_sigmoid_is_ln2_at_equal_margins(
        pc in prop::collection::vec(-50.0..0.0f64, 1..9),
        shift in -10.0..10.0f64,
        margin in -5.0..5.0f64,
        beta in 0.01..2.0f64,
    ) {
        let pc = Tensor::from_slice(&pc);
        let pr = &pc - margin;
        let (rc, rr) = (&pc + shift, &pr + shift);
        let cfg = DpoConfig { dpo_beta: beta, ..DpoConfig::default() };
        let l = dpo::loss(&pc, &pr, &rc, &rr, &cfg).unwrap().double_value(&[]);
        prop_assert!((l - std::f64::consts::LN_2).abs() < 1e-9, "{}", l);
    }

    #[test]
    fn micro_batches_accumulate_to_the_whole_batch(
        (rows, x, m) in batch(8, 6),
        split in 1usize..4,
        mode in prop::sample::select(LossAggMode::ALL.to_vec()),
    ) {
        let (x, mask) = (t2(&x, rows), t2(&m, rows));
        let cols = x.size()[1];
        // the whole batch, normalised by itself
        let whole = x.copy().set_requires_grad(true);
        let full = agg::aggregate(&whole, &mask, mode, &GlobalBatchInfo::local()).unwrap();
        full.backward();
        // micro-batches normalised by the whole mini-batch's counts, gradients accumulated
        let info = GlobalBatchInfo::from_mini_batch(&mask).unwrap();
        let parts = x.copy().set_requires_grad(true);
        let chunk = rows.div_ceil(split) as i64;
        let mut sum = 0.0;
        let mut start = 0;
        while start < rows as i64 {
            let len = chunk.min(rows as i64 - start);
            let l = agg::aggregate(&parts.narrow(0, start, len), &mask.narrow(0, start, len), mode, &info).unwrap();
            sum += l.double_value(&[]);
            l.backward();
            start += len;
        }
        let f = full.double_value(&[]);
        prop_assert!((f - sum).abs() <= 1e-10 * (1.0 + f.abs()), "{} vs {}", f, sum);
        prop_assert!(max_abs(&(whole.grad() - parts.grad())) < 1e-12);
        let _ = cols;
    }

    #[test]
    fn ppo_clip_micro_batches_accumulate_to_the_whole_batch(
        (rows, adv, m) in batch(8, 6),
        d in prop::collection::vec(-1.0..1.0f64, 48),
        split in 1usize..4,
        mode in prop::sample::select(LossAggMode::ALL.to_vec()),
    ) {
        let n = adv.len();
        let (adv, mask) = (t2(&adv, rows), t2(&m, rows));
        let old = t2(&vec![-2.0; n], rows);
        let lp0 = &old + t2(&(0..n).map(|i| d[i % d.len()]).collect::<Vec<_>>(), rows);
        let cfg = PolicyLossConfig { clip_ratio_high: Some(0.28), loss_agg_mode: mode, ..Default::default() };
        let run = |lp: &Tensor, rows: (i64, i64), info: &GlobalBatchInfo| {
            let (s, l) = rows;
            let (o, a, m) = (old.narrow(0, s, l), adv.narrow(0, s, l), mask.narrow(0, s, l));
            let lp = lp.narrow(0, s, l);
            let inputs = PolicyLossInputs { old_log_prob: &o, log_prob: &lp, advantages: &a, response_mask: &m, rollout_is_weights: None };
            loss::ppo_clip(&inputs, &cfg, info).unwrap().loss
        };
        let whole = lp0.copy().set_requires_grad(true);
        let full = run(&whole, (0, rows as i64), &GlobalBatchInfo::local());
        full.backward();
        let info = GlobalBatchInfo::from_mini_batch(&mask).unwrap();
        let parts = lp0.copy().set_requires_grad(true);
        let chunk = rows.div_ceil(split) as i64;
        let (mut sum, mut start) = (0.0, 0);
        while start < rows as i64 {
            let len = chunk.min(rows as i64 - start);
            let l = run(&parts, (start, len), &info);
            sum += l.double_value(&[]);
            l.backward();
            start += len;
        }
        let f = full.double_value(&[]);
        prop_assert!((f - sum).abs() <= 1e-10 * (1.0 + f.abs()), "{} vs {}", f, sum);
        prop_assert!(max_abs(&(whole.grad() - parts.grad())) < 1e-12);
    }
}

//! Parity with verl: values, gradients and metrics of every fixture case, within `RTOL`/`ATOL`.
//!
//! The fixtures in `tests/fixtures/` were made by `generate.py` from verl's own functions.

use std::collections::HashMap;

use rl_algos::advantage;
use rl_algos::agg::{self, GlobalBatchInfo};
use rl_algos::dapo::{self, OverlongBufferConfig};
use rl_algos::dpo::{self, DpoConfig};
use rl_algos::kl::{self, KlController};
use rl_algos::logits;
use rl_algos::loss::{self, PolicyLossConfig, PolicyLossInputs, PolicyLossParams};
use rl_algos::masked;
use rl_algos::{KlCtrlConfig, KlPenalty, PolicyLossMode};
use tch::Kind;

mod common;

use common::{Case, Family, batch_info, leaf, mode};

#[test]
fn masked_and_logits_match_verl() {
    let fam = Family::load("masked");
    for c in fam.cases() {
        match c.func() {
            "masked" => {
                let (v, m) = (c.t("values"), c.t("mask"));
                c.close_key("sum", &masked::sum(&v, &m, None).unwrap());
                c.close_key("sum_rows", &masked::sum(&v, &m, Some(-1)).unwrap());
                c.close_key("mean", &masked::mean(&v, &m, None).unwrap());
                c.close_key("mean_rows", &masked::mean(&v, &m, Some(-1)).unwrap());
                c.close_key("var_unbiased", &masked::var(&v, &m, true).unwrap());
                c.close_key("var_biased", &masked::var(&v, &m, false).unwrap());
                c.close_key("whiten", &masked::whiten(&v, &m, true).unwrap());
                c.close_key("whiten_keep_mean", &masked::whiten(&v, &m, false).unwrap());
            }
            "logits" => {
                let (w, labels) = (c.t("weights"), c.t("labels"));
                let x = leaf(&c.t("logits"));
                let lp = logits::log_probs(&x, &labels).unwrap();
                c.close_key("log_probs", &lp);
                (lp * &w).sum(Kind::Double).backward();
                c.close_key("grad_log_probs", &x.grad());
                let x = leaf(&c.t("logits"));
                let h = logits::entropy(&x).unwrap();
                c.close_key("entropy", &h);
                (h * &w).sum(Kind::Double).backward();
                c.close_key("grad_entropy", &x.grad());
            }
            other => panic!("unknown fn {other}"),
        }
    }
}

#[test]
fn aggregation_matches_verl() {
    let fam = Family::load("agg");
    for c in fam.cases() {
        let info = GlobalBatchInfo {
            dp_size: c.p("dp_size").as_i64().unwrap_or(1),
            batch_num_tokens: c.p("batch_num_tokens").as_f64(),
            global_batch_size: c.p("global_batch_size").as_f64(),
            loss_scale_factor: c.p("loss_scale_factor").as_f64(),
        };
        let x = leaf(&c.t("loss_mat"));
        let loss = agg::aggregate(
            &x,
            &c.t("loss_mask"),
            mode(c.p("mode").as_str().unwrap()),
            &info,
        )
        .unwrap();
        c.close_key("loss", &loss);
        loss.backward();
        c.close_key("grad", &x.grad());
    }
}

#[test]
fn advantages_match_verl() {
    let fam = Family::load("advantage");
    let mut seen = 0;
    for c in fam.cases() {
        let (r, m) = (c.t("token_level_rewards"), c.t("response_mask"));
        let index = || c.t("index");
        let flag = || c.p("norm_adv_by_std_in_grpo").as_bool().unwrap();
        let (adv, ret) = match c.func() {
            "gae" => advantage::gae(&r, &c.t("values"), &m, c.f("gamma"), c.f("lam")),
            "grpo" => advantage::grpo(&r, &m, &index(), flag(), advantage::EPSILON),
            "grpo_passk" => advantage::grpo_passk(&r, &m, &index(), flag(), advantage::EPSILON),
            "rloo" => advantage::rloo(&r, &m, &index()),
            "opo" => advantage::opo(&r, &m, &index()),
            "gpg" => advantage::gpg(&r, &m, &index(), 1.0),
            "reinforce_plus_plus" => advantage::reinforce_plus_plus(&r, &m, c.f("gamma")),
            "reinforce_plus_plus_baseline" => {
                advantage::reinforce_plus_plus_baseline(&r, &m, &index())
            }
            "remax" => advantage::remax(&r, &c.t("reward_baselines"), &m),
            other => panic!("unknown fn {other}"),
        }
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        c.close_key("advantages", &adv);
        c.close_key("returns", &ret);
        seen += 1;
    }
    assert_eq!(seen, 13);
}

#[test]
fn kl_matches_verl() {
    let fam = Family::load("kl");
    for c in fam.cases() {
        match c.func() {
            "penalty" => {
                let kind: KlPenalty = c.p("kl_penalty").as_str().unwrap().parse().unwrap();
                let x = leaf(&c.t("log_prob"));
                let out = kl::penalty(&x, &c.t("ref_log_prob"), kind).unwrap();
                c.close_key("kl", &out);
                (out * c.t("weights")).sum(Kind::Double).backward();
                c.close_key("grad_log_prob", &x.grad());
            }
            "in_reward" => {
                let cfg: KlCtrlConfig = serde_json::from_value(c.p("kl_ctrl").clone()).unwrap();
                let mut ctrl = KlController::new(&cfg).unwrap();
                let kind: KlPenalty = c.p("kl_penalty").as_str().unwrap().parse().unwrap();
                let (rewards, metrics) = kl::in_reward(
                    &c.t("token_level_scores"),
                    &c.t("old_log_probs"),
                    &c.t("ref_log_prob"),
                    &c.t("response_mask"),
                    &mut ctrl,
                    kind,
                )
                .unwrap();
                c.close_key("token_level_rewards", &rewards);
                c.close_f(
                    "reward_kl_penalty",
                    metrics.reward_kl_penalty,
                    c.metric(kl::REWARD_KL_PENALTY),
                );
                c.close_f(
                    "coeff",
                    metrics.reward_kl_penalty_coeff,
                    c.metric(kl::REWARD_KL_PENALTY_COEFF),
                );
                c.close_f("kl_coef_after", ctrl.value(), c.metric("kl_coef_after"));
            }
            "controller" => {
                let cfg = KlCtrlConfig {
                    kind: rl_algos::KlCtrlType::Adaptive,
                    kl_coef: c.f("kl_coef"),
                    horizon: c.p("horizon").as_i64().unwrap(),
                    target_kl: c.f("target_kl"),
                };
                let mut ctrl = KlController::new(&cfg).unwrap();
                let want = c.json["metrics"]["values"].as_array().unwrap();
                for (step, w) in c.p("steps").as_array().unwrap().iter().zip(want) {
                    ctrl.update(
                        step[0].as_f64().unwrap(),
                        step[1].as_u64().unwrap() as usize,
                    );
                    c.close_f("value", ctrl.value(), w.as_f64().unwrap());
                }
            }
            other => panic!("unknown fn {other}"),
        }
    }
}

fn policy_config(c: &Case<'_>) -> PolicyLossConfig {
    let mut params = PolicyLossParams::default();
    let pl = c.p("policy_loss");
    if pl.is_object() {
        params = serde_json::from_value(pl.clone()).unwrap();
    } else if let Some(m) = c.p("loss_mode").as_str() {
        params.loss_mode = m.parse::<PolicyLossMode>().unwrap();
    }
    PolicyLossConfig {
        clip_ratio: c.f("clip_ratio"),
        clip_ratio_low: c.p("clip_ratio_low").as_f64(),
        clip_ratio_high: c.p("clip_ratio_high").as_f64(),
        clip_ratio_c: c.f("clip_ratio_c"),
        loss_agg_mode: mode(c.p("loss_agg_mode").as_str().unwrap()),
        loss_scale_factor: None,
        tau_pos: c.p("tau_pos").as_f64().unwrap_or(1.0),
        tau_neg: c.p("tau_neg").as_f64().unwrap_or(1.05),
        policy_loss: params,
    }
}

#[test]
fn losses_match_verl() {
    let fam = Family::load("loss");
    let mut seen = HashMap::<String, usize>::new();
    for c in fam.cases() {
        match c.func() {
            "policy" => {
                let cfg = policy_config(&c);
                let info = batch_info(c.p("global_batch_info"));
                let x = leaf(&c.t("log_prob"));
                let (old, adv, m) = (c.t("old_log_prob"), c.t("advantages"), c.t("response_mask"));
                let w = c
                    .has("rollout_is_weights")
                    .then(|| c.t("rollout_is_weights"));
                let inputs = PolicyLossInputs {
                    old_log_prob: &old,
                    log_prob: &x,
                    advantages: &adv,
                    response_mask: &m,
                    rollout_is_weights: w.as_ref(),
                };
                if let Some(seed) = c.p("seed").as_i64() {
                    tch::manual_seed(seed);
                }
                let out = loss::policy(&inputs, &cfg, &info)
                    .unwrap_or_else(|e| panic!("{}: {e}", c.name));
                c.close_key("loss", &out.loss);
                out.loss.backward();
                c.close_key("grad_log_prob", &x.grad());
                let want = c.json["metrics"].as_object().unwrap();
                let got: HashMap<&str, f64> = out
                    .metrics
                    .to_vec()
                    .into_iter()
                    .map(|(k, v)| (k.trim_start_matches("actor/"), v))
                    .collect();
                assert_eq!(
                    got.len(),
                    want.len(),
                    "{}: metric keys {got:?} vs {want:?}",
                    c.name
                );
                for (k, v) in want {
                    c.close_f(k, got[k.as_str()], v.as_f64().unwrap());
                }
                *seen
                    .entry(cfg.policy_loss.loss_mode.to_string())
                    .or_default() += 1;
            }
            "value" => {
                let x = leaf(&c.t("vpreds"));
                let out = loss::value(
                    &x,
                    &c.t("returns"),
                    &c.t("values"),
                    &c.t("response_mask"),
                    c.f("cliprange_value"),
                    mode(c.p("loss_agg_mode").as_str().unwrap()),
                    &GlobalBatchInfo::local(),
                )
                .unwrap();
                c.close_key("loss", &out.loss);
                out.loss.backward();
                c.close_key("grad_vpreds", &x.grad());
                c.close_f("vf_clipfrac", out.vf_clipfrac, c.metric("vf_clipfrac"));
            }
            "entropy" => {
                let x = leaf(&c.t("logits"));
                let mode = mode(c.p("loss_agg_mode").as_str().unwrap());
                let l = loss::entropy(&x, &c.t("response_mask"), mode, &GlobalBatchInfo::local())
                    .unwrap();
                c.close_key("loss", &l);
                l.backward();
                c.close_key("grad_logits", &x.grad());
            }
            other => panic!("unknown fn {other}"),
        }
    }
    for m in PolicyLossMode::ALL {
        assert!(
            seen.contains_key(m.as_str()),
            "no fixture for loss mode {m}"
        );
    }
}

#[test]
fn dpo_family_matches_verl() {
    let fam = Family::load("dpo");
    for c in fam.cases() {
        match c.func() {
            "dpo_loss" => {
                let cfg = DpoConfig {
                    dpo_beta: c.f("beta"),
                    dpo_loss_type: c.p("loss_type").as_str().unwrap().parse().unwrap(),
                    dpo_label_smoothing: c.f("label_smoothing"),
                    reference_free: c.p("reference_free").as_bool().unwrap(),
                };
                let (pc, pr) = (
                    leaf(&c.t("policy_chosen_logps")),
                    leaf(&c.t("policy_rejected_logps")),
                );
                let l = dpo::loss(
                    &pc,
                    &pr,
                    &c.t("reference_chosen_logps"),
                    &c.t("reference_rejected_logps"),
                    &cfg,
                )
                .unwrap();
                c.close_key("loss", &l);
                l.backward();
                c.close_key("grad_chosen", &pc.grad());
                c.close_key("grad_rejected", &pr.grad());
            }
            "pref" => {
                let p = dpo::pref_from_rewards(&c.t("token_level_rewards"), &c.t("response_mask"))
                    .unwrap();
                assert!(
                    p.eq_tensor(&c.t("chosen").to_kind(Kind::Bool))
                        .all()
                        .int64_value(&[])
                        == 1,
                    "{}",
                    c.name
                );
            }
            "logps" => {
                let x = leaf(&c.t("logits"));
                let out = dpo::sequence_log_probs(
                    &x,
                    &c.t("labels"),
                    c.p("average_log_prob").as_bool().unwrap(),
                )
                .unwrap();
                c.close_key("logps", &out);
                out.sum(Kind::Double).backward();
                c.close_key("grad_logits", &x.grad());
            }
            "sppo" => {
                let x = leaf(&c.t("log_prob"));
                let out = dpo::sppo(
                    &c.t("old_log_prob"),
                    &x,
                    &c.t("rewards"),
                    &c.t("response_mask"),
                    c.f("eta"),
                )
                .unwrap();
                c.close_key("loss", &out.loss);
                c.close_key("log_ratios", &out.log_ratios);
                c.close_key("scaled_rewards", &out.scaled_rewards);
                out.loss.backward();
                c.close_key("grad_log_prob", &x.grad());
            }
            other => panic!("unknown fn {other}"),
        }
    }
}

#[test]
fn dapo_matches_verl() {
    let fam = Family::load("dapo");
    for c in fam.cases() {
        match c.func() {
            "overlong" => {
                let cfg = OverlongBufferConfig {
                    enable: true,
                    len: c.p("len").as_i64().unwrap(),
                    penalty_factor: c.f("penalty_factor"),
                    log: true,
                };
                let max = c.p("max_resp_len").as_i64().unwrap();
                let p = dapo::overlong_penalty(&c.t("response_lengths"), max, &cfg).unwrap();
                c.close_key("overlong_reward", &p);
                let (shaped, _) = dapo::apply_overlong_penalty(
                    &c.t("token_level_scores"),
                    &c.t("response_mask"),
                    max,
                    &cfg,
                )
                .unwrap();
                // verl adds an f32 penalty to the score in f32
                let want = c.t("reward_tensor");
                let diff = (shaped - &want).abs().max().double_value(&[]);
                assert!(diff < 1e-6, "{}: shaped scores differ by {diff}", c.name);
            }
            "filter_groups" => {
                let f = dapo::filter_groups(&c.t("metric"), &c.t("index")).unwrap();
                assert!(
                    f.keep
                        .eq_tensor(&c.t("keep").to_kind(Kind::Bool))
                        .all()
                        .int64_value(&[])
                        == 1
                );
                assert_eq!(f.kept_groups as f64, c.metric("kept_groups"));
            }
            other => panic!("unknown fn {other}"),
        }
    }
}

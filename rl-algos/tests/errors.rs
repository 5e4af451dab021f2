//! Bad input is a clear `Err` at every public entry point, never a panic.

use rl_algos::advantage;
use rl_algos::agg::{self, GlobalBatchInfo, LossAggMode};
use rl_algos::dpo;
use rl_algos::kl;
use rl_algos::loss::{self, PolicyLossConfig, PolicyLossInputs};
use rl_algos::{AlgoConfig, Error, KlPenalty, PolicyLossMode};
use tch::{Device, Kind, Tensor};

fn ones(shape: &[i64]) -> Tensor {
    Tensor::ones(shape, (Kind::Double, Device::Cpu))
}

#[test]
fn mismatched_shapes_name_the_argument() {
    let err = advantage::gae(&ones(&[2, 3]), &ones(&[2, 4]), &ones(&[2, 3]), 1.0, 1.0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`values` has shape [2, 4], expected [2, 3] (as `token_level_rewards`)"
    );
    let err = advantage::grpo(
        &ones(&[2, 3]),
        &ones(&[3, 3]),
        &Tensor::from_slice(&[0i64, 1]),
        true,
        advantage::EPSILON,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("`response_mask` has shape [3, 3]"),
        "{err}"
    );
    let err = advantage::rloo(
        &ones(&[2, 3]),
        &ones(&[2, 3]),
        &Tensor::from_slice(&[0i64, 1, 2]),
    )
    .unwrap_err();
    assert_eq!(err.to_string(), "`index` has shape [3], expected [2]");
    let err = kl::low_var_kl(&ones(&[2, 3]), &ones(&[3])).unwrap_err();
    assert!(
        err.to_string().starts_with("`ref_log_prob` has shape [3]"),
        "{err}"
    );
    let err = dpo::sequence_log_probs(
        &ones(&[2, 3, 5]),
        &Tensor::zeros([2, 4], (Kind::Int64, Device::Cpu)),
        false,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`labels` has shape [2, 4], expected [2, 3]"
    );
    let err = advantage::remax(&ones(&[2, 3]), &ones(&[3]), &ones(&[2, 3])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`reward_baselines` has shape [3], expected [2]"
    );
}

#[test]
fn non_binary_and_empty_masks_are_errors() {
    let x = ones(&[2, 3]);
    let half = &x * 0.5;
    let inputs = PolicyLossInputs {
        old_log_prob: &x,
        log_prob: &x,
        advantages: &x,
        response_mask: &half,
        rollout_is_weights: None,
    };
    let err = loss::ppo_clip(
        &inputs,
        &PolicyLossConfig::default(),
        &GlobalBatchInfo::local(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "`response_mask` must be binary (0 or 1 everywhere), found 0.5"
    );
    let err =
        agg::aggregate(&x, &half, LossAggMode::TokenMean, &GlobalBatchInfo::local()).unwrap_err();
    assert!(matches!(
        err,
        Error::NonBinaryMask {
            name: "loss_mask",
            ..
        }
    ));
    // GAE whitens over the mask: verl raises when it selects fewer than two tokens
    let one = x.zeros_like();
    let _ = one.get(0).get(0).fill_(1.0);
    let err = advantage::gae(&x, &x, &one, 1.0, 1.0).unwrap_err();
    assert!(err.to_string().contains("selects 1 element(s)"), "{err}");
    let err = advantage::reinforce_plus_plus(&x, &x.zeros_like(), 1.0).unwrap_err();
    assert!(err.to_string().contains("selects 0 element(s)"), "{err}");
}

#[test]
fn wrong_dtypes_and_ranges_are_errors() {
    let x = ones(&[2, 3]);
    let ints = Tensor::ones([2, 3], (Kind::Int64, Device::Cpu));
    let err = kl::penalty(&ints, &x, KlPenalty::Kl).unwrap_err();
    assert!(
        err.to_string().contains("`log_prob` has dtype Int64"),
        "{err}"
    );
    let cfg = PolicyLossConfig {
        clip_ratio_c: 0.5,
        ..PolicyLossConfig::default()
    };
    let inputs = PolicyLossInputs {
        old_log_prob: &x,
        log_prob: &x,
        advantages: &x,
        response_mask: &x,
        rollout_is_weights: None,
    };
    let err = loss::ppo_clip(&inputs, &cfg, &GlobalBatchInfo::local()).unwrap_err();
    assert!(err.to_string().contains("clip_ratio_c"), "{err}");
    let err = loss::value(
        &x,
        &x,
        &x,
        &x,
        -1.0,
        LossAggMode::TokenMean,
        &GlobalBatchInfo::local(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("cliprange_value"), "{err}");
}

#[test]
fn unknown_config_names_list_the_valid_ones() {
    let err = toml_like(r#"{"adv_estimator": "grpo_vectorised"}"#);
    assert!(
        err.contains("unknown variant `grpo_vectorised`") && err.contains("`reinforce_plus_plus`"),
        "{err}"
    );
    let err = "sum".parse::<LossAggMode>().unwrap_err().to_string();
    assert!(
        err.contains(
            "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
        )
    );
    let err = "bypass_mode"
        .parse::<PolicyLossMode>()
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("unknown loss_mode `bypass_mode`; expected one of: vanilla, gspo"),
        "{err}"
    );
    let err = "full".parse::<KlPenalty>().unwrap_err().to_string();
    assert!(err.contains("low_var_kl+"), "{err}");
    let err = serde_json::from_str::<PolicyLossConfig>(r#"{"loss_agg_mode": "mean"}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("`seq-mean-token-sum-norm`"), "{err}");
}

fn toml_like(json: &str) -> String {
    serde_json::from_str::<AlgoConfig>(json)
        .unwrap_err()
        .to_string()
}

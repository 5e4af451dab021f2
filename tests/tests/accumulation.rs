//! Gradient accumulation is exact: one actor update with 4 micro-batches leaves the same
//! parameters (within 1e-5) as with 1, for every loss aggregation mode, with the KL loss and
//! the entropy bonus on; and dynamic (token-budget) micro-batches agree too.

use rl_algos::LossAggMode;
use rl_algos::trainer::{ActorLossConfig, PolicyLoss};
use rl_core::roles::{Actor, Reference, Rollout};
use rl_core::{Batch, keys};
use rl_workers::roles::{
    ActorConfig, ActorWorker, OptimConfig, ReferenceWorker, RolloutWorker, SharedPolicy, ValKwargs,
    share,
};
use rl_workers::{CausalLm, Config, RolloutConfig};
use tch::{Device, Kind, Tensor};

fn policy() -> SharedPolicy {
    tch::manual_seed(5);
    share(CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap())
}

/// 16 rows (4 prompts x 4 samples) with old/ref log-probs and random advantages.
fn batch() -> Batch {
    let p = policy();
    tch::manual_seed(6);
    let ids = Tensor::randint_low(3, 120, [4, 6], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([4, 6], (Kind::Int64, Device::Cpu));
    let _ = mask.narrow(0, 1, 2).narrow(1, 0, 3).fill_(0);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut prompts = Batch::new();
    prompts.insert(keys::INPUT_IDS, ids).unwrap();
    prompts.insert(keys::ATTENTION_MASK, mask).unwrap();
    prompts.insert(keys::POSITION_IDS, pos).unwrap();
    let cfg = RolloutConfig {
        n: 4,
        response_length: 7,
        seed: 1,
        ..RolloutConfig::default()
    };
    let mut rollout = RolloutWorker::new(p.clone(), cfg, ValKwargs::default(), vec![2], 0).unwrap();
    let mut b = rollout.generate(&prompts).unwrap();
    let mut reference = ReferenceWorker::from_policy(&p, None).unwrap();
    let mut actor = ActorWorker::new(p, ActorConfig::default(), 4).unwrap();
    let old = actor.compute_log_prob(&b, false).unwrap();
    b.union(old).unwrap();
    let r = reference.compute_ref_log_prob(&b).unwrap();
    b.union(r).unwrap();
    // perturb old log-probs so the PPO ratio leaves 1 and clipping is exercised
    let old = b.pop(keys::OLD_LOG_PROBS).unwrap();
    let noise = Tensor::randn(old.size(), (Kind::Float, Device::Cpu)) * 0.3;
    b.insert(
        keys::OLD_LOG_PROBS,
        (old + noise) * b.get(keys::RESPONSE_MASK).unwrap(),
    )
    .unwrap();
    b.insert(
        keys::ADVANTAGES,
        Tensor::randn([16, 7], (Kind::Float, Device::Cpu)),
    )
    .unwrap();
    b
}

fn params(p: &SharedPolicy) -> Vec<(String, Tensor)> {
    let lm = p.lock().unwrap();
    let mut v: Vec<_> = lm
        .var_store()
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn update(
    b: &Batch,
    mode: LossAggMode,
    micro: Option<usize>,
    dynamic: bool,
) -> Vec<(String, Tensor)> {
    let p = policy();
    let cfg = ActorConfig {
        ppo_mini_batch_size: 4,
        ppo_micro_batch_size_per_gpu: micro,
        use_dynamic_bsz: dynamic,
        ppo_max_token_len_per_gpu: 40,
        grad_clip: 1e9,
        optim: OptimConfig {
            lr: 1e-2,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    let mut actor = ActorWorker::new(p.clone(), cfg, 4).unwrap();
    let objective = PolicyLoss {
        cfg: ActorLossConfig {
            loss_agg_mode: mode,
            use_kl_loss: true,
            kl_loss_coef: 0.1,
            entropy_coeff: 0.01,
            clip_ratio_high: Some(0.28),
            ..ActorLossConfig::default()
        },
    };
    actor.update(b, &objective).unwrap();
    params(&p)
}

#[test]
fn four_micro_batches_equal_one_for_every_aggregation_mode() {
    let b = batch();
    let init = params(&policy());
    for mode in LossAggMode::ALL {
        let one = update(&b, mode, None, false);
        for (name, other) in [
            ("4 micro-batches", update(&b, mode, Some(4), false)),
            ("dynamic bsz", update(&b, mode, None, true)),
        ] {
            let diff = one
                .iter()
                .zip(&other)
                .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
                .fold(0.0, f64::max);
            println!("{mode}: {name} vs 1 micro-batch, max |param diff| = {diff:.2e}");
            assert!(diff < 1e-5, "{mode} {name}: {diff}");
        }
        let moved = one
            .iter()
            .zip(&init)
            .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
            .fold(0.0, f64::max);
        assert!(
            moved > 1e-3,
            "{mode}: the update did not move the parameters"
        );
    }
}

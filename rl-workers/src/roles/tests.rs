//! Role tests on a tiny random model: shared weights, exact accumulation, resume.

use rl_core::roles::{
    Actor, Critic, Metrics, MiniBatchInfo, PolicyObjective, PolicyOutput, Reference, Rollout,
    ValueObjective,
};
use rl_core::{Batch, keys};
use tch::{Device, Kind, Tensor};

use super::*;
use crate::heads::{CausalLm, ValueModel};
use crate::model::Config;
use crate::rollout::RolloutConfig;

/// `-sum(log_prob * advantages * mask) / mini-batch tokens`: sums to the mini-batch's loss.
struct TokenMeanPg;

impl PolicyObjective for TokenMeanPg {
    fn needs_entropy(&self) -> bool {
        false
    }
    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = micro.get(keys::RESPONSE_MASK)?;
        let adv = micro.get(keys::ADVANTAGES)?;
        let loss = -(&out.log_prob * adv * mask).sum(Kind::Float) / info.tokens;
        let mut m = Metrics::new();
        m.push("actor/pg_loss", loss.double_value(&[]));
        Ok((loss, m))
    }
}

struct Mse;

impl ValueObjective for Mse {
    fn loss(
        &self,
        micro: &Batch,
        values: &Tensor,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let mask = micro.get(keys::RESPONSE_MASK)?;
        let ret = micro.get(keys::RETURNS)?;
        let loss = ((values - ret).square() * mask).sum(Kind::Float) / info.tokens * 0.5;
        let mut m = Metrics::new();
        m.push("critic/vf_loss", loss.double_value(&[]));
        Ok((loss, m))
    }
}

/// A random tiny policy, seeded under the generator lock (`crate::seeded`'s), so one seed gives
/// one set of weights whatever other test threads do. [`copy_of`] copies a policy's current
/// weights.
fn tiny_policy(seed: i64) -> SharedPolicy {
    let _generator = crate::hold_generator();
    tch::manual_seed(seed);
    share(CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap())
}

/// A new policy holding exactly `src`'s current weights (their own tensors, not shared).
fn copy_of(src: &SharedPolicy) -> SharedPolicy {
    let src = src.lock().unwrap();
    let mut lm = CausalLm::new(src.config(), Device::Cpu, Kind::Float).unwrap();
    lm.var_store_mut().copy(src.var_store()).unwrap();
    share(lm)
}

fn prompts(rows: i64) -> Batch {
    let ids = Tensor::randint_low(3, 100, [rows, 5], (Kind::Int64, Device::Cpu));
    let mask = Tensor::ones([rows, 5], (Kind::Int64, Device::Cpu));
    let _ = mask.narrow(1, 0, 2).narrow(0, 0, 1).fill_(0);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut b = Batch::new();
    b.insert(keys::INPUT_IDS, ids).unwrap();
    b.insert(keys::ATTENTION_MASK, mask).unwrap();
    b.insert(keys::POSITION_IDS, pos).unwrap();
    b.insert_column(keys::UID, (0..rows).map(|i| i.to_string().into()).collect())
        .unwrap();
    b
}

fn rollout(policy: &SharedPolicy, n: usize) -> RolloutWorker {
    let cfg = RolloutConfig {
        n,
        response_length: 6,
        seed: 3,
        ..RolloutConfig::default()
    };
    RolloutWorker::new(policy.clone(), cfg, ValKwargs::default(), vec![2], 0).unwrap()
}

fn rolled(policy: &SharedPolicy) -> Batch {
    let _generator = crate::hold_generator();
    tch::manual_seed(11);
    let mut b = rollout(policy, 2).generate(&prompts(4)).unwrap();
    let adv = Tensor::randn([8, 6], (Kind::Float, Device::Cpu));
    b.insert(keys::ADVANTAGES, adv).unwrap();
    let ret = Tensor::randn([8, 6], (Kind::Float, Device::Cpu));
    b.insert(keys::RETURNS, ret).unwrap();
    b
}

fn actor_cfg(micro: Option<usize>, dynamic: bool) -> ActorConfig {
    ActorConfig {
        ppo_mini_batch_size: 2,
        ppo_micro_batch_size_per_gpu: micro,
        use_dynamic_bsz: dynamic,
        ppo_max_token_len_per_gpu: 25,
        optim: OptimConfig {
            lr: 1e-2,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    }
}

fn params(p: &SharedPolicy) -> Vec<(String, Tensor)> {
    vars(p.lock().unwrap().var_store())
}

/// Copies of every variable of `vs`, in name order.
fn vars(vs: &tch::nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// The L2 norm of `a - b` over all the weights.
fn l2_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| (x - y).square().sum(Kind::Double).double_value(&[]))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn rollout_carries_columns_and_shares_the_actors_weights() {
    let policy = tiny_policy(0);
    let batch = rolled(&policy);
    assert_eq!(batch.len(), 8);
    assert_eq!(
        batch.column(keys::UID).unwrap()[..2],
        ["0".into(), "0".into()] as [serde_json::Value; 2]
    );
    let before = rollout(&policy, 2).generate(&prompts(4)).unwrap();
    let init = copy_of(&policy);
    let mut actor = ActorWorker::new(policy.clone(), actor_cfg(None, false), 2).unwrap();
    let old = actor.compute_log_prob(&batch, true).unwrap();
    let mut batch = batch;
    batch.union(old).unwrap();
    actor.update(&batch, &TokenMeanPg).unwrap();
    // the rollout holds the same tensors: its log-probs of a fixed sequence moved with the update
    let again = actor.compute_log_prob(&before, false).unwrap();
    let lm = policy.lock().unwrap();
    let direct = tch::no_grad(|| {
        micro::log_probs(
            &lm,
            &before,
            1.0,
            micro::EntropyOut::No,
            micro::Packing::Padded,
        )
        .unwrap()
        .0
    });
    assert!(
        again
            .get(keys::OLD_LOG_PROBS)
            .unwrap()
            .allclose(&direct, 1e-6, 1e-6, false)
    );
    drop(lm);
    let lp_before = {
        let mut a = ActorWorker::new(init, actor_cfg(None, false), 2).unwrap();
        a.compute_log_prob(&before, false).unwrap()
    };
    assert!(
        !lp_before
            .get(keys::OLD_LOG_PROBS)
            .unwrap()
            .allclose(&direct, 1e-6, 1e-6, false)
    );
}

#[test]
fn four_micro_batches_equal_one_and_dynamic_bsz_too() {
    let base = tiny_policy(1);
    let batch = rolled(&base);
    let init = params(&base);
    let mut results = Vec::new();
    for (micro, dynamic) in [(None, false), (Some(1), false), (None, true)] {
        // the same start for all three: re-seeding would not promise it (see `tiny_policy`)
        let policy = copy_of(&base);
        let mut actor = ActorWorker::new(policy.clone(), actor_cfg(micro, dynamic), 2).unwrap();
        let mut b = batch.shallow_clone();
        b.union(actor.compute_log_prob(&batch, false).unwrap())
            .unwrap();
        let m = actor.update(&b, &TokenMeanPg).unwrap();
        assert_eq!(m.values("actor/grad_norm").len(), 2);
        let (losses, norms) = (m.values("actor/pg_loss"), m.values("actor/grad_norm"));
        results.push((params(&policy), losses.to_vec(), norms.to_vec()));
    }
    // Not bit-equal: 1, 4 and token-budget micro-batches run the forward on different shapes
    // and sum the gradient in another order, so the gradients agree to f32 rounding (~1e-7
    // relative). Nor within a max-abs bar: Adam moves a weight by lr * m / (sqrt(v) + eps), so
    // a weight whose gradient cancels to the rounding noise (~eps = 1e-8) moves by up to ~lr on
    // that noise, differently in each run (4e-6 at lr 1e-2 seen on an AMD EPYC, the rest below
    // 1e-6). Such weights are a handful, so the bar is on the L2 norm over all weights: under
    // 1% of how far the update moved them (seen: 2.4e-6 of it), which a micro-batch counted
    // twice or dropped (a different update direction, a difference of order 1) still fails.
    // The losses are sums over micro-batches of f32 means, the second mini-batch's after a
    // step that moves those few weights only where the gradient is ~0: rounding ~1e-6 at most.
    // Adam also hides a gradient off by a constant factor, which the gradient norms (f64 sums
    // of f32 gradients that agree to rounding) show: 1e-5 relative.
    let travel = l2_diff(&results[0].0, &init);
    for (p, loss, norms) in &results[1..] {
        for (a, b) in norms.iter().zip(&results[0].2) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{norms:?} vs {:?}",
                results[0].2
            );
        }
        let (d, l2) = (max_diff(&results[0].0, p), l2_diff(&results[0].0, p));
        assert!(
            l2 < 1e-2 * travel,
            "weights differ by {l2:e} (L2; max abs {d:e}), over 1% of the update's {travel:e}"
        );
        for (a, b) in loss.iter().zip(&results[0].1) {
            assert!((a - b).abs() < 1e-5, "{loss:?} vs {:?}", results[0].1);
        }
    }
    assert!(max_diff(&results[0].0, &init) > 1e-4);
}

#[test]
fn reference_is_frozen_and_resume_restores_weights_and_optimizer() {
    let policy = tiny_policy(2);
    let mut reference = ReferenceWorker::from_policy(&policy, Some(3)).unwrap();
    let batch = rolled(&policy);
    let r0 = reference.compute_ref_log_prob(&batch).unwrap();
    let mut actor = ActorWorker::new(policy.clone(), actor_cfg(Some(2), false), 2).unwrap();
    let mut b = batch.shallow_clone();
    b.union(actor.compute_log_prob(&batch, false).unwrap())
        .unwrap();
    assert!(r0.get(keys::REF_LOG_PROB).unwrap().allclose(
        b.get(keys::OLD_LOG_PROBS).unwrap(),
        1e-6,
        1e-6,
        false
    ));
    actor.update(&b, &TokenMeanPg).unwrap();
    let r1 = reference.compute_ref_log_prob(&batch).unwrap();
    // bit-equal: the same worker's same forward on the same batch, so a frozen reference
    // repeats every operation on the same shapes and values
    assert!(
        r0.get(keys::REF_LOG_PROB)
            .unwrap()
            .equal(r1.get(keys::REF_LOG_PROB).unwrap())
    );

    let dir = tempfile::tempdir().unwrap();
    actor.save_state(dir.path()).unwrap();
    actor.update(&b, &TokenMeanPg).unwrap();
    let want = params(&policy);
    let other = tiny_policy(9);
    let mut resumed = ActorWorker::new(other.clone(), actor_cfg(Some(2), false), 2).unwrap();
    resumed.load_state(dir.path()).unwrap();
    resumed.update(&b, &TokenMeanPg).unwrap();
    // bit-equal: the saved weights and optimiser state load exactly, and the resumed update
    // is the uninterrupted one's sequence of operations on the same shapes
    assert!(max_diff(&want, &params(&other)) == 0.0);
    assert_eq!(resumed.optimizer().counters(), actor.optimizer().counters());
}

#[test]
fn critic_loss_falls() {
    let policy = tiny_policy(3);
    let batch = rolled(&policy);
    let _generator = crate::hold_generator();
    tch::manual_seed(4);
    let vm = ValueModel::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
    let cfg = CriticConfig {
        ppo_mini_batch_size: 4,
        optim: OptimConfig {
            lr: 1e-2,
            ..OptimConfig::default()
        },
        ..CriticConfig::default()
    };
    let mut critic = CriticWorker::new(vm, cfg, 2).unwrap();
    let v = critic.compute_values(&batch).unwrap();
    assert_eq!(v.get(keys::VALUES).unwrap().size(), [8, 6]);
    let first = critic
        .update(&batch, &Mse)
        .unwrap()
        .values("critic/vf_loss")[0];
    let mut last = first;
    for _ in 0..20 {
        last = critic
            .update(&batch, &Mse)
            .unwrap()
            .values("critic/vf_loss")[0];
    }
    assert!(last < first * 0.7, "{first} -> {last}");
}

#[test]
fn bad_configs_name_the_key() {
    let policy = tiny_policy(0);
    let err = ActorWorker::new(
        policy.clone(),
        ActorConfig {
            ppo_mini_batch_size: 0,
            ..ActorConfig::default()
        },
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("actor_rollout_ref.actor.ppo_mini_batch_size"),
        "{err}"
    );
    let mut actor = ActorWorker::new(policy.clone(), actor_cfg(None, false), 3).unwrap();
    let b = rolled(&policy);
    assert!(actor.update(&b, &TokenMeanPg).is_err()); // 6 rows per mini-batch do not divide 8
}

#[test]
fn the_progress_hook_sees_every_decode_step_of_a_generation() {
    let policy = tiny_policy(0);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let mut r = rollout(&policy, 2).with_progress(std::sync::Arc::new(move |p| {
        sink.lock().unwrap().push(*p);
    }));
    let out = r.generate(&prompts(4)).unwrap();
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty());
    let steps: Vec<i64> = seen.iter().map(|p| p.step).collect();
    assert_eq!(steps, (1..=steps.len() as i64).collect::<Vec<_>>());
    let last = seen.last().unwrap();
    assert_eq!(last.total_rows, 8);
    let produced = out
        .get(keys::RESPONSE_MASK)
        .unwrap()
        .sum(tch::Kind::Int64)
        .int64_value(&[]);
    assert_eq!(last.generated_tokens, produced);
}

/// 8 rows of skewed lengths (one 24-token response, the others 1 to 3 tokens; prompts of 2 to
/// 9 tokens, left-padded): the layout the rollout makes, with advantages and returns.
fn skewed_batch() -> Batch {
    let _generator = crate::hold_generator();
    tch::manual_seed(21);
    let (rows, pw, rw) = (8i64, 9i64, 24i64);
    let prompt_lens = [2i64, 9, 4, 6, 3, 8, 5, 7];
    let response_lens = [24i64, 2, 1, 3, 2, 1, 3, 2];
    let ids = Tensor::randint_low(3, 100, [rows, pw + rw], (Kind::Int64, Device::Cpu));
    let mut mask = vec![0i64; (rows * (pw + rw)) as usize];
    let mut rmask = vec![0f32; (rows * rw) as usize];
    for r in 0..rows as usize {
        for c in 0..(pw + rw) as usize {
            let in_prompt = c < pw as usize && c >= (pw - prompt_lens[r]) as usize;
            let in_response = c >= pw as usize && c < (pw + response_lens[r]) as usize;
            if in_prompt || in_response {
                mask[r * (pw + rw) as usize + c] = 1;
            }
            if in_response {
                rmask[r * rw as usize + c - pw as usize] = 1.0;
            }
        }
    }
    let mask = Tensor::from_slice(&mask).view([rows, pw + rw]);
    let rmask = Tensor::from_slice(&rmask).view([rows, rw]);
    let ids = ids * &mask;
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    let mut b = Batch::new();
    b.insert(keys::RESPONSES, ids.narrow(1, pw, rw)).unwrap();
    b.insert(keys::INPUT_IDS, ids).unwrap();
    b.insert(keys::ATTENTION_MASK, mask).unwrap();
    b.insert(keys::POSITION_IDS, pos).unwrap();
    b.insert(
        keys::ADVANTAGES,
        Tensor::randn([rows, rw], (Kind::Float, Device::Cpu)) * &rmask,
    )
    .unwrap();
    b.insert(
        keys::RETURNS,
        Tensor::randn([rows, rw], (Kind::Float, Device::Cpu)) * &rmask,
    )
    .unwrap();
    b.insert(keys::RESPONSE_MASK, rmask).unwrap();
    b
}

#[test]
fn packed_forwards_equal_padded_ones_on_skewed_lengths() {
    let batch = skewed_batch();
    let mut batch_t = batch.shallow_clone();
    batch_t
        .meta_info_mut()
        .insert("temperature".into(), 0.7.into());
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-5, "{what}: packed differs from padded by {d}");
        d
    };
    let base = tiny_policy(4);
    let mut runs = Vec::new();
    for packed in [false, true] {
        let p = copy_of(&base);
        let mut cfg = actor_cfg(Some(3), false);
        cfg.ppo_mini_batch_size = 4;
        cfg.use_remove_padding = packed;
        let mut actor = ActorWorker::new(p.clone(), cfg, 2).unwrap();
        let lp = actor.compute_log_prob(&batch_t, true).unwrap();
        let mut reference = ReferenceWorker::from_policy(&p, Some(5))
            .unwrap()
            .with_packing(packed, false);
        let rlp = reference.compute_ref_log_prob(&batch_t).unwrap();
        actor.update(&batch, &TokenMeanPg).unwrap();
        let critic_model = {
            let _generator = crate::hold_generator();
            tch::manual_seed(9);
            ValueModel::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
        };
        let ccfg = CriticConfig {
            ppo_mini_batch_size: 4,
            ppo_micro_batch_size_per_gpu: Some(3),
            use_remove_padding: packed,
            ..CriticConfig::default()
        };
        let mut critic = CriticWorker::new(critic_model, ccfg, 2).unwrap();
        let v = critic.compute_values(&batch).unwrap();
        critic.update(&batch, &Mse).unwrap();
        runs.push((lp, rlp, v, params(&p), vars(critic.model().var_store())));
    }
    let (pad, pk) = (&runs[0], &runs[1]);
    let mask = batch.get(keys::RESPONSE_MASK).unwrap();
    let lp = close(
        pad.0.get(keys::OLD_LOG_PROBS).unwrap(),
        pk.0.get(keys::OLD_LOG_PROBS).unwrap(),
        "log-probs",
    );
    close(
        pad.0.get(keys::ENTROPYS).unwrap(),
        pk.0.get(keys::ENTROPYS).unwrap(),
        "entropy",
    );
    close(
        pad.1.get(keys::REF_LOG_PROB).unwrap(),
        pk.1.get(keys::REF_LOG_PROB).unwrap(),
        "reference log-probs",
    );
    close(
        pad.2.get(keys::VALUES).unwrap(),
        pk.2.get(keys::VALUES).unwrap(),
        "values",
    );
    // zero where the mask is, like the padded outputs
    let off: Tensor = pk.0.get(keys::OLD_LOG_PROBS).unwrap() * (mask.ones_like() - mask);
    assert_eq!(off.abs().max().double_value(&[]), 0.0);
    // and the same update: the actor's and the critic's weights
    let (da, dc) = (max_diff(&pad.3, &pk.3), max_diff(&pad.4, &pk.4));
    println!(
        "packed vs padded: log-probs {lp:.1e}, actor after an update {da:.1e}, critic {dc:.1e}"
    );
    // Adam's first step moves each weight by about lr * g / |g|, so two roundings of a gradient
    // near zero (packed and padded rows are different GEMM shapes) can differ by a small
    // fraction of lr; a token packed into the wrong row moves weights by about lr (1e-2)
    assert!(
        da < 1e-5 && dc < 1e-5,
        "updates differ: actor {da}, critic {dc}"
    );
    assert!(
        max_diff(&pad.3, &params(&base)) > 1e-4,
        "the update did not move the actor"
    );
}

/// [`skewed_batch`] with GRPO's layout of prompts: rows 0-2 share row 0's prompt, rows 3-5
/// row 3's, rows 6 and 7 have their own; each row keeps its response.
fn grouped_batch() -> Batch {
    let mut b = skewed_batch();
    let leader = Tensor::from_slice(&[0i64, 0, 0, 3, 3, 3, 6, 7]);
    let rw = b.get(keys::RESPONSES).unwrap().size()[1];
    let regroup = |t: &Tensor| {
        let pw = t.size()[1] - rw;
        Tensor::cat(
            &[
                t.narrow(1, 0, pw).index_select(0, &leader),
                t.narrow(1, pw, rw),
            ],
            1,
        )
    };
    let ids = regroup(b.get(keys::INPUT_IDS).unwrap());
    let mask = regroup(b.get(keys::ATTENTION_MASK).unwrap());
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    b.insert(keys::INPUT_IDS, ids).unwrap();
    b.insert(keys::ATTENTION_MASK, mask).unwrap();
    b.insert(keys::POSITION_IDS, pos).unwrap();
    b
}

/// `use_prefix_grouper`: with each group's prompt computed once, the old and the reference's
/// log-probs, the entropies and an update (micro-batches that split a group, too) equal the
/// padded forward's, and a response whose prompt is shared reads it at its own positions.
#[test]
fn shared_prompt_forwards_equal_padded_ones() {
    let batch = grouped_batch();
    let mut batch_t = batch.shallow_clone();
    batch_t
        .meta_info_mut()
        .insert("temperature".into(), 0.7.into());
    let base = tiny_policy(4);
    let mut runs = Vec::new();
    for (remove_padding, prefix_grouper) in [(false, false), (false, true), (true, true)] {
        let p = copy_of(&base);
        let mut cfg = actor_cfg(Some(4), false);
        cfg.ppo_mini_batch_size = 4;
        cfg.use_remove_padding = remove_padding;
        cfg.use_prefix_grouper = prefix_grouper;
        let mut actor = ActorWorker::new(p.clone(), cfg, 2).unwrap();
        let lp = actor.compute_log_prob(&batch_t, true).unwrap();
        let mut reference = ReferenceWorker::from_policy(&p, Some(8))
            .unwrap()
            .with_packing(remove_padding, prefix_grouper);
        let rlp = reference.compute_ref_log_prob(&batch_t).unwrap();
        actor.update(&batch, &TokenMeanPg).unwrap();
        runs.push((lp, rlp, params(&p)));
    }
    let pad = &runs[0];
    for (i, run) in runs.iter().enumerate().skip(1) {
        for (key, a, b) in [
            (keys::OLD_LOG_PROBS, &pad.0, &run.0),
            (keys::ENTROPYS, &pad.0, &run.0),
            (keys::REF_LOG_PROB, &pad.1, &run.1),
        ] {
            let d = (a.get(key).unwrap() - b.get(key).unwrap())
                .abs()
                .max()
                .double_value(&[]);
            assert!(d < 1e-5, "layout {i}: {key} differs from padded by {d}");
        }
        let d = max_diff(&pad.2, &run.2);
        println!(
            "shared prompts (layout {i}) vs padded: weights after an update differ by {d:.1e}"
        );
        assert!(d < 1e-5, "layout {i}: update differs by {d}");
    }
    assert!(
        max_diff(&pad.2, &params(&base)) > 1e-4,
        "the update did not move the actor"
    );
}

/// [`TokenMeanPg`] with an entropy bonus, so both of the head's outputs carry a gradient.
struct PgWithEntropy;

impl PolicyObjective for PgWithEntropy {
    fn needs_entropy(&self) -> bool {
        true
    }
    fn loss(
        &self,
        micro: &Batch,
        out: &PolicyOutput,
        info: MiniBatchInfo,
    ) -> rl_core::Result<(Tensor, Metrics)> {
        let (pg, m) = TokenMeanPg.loss(micro, out, info)?;
        let mask = micro.get(keys::RESPONSE_MASK)?;
        let entropy = out.entropy.as_ref().expect("asked for the entropy");
        Ok((
            pg - (entropy * mask).sum(Kind::Float) * 0.01 / info.tokens,
            m,
        ))
    }
}

/// `use_fused_kernels`: the update through the fused head (chunked, recomputed in the
/// backward) moves the weights as the plain head does, padded and packed, with a temperature,
/// an entropy bonus and gradient accumulation.
#[test]
fn fused_head_updates_equal_plain_ones() {
    let mut batch = skewed_batch();
    batch
        .meta_info_mut()
        .insert("temperature".into(), 0.7.into());
    let base = tiny_policy(4);
    for packed in [false, true] {
        let (mut after, mut norms) = (Vec::new(), Vec::new());
        for fused in [false, true] {
            let p = copy_of(&base);
            let mut cfg = actor_cfg(Some(3), false);
            cfg.ppo_mini_batch_size = 4;
            cfg.use_remove_padding = packed;
            cfg.use_fused_kernels = fused;
            let mut actor = ActorWorker::new(p.clone(), cfg, 2).unwrap();
            // two updates: AdamW's first step is about lr * sign(gradient), the second reads
            // the gradients' sizes
            let mut norm = Vec::new();
            for _ in 0..2 {
                let m = actor.update(&batch, &PgWithEntropy).unwrap();
                norm.extend_from_slice(m.values("actor/grad_norm"));
            }
            after.push(params(&p));
            norms.push(norm);
        }
        let d = max_diff(&after[0], &after[1]);
        println!(
            "fused vs plain head (packed: {packed}): weights after two updates differ by {d:.1e}; gradient norms {:?} vs {:?}",
            norms[0], norms[1]
        );
        assert!(d < 1e-6, "packed {packed}: fused update differs by {d}");
        assert_eq!(norms[0].len(), 2);
        for (a, b) in norms[0].iter().zip(&norms[1]) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs() && *a > 0.0,
                "gradient norms {a} vs {b}"
            );
        }
        for run in &after {
            assert!(
                max_diff(run, &params(&base)) > 1e-4,
                "the update did not move the actor"
            );
        }
    }
}

/// When the trainer skips the old-log-prob forward (`OLD_LOG_PROBS_FROM_UPDATE`), the update
/// reports `actor/entropy` as that forward would have (the masked mean over the batch's rows,
/// at the batch's temperature), whole or in micro-batches, through the plain head or the fused
/// one, and trains exactly as without the flag (the entropy is a value, not part of the loss).
/// The actor offers to supply old log-probs only for one mini-batch of one epoch, and not when
/// its config says no; the flag on any other update is an error.
#[test]
fn an_on_policy_update_reports_the_entropy_the_old_forward_would_have() {
    let mut batch = skewed_batch();
    batch
        .meta_info_mut()
        .insert("temperature".into(), 0.7.into());
    let base = tiny_policy(6);
    let rows = batch.len();
    let mut flagged = batch.shallow_clone();
    flagged.meta_info_mut().insert(
        rl_core::roles::OLD_LOG_PROBS_FROM_UPDATE.into(),
        true.into(),
    );
    let expected = {
        let mut actor = ActorWorker::new(copy_of(&base), actor_cfg(None, false), 2).unwrap();
        let old = actor.compute_log_prob(&batch, true).unwrap();
        let mask = keys::policy_mask(&batch).unwrap().to_kind(Kind::Double);
        let ent = old.get(keys::ENTROPYS).unwrap().to_kind(Kind::Double);
        ((ent * &mask).sum(Kind::Double) / mask.sum(Kind::Double)).double_value(&[])
    };
    assert!(expected > 0.1, "a random model's entropy, {expected}");
    for (micro, fused) in [(None, false), (Some(3), false), (Some(3), true)] {
        let mut cfg = actor_cfg(micro, false);
        cfg.ppo_mini_batch_size = rows / 2;
        cfg.use_fused_kernels = fused;
        let mut after = Vec::new();
        for b in [&batch, &flagged] {
            let p = copy_of(&base);
            let mut actor = ActorWorker::new(p.clone(), cfg.clone(), 2).unwrap();
            assert!(actor.old_log_probs_from_update(rows));
            let m = actor.update(b, &TokenMeanPg).unwrap();
            let reported = m.values("actor/entropy");
            if std::ptr::eq(b, &flagged) {
                assert_eq!(reported.len(), 1, "{micro:?} {fused}");
                assert!(
                    (reported[0] - expected).abs() < 1e-5 * expected,
                    "micro {micro:?}, fused {fused}: {} against the old forward's {expected}",
                    reported[0]
                );
            } else {
                assert!(reported.is_empty(), "no entropy metric without the flag");
            }
            after.push(params(&p));
        }
        assert_eq!(max_diff(&after[0], &after[1]), 0.0, "{micro:?} {fused}");
    }
    // two mini-batches, two epochs, or the config's no: the trainer must run the forward
    let mut cfg = actor_cfg(None, false);
    cfg.ppo_mini_batch_size = rows / 4;
    let mut actor = ActorWorker::new(copy_of(&base), cfg.clone(), 2).unwrap();
    assert!(!actor.old_log_probs_from_update(rows));
    assert!(actor.old_log_probs_from_update(rows / 2));
    // the flag on such an update is refused, naming it, before any weight moves
    let err = actor
        .update(&flagged, &TokenMeanPg)
        .unwrap_err()
        .to_string();
    assert!(err.contains("old_log_probs_from_update"), "{err}");
    cfg.ppo_mini_batch_size = rows / 2;
    cfg.ppo_epochs = 2;
    let actor = ActorWorker::new(copy_of(&base), cfg.clone(), 2).unwrap();
    assert!(!actor.old_log_probs_from_update(rows));
    cfg.ppo_epochs = 1;
    cfg.old_log_prob_from_update = false;
    let actor = ActorWorker::new(copy_of(&base), cfg, 2).unwrap();
    assert!(!actor.old_log_probs_from_update(rows));
}

/// Rank-4 adapters (alpha 8) on every linear layer, no dropout.
fn rank_4_lora() -> crate::LoraConfig {
    crate::LoraConfig {
        rank: 4,
        alpha: 8.0,
        target_modules: Default::default(),
        exclude_modules: Vec::new(),
        dropout: 0.0,
        use_rslora: false,
    }
}

/// Every variable of the decoder stack is in `stack` (LoRA's adapters excepted), the rest
/// (adapters, a score head) in float32.
fn stack_in(vs: &tch::nn::VarStore, stack: Kind) {
    for (name, t) in vs.variables() {
        let want = match name.starts_with("model.") && !name.contains("lora_") {
            true => stack,
            false => Kind::Float,
        };
        assert_eq!(t.kind(), want, "{name}");
    }
}

/// The same names with bitwise-equal tensors.
fn same_weights(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.0 == y.0 && x.1.equal(&y.1))
}

/// LoRA under mixed precision: a base loaded straight in bfloat16 with float32 adapters
/// (`add_lora_in`, what `load_policy` does) trains exactly as a model loaded in float32 and
/// cast by the optimizer (the only way before): the same bf16 weights, the same float32
/// masters (checked through an update, which they feed), without a float32 copy of the base.
#[test]
fn a_lora_base_loaded_in_bf16_trains_as_one_cast_from_f32() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny_policy(5);
    src.lock().unwrap().save_pretrained(dir.path()).unwrap();
    let lora = rank_4_lora();
    let cfg = ActorConfig {
        mixed_precision: MixedPrecision {
            param_dtype: ParamDtype::Bf16,
        },
        ..actor_cfg(None, false)
    };
    let batch = rolled(&src);
    let mut results = Vec::new();
    for base in [Kind::Float, Kind::BFloat16] {
        let mut lm = CausalLm::from_pretrained(dir.path(), Device::Cpu, base).unwrap();
        crate::seeded(9, || lm.add_lora_in(&lora, Kind::Float)).unwrap();
        let policy = share(lm);
        let mut actor = ActorWorker::new(policy.clone(), cfg.clone(), 2).unwrap();
        let built = params(&policy);
        assert!(built.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
        let mut b = batch.shallow_clone();
        b.union(actor.compute_log_prob(&batch, false).unwrap())
            .unwrap();
        actor.update(&b, &TokenMeanPg).unwrap();
        results.push((built, params(&policy)));
    }
    let same = same_weights;
    assert!(same(&results[0].0, &results[1].0), "built weights differ");
    assert!(same(&results[0].1, &results[1].1), "trained weights differ");
    assert!(
        !same(&results[0].0, &results[0].1),
        "the update changed nothing"
    );
}

/// The critic's (and reward model's) form of the test above: the stack loaded straight in
/// bfloat16 under a float32 value head and adapters (`from_pretrained_stack_in`, what compose
/// does for a LoRA critic under mixed precision) trains exactly as a critic loaded in float32
/// and cast by the optimizer: the fresh head drawn the same, every weight bitwise equal after
/// building and after an update.
#[test]
fn a_lora_critic_stack_loaded_in_bf16_trains_as_one_cast_from_f32() {
    let dir = tempfile::tempdir().unwrap();
    let src = tiny_policy(5);
    src.lock().unwrap().save_pretrained(dir.path()).unwrap();
    let lora = rank_4_lora();
    let cfg = CriticConfig {
        ppo_mini_batch_size: 4,
        optim: OptimConfig {
            lr: 1e-2,
            ..OptimConfig::default()
        },
        mixed_precision: MixedPrecision {
            param_dtype: ParamDtype::Bf16,
        },
        ..CriticConfig::default()
    };
    let batch = rolled(&src);
    let mut results = Vec::new();
    for stack in [Kind::Float, Kind::BFloat16] {
        let mut vm = crate::seeded(9, || {
            ValueModel::from_pretrained_stack_in(dir.path(), Device::Cpu, Kind::Float, stack)
        })
        .unwrap();
        assert!(vm.fresh_head());
        crate::seeded(10, || vm.add_lora_in(&lora, Kind::Float)).unwrap();
        // loaded in the dtype asked for: no float32 copy of a bf16 stack was made
        stack_in(vm.var_store(), stack);
        let mut critic = CriticWorker::new(vm, cfg.clone(), 2).unwrap();
        let built = vars(critic.model().var_store());
        assert!(built.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
        critic.update(&batch, &Mse).unwrap();
        results.push((built, vars(critic.model().var_store())));
    }
    let same = same_weights;
    assert!(same(&results[0].0, &results[1].0), "built weights differ");
    assert!(same(&results[0].1, &results[1].1), "trained weights differ");
    assert!(
        !same(&results[0].0, &results[0].1),
        "the update changed nothing"
    );
    // the reward model's loader, the same way (compose's reward-model trainer under LoRA)
    let rm = crate::roles::reward_model_from_lm_stack_in(
        dir.path(),
        Device::Cpu,
        Kind::Float,
        Kind::BFloat16,
    )
    .unwrap();
    stack_in(rm.var_store(), Kind::BFloat16);
    // a stack in another dtype only under a float32 model
    let err =
        ValueModel::from_pretrained_stack_in(dir.path(), Device::Cpu, Kind::BFloat16, Kind::Half)
            .unwrap_err();
    assert!(err.to_string().contains("Half"), "{err}");
}

//! The preference trainers from the shared SFT checkpoint (`rl_e2e::carry_free_warm`), each
//! asserted over the initial-weight seeds: offline DPO on right vs wrong answers raises
//! held-out preference accuracy (and its first loss at the reference is ln 2); SPIN and online
//! DPO raise held-out task accuracy; DPO, online DPO and SPIN resume exactly.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use rl_algos::trainer::{
    DpoTrainer, DpoTrainerConfig, OnlineDpoTrainer, RefInit, ReferenceFactory, SpinTrainer,
};
use rl_core::roles::{Reference, Reward};
use rl_core::{Batch, StepMetrics, Trainer, keys};
use rl_data::reward::RewardRegistry;
use rl_data::reward::role::RuleReward;
use rl_data::{DataConfig, RlDataset};
use rl_e2e::*;

use crate::pairs::{Cycle, pair_batch};
use rl_workers::RolloutConfig;
use rl_workers::roles::{
    ActorConfig, ActorWorker, OptimConfig, ReferenceWorker, RolloutWorker, SharedPolicy, ValKwargs,
};
use tch::{Device, Kind, Tensor};

/// The resume tests' task: the original addition (operands up to 19, not zero-padded).
const MAX_OPERAND: i64 = 19;

/// The seed of the resume tests' task and (untrained) policy.
const COLD_SEED: u64 = 5;

/// A start point of the preference trainers: a task, a policy checkpoint, and the data config
/// of its batches.
struct Start {
    task: &'static TinyTask,
    ckpt: PathBuf,
    data: DataConfig,
    /// The data's and the runs' seed.
    seed: u64,
}

/// The shared SFT checkpoint of the initial weights `init_seed`.
fn warm(init_seed: u64) -> Start {
    let w = carry_free_warm(init_seed);
    Start {
        task: &w.task,
        ckpt: w.ckpt.clone(),
        data: tiny_data_config(&w.task, 16, TASK_SEED),
        seed: TASK_SEED,
    }
}

/// A random (untrained) tiny policy saved as the start checkpoint of the resume tests, on the
/// original addition task (64 train, 16 test prompts): resuming needs no warm-up. Its initial
/// weights are drawn under `rl_e2e::seeded` (every other construction of the binary's tests
/// waits on that lock or loads weights over its draws).
fn cold() -> &'static Start {
    static COLD: OnceLock<Start> = OnceLock::new();
    COLD.get_or_init(|| {
        let seed = COLD_SEED;
        let task: &'static TinyTask =
            Box::leak(Box::new(tiny_task(MAX_OPERAND, 64, 16, seed).unwrap()));
        let ckpt = task.root.path().join("init");
        let policy = fresh_tiny_policy(task.tokenizer.vocab_size() as i64, seed as i64).unwrap();
        policy.lock().unwrap().save_pretrained(&ckpt).unwrap();
        let data = tiny_data_config(task, 4, seed);
        Start {
            task,
            ckpt,
            data,
            seed,
        }
    })
}

/// A wrong answer for row `row`: another number written with as many digits as `answer` (the
/// zero-padded sums keep their width, so the pair differs in value, not in format), picked by
/// a fixed hash of the row.
fn wrong_answer(answer: &str, row: usize) -> AnyResult<String> {
    let width = answer.len();
    let span = 10u64.pow(width as u32) - 1;
    let right: u64 = answer.parse()?;
    let h = (row as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33;
    // a value in 0..=span other than `right`
    let w = h % span;
    let w = if w >= right { w + 1 } else { w };
    Ok(format!("{w:0width$}"))
}

/// The training rows of offline DPO: 40 batches of 16 pairs (two epochs, a new wrong answer
/// each), so that a 60-step run cycles through its data and the reference cache is used.
const DPO_ROWS: usize = 320;

/// Train pair batches of `pairs` pairs each over the first [`DPO_ROWS`] training rows, and
/// held-out pair batches.
fn pair_sources(w: &Start, pairs: usize) -> AnyResult<(Cycle, Vec<Batch>)> {
    let tok = &w.task.tokenizer;
    let train = RlDataset::train(&w.data)?;
    let val = RlDataset::val(&w.data)?;
    // two epochs of pairs, each prompt with a different wrong answer per epoch
    let n = train.len().min(DPO_ROWS);
    let idx: Vec<usize> = (0..2 * n).collect();
    let batches = idx
        .chunks_exact(pairs)
        .map(|c| pair_batch(&train, n, tok, c, wrong_answer))
        .collect::<AnyResult<Vec<_>>>()?;
    let vidx: Vec<usize> = (0..val.len()).collect();
    let val_batches = vidx
        .chunks(50)
        .map(|c| pair_batch(&val, val.len(), tok, c, wrong_answer))
        .collect::<AnyResult<Vec<_>>>()?;
    Ok((Cycle { batches, cursor: 0 }, val_batches))
}

fn dpo_actor(policy: SharedPolicy, pairs: usize, lr: f64) -> AnyResult<ActorWorker> {
    let cfg = ActorConfig {
        ppo_mini_batch_size: pairs,
        ppo_micro_batch_size_per_gpu: Some(2 * pairs),
        optim: OptimConfig {
            lr,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    Ok(ActorWorker::new(policy, cfg, 2)?)
}

/// Offline DPO from the SFT checkpoint of `init_seed`.
fn build_dpo(
    init_seed: u64,
    cfg: DpoTrainerConfig,
    pairs: usize,
    lr: f64,
) -> AnyResult<DpoTrainer> {
    let w = warm(init_seed);
    build_dpo_from(&w, load_policy(&w.ckpt)?, cfg, pairs, lr)
}

/// Offline DPO of `policy` on `w`'s synthetic pairs.
fn build_dpo_from(
    w: &Start,
    policy: SharedPolicy,
    cfg: DpoTrainerConfig,
    pairs: usize,
    lr: f64,
) -> AnyResult<DpoTrainer> {
    let reference = ReferenceWorker::from_policy(&policy, None)?;
    let (train, val) = pair_sources(w, pairs)?;
    let actor = dpo_actor(policy, pairs, lr)?;
    Ok(DpoTrainer::new(
        cfg,
        Box::new(actor),
        Some(Box::new(reference)),
        Box::new(train),
        val,
    )?)
}

/// How far from 0 `rewards/margins` may be while the policy still has the reference's
/// weights. The margin is beta * mean((pc - rc) - (pr - rr)) over sequence log-probs, and the
/// policy's and the reference's come from two forwards of the same weights that are not
/// bit-equal: the policy's runs on its update's (or validation's) micro-batches with weights
/// that require gradients, the frozen reference's on its own, and libtorch may pick other
/// kernels for them (at::matmul, for one, decides by `requires_grad` whether to fold a batch
/// into one matrix product), so they differ in f32 rounding: margins of 6e-9 and 2.5e-8 seen
/// on AMD EPYCs, per-token log-probs 7e-7 apart. A few ulps of logits of size ~10 per token
/// (~1e-6) over the <= 4 response tokens of these sums bound each sequence's difference by
/// ~1e-5, so |margins| <= beta * 2 * 1e-5. A reference that is not the policy, or pairs taken
/// apart, gives margins of order beta * 0.1 and more.
fn margin_tol(beta: f64) -> f64 {
    beta * 2e-5
}

#[test]
fn first_dpo_loss_is_ln2_at_the_reference() {
    let mut t = build_dpo(init_seeds()[0], DpoTrainerConfig::default(), 16, 1e-3).unwrap();
    let m = t.step().unwrap();
    println!(
        "step 1: loss {} (ln 2 = {})",
        m["loss"],
        std::f64::consts::LN_2
    );
    assert!((m["loss"] - std::f64::consts::LN_2).abs() < 1e-5, "{m:?}");
    let beta = DpoTrainerConfig::default().beta;
    assert!(
        m["rewards/margins"].abs() <= margin_tol(beta),
        "{} > {}",
        m["rewards/margins"],
        margin_tol(beta)
    );
    for key in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "actor/grad_norm",
        "timing_s/ref",
    ] {
        assert!(m.contains_key(key), "lacks {key}");
    }
}

/// Offline DPO on synthetic pairs (the right sum against another number of the same width),
/// 60 steps of 16 pairs at beta 0.1 and lr 1e-3, from each seed's SFT checkpoint: held-out
/// preference accuracy starts at the ties of the reference (every implicit reward 0) and must
/// reach 80% at the median and 70% on the worst seed, and the held-out loss must fall on every
/// seed.
#[test]
fn offline_dpo_raises_held_out_preference_accuracy() {
    let steps = env_or("DPO_STEPS", 60);
    let beta = env_or("DPO_BETA_E2", 10) as f64 * 1e-2;
    let lr = env_or("DPO_LR_E4", 10) as f64 * 1e-4;
    let key = "val/rewards/accuracies";
    let runs = per_seed(init_seeds(), |seed| {
        let cfg = DpoTrainerConfig {
            beta,
            precompute_ref_log_probs: true,
            total_training_steps: steps,
            ..DpoTrainerConfig::default()
        };
        let mut t = build_dpo(seed, cfg, 16, lr).unwrap();
        let (before, _) = t.validate().unwrap();
        let mut last = Default::default();
        let mut ref_steps = 0;
        while t.global_step() < t.total_steps() {
            last = t.step().unwrap();
            ref_steps += last.contains_key("timing_s/ref") as usize;
        }
        let (after, _) = t.validate().unwrap();
        println!(
            "offline dpo (init seed {seed}): held-out preference accuracy {:.1}% (ties up to \
             rounding) -> {:.1}% over {steps} steps; margins {:.1e} -> {:.3}, val/loss {:.4} -> \
             {:.4}; last train loss {:.4}; reference forwards on {ref_steps} of {steps} steps",
            before[key] * 100.0,
            after[key] * 100.0,
            before["val/rewards/margins"],
            after["val/rewards/margins"],
            before["val/loss"],
            after["val/loss"],
            last["loss"],
        );
        // at the reference every implicit reward is 0 up to f32 rounding (see `margin_tol`)
        assert!(
            before["val/rewards/margins"].abs() <= margin_tol(beta),
            "seed {seed}: {before:?}"
        );
        assert!(
            after["val/loss"] < before["val/loss"],
            "seed {seed}: {before:?} -> {after:?}"
        );
        // the cache: one reference forward per training batch, none once the data cycles
        assert!(ref_steps < steps as usize, "seed {seed}: {ref_steps}");
        SeedResult {
            seed,
            before: before[key],
            after: after[key],
        }
    });
    let afters: Vec<f64> = runs.iter().map(|r| r.after).collect();
    let worst = afters.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "offline dpo: held-out preference accuracy after, median {:.1}%, worst {:.1}%",
        100.0 * median(&afters),
        100.0 * worst
    );
    assert!(
        median(&afters) >= 0.80 && worst >= 0.70,
        "offline dpo: held-out preference accuracy must reach 80% at the median and 70% on the \
         worst seed: {runs:?}"
    );
}

/// The rollout of the preference trainers: `n` samples per prompt at `temperature`, greedy
/// validation.
fn rollout(
    w: &Start,
    policy: &SharedPolicy,
    n: usize,
    temperature: f64,
    seed: u64,
) -> AnyResult<RolloutWorker> {
    let tok = &w.task.tokenizer;
    Ok(RolloutWorker::new(
        policy.clone(),
        RolloutConfig {
            n,
            response_length: 4,
            temperature,
            seed,
            ..RolloutConfig::default()
        },
        ValKwargs::default(),
        vec![tok.eos_token_id().ok_or("no eos")? as i64],
        tok.pad_id_or_eos()? as i64,
    )?)
}

/// The SPIN trainer from `w`'s SFT checkpoint: ground truth vs one generation per prompt.
fn build_spin(
    w: &Start,
    policy: SharedPolicy,
    cfg: DpoTrainerConfig,
    prompts: usize,
    lr: f64,
    seed: u64,
) -> AnyResult<SpinTrainer> {
    let tok = w.task.tokenizer.clone();
    let exp = ExperimentConfig {
        data: tiny_data_config(w.task, prompts, w.seed),
        ..ExperimentConfig::default()
    };
    let (_, val) = loaders(&exp, &tok)?;
    let train = SftSource::new(
        Arc::new(answer_rows(&w.data.train_files)?),
        tok.clone(),
        prompts,
        seed,
    )?;
    let temperature = env_or("SPIN_TEMP_E2", 100) as f64 * 1e-2;
    let rollout = rollout(w, &policy, 1, temperature, seed)?;
    let actor = dpo_actor(policy.clone(), prompts, lr)?;
    let ckpt = w.ckpt.clone();
    let make_reference: ReferenceFactory = Box::new(move |init| {
        Ok(Box::new(match init {
            RefInit::Initial => {
                ReferenceWorker::from_pretrained(&ckpt, Device::Cpu, Kind::Float, None)?
            }
            RefInit::Policy => ReferenceWorker::from_policy(&policy, None)?,
        }) as Box<dyn Reference>)
    });
    let reward = RuleReward::new(tok, RewardRegistry::verl_default());
    Ok(SpinTrainer::new(
        cfg,
        Box::new(actor),
        Box::new(rollout),
        make_reference,
        Box::new(reward),
        Box::new(train),
        val,
    )?)
}

/// `probe`'s log-probs under a frozen copy of `policy`'s current weights and under the
/// trainer's reference. Both are frozen models running the same forward on the same batch, so
/// equal weights give bit-equal log-probs. The actor's own log-probs would not do: its weights
/// require gradients, which can send libtorch's matmuls to other kernels, and the same
/// weights then give log-probs that differ in f32 rounding (up to 1.2e-6 seen on AMD EPYCs).
fn probe_log_probs(t: &mut SpinTrainer, policy: &SharedPolicy, probe: &Batch) -> (Tensor, Tensor) {
    let mut frozen = ReferenceWorker::from_policy(policy, None).unwrap();
    let a = frozen.compute_ref_log_prob(probe).unwrap();
    let r = t.reference_mut().compute_ref_log_prob(probe).unwrap();
    (
        a.get(keys::REF_LOG_PROB).unwrap().shallow_clone(),
        r.get(keys::REF_LOG_PROB).unwrap().shallow_clone(),
    )
}

#[test]
fn spin_reference_is_the_policy_after_each_update_and_frozen_between() {
    let cfg = DpoTrainerConfig {
        ref_update_freq: 2,
        total_training_steps: 4,
        ..DpoTrainerConfig::default()
    };
    let w = &warm(init_seeds()[0]);
    let policy = load_policy(&w.ckpt).unwrap();
    let mut t = build_spin(w, policy.clone(), cfg, 8, 1e-3, w.seed).unwrap();
    let sft = SftSource::new(
        Arc::new(answer_rows(&w.data.val_files).unwrap()),
        w.task.tokenizer.clone(),
        8,
        w.seed,
    )
    .unwrap();
    let probe = sft.batch(&(0..8).collect::<Vec<_>>()).unwrap();
    let (_, ref0) = probe_log_probs(&mut t, &policy, &probe);
    let mut prev_ref = ref0;
    for step in 1..=4u64 {
        let m = t.step().unwrap();
        let (actor, reference) = probe_log_probs(&mut t, &policy, &probe);
        let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        let (to_actor, to_prev) = (diff(&actor, &reference), diff(&reference, &prev_ref));
        println!(
            "spin step {step}: |ref - actor| {to_actor:.2e}, |ref - previous ref| {to_prev:.2e}"
        );
        // bit-equal where the weights are equal: every comparison is between frozen models
        // running the same operations on the same probe (see `probe_log_probs`)
        if step % 2 == 0 {
            assert_eq!(m["spin/ref_updated"], 1.0);
            assert_eq!(to_actor, 0.0, "step {step}: reference is not the policy");
            assert!(to_prev > 0.0, "step {step}: reference did not move");
        } else {
            assert_eq!(m["spin/ref_updated"], 0.0);
            assert_eq!(to_prev, 0.0, "step {step}: reference moved between updates");
            assert!(to_actor > 0.0, "step {step}: the policy did not train");
        }
        prev_ref = reference;
    }
}

/// The preference learning bar on task accuracy, over the seeds: SPIN and online DPO must gain
/// 5 points at the median and lose at most 5 on the worst seed. Their gains are smaller and
/// noisier than the on-policy algorithms' (`docs/learning.md`: over five seeds SPIN measured
/// +16 at the median and +10 at the worst, online DPO +12 and 0).
const PREF_MEDIAN_GAIN: f64 = 0.05;
const PREF_WORST_GAIN: f64 = -0.05;

/// Online DPO's floor for the worst seed is the on-policy tests' collapse floor, -10 points: from
/// the strongest SFT start (seed 2, 64.5% before) it loses 7.5 points, on the development machine
/// and on CI's alike, while the ten other seeds measured (7, 1 and 3-6, 8-11 with
/// `LEARN_INIT_SEEDS`) gain +5.0 to +28.5 (median +10.5 over all eleven). A gentler lr (5e-5)
/// keeps seed 2 at +2.5 but learns less on the seeds the tests do not use (median +8.0 against
/// +10.25), so the recipe stays; `docs/learning.md` has the table.
const ONLINE_DPO_WORST_GAIN: f64 = -0.10;

/// SPIN (`experiments/spin.toml`'s recipe): 40 steps of 16 prompts, one generation each
/// against the ground truth, beta 0.1, the reference replaced by the policy every 10 steps,
/// lr 5e-4.
#[test]
fn spin_raises_held_out_accuracy() {
    let steps = env_or("SPIN_STEPS", 40);
    let prompts = env_or("SPIN_PROMPTS", 16) as usize;
    let lr = env_or("SPIN_LR_E4", 5) as f64 * 1e-4;
    let key = "val/test_score/arithmetic";
    let results = per_seed(init_seeds(), |seed| {
        let w = &warm(seed);
        let cfg = DpoTrainerConfig {
            beta: env_or("SPIN_BETA_E2", 10) as f64 * 1e-2,
            ref_update_freq: env_or("SPIN_REF_FREQ", 10),
            total_training_steps: steps,
            ..DpoTrainerConfig::default()
        };
        let mut t = build_spin(w, load_policy(&w.ckpt).unwrap(), cfg, prompts, lr, w.seed).unwrap();
        let t1 = std::time::Instant::now();
        let (before, _) = t.validate().unwrap();
        let mut identical = Vec::new();
        while t.global_step() < t.total_steps() {
            identical.push(t.step().unwrap()["spin/identical_ratio"]);
        }
        let (after, _) = t.validate().unwrap();
        let first = identical[..10].iter().sum::<f64>() / 10.0;
        println!(
            "spin (init seed {seed}): held-out accuracy {:.1}% -> {:.1}% over {steps} steps \
             ({:.1}s); generations identical to the ground truth over the first 10 steps {:.0}%",
            before[key] * 100.0,
            after[key] * 100.0,
            t1.elapsed().as_secs_f64(),
            first * 100.0
        );
        // the SFT start point is not yet perfect at imitating: most pairs carry a gradient
        assert!(first < 0.5, "seed {seed}: {identical:?}");
        SeedResult {
            seed,
            before: before[key],
            after: after[key],
        }
    });
    assert_gain_over_seeds("spin", &results, PREF_MEDIAN_GAIN, PREF_WORST_GAIN);
}

/// The online-DPO trainer from `w`'s SFT checkpoint: `cfg.n` samples per prompt of a batch of
/// `prompts`, ranked by the rule reward, `pairs_per_update` pairs per optimiser step.
fn build_online_dpo(
    w: &Start,
    cfg: DpoTrainerConfig,
    prompts: usize,
    pairs_per_update: usize,
    lr: f64,
    seed: u64,
) -> AnyResult<OnlineDpoTrainer> {
    let reward = RuleReward::new(w.task.tokenizer.clone(), RewardRegistry::verl_default());
    let policy = load_policy(&w.ckpt)?;
    build_online_dpo_with(
        w,
        policy,
        cfg,
        prompts,
        pairs_per_update,
        lr,
        seed,
        Box::new(reward),
    )
}

/// [`build_online_dpo`] of `policy` with another reward role.
#[allow(clippy::too_many_arguments)]
fn build_online_dpo_with(
    w: &Start,
    policy: SharedPolicy,
    cfg: DpoTrainerConfig,
    prompts: usize,
    pairs_per_update: usize,
    lr: f64,
    seed: u64,
    reward: Box<dyn Reward>,
) -> AnyResult<OnlineDpoTrainer> {
    let tok = w.task.tokenizer.clone();
    let exp = ExperimentConfig {
        data: tiny_data_config(w.task, prompts, w.seed),
        ..ExperimentConfig::default()
    };
    let (train, val) = loaders(&exp, &tok)?;
    let temperature = env_or("ONLINE_DPO_TEMP_E2", 100) as f64 * 1e-2;
    let rollout = rollout(w, &policy, cfg.n, temperature, seed)?;
    let reference = ReferenceWorker::from_policy(&policy, None)?;
    let actor = dpo_actor(policy, pairs_per_update, lr)?;
    Ok(OnlineDpoTrainer::new(
        cfg,
        Box::new(actor),
        Box::new(rollout),
        Some(Box::new(reference)),
        reward,
        Box::new(train),
        val,
        pairs_per_update,
    )?)
}

/// Online DPO (`experiments/online_dpo.toml`'s recipe): 40 steps of 16 prompts x 16
/// samples ranked by the rule reward, 4 pairs an update, beta 0.1, lr 1e-4.
#[test]
fn online_dpo_raises_held_out_accuracy() {
    let steps = env_or("ONLINE_DPO_STEPS", 40);
    let n = env_or("ONLINE_DPO_N", 16) as usize;
    let prompts = env_or("ONLINE_DPO_PROMPTS", 16) as usize;
    let pairs = env_or("ONLINE_DPO_PAIRS", 4) as usize;
    let lr = env_or("ONLINE_DPO_LR_E5", 10) as f64 * 1e-5;
    let key = "val/test_score/arithmetic";
    let results = per_seed(init_seeds(), |seed| {
        let w = &warm(seed);
        let cfg = DpoTrainerConfig {
            beta: env_or("ONLINE_DPO_BETA_E2", 10) as f64 * 1e-2,
            n,
            total_training_steps: steps,
            ..DpoTrainerConfig::default()
        };
        let mut t = build_online_dpo(w, cfg, prompts, pairs, lr, w.seed).unwrap();
        let t1 = std::time::Instant::now();
        let (before, _) = t.validate().unwrap();
        let (mut used, mut ties) = (0.0, 0.0);
        while t.global_step() < t.total_steps() {
            let m = t.step().unwrap();
            used += m["online_dpo/pairs"];
            ties += m["online_dpo/ties"];
        }
        let (after, _) = t.validate().unwrap();
        println!(
            "online dpo (init seed {seed}): held-out accuracy {:.1}% -> {:.1}% over {steps} \
             steps ({used} pairs trained, {ties} tied groups skipped; {:.1}s)",
            before[key] * 100.0,
            after[key] * 100.0,
            t1.elapsed().as_secs_f64()
        );
        assert!(
            used > 0.0 && ties > 0.0,
            "seed {seed}: {used} pairs, {ties} ties"
        );
        SeedResult {
            seed,
            before: before[key],
            after: after[key],
        }
    });
    assert_gain_over_seeds(
        "online dpo",
        &results,
        PREF_MEDIAN_GAIN,
        ONLINE_DPO_WORST_GAIN,
    );
}

/// Scores a response by its first token (`id / 100` on its first position), so even a random
/// policy's samples rank without ties and online DPO has pairs to train on.
struct FirstTokenReward;

impl Reward for FirstTokenReward {
    fn score(&mut self, batch: &Batch) -> rl_core::Result<Batch> {
        let responses = batch.get(keys::RESPONSES)?;
        let first = responses.narrow(1, 0, 1).to_kind(Kind::Float) / 100.0;
        let rest = Tensor::zeros(
            [responses.size()[0], responses.size()[1] - 1],
            (Kind::Float, responses.device()),
        );
        let mut out = Batch::new();
        out.insert(keys::TOKEN_LEVEL_SCORES, Tensor::cat(&[first, rest], 1))?;
        Ok(out)
    }
}

/// The metrics a resumed run must reproduce: everything but wall times.
fn comparable(m: &StepMetrics) -> Vec<(String, f64)> {
    m.iter()
        .filter(|(k, _)| !rl_core::is_wall_clock(k))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// Trains `steps` steps uninterrupted, then `steps / 2` + save + load into a freshly built
/// trainer + the rest, and checks that every step's metrics (timings aside) and the final
/// weights are identical. `build` returns a trainer at step 0 and the policy it trains.
fn assert_resume_exact(
    name: &str,
    steps: u64,
    build: impl Fn() -> AnyResult<(Box<dyn Trainer>, SharedPolicy)>,
) {
    let w = cold();
    let (mut a, pa) = build().unwrap();
    let full: Vec<StepMetrics> = (0..steps).map(|_| a.step().unwrap()).collect();
    let half = steps / 2;
    let ckpt = w.task.root.path().join(format!("ckpt-{name}"));
    std::fs::create_dir_all(&ckpt).unwrap();
    let (mut b, _) = build().unwrap();
    for want in &full[..half as usize] {
        assert_eq!(comparable(&b.step().unwrap()), comparable(want), "{name}");
    }
    b.save_checkpoint(&ckpt).unwrap();
    drop(b);
    let (mut c, pc) = build().unwrap();
    c.load_checkpoint(&ckpt).unwrap();
    assert_eq!(c.global_step(), half, "{name}");
    for (i, want) in full.iter().enumerate().skip(half as usize) {
        let got = c.step().unwrap();
        assert_eq!(comparable(&got), comparable(want), "{name}: step {}", i + 1);
    }
    assert_eq!(c.global_step(), steps);
    assert!(
        full.iter().all(|m| m.contains_key("loss")),
        "{name}: a step made no update"
    );
    let init = load_policy(&w.ckpt).unwrap();
    let init = init.lock().unwrap().var_store().variables();
    let (va, vc) = (pa.lock().unwrap(), pc.lock().unwrap());
    let (va, vc) = (va.var_store().variables(), vc.var_store().variables());
    assert_eq!(va.len(), vc.len());
    for (k, t) in &va {
        assert!(t.equal(&vc[k]), "{name}: weight {k} differs after resume");
    }
    assert!(
        va.iter().any(|(k, t)| !t.equal(&init[k])),
        "{name}: the policy did not train"
    );
    println!(
        "{name}: {half} + {half} steps resumed = {steps} uninterrupted (metrics and {} weights)",
        va.len()
    );
}

#[test]
fn dpo_resume_is_exact() {
    assert_resume_exact("dpo", 4, || {
        let cfg = DpoTrainerConfig {
            precompute_ref_log_probs: true,
            total_training_steps: 4,
            ..DpoTrainerConfig::default()
        };
        let policy = load_policy(&cold().ckpt)?;
        let t = build_dpo_from(cold(), policy.clone(), cfg, 4, 1e-3)?;
        Ok((Box::new(t), policy))
    });
}

#[test]
fn online_dpo_resume_is_exact() {
    assert_resume_exact("online dpo", 4, || {
        let cfg = DpoTrainerConfig {
            n: 4,
            total_training_steps: 4,
            ..DpoTrainerConfig::default()
        };
        let w = cold();
        let policy = load_policy(&w.ckpt)?;
        let reward = Box::new(FirstTokenReward);
        let t = build_online_dpo_with(w, policy.clone(), cfg, 4, 2, 1e-3, w.seed, reward)?;
        Ok((Box::new(t), policy))
    });
}

#[test]
fn spin_resume_is_exact() {
    // the checkpoint (step 2) falls on a reference update: the resumed reference is the policy
    assert_resume_exact("spin", 4, || {
        let cfg = DpoTrainerConfig {
            ref_update_freq: 2,
            total_training_steps: 4,
            ..DpoTrainerConfig::default()
        };
        let w = cold();
        let policy = load_policy(&w.ckpt)?;
        let t = build_spin(w, policy.clone(), cfg, 4, 1e-3, w.seed)?;
        Ok((Box::new(t), policy))
    });
}

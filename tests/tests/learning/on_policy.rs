//! The on-policy algorithms: each raises held-out accuracy over the shared SFT checkpoint
//! (`rl_e2e::carry_free_warm`) with the same seed and budget, by at least 10 points at the
//! median of the initial-weight seeds, and collapses on none. The seeds of a test train side by
//! side in threads of one intra-op thread each.

use rl_algos::AdvEstimator;
use rl_algos::{FilterGroupsConfig, KlPenalty, LossAggMode, OverlongBufferConfig};
use rl_core::Trainer;
use rl_e2e::*;
use rl_workers::roles::{ActorConfig, CriticConfig, OptimConfig};
use rl_workers::{RolloutConfig, ValueModel};
use tch::{Device, Kind};

/// The runs' seed (rollout sampling, shuffling), the data's.
const SEED: u64 = TASK_SEED;
const RL_STEPS: usize = 40;

/// The initial-weight seeds of the comparison between LoRA and full fine-tuning
/// ([`lora_grpo_learns`]): the tests' three and the next seeds from 12 whose SFT warm-up does
/// not stall, fifteen in all, none of them used to choose the recipe.
const COMPARE_SEEDS: usize = 15;
const COMPARE_FIRST_EXTRA_SEED: u64 = 12;

/// The rollout temperature of that comparison (verl's default): see [`lora_grpo_learns`].
const COMPARE_TEMPERATURE: f64 = 1.0;

/// Its bar (issue 21: "at least full fine-tuning's gain minus 5 points"): LoRA's gain less full
/// fine-tuning's from the same SFT start, as a mean over the seeds.
const LORA_GAP_MEAN: f64 = -0.05;

/// The bar: at least 10 points at the median over the initial-weight seeds ([`init_seeds`]), and no seed may lose more than
/// 10 (a collapse). The floor is not 0: on seed 1, the weakest SFT start (27.5%), RLOO without
/// a KL term measured 27.5% -> 20.5% in `scripts/learning-report` (docs/learning.md).
const MEDIAN_GAIN: f64 = 0.10;
const WORST_GAIN: f64 = -0.10;

/// The critic's bars ([`ppo_critic_learns`]), over the last five of 20 critic-only steps against
/// step 1, chosen on eight initial-weight seeds the tests do not use (3-6, 8-11;
/// docs/learning.md), where the explained variance rose by +0.036 to +0.928 (median +0.069) to
/// -0.008 to +0.078 (median +0.004), and `critic/vf_loss` ended at 0.72x to 0.87x of step 1's
/// (median 0.82x): the fresh head's noise is unlearned within a few steps, and the critic
/// predicts about as well as the best constant (the mean return) by step 20, not better.
const CRITIC_EV_GAIN_MEDIAN: f64 = 0.02;
const CRITIC_EV_LATE_WORST: f64 = -0.05;
const CRITIC_LOSS_RATIO_MEDIAN: f64 = 0.95;

/// The shared SFT warm-up of the initial weights `init_seed`.
fn warm(init_seed: u64) -> &'static Warm {
    carry_free_warm(init_seed)
}

/// The on-policy config every test starts from (`experiments/quickstart.toml`'s recipe: 64
/// prompts x 8 samples a step at temperature 0.5, lr 1e-3), over the SFT checkpoint of `w`.
pub(crate) fn base_config(w: &Warm, adv: AdvEstimator) -> ExperimentConfig {
    let batch = env_or("LEARN_RL_BATCH", 64) as usize;
    let mut cfg = ExperimentConfig {
        data: tiny_data_config(&w.task, batch, SEED),
        ..ExperimentConfig::default()
    };
    let arr = &mut cfg.actor_rollout_ref;
    arr.model.path = w.ckpt.clone();
    arr.rollout = RolloutConfig {
        n: 8,
        response_length: 4,
        temperature: env_or("LEARN_RL_TEMP_PCT", 50) as f64 / 100.0,
        seed: SEED,
        ..RolloutConfig::default()
    };
    arr.actor = ActorConfig {
        ppo_mini_batch_size: batch,
        ppo_micro_batch_size_per_gpu: Some(64),
        optim: OptimConfig {
            lr: env_or("LEARN_RL_LR_E4", 10) as f64 * 1e-4,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    cfg.algorithm.adv_estimator = adv;
    cfg.trainer.total_training_steps = Some(env_or("LEARN_RL_STEPS", RL_STEPS as u64));
    cfg.trainer.log_val_generations = 3;
    cfg.critic.worker = CriticConfig {
        ppo_mini_batch_size: 16,
        optim: OptimConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..CriticConfig::default()
    };
    cfg
}

/// One seed's run: held-out accuracy before and after, and every step's metrics.
struct Run {
    result: SeedResult,
    steps: Vec<rl_core::StepMetrics>,
}

/// Trains from the SFT checkpoint of `init_seed` and returns held-out accuracy before and
/// after.
fn train(name: &str, init_seed: u64, cfg: &ExperimentConfig) -> Run {
    let w = warm(init_seed);
    let mut cfg = cfg.clone();
    // a wider held-out set for measuring (the warm-up's 200 prompts and more)
    let rows = env_or("LEARN_EVAL_ROWS", 0) as usize;
    if rows > 0 {
        cfg.data.val_files = vec![wide_held_out(rows).to_path_buf()];
    }
    let cfg = &cfg;
    // as `harness train` loads it: LoRA adapters when the config asks for them
    let policy = rl_workers::roles::share(
        seeded(SEED as i64, || {
            rl_harness::run::compose::load_policy(cfg, Device::Cpu)
        })
        .unwrap(),
    );
    let critic = cfg.algorithm.adv_estimator.needs_critic().then(|| {
        seeded(SEED as i64, || {
            ValueModel::from_pretrained(&w.ckpt, Device::Cpu, Kind::Float).unwrap()
        })
    });
    let mut trainer = build_on_policy(cfg, policy, critic, &w.task.tokenizer).unwrap();
    let key = "val/test_score/arithmetic";
    let (before, samples) = trainer.validate().unwrap();
    // held-out accuracy every `LEARN_EVAL_EVERY` steps too, for measuring (validation is greedy
    // and draws nothing, so the run's trajectory does not change)
    let every = env_or("LEARN_EVAL_EVERY", 0) as usize;
    let mut curve = Vec::new();
    let mut steps = Vec::new();
    while trainer.global_step() < trainer.total_steps() {
        steps.push(trainer.step().unwrap());
        if every > 0
            && steps.len().is_multiple_of(every)
            && trainer.global_step() < trainer.total_steps()
        {
            let accuracy = trainer.validate().unwrap().0[key];
            curve.push(format!("{}: {:.1}%", steps.len(), accuracy * 100.0));
        }
    }
    let (after, _) = trainer.validate().unwrap();
    let (b, a) = (before[key], after[key]);
    if !curve.is_empty() {
        println!(
            "{name} (init seed {init_seed}): held-out accuracy by step {}",
            curve.join(", ")
        );
    }
    // seconds of each phase over all steps (where the suite's time goes)
    let phases: Vec<String> = steps[0]
        .keys()
        .filter_map(|k| k.strip_prefix("timing_s/"))
        .map(|phase| {
            let key = format!("timing_s/{phase}");
            let total: f64 = steps.iter().filter_map(|m| m.get(&key)).sum();
            format!("{phase} {total:.1}")
        })
        .collect();
    println!(
        "{name} (init seed {init_seed}): held-out accuracy {:.1}% -> {:.1}% over {} steps (step 1: score {:.3}; seconds in all: {}); sample {:?}",
        b * 100.0,
        a * 100.0,
        steps.len(),
        steps[0]["critic/score/mean"],
        phases.join(", "),
        samples.first()
    );
    Run {
        result: SeedResult {
            seed: init_seed,
            before: b,
            after: a,
        },
        steps,
    }
}

/// Trains `make(warm)` from each seed's SFT checkpoint, side by side, and asserts the bar over
/// the seeds; returns each seed's step metrics.
fn assert_gain(
    name: &str,
    make: impl Fn(&Warm) -> ExperimentConfig + Sync,
) -> Vec<Vec<rl_core::StepMetrics>> {
    let runs = per_seed(init_seeds(), |seed| train(name, seed, &make(warm(seed))));
    let results: Vec<SeedResult> = runs.iter().map(|r| r.result).collect();
    assert_gain_over_seeds(name, &results, MEDIAN_GAIN, WORST_GAIN);
    for run in &runs {
        for key in [
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/lr",
            "critic/advantages/mean",
            "response_length/mean",
            "prompt_length/mean",
            "timing_s/gen",
            "timing_s/update_actor",
            "perf/throughput",
        ] {
            assert!(run.steps[0].contains_key(key), "{name} lacks {key}");
        }
    }
    runs.into_iter().map(|r| r.steps).collect()
}

/// GRPO with a KL loss, the quickstart's recipe.
fn grpo_config(w: &Warm) -> ExperimentConfig {
    let mut cfg = base_config(w, AdvEstimator::Grpo);
    cfg.actor_rollout_ref.actor_loss.use_kl_loss = true;
    cfg.actor_rollout_ref.actor_loss.kl_loss_type = KlPenalty::LowVarKl;
    cfg
}

/// The full fine-tuning GRPO runs of every seed, trained once for the tests that compare with
/// them.
fn grpo_full_runs() -> &'static [Run] {
    static RUNS: std::sync::OnceLock<Vec<Run>> = std::sync::OnceLock::new();
    RUNS.get_or_init(|| {
        per_seed(init_seeds(), |seed| {
            train("grpo", seed, &grpo_config(warm(seed)))
        })
    })
}

/// The seeds of the LoRA comparison: the tests' seeds and the next [`COMPARE_SEEDS`] less
/// three from [`COMPARE_FIRST_EXTRA_SEED`] on whose warm-up does not stall (which varies with
/// the CPU's rounding: seed 17's stalled on the Zen 4 VM, seed 12's took 740 of its 800 steps),
/// or only `LEARN_INIT_SEEDS` where that is set.
fn compare_seeds() -> Vec<u64> {
    let mut seeds = init_seeds().to_vec();
    if std::env::var_os("LEARN_INIT_SEEDS").is_some() {
        return seeds;
    }
    let mut next = COMPARE_FIRST_EXTRA_SEED;
    while seeds.len() < COMPARE_SEEDS {
        assert!(
            next < COMPARE_FIRST_EXTRA_SEED + 2 * COMPARE_SEEDS as u64,
            "the LoRA comparison found only {} seeds whose SFT warm-up does not stall up to seed {next}",
            seeds.len()
        );
        let batch: Vec<u64> = (next..).take(COMPARE_SEEDS - seeds.len()).collect();
        next += batch.len() as u64;
        for (seed, warm) in batch.iter().zip(per_seed(&batch, try_carry_free_warm)) {
            match warm {
                Ok(_) => seeds.push(*seed),
                Err(stalled) => println!("lora comparison: init seed {seed} skipped: {stalled}"),
            }
        }
    }
    seeds
}

#[test]
fn grpo_raises_accuracy() {
    let runs = grpo_full_runs();
    let results: Vec<SeedResult> = runs.iter().map(|r| r.result).collect();
    assert_gain_over_seeds("grpo", &results, MEDIAN_GAIN, WORST_GAIN);
    assert!(runs.iter().all(|r| r.steps[0].contains_key("timing_s/ref")));
}

/// LoRA: adapters of rank 16 (alpha 32) on every linear layer of a frozen base and on the
/// vocabulary layers (`lm_head`, `embed_tokens`), at full fine-tuning's learning rate, with the
/// reference being the base model (adapters off), training 46,208 parameters (the adapters) of
/// the tiny model's 113,216. Against full fine-tuning from the same SFT starts with the same
/// recipe, sampling at temperature 1 ([`COMPARE_TEMPERATURE`]), over [`compare_seeds`] (fifteen):
/// LoRA must clear the bar of every on-policy algorithm, and its gain less full fine-tuning's,
/// seed by seed, must be at least -5 points at the mean (issue 21).
///
/// The recipe was chosen on eight initial-weight seeds no test uses (3-6, 8-11;
/// `LEARN_INIT_SEEDS`, docs/learning.md, 2026-11-29 on the Zen 4 VM): full fine-tuning gained
/// +43.5 at the median after 40 steps at the quickstart's temperature 0.5; with the tied
/// embedding frozen +33.0, so LoRA on the decoder alone (r=8, 5e-3: +30.0) missed the vocabulary
/// matrix; adapting the head and the embedding too, at rank 16 and 1e-3 (the embedding's adapter
/// collapses at 5e-3), +39.5.
///
/// Why this form of the bar. At temperature 0.5 a run stalls on the prompts whose eight samples
/// all agree (no group advantage), and when it stalls decides its outcome: from the same start
/// LoRA's and full fine-tuning's gains differ by -21.0 to +9.0 points after 40 steps and by
/// -23.0 to +21.5 after 80 (seeds 1-15; as much on seeds 1-11 with 1000 held-out prompts, so it
/// is the runs, not the evaluation). At temperature 1 the runs keep exploring and the two stay
/// closer (-14.5 to +16.0 over 23 seeds, mean -1.2, standard deviation 6.7), but each method's
/// gains still range from +3 to +40, so the medians of two equally good methods over a few
/// seeds differ by more than 5 points often: resampling those 23 seeds, LoRA's median fell 5
/// points below full fine-tuning's in 18% of seven-seed draws and 12% of fifteen-seed draws,
/// the mean of the seed-by-seed differences in 6% and 1%. So the bar is that mean over fifteen
/// seeds (docs/learning.md has every seed's figures).
/// `LEARN_LORA_TARGETS` (a comma list), `LEARN_LORA_RANK`, `LEARN_LORA_ALPHA`,
/// `LEARN_LORA_LR_E4` and `LEARN_COMPARE_TEMP_PCT` measure other recipes.
#[test]
fn lora_grpo_learns() {
    let seeds = compare_seeds();
    let rank = env_or("LEARN_LORA_RANK", 16) as i64;
    // every linear layer and both sides of the (tied) vocabulary matrix, unless measuring others
    let targets = match std::env::var("LEARN_LORA_TARGETS") {
        Ok(t) => rl_workers::lora::TargetModules::Names(t.split(',').map(str::to_owned).collect()),
        Err(_) => rl_workers::lora::TargetModules::every_layer(),
    };
    let temperature = env_or(
        "LEARN_COMPARE_TEMP_PCT",
        (COMPARE_TEMPERATURE * 100.0) as u64,
    ) as f64
        / 100.0;
    let config = |seed| {
        let mut cfg = grpo_config(warm(seed));
        cfg.actor_rollout_ref.rollout.temperature = temperature;
        cfg
    };
    let runs = per_seed(&seeds, |seed| {
        let full = train("grpo t1", seed, &config(seed));
        let mut cfg = config(seed);
        let m = &mut cfg.actor_rollout_ref.model;
        m.lora_rank = rank;
        m.lora_alpha = env_or("LEARN_LORA_ALPHA", 32) as f64;
        m.target_modules = targets.clone();
        cfg.actor_rollout_ref.actor.optim.lr = env_or("LEARN_LORA_LR_E4", 10) as f64 * 1e-4;
        (full.result, train("grpo t1 lora", seed, &cfg))
    });
    let results: Vec<SeedResult> = runs.iter().map(|(_, lora)| lora.result).collect();
    let lora_median = assert_gain_over_seeds("grpo t1 lora", &results, MEDIAN_GAIN, WORST_GAIN);
    let full: Vec<f64> = runs.iter().map(|(full, _)| full.gain()).collect();
    let full_median = median(&full);
    // LoRA's gain less full fine-tuning's from the same SFT start, seed by seed
    let gaps: Vec<f64> = results
        .iter()
        .zip(&full)
        .map(|(l, f)| l.gain() - f)
        .collect();
    let mean_gap = mean(&gaps);
    println!(
        "grpo at temperature {temperature}, {} seeds: median gain full fine-tuning {:+.1} points, LoRA r={rank} on {targets:?} {:+.1}; LoRA less full fine-tuning, seed by seed: mean {:+.1}, median {:+.1}, {}",
        seeds.len(),
        full_median * 100.0,
        lora_median * 100.0,
        mean_gap * 100.0,
        median(&gaps) * 100.0,
        gaps.iter()
            .map(|d| format!("{:+.1}", d * 100.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        mean_gap >= LORA_GAP_MEAN,
        "grpo lora over seeds {seeds:?}: LoRA's gain less full fine-tuning's is {:+.1} points at the mean, under the bar of {:+.1}",
        mean_gap * 100.0,
        LORA_GAP_MEAN * 100.0
    );
    for (_, lora) in &runs {
        assert!(lora.steps[0].contains_key("actor/grad_norm"));
    }
}

/// One-step off-policy GRPO (`async_training`, max_staleness 1: each step trains on samples
/// the previous step's weights generated in the background while that step updated), with
/// rollout correction's bypass mode (PPO's ratio taken against the policy that drew the samples,
/// from the rollout's own log-probs), clears the bar of every on-policy algorithm; its gap to
/// the synchronous run is printed, not asserted.
///
/// The recipe was chosen on initial-weight seeds the tests do not use (3 and 4; docs/async.md):
/// without a correction one step of staleness collapsed both (-30.0 and -16.0 points against the
/// synchronous +58.0 and +53.0: an update of this recipe moves the tiny policy by 0.2-0.6 nats a
/// token, so last step's samples are far off-policy), token-level truncated importance weights
/// recovered part (+12.5, +31.5), bypass mode all of it (+60.5, +62.5).
#[test]
fn one_step_off_policy_grpo_learns() {
    let sync: Vec<SeedResult> = grpo_full_runs().iter().map(|r| r.result).collect();
    let runs = per_seed(init_seeds(), |seed| {
        let mut cfg = grpo_config(warm(seed));
        cfg.async_training.enable = true;
        cfg.async_training.max_staleness = 1;
        cfg.algorithm.rollout_correction.bypass_mode = true;
        train("grpo off-policy", seed, &cfg)
    });
    let results: Vec<SeedResult> = runs.iter().map(|r| r.result).collect();
    let off = assert_gain_over_seeds("grpo off-policy", &results, MEDIAN_GAIN, WORST_GAIN);
    let on = median(&sync.iter().map(SeedResult::gain).collect::<Vec<_>>());
    println!(
        "grpo: median gain synchronous {:.1} points, one step off-policy {:.1} points",
        on * 100.0,
        off * 100.0
    );
    for run in &runs {
        let staleness: Vec<f64> = run.steps.iter().map(|m| m["async/staleness"]).collect();
        assert_eq!(staleness[0], 0.0);
        assert!(staleness[1..].iter().all(|s| *s == 1.0), "{staleness:?}");
    }
}

/// Mixed precision: bfloat16 weights and compute with float32 master weights and optimizer
/// state reach the float32 run's outcome (median gain within 5 points, no collapse), and its
/// per-step score curve stays close to float32's. Ignored in the default suite: bfloat16
/// matmuls are slow on this CPU (7.5 s a step against float32's 1.2 s, so the three seeds take
/// six minutes); `cargo test -p rl-e2e --test learning -- --ignored bf16 --nocapture` runs it,
/// and docs/learning.md records its figures.
#[test]
#[ignore = "six minutes on 2 CPU cores (bfloat16 matmuls are slow on CPU); docs/learning.md has its figures"]
fn bf16_mixed_precision_grpo_learns_like_float32() {
    let full = grpo_full_runs();
    let bf16 = per_seed(init_seeds(), |seed| {
        let mut cfg = grpo_config(warm(seed));
        cfg.actor_rollout_ref.actor.mixed_precision.param_dtype =
            rl_workers::roles::ParamDtype::Bf16;
        train("grpo bf16", seed, &cfg)
    });
    let results: Vec<SeedResult> = bf16.iter().map(|r| r.result).collect();
    let bf16_median = assert_gain_over_seeds("grpo bf16", &results, MEDIAN_GAIN, WORST_GAIN);
    let full_median = median(&full.iter().map(|r| r.result.gain()).collect::<Vec<_>>());
    for (f, b) in full.iter().zip(&bf16) {
        let curve =
            |r: &Run| -> Vec<f64> { r.steps.iter().map(|m| m["critic/score/mean"]).collect() };
        let (cf, cb) = (curve(f), curve(b));
        let max_dev = cf
            .iter()
            .zip(&cb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        let (mf, mb) = (mean(&cf), mean(&cb));
        println!(
            "grpo bf16 vs fp32 (init seed {}): critic/score/mean averaged over steps fp32 {mf:.3}, bf16 {mb:.3}, max step deviation {max_dev:.3}; fp32 {cf:.2?}; bf16 {cb:.2?}",
            f.result.seed
        );
    }
    println!(
        "grpo: median gain float32 {:.1} points, bf16 mixed {:.1} points",
        full_median * 100.0,
        bf16_median * 100.0
    );
    assert!(
        bf16_median >= full_median - 0.05,
        "bf16's median gain {bf16_median:.3} is more than 5 points under float32's {full_median:.3}"
    );
}

#[test]
fn rloo_raises_accuracy() {
    assert_gain("rloo", |w| base_config(w, AdvEstimator::Rloo));
}

#[test]
fn reinforce_plus_plus_raises_accuracy() {
    assert_gain("reinforce_plus_plus", |w| {
        base_config(w, AdvEstimator::ReinforcePlusPlusBaseline)
    });
}

#[test]
fn dapo_raises_accuracy() {
    let steps = assert_gain("dapo", |w| {
        let mut cfg = base_config(w, AdvEstimator::Grpo);
        let loss = &mut cfg.actor_rollout_ref.actor_loss;
        loss.clip_ratio_low = Some(0.2);
        loss.clip_ratio_high = Some(0.28);
        loss.loss_agg_mode = LossAggMode::TokenMean;
        cfg.reward_model.own.overlong_buffer = OverlongBufferConfig {
            enable: true,
            len: 2,
            penalty_factor: 0.5,
            log: false,
        };
        cfg.algorithm.filter_groups = Some(FilterGroupsConfig {
            enable: true,
            metric: Some("acc".into()),
            max_num_gen_batches: 10,
        });
        cfg
    });
    assert!(
        steps
            .iter()
            .all(|s| s[0].contains_key("train/num_gen_batches"))
    );
}

#[test]
fn ppo_raises_accuracy() {
    let steps = assert_gain("ppo", |w| {
        let mut cfg = base_config(w, AdvEstimator::Gae);
        cfg.algorithm.use_kl_in_reward = true;
        cfg.algorithm.lam = 0.95;
        cfg
    });
    assert!(steps.iter().all(|s| {
        s[0].contains_key("critic/values/mean")
            && s[0].contains_key("timing_s/update_critic")
            && s[0].contains_key("actor/reward_kl_penalty")
    }));
}

/// Regression: PPO's critic learns. With the actor frozen (`trainer.critic_warmup` covering
/// every step) the returns keep one distribution, and the critic's explained variance (verl's
/// `critic/vf_explained_var`, `1 - Var(returns - values) / Var(returns)`) must rise from the
/// fresh head's (below 0: its per-token noise explains less than a constant would) to about the
/// best constant's (0), and its loss must fall, each over the seeds as every learning bar is
/// (median, worst), on the mean of the last five steps. The earlier form of this test ("the loss
/// falls on every seed") failed on seed 2 once the value head was drawn from another point of
/// the generator's stream: a head drawn near the mean return has little loss to lose
/// (docs/learning.md).
#[test]
fn ppo_critic_learns() {
    let runs = per_seed(init_seeds(), |seed| {
        let mut cfg = base_config(warm(seed), AdvEstimator::Gae);
        cfg.algorithm.lam = 0.95;
        cfg.trainer.total_training_steps = Some(20);
        cfg.trainer.critic_warmup = 20;
        (seed, train("ppo critic warmup", seed, &cfg).steps)
    });
    let (mut gain, mut late_ev, mut loss_ratio) = (Vec::new(), Vec::new(), Vec::new());
    for (seed, steps) in &runs {
        assert!(!steps[0].contains_key("timing_s/update_actor"));
        let ev: Vec<f64> = steps.iter().map(|m| m["critic/vf_explained_var"]).collect();
        let vf: Vec<f64> = steps.iter().map(|m| m["critic/vf_loss"]).collect();
        let last5 = |x: &[f64]| x[x.len() - 5..].iter().sum::<f64>() / 5.0;
        println!(
            "ppo (init seed {seed}) critic/vf_explained_var step 1 {:.3} -> last 5 steps {:.3}; critic/vf_loss {:.4} -> {:.4}",
            ev[0],
            last5(&ev),
            vf[0],
            last5(&vf)
        );
        gain.push(last5(&ev) - ev[0]);
        late_ev.push(last5(&ev));
        loss_ratio.push(last5(&vf) / vf[0]);
    }
    let worst = late_ev.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "ppo critic: explained variance gain median {:+.3}, last 5 steps worst {worst:.3}; vf_loss last 5 / step 1 median {:.3}",
        median(&gain),
        median(&loss_ratio)
    );
    assert!(
        median(&gain) >= CRITIC_EV_GAIN_MEDIAN,
        "the critic's explained variance must rise by >= {CRITIC_EV_GAIN_MEDIAN} at the median; rose by {gain:?}"
    );
    assert!(
        worst >= CRITIC_EV_LATE_WORST,
        "the critic's explained variance over the last 5 steps must be >= {CRITIC_EV_LATE_WORST} on every seed (about the best constant's 0); got {late_ev:?}"
    );
    assert!(
        median(&loss_ratio) <= CRITIC_LOSS_RATIO_MEDIAN,
        "the critic's loss must end at <= {CRITIC_LOSS_RATIO_MEDIAN}x step 1's at the median; got {loss_ratio:?}"
    );
}

/// Dr. GRPO: no division by the group's standard deviation, and the loss summed over tokens
/// and divided by a constant (the response length) instead of each sequence's length.
#[test]
fn dr_grpo_raises_accuracy() {
    assert_gain("dr_grpo", |w| {
        let mut cfg = base_config(w, AdvEstimator::Grpo);
        cfg.algorithm.norm_adv_by_std_in_grpo = false;
        cfg.actor_rollout_ref.actor_loss.loss_agg_mode = LossAggMode::SeqMeanTokenSumNorm;
        cfg
    });
}

/// GSPO: sequence-level importance ratios (the geometric mean of the token ratios), clipped
/// per sequence, with verl's recommended sequence-mean aggregation.
#[test]
fn gspo_raises_accuracy() {
    assert_gain("gspo", |w| {
        let mut cfg = base_config(w, AdvEstimator::Grpo);
        let loss = &mut cfg.actor_rollout_ref.actor_loss;
        loss.policy_loss.loss_mode = rl_algos::PolicyLossMode::Gspo;
        loss.loss_agg_mode = LossAggMode::SeqMeanTokenMean;
        loss.clip_ratio_low = Some(3e-4);
        loss.clip_ratio_high = Some(4e-4);
        cfg
    });
}

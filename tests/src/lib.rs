//! Shared helpers of the end-to-end tests: the tiny character-level task on disk, the SFT
//! warm-up, and thin wrappers over `rl_harness::run::compose`, which composes the experiments
//! exactly as `harness train` does (its config, loaders, batch sources and trainers are
//! re-exported here).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rl_algos::AlgoConfig;
use rl_algos::trainer::{OnPolicyTrainer, SftConfig, SftTrainer};
use rl_data::{DataConfig, SftDataConfig, SftDataset, Tokenizer};
use rl_workers::roles::{ActorConfig, ActorWorker, SharedPolicy, share};
use rl_workers::{CausalLm, ValueModel};
use serde_json::Value;
use tch::{Device, Kind};

pub use rl_harness::config::ExperimentConfig;
pub use rl_harness::config::checks::on_policy_config;
pub use rl_harness::run::compose::{
    LoaderSource, PreferenceSource, SftSource, loaders, tiny_llama_config,
};

mod warm;
pub use warm::{
    INIT_SEEDS, PerSeed, SFT_MAX_STEPS, SFT_TARGET_LOSS, TASK_SEED, Warm, carry_free_warm,
    init_seeds, try_carry_free_warm, wide_held_out,
};

/// Any error of the workspace crates, as a boxed error for tests.
pub type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The on-disk pieces of the tiny task: a model folder holding the tokenizer (and, once
/// written, weights) and the `train`/`test` parquet files.
#[derive(Debug)]
pub struct TinyTask {
    /// Holds everything; removed on drop.
    pub root: tempfile::TempDir,
    /// The tokenizer / model folder.
    pub model_dir: PathBuf,
    /// `train.parquet`.
    pub train: PathBuf,
    /// `test.parquet`.
    pub test: PathBuf,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
}

/// The tuning knob `key` (a whole number, read from the environment), or `default` when unset; a
/// value that does not parse fails the test naming it. The end-to-end tests' knobs are never
/// `RL_`-prefixed: those variables are the harness's config.
pub fn env_or(key: &str, default: u64) -> u64 {
    match std::env::var(key) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{key}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// Writes the tiny tokenizer and an addition task with operands up to `max_operand`.
pub fn tiny_task(max_operand: i64, train: usize, test: usize, seed: u64) -> AnyResult<TinyTask> {
    let task = rl_data::tasks::tiny_vocab::TinyAddition {
        max_operand,
        no_carry: false,
        zero_pad: false,
    };
    tiny_task_with(task, train, test, seed)
}

/// [`tiny_task`] with every option of the addition task.
pub fn tiny_task_with(
    addition: rl_data::tasks::tiny_vocab::TinyAddition,
    train: usize,
    test: usize,
    seed: u64,
) -> AnyResult<TinyTask> {
    let root = tempfile::tempdir()?;
    let model_dir = root.path().join("model");
    rl_data::tasks::tiny_vocab::write_tiny_tokenizer(&model_dir)?;
    let files = rl_data::tasks::tiny_vocab::generate_tiny_addition(
        &root.path().join("data"),
        addition,
        rl_data::tasks::SplitSizes { train, test },
        seed,
    )?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
    Ok(TinyTask {
        model_dir,
        train: files.train,
        test: files.test,
        tokenizer,
        root,
    })
}

/// GRPO with a KL loss on the tiny task, small enough for a few seconds a run: 4 prompts x 4
/// samples of 4 tokens a step, two shuffled mini-batches of 2 prompts for 2 epochs, lr 1e-3
/// after 2 warm-up steps, `steps` steps.
pub fn tiny_grpo_config(task: &TinyTask, steps: u64) -> ExperimentConfig {
    let mut cfg = ExperimentConfig {
        data: tiny_data_config(task, 4, 3),
        ..ExperimentConfig::default()
    };
    cfg.actor_rollout_ref.rollout = rl_workers::RolloutConfig {
        n: 4,
        response_length: 4,
        seed: 3,
        ..rl_workers::RolloutConfig::default()
    };
    cfg.actor_rollout_ref.actor = ActorConfig {
        ppo_mini_batch_size: 2,
        ppo_epochs: 2,
        shuffle: true,
        optim: rl_workers::roles::OptimConfig {
            lr: 1e-3,
            lr_warmup_steps: 2,
            ..rl_workers::roles::OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    cfg.actor_rollout_ref.actor_loss.use_kl_loss = true;
    cfg.algorithm.adv_estimator = rl_algos::AdvEstimator::Grpo;
    cfg.trainer.total_training_steps = Some(steps);
    cfg
}

/// The data config of the tiny task (prompts padded to the longest in a batch).
pub fn tiny_data_config(task: &TinyTask, train_batch_size: usize, seed: u64) -> DataConfig {
    DataConfig {
        train_files: vec![task.train.clone()],
        val_files: vec![task.test.clone()],
        max_prompt_length: 64,
        max_response_length: 8,
        train_batch_size,
        seed: Some(seed),
        pad_to_max_prompt_length: false,
        return_raw_chat: false,
        ..DataConfig::default()
    }
}

/// Builds the on-policy trainer of `cfg` over the policy weights in `policy`, as
/// `harness train` does (`rl_harness::run::compose::build_on_policy`, no progress bar): every check
/// runs before the trainer touches a model; the reference is a frozen copy of `policy` as it is
/// now; the critic (GAE only) starts from `critic_init`.
pub fn build_on_policy(
    cfg: &ExperimentConfig,
    policy: SharedPolicy,
    critic_init: Option<ValueModel>,
    tokenizer: &Arc<Tokenizer>,
) -> AnyResult<OnPolicyTrainer> {
    Ok(rl_harness::run::compose::build_on_policy(
        cfg,
        policy,
        critic_init,
        tokenizer,
        None,
    )?)
}

/// Left-pads prompts and right-pads responses into the rollout layout
/// (`rl_harness::run::compose::rollout_layout`).
pub fn rollout_layout(
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    pad: u32,
) -> AnyResult<rl_core::Batch> {
    Ok(rl_harness::run::compose::rollout_layout(
        prompts, responses, pad,
    )?)
}

/// Every check `harness train` runs on an on-policy experiment, before any model loads.
pub fn check_on_policy(cfg: &ExperimentConfig) -> AnyResult<()> {
    Ok(rl_harness::config::checks::check_groups(
        cfg,
        rl_harness::config::TrainerKind::OnPolicy,
    )?)
}

/// The tiny task's SFT rows of `files`: the `prompt` messages and the target `extra_info.answer`.
pub fn answer_rows(files: &[std::path::PathBuf]) -> AnyResult<SftDataset> {
    Ok(SftDataset::open(
        files,
        &SftDataConfig {
            prompt_key: "prompt".into(),
            response_key: "extra_info".into(),
            response_dict_keys: vec!["answer".into()],
            max_length: usize::MAX,
            ..SftDataConfig::default()
        },
    )?)
}

/// SFT of `policy` on `task`'s train split for `steps` steps of `batch_size`; returns the SFT
/// trainer (its validation gives `val/loss`).
pub fn build_sft(
    task: &TinyTask,
    policy: SharedPolicy,
    actor_cfg: ActorConfig,
    steps: u64,
    seed: u64,
) -> AnyResult<SftTrainer> {
    let data = tiny_data_config(task, actor_cfg.ppo_mini_batch_size, seed);
    let train = Arc::new(answer_rows(&data.train_files)?);
    let val = Arc::new(answer_rows(&data.val_files)?);
    let source = SftSource::new(
        train,
        task.tokenizer.clone(),
        actor_cfg.ppo_mini_batch_size,
        seed,
    )?;
    let val_source = SftSource::new(val.clone(), task.tokenizer.clone(), val.len(), seed)?;
    let val_batch = val_source.batch(&(0..val.len()).collect::<Vec<_>>())?;
    let actor = ActorWorker::new(policy, actor_cfg, 1)?;
    Ok(SftTrainer::new(
        SftConfig {
            total_training_steps: steps,
        },
        Box::new(actor),
        Box::new(source),
        vec![val_batch],
    )?)
}

/// Runs `f` with torch's global generator seeded with `seed` and held ([`rl_workers::seeded`]):
/// every model construction of the workspace draws under the same lock, so a seeded
/// initialisation (a fresh policy, a value head) is the same however tests are scheduled.
pub fn seeded<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    rl_workers::seeded(seed, f)
}

/// A fresh tiny policy (seeded init, see [`seeded`]).
pub fn fresh_tiny_policy(vocab: i64, seed: i64) -> AnyResult<SharedPolicy> {
    seeded(seed, || {
        Ok(share(CausalLm::new(
            &tiny_llama_config(vocab),
            Device::Cpu,
            Kind::Float,
        )?))
    })
}

/// A step's `timing_s/<phase>` in seconds with `decimals` places, or `skipped` where the step
/// ran no such phase (an on-policy update supplies the old log-probs: no separate forward).
pub fn phase_seconds(m: &rl_core::StepMetrics, phase: &str, decimals: usize) -> String {
    m.get(&format!("timing_s/{phase}"))
        .map_or("skipped".to_owned(), |t| format!("{t:.decimals$}s"))
}

/// `f(seed)` for every seed, each in its own thread, results in the order of `seeds`. The
/// learning tests train their seeds side by side: the machine's cores are used without
/// raising any one run's intra-op thread count, which would change its arithmetic. The process
/// keeps the memory it frees, as `harness` does ([`rl_workers::heap`]): with glibc's defaults
/// the Search-R1 test's first three steps spent 62-66 s in the kernel (page faults of freshly
/// mapped tensors) against 8-14 s, on the Intel VM of docs/perf.md.
pub fn per_seed<T: Send>(seeds: &[u64], f: impl Fn(u64) -> T + Sync) -> Vec<T> {
    rl_workers::heap::keep_freed_memory();
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = seeds.iter().map(|&seed| s.spawn(move || f(seed))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// A learning result of one seed: the held-out metric before and after training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeedResult {
    /// The seed of the initial weights.
    pub seed: u64,
    /// The held-out metric before training.
    pub before: f64,
    /// The held-out metric after training.
    pub after: f64,
}

impl SeedResult {
    /// `after - before`.
    pub fn gain(&self) -> f64 {
        self.after - self.before
    }
}

/// The mean of `xs`; `xs` must not be empty.
pub fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// The median of `xs` (the upper middle for an even count); `xs` must not be empty.
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A learning bar over seeds, which one lucky seed cannot pass and one CPU's rounding cannot
/// flip: the median gain must reach `median_gain` and the worst seed's `worst_gain`. Prints
/// the per-seed figures (run with `--nocapture` to see them) and returns the median gain.
pub fn assert_gain_over_seeds(
    name: &str,
    results: &[SeedResult],
    median_gain: f64,
    worst_gain: f64,
) -> f64 {
    assert!(
        results.len() >= 3,
        "{name}: a learning bar needs at least 3 seeds"
    );
    let gains: Vec<f64> = results.iter().map(SeedResult::gain).collect();
    let (med, worst) = (
        median(&gains),
        gains.iter().copied().fold(f64::INFINITY, f64::min),
    );
    let table = results
        .iter()
        .map(|r| {
            format!(
                "seed {}: {:.1}% -> {:.1}% ({:+.1})",
                r.seed,
                100.0 * r.before,
                100.0 * r.after,
                100.0 * r.gain()
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "{name}: gain median {:+.1}, worst {:+.1} points over {} seeds ({table})",
        100.0 * med,
        100.0 * worst,
        results.len()
    );
    assert!(
        med >= median_gain - 1e-9 && worst >= worst_gain - 1e-9,
        "{name}: the gain must be >= {:.1} points at the median and >= {:.1} on the worst seed; got median {:+.1}, worst {:+.1} ({table})",
        100.0 * median_gain,
        100.0 * worst_gain,
        100.0 * med,
        100.0 * worst
    );
    med
}

/// Loads a policy saved with `save_pretrained` into `dir`.
pub fn load_policy(dir: &Path) -> AnyResult<SharedPolicy> {
    Ok(share(CausalLm::from_pretrained(
        dir,
        Device::Cpu,
        Kind::Float,
    )?))
}

/// Parses verl's `algorithm` group; an unknown `adv_estimator` is an error naming
/// `algorithm.adv_estimator` and the valid names, any other bad key names itself.
pub fn parse_algorithm(v: &Value) -> AnyResult<AlgoConfig> {
    if let Some(name) = v.get("adv_estimator").and_then(Value::as_str) {
        name.parse::<rl_algos::AdvEstimator>()
            .map_err(|e| format!("algorithm.adv_estimator: {e}"))?;
    }
    serde_json::from_value(v.clone()).map_err(|e| format!("algorithm: {e}").into())
}

// ---- preference-test helpers (issue 8): appended block, owned by the preference tests ----

/// SFT of `policy` on `task` until the held-out loss first drops below `target` (checked every
/// 10 steps) or `max_steps` pass; returns the held-out losses (before training, then every 10
/// steps). The loss curve of the tiny task has a sharp transition whose step varies, so a loss
/// target gives a steadier starting accuracy than a fixed step count.
pub fn sft_until_loss(
    task: &TinyTask,
    policy: SharedPolicy,
    actor_cfg: ActorConfig,
    max_steps: u64,
    target: f64,
    seed: u64,
) -> AnyResult<Vec<f64>> {
    use rl_core::Trainer;
    let mut sft = build_sft(task, policy, actor_cfg, max_steps, seed)?;
    let mut losses = vec![sft.validate()?.0["val/loss"]];
    while sft.global_step() < max_steps {
        sft.step()?;
        if sft.global_step().is_multiple_of(10) {
            let loss = sft.validate()?.0["val/loss"];
            losses.push(loss);
            if loss < target {
                break;
            }
        }
    }
    Ok(losses)
}

// ---- end of the preference-test helpers ----

// ---- multi-turn helpers (issue 10): appended block, owned by the search test ----

/// An SFT batch of multi-turn traces in the rollout layout: each prompt (a user message)
/// rendered with the chat template and the generation prompt, each response the concatenation
/// of its segments, `loss_mask` (`[batch, seq_len]`) 1 on the segments marked generated and 0
/// on the others (tool observations), so the SFT loss trains only what the model writes.
pub fn multi_turn_sft_batch(
    tokenizer: &Tokenizer,
    prompts: &[String],
    responses: &[Vec<(String, bool)>],
) -> AnyResult<rl_core::Batch> {
    if prompts.len() != responses.len() {
        return Err(format!(
            "{} prompts for {} responses",
            prompts.len(),
            responses.len()
        )
        .into());
    }
    let mut prompt_ids = Vec::with_capacity(prompts.len());
    let mut response_ids = Vec::with_capacity(prompts.len());
    let mut generated = Vec::with_capacity(prompts.len());
    for (p, segments) in prompts.iter().zip(responses) {
        let text = tokenizer.apply_chat_template(&[rl_data::Message::user(p.clone())], true)?;
        prompt_ids.push(tokenizer.encode(&text, false)?);
        let (mut ids, mut gen_flags) = (Vec::new(), Vec::new());
        for (segment, is_generated) in segments {
            let seg = tokenizer.encode(segment, false)?;
            gen_flags.extend(std::iter::repeat_n(*is_generated, seg.len()));
            ids.extend(seg);
        }
        response_ids.push(ids);
        generated.push(gen_flags);
    }
    let mut batch = rollout_layout(&prompt_ids, &response_ids, tokenizer.pad_id_or_eos()?)?;
    let seq_len = batch.get(rl_core::keys::INPUT_IDS)?.size()[1] as usize;
    let response_len = batch.get(rl_core::keys::RESPONSES)?.size()[1] as usize;
    let prompt_len = seq_len - response_len;
    let mut loss = vec![0i64; prompts.len() * seq_len];
    for (r, flags) in generated.iter().enumerate() {
        for (t, &g) in flags.iter().enumerate() {
            loss[r * seq_len + prompt_len + t] = i64::from(g);
        }
    }
    batch.insert(
        rl_core::keys::LOSS_MASK,
        tch::Tensor::from_slice(&loss).view([prompts.len() as i64, seq_len as i64]),
    )?;
    Ok(batch)
}

// ---- end of the multi-turn helpers ----

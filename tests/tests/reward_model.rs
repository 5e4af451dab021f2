//! End to end on CPU: reward models on the tiny carry-free addition task (a tiny Llama
//! SFT-warmed once per test binary). Bradley–Terry training raises held-out preference accuracy
//! (chosen: the right sum, rejected: a wrong one); resume is exact; the combination with a rule
//! reward is exactly the weighted sum at the last response token. GRPO with the learned reward
//! as its only reward (combined with the rule reward at weight 0) is here but ignored: it hacks
//! the tiny reward model (see docs/algos/reward_model.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use rl_algos::KlPenalty;
use rl_algos::advantage::AdvEstimator;
use rl_algos::trainer::{
    BatchSource, CombinedReward, OnPolicyTrainer, RewardPart, RmTrainer, RmTrainerConfig, Roles,
    TrainValReward, reward_metrics,
};
use rl_core::roles::{Reference, Reward};
use rl_core::{Batch, StepMetrics, Trainer, keys};
use rl_data::reward::RewardRegistry;
use rl_data::reward::role::RuleReward;
use rl_data::{RlDataset, Tokenizer};
use rl_e2e::*;
use rl_workers::roles::{
    ActorConfig, ActorWorker, OptimConfig, ReferenceWorker, RewardModelConfig, RewardModelWorker,
    RmWorker, RmWorkerConfig, RolloutWorker, reward_model_from_lm,
};
use rl_workers::{RewardModel, RolloutConfig};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

const MAX_OPERAND: i64 = 99;
const SEED: u64 = 7;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Warm {
    task: TinyTask,
    /// The policy's and the reward model's initialisation (SFT stopped at val/loss < 0.8, as
    /// in learn.rs).
    ckpt: PathBuf,
}

/// SFT on carry-free, zero-padded addition until the held-out loss drops below `target`
/// (checked every 10 steps, at most `max_steps`); returns the losses seen.
fn sft_until(sft: &mut rl_algos::trainer::SftTrainer, target: f64, max_steps: u64) -> Vec<f64> {
    let mut losses = Vec::new();
    let end = sft.global_step() + max_steps;
    while sft.global_step() < end {
        sft.step().unwrap();
        if sft.global_step().is_multiple_of(10) {
            let loss = sft.validate().unwrap().0["val/loss"];
            losses.push(loss);
            if loss < target {
                break;
            }
        }
    }
    losses
}

/// The SFT checkpoint (val/loss < 0.8, as learn.rs): the policy's and the reward model's
/// initialisation.
fn warm() -> &'static Warm {
    static WARM: OnceLock<Warm> = OnceLock::new();
    WARM.get_or_init(|| {
        let t = Instant::now();
        let addition = rl_data::tasks::tiny_vocab::TinyAddition {
            max_operand: MAX_OPERAND,
            no_carry: true,
            zero_pad: true,
        };
        let task = tiny_task_with(addition, 1500, 200, SEED).unwrap();
        // RM_SFT_CACHE=<dir> keeps the SFT checkpoints between runs while tuning
        let cache = std::env::var_os("RM_SFT_CACHE").map(PathBuf::from);
        if let Some(dir) = cache
            .as_ref()
            .filter(|d| d.join("policy/config.json").exists())
        {
            return Warm {
                task,
                ckpt: dir.join("policy"),
            };
        }
        let policy = fresh_tiny_policy(task.tokenizer.vocab_size() as i64, SEED as i64).unwrap();
        let actor = ActorConfig {
            ppo_mini_batch_size: 32,
            optim: OptimConfig {
                lr: 3e-3,
                weight_decay: 0.0,
                ..OptimConfig::default()
            },
            ..ActorConfig::default()
        };
        let mut sft = build_sft(&task, policy.clone(), actor, 1000, SEED).unwrap();
        let losses = sft_until(&mut sft, 0.8, 400);
        let policy_steps = sft.global_step();
        assert!(losses[losses.len() - 1] < 0.8, "SFT stalled: {losses:?}");
        let root = cache.unwrap_or_else(|| task.root.path().to_path_buf());
        let ckpt = root.join("policy");
        policy.lock().unwrap().save_pretrained(&ckpt).unwrap();
        println!(
            "sft: {policy_steps} steps, val/loss every 10 steps {losses:?}, {:.1}s",
            t.elapsed().as_secs_f64()
        );
        Warm { task, ckpt }
    })
}

/// A fixed hash of `k` (splitmix64's finaliser).
fn hash(k: u64) -> u64 {
    let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The right answer with one digit changed (a near miss, like most of a policy's mistakes),
/// chosen by `h`.
fn near_miss(answer: &str, h: u64) -> String {
    let mut digits: Vec<u8> = answer.bytes().map(|b| b - b'0').collect();
    let pos = ((h >> 8) % digits.len() as u64) as usize;
    digits[pos] = ((digits[pos] as u64 + 1 + (h >> 16) % 9) % 10) as u8;
    digits.iter().map(|d| char::from(b'0' + d)).collect()
}

/// A wrong answer for pair `k` whose right answer is `answer`: any other number of the same
/// width, drawn by a fixed hash.
fn wrong_answer(answer: &str, k: usize) -> String {
    let width = answer.len();
    let span = 10u64.pow(width as u32);
    let right: u64 = answer.parse().unwrap_or(0);
    let mut w = (hash(k as u64) >> 20) % span;
    if w == right {
        w = (w + 1) % span;
    }
    format!("{w:0width$}")
}

/// `extra_info.answer` of a row: the zero-padded sum as written in the SFT target.
fn answer_of(row: &rl_data::RlRow) -> AnyResult<String> {
    Ok(row
        .extra_info
        .get("answer")
        .and_then(Value::as_str)
        .ok_or("row lacks extra_info.answer")?
        .to_owned())
}

/// Pairs for `dataset`'s rows `idx` (index `k` past the end reuses row `k % len` with another
/// wrong answer), interleaved chosen-first in the rollout layout.
fn pair_batch(dataset: &RlDataset, tok: &Tokenizer, idx: &[usize]) -> AnyResult<Batch> {
    let (mut prompts, mut responses) = (Vec::new(), Vec::new());
    for &k in idx {
        let row = dataset.row(k % dataset.len())?;
        let answer = answer_of(&row)?;
        let wrong = wrong_answer(&answer, k);
        for resp in [answer.as_str(), wrong.as_str()] {
            let ex = rl_data::tokenize_prompt_response(tok, &row.prompt, resp)?;
            let split = ex.loss_mask.iter().position(|&m| m == 1).unwrap_or(0);
            prompts.push(ex.input_ids[..split].to_vec());
            responses.push(ex.input_ids[split..].to_vec());
        }
    }
    rollout_layout(&prompts, &responses, tok.pad_id_or_eos()?)
}

/// Fixed batches, cycled; the state is the cursor.
struct Cycle {
    batches: Vec<Batch>,
    cursor: usize,
}

impl BatchSource for Cycle {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let b = self.batches[self.cursor % self.batches.len()].shallow_clone();
        self.cursor += 1;
        Ok(b)
    }
    fn state(&self) -> Value {
        self.cursor.into()
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        self.cursor = state
            .as_u64()
            .ok_or("cursor is not a number")
            .map_err(|e| rl_core::Error::Role {
                role: "data",
                source: e.into(),
            })? as usize;
        Ok(())
    }
}

/// Train batches of `pairs` pairs over `epochs` passes of `train` (a new wrong answer per pass)
/// and held-out pair batches of `val`.
fn pair_sources(
    train: &RlDataset,
    val: &RlDataset,
    tok: &Tokenizer,
    pairs: usize,
    epochs: usize,
) -> AnyResult<(Cycle, Vec<Batch>)> {
    let idx: Vec<usize> = (0..epochs * train.len()).collect();
    let batches = idx
        .chunks_exact(pairs)
        .map(|c| pair_batch(train, tok, c))
        .collect::<AnyResult<Vec<_>>>()?;
    let vidx: Vec<usize> = (0..val.len()).collect();
    let val_batches = vidx
        .chunks(100)
        .map(|c| pair_batch(val, tok, c))
        .collect::<AnyResult<Vec<_>>>()?;
    Ok((Cycle { batches, cursor: 0 }, val_batches))
}

fn rm_worker_config(pairs: usize, lr: f64) -> RmWorkerConfig {
    RmWorkerConfig {
        train_batch_size: pairs,
        micro_train_batch_size: Some(pairs / 2),
        optim: OptimConfig {
            lr,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..RmWorkerConfig::default()
    }
}

struct TrainedRm {
    dir: PathBuf,
    before: StepMetrics,
    after: StepMetrics,
    first: StepMetrics,
    last: StepMetrics,
    steps: u64,
    secs: f64,
}

/// The reward model of the tests: initialised from the SFT checkpoint with a fresh one-label
/// head, trained with Bradley–Terry on (right sum, another number) pairs, validated on pairs of
/// the held-out prompts, saved as a Hugging Face folder.
fn trained_rm() -> &'static TrainedRm {
    static RM: OnceLock<TrainedRm> = OnceLock::new();
    RM.get_or_init(|| {
        let w = warm();
        let data = tiny_data_config(&w.task, 16, SEED);
        let train = RlDataset::train(&data).unwrap();
        let val = RlDataset::val(&data).unwrap();
        let pairs = 32;
        let (source, val_batches) =
            pair_sources(&train, &val, &w.task.tokenizer, pairs, 2).unwrap();
        tch::manual_seed(SEED as i64);
        let model = reward_model_from_lm(&w.ckpt, Device::Cpu, Kind::Float).unwrap();
        let lr = env_or("RM_LR_E4", 10) as f64 * 1e-4;
        let worker = RmWorker::new(
            model,
            RmWorkerConfig {
                micro_train_batch_size: None,
                ..rm_worker_config(pairs, lr)
            },
        )
        .unwrap();
        let steps = env_or("RM_STEPS", 80);
        let cfg = RmTrainerConfig {
            total_training_steps: steps,
            ..RmTrainerConfig::default()
        };
        let mut t = RmTrainer::new(cfg, Box::new(worker), Box::new(source), val_batches).unwrap();
        let t0 = Instant::now();
        let (before, _) = t.validate().unwrap();
        let mut history = Vec::new();
        while t.global_step() < t.total_steps() {
            history.push(t.step().unwrap());
        }
        let (after, _) = t.validate().unwrap();
        let secs = t0.elapsed().as_secs_f64();
        let dir = w.task.root.path().join("rm_ckpt");
        t.save_checkpoint_to(&dir);
        TrainedRm {
            dir: dir.join("rm"),
            before,
            after,
            first: history[0].clone(),
            last: history[history.len() - 1].clone(),
            steps,
            secs,
        }
    })
}

/// Writes a trainer checkpoint into a new folder.
trait SaveTo {
    fn save_checkpoint_to(&self, dir: &Path);
}

impl<T: Trainer> SaveTo for T {
    fn save_checkpoint_to(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        self.save_checkpoint(dir).unwrap();
    }
}

#[test]
fn rm_training_raises_held_out_preference_accuracy() {
    let rm = trained_rm();
    let key = "val/rm/accuracy";
    println!(
        "rm: held-out preference accuracy {:.1}% -> {:.1}% over {} steps in {:.1}s; \
         val/rm/loss {:.4} -> {:.4}, val/rm/margin {:.3} -> {:.3}; train rm/loss {:.4} -> {:.4}",
        rm.before[key] * 100.0,
        rm.after[key] * 100.0,
        rm.steps,
        rm.secs,
        rm.before["val/rm/loss"],
        rm.after["val/rm/loss"],
        rm.before["val/rm/margin"],
        rm.after["val/rm/margin"],
        rm.first["rm/loss"],
        rm.last["rm/loss"],
    );
    // measured 80.0% after 80 steps (78.0% after 100): the tiny model plateaus near 80%, so
    // the bar leaves room for float noise across thread counts
    assert!(rm.after[key] >= 0.75, "{:?}", rm.after);
    assert!(rm.after[key] - rm.before[key] >= 0.25, "{:?}", rm.after);
    assert!(rm.after["val/rm/loss"] < rm.before["val/rm/loss"]);
    for k in [
        "rm/loss",
        "rm/accuracy",
        "rm/chosen_reward",
        "rm/rejected_reward",
        "rm/margin",
        "rm/grad_norm",
        "rm/lr",
        "timing_s/update_rm",
    ] {
        assert!(rm.first.contains_key(k), "lacks {k}: {:?}", rm.first);
    }
    // the first loss of a near-zero fresh head is close to ln 2
    assert!((rm.first["rm/loss"] - std::f64::consts::LN_2).abs() < 0.1);
}

/// A small trainer on a tiny task for the resume test: a fresh reward model (seed `init`).
fn small_rm_trainer(task: &TinyTask, init: i64, steps: u64) -> AnyResult<RmTrainer> {
    let data = tiny_data_config(task, 8, SEED);
    let train = RlDataset::train(&data)?;
    let val = RlDataset::val(&data)?;
    let (source, val_batches) = pair_sources(&train, &val, &task.tokenizer, 8, 1)?;
    tch::manual_seed(init);
    let mut cfg = tiny_llama_config(task.tokenizer.vocab_size() as i64);
    cfg.set_num_labels(1);
    let model = RewardModel::new(&cfg, Device::Cpu, Kind::Float)?;
    let worker = RmWorker::new(model, rm_worker_config(8, 1e-3))?;
    let tcfg = RmTrainerConfig {
        total_training_steps: steps,
        margin: 0.1,
        center_rewards_coefficient: 0.01,
    };
    Ok(RmTrainer::new(
        tcfg,
        Box::new(worker),
        Box::new(source),
        val_batches,
    )?)
}

fn without_timing(m: &StepMetrics) -> StepMetrics {
    m.iter()
        .filter(|(k, _)| !k.starts_with("timing_s/"))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

fn saved_tensors(dir: &Path) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for f in ["model.safetensors", "optim.safetensors"] {
        for (k, t) in Tensor::read_safetensors(dir.join(f)).unwrap() {
            out.insert(format!("{f}:{k}"), t);
        }
    }
    out
}

#[test]
fn rm_resume_is_exact() {
    let task = tiny_task(19, 64, 16, SEED).unwrap();
    let n = 6u64;
    let mut straight = small_rm_trainer(&task, 1, n).unwrap();
    let mut full = Vec::new();
    while straight.global_step() < n {
        full.push(without_timing(&straight.step().unwrap()));
    }
    let full_val = straight.validate().unwrap().0;
    let mut first = small_rm_trainer(&task, 1, n).unwrap();
    for _ in 0..n / 2 {
        first.step().unwrap();
    }
    let ckpt = task.root.path().join("half");
    first.save_checkpoint_to(&ckpt);
    drop(first);
    // fresh objects, a different initialisation: everything must come from the checkpoint
    let mut resumed = small_rm_trainer(&task, 99, n).unwrap();
    resumed.load_checkpoint(&ckpt).unwrap();
    assert_eq!(resumed.global_step(), n / 2);
    let mut tail = Vec::new();
    while resumed.global_step() < n {
        tail.push(without_timing(&resumed.step().unwrap()));
    }
    assert_eq!(
        tail,
        full[(n / 2) as usize..],
        "metrics differ after resume"
    );
    assert_eq!(resumed.validate().unwrap().0, full_val);
    let (a, b) = (task.root.path().join("a"), task.root.path().join("b"));
    straight.save_checkpoint_to(&a);
    resumed.save_checkpoint_to(&b);
    let (ta, tb) = (saved_tensors(&a.join("rm")), saved_tensors(&b.join("rm")));
    assert_eq!(ta.keys().collect::<Vec<_>>(), tb.keys().collect::<Vec<_>>());
    for (k, t) in &ta {
        assert!(t.equal(&tb[k]), "{k} differs after resume");
    }
    println!(
        "rm resume: {} steps straight == {} + {} resumed; last rm/loss {:.6}",
        n,
        n / 2,
        n - n / 2,
        full[full.len() - 1]["rm/loss"]
    );
}

/// Prompts of `dataset`'s first `rows` rows answered right (even rows) and wrong (odd rows),
/// with the columns the rule reward reads.
fn scored_rows(dataset: &RlDataset, tok: &Tokenizer, rows: usize) -> AnyResult<Batch> {
    let (mut prompts, mut responses, mut truths) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rows {
        let row = dataset.row(i)?;
        let answer = answer_of(&row)?;
        let resp = if i % 2 == 0 {
            answer.clone()
        } else {
            near_miss(&answer, hash(i as u64))
        };
        let ex = rl_data::tokenize_prompt_response(tok, &row.prompt, &resp)?;
        let split = ex.loss_mask.iter().position(|&m| m == 1).unwrap_or(0);
        prompts.push(ex.input_ids[..split].to_vec());
        // drop eos on every third row so the responses have different lengths
        let end = if i % 3 == 0 {
            ex.input_ids.len() - 1
        } else {
            ex.input_ids.len()
        };
        responses.push(ex.input_ids[split..end].to_vec());
        truths.push(row.ground_truth.clone());
    }
    let mut b = rollout_layout(&prompts, &responses, tok.pad_id_or_eos()?)?;
    b.insert_column(keys::DATA_SOURCE, vec![Value::from("arithmetic"); rows])?;
    b.insert_column(keys::GROUND_TRUTH, truths)?;
    Ok(b)
}

#[test]
fn rm_plus_rule_is_the_weighted_sum_at_the_last_token() {
    let task = tiny_task(19, 16, 8, SEED).unwrap();
    let data = tiny_data_config(&task, 8, SEED);
    let train = RlDataset::train(&data).unwrap();
    let tok = task.tokenizer.clone();
    let batch = scored_rows(&train, &tok, 6).unwrap();
    tch::manual_seed(5);
    let mut cfg = tiny_llama_config(tok.vocab_size() as i64);
    cfg.set_num_labels(1);
    let model = RewardModel::new(&cfg, Device::Cpu, Kind::Float).unwrap();
    let rm_cfg = RewardModelConfig {
        micro_batch_size_per_gpu: Some(4),
        ..RewardModelConfig::default()
    };
    let mut rm = RewardModelWorker::new(model, rm_cfg).unwrap();
    let rm_alone = rm.score(&batch).unwrap();
    let mut rule = RuleReward::new(tok.clone(), RewardRegistry::verl_default());
    let rule_alone = rule.score(&batch).unwrap();
    let (rm_coef, rule_coef) = (0.25, 2.0);
    let mut combined = CombinedReward::new(vec![
        RewardPart {
            name: "rm".into(),
            weight: rm_coef,
            reward: Box::new(rm),
        },
        RewardPart {
            name: "rule".into(),
            weight: rule_coef,
            reward: Box::new(rule),
        },
    ])
    .unwrap();
    let out = combined.score(&batch).unwrap();
    let tls = out.get(keys::TOKEN_LEVEL_SCORES).unwrap();
    let rm_tls = rm_alone.get(keys::RM_SCORES).unwrap();
    let rule_tls = rule_alone.get(keys::TOKEN_LEVEL_SCORES).unwrap();
    let expect = rm_tls * rm_coef + rule_tls * rule_coef;
    assert!(tls.equal(&expect), "{tls} vs {expect}");
    // the only non-zero column of each row is its last response token
    let mask = batch.get(keys::RESPONSE_MASK).unwrap();
    let len =
        Vec::<i64>::try_from(mask.sum_dim_intlist([1].as_slice(), false, Kind::Int64)).unwrap();
    let rows = Vec::<Vec<f32>>::try_from(tls).unwrap();
    let rm_rows: Vec<f64> = rm_alone
        .column("score")
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let rule_rows: Vec<f64> = rule_alone
        .column("score")
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    for (i, row) in rows.iter().enumerate() {
        let last = len[i] as usize - 1;
        let want = (rm_rows[i] * rm_coef + rule_rows[i] * rule_coef) as f32;
        assert!(
            (row[last] - want).abs() <= 1e-6 * want.abs().max(1.0),
            "row {i}"
        );
        for (j, v) in row.iter().enumerate() {
            if j != last {
                assert_eq!(*v, 0.0, "row {i} column {j}");
            }
        }
    }
    // the rule half: right answers on even rows
    assert_eq!(rule_rows, vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    let m = reward_metrics(&out);
    let mean_rm = rm_rows.iter().sum::<f64>() / rm_rows.len() as f64;
    assert!((m["reward/rm_score/mean"] - mean_rm).abs() < 1e-9);
    assert_eq!(m["reward/rule_score/mean"], 0.5);
    assert!(out.contains("acc") && out.contains(keys::RM_SCORES));
}

#[test]
#[ignore = "issue 8 bar not met yet: GRPO hacks the tiny learned reward (every prompt collapses onto `99`, the answer it prefers) and rule-checked held-out accuracy falls 26.5% -> 4.0% in 40 steps; see docs/algos/reward_model.md"]
fn grpo_with_the_learned_reward_raises_accuracy() {
    let w = warm();
    let rm = trained_rm();
    let tok = w.task.tokenizer.clone();
    let mut cfg = ExperimentConfig {
        data: tiny_data_config(&w.task, 16, SEED),
        ..ExperimentConfig::default()
    };
    let steps = env_or("RM_RL_STEPS", 40);
    {
        let arr = &mut cfg.actor_rollout_ref;
        arr.model.path = w.ckpt.clone();
        arr.rollout = RolloutConfig {
            n: 8,
            response_length: 4,
            temperature: 1.0,
            seed: SEED,
            ..RolloutConfig::default()
        };
        arr.actor = ActorConfig {
            ppo_mini_batch_size: 16,
            ppo_micro_batch_size_per_gpu: Some(64),
            optim: OptimConfig {
                lr: env_or("RM_RL_LR_E4", 5) as f64 * 1e-4,
                weight_decay: 0.0,
                ..OptimConfig::default()
            },
            ..ActorConfig::default()
        };
        arr.actor_loss.use_kl_loss = true;
        arr.actor_loss.kl_loss_type = KlPenalty::LowVarKl;
        arr.actor_loss.kl_loss_coef = env_or("RM_RL_KL_E3", 1) as f64 * 1e-3;
    }
    cfg.algorithm.adv_estimator = AdvEstimator::Grpo;
    cfg.trainer.total_training_steps = Some(steps);
    cfg.trainer.log_val_generations = 4;
    check_on_policy(&cfg).unwrap();
    let (train, val) = loaders(&cfg, &tok).unwrap();
    let policy = load_policy(&w.ckpt).unwrap();
    let arr = &cfg.actor_rollout_ref;
    let reference = ReferenceWorker::from_policy(&policy, None).unwrap();
    let eos = tok.eos_token_id().unwrap() as i64;
    let pad = tok.pad_id_or_eos().unwrap() as i64;
    let rollout = RolloutWorker::new(
        policy.clone(),
        arr.rollout.clone(),
        arr.val_kwargs.clone(),
        vec![eos],
        pad,
    )
    .unwrap();
    let actor = ActorWorker::new(policy, arr.actor.clone(), arr.rollout.n).unwrap();
    let rm_worker =
        RewardModelWorker::from_pretrained(&rm.dir, Device::Cpu, Kind::Float, Default::default())
            .unwrap();
    let rule = RuleReward::new(tok.clone(), RewardRegistry::verl_default());
    // train on the reward model alone (the rule part only reports `acc`); validate with rules
    let train_reward = CombinedReward::new(vec![
        RewardPart {
            name: "rm".into(),
            weight: 1.0,
            reward: Box::new(rm_worker),
        },
        RewardPart {
            name: "rule".into(),
            weight: 0.0,
            reward: Box::new(rule.clone()),
        },
    ])
    .unwrap();
    let reward = TrainValReward {
        train: Box::new(train_reward),
        val: Box::new(rule),
    };
    let batches_per_epoch = train.0.batches_per_epoch();
    let roles = Roles {
        actor: Box::new(actor),
        rollout: Box::new(rollout),
        reference: Some(Box::new(reference) as Box<dyn Reference>),
        critic: None,
        reward: Box::new(reward),
    };
    let mut trainer = OnPolicyTrainer::new(
        on_policy_config(&cfg, batches_per_epoch),
        roles,
        Box::new(train),
        val,
    )
    .unwrap();
    let key = "val/test_score/arithmetic";
    let t0 = Instant::now();
    let (before, _) = trainer.validate().unwrap();
    let mut history = Vec::new();
    while trainer.global_step() < trainer.total_steps() {
        history.push(trainer.step().unwrap());
    }
    let (after, samples) = trainer.validate().unwrap();
    let secs = t0.elapsed().as_secs_f64();
    for (i, m) in history.iter().enumerate().step_by(5) {
        println!(
            "step {}: rm score {:.3}, rule acc {:.3}, response length {:.2}",
            i + 1,
            m["critic/score/mean"],
            m["critic/acc/mean"],
            m["response_length/mean"]
        );
    }
    println!("samples after: {samples:?}");
    let mean_of =
        |k: &str, ms: &[StepMetrics]| ms.iter().map(|m| m[k]).sum::<f64>() / ms.len().max(1) as f64;
    let early = &history[..5.min(history.len())];
    let late = &history[history.len().saturating_sub(5)..];
    println!(
        "grpo with the learned reward: held-out accuracy (rule-checked) {:.1}% -> {:.1}% over {} \
         steps in {:.1}s; rm score {:.3} -> {:.3}, rule acc of the samples {:.3} -> {:.3} \
         (first / last 5 steps)",
        before[key] * 100.0,
        after[key] * 100.0,
        history.len(),
        secs,
        mean_of("critic/score/mean", early),
        mean_of("critic/score/mean", late),
        mean_of("critic/acc/mean", early),
        mean_of("critic/acc/mean", late),
    );
    assert!(
        after[key] - before[key] >= 0.10 - 1e-9,
        "{before:?} -> {after:?}"
    );
}

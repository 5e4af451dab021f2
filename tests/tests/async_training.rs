//! Asynchronous training (`async_training`, issue 23): the rollout of the next steps runs in a
//! background thread on its own copy of the policy while the actor trains.
//! - `max_staleness = 0` equals the synchronous run, metric for metric;
//! - `max_staleness = K` generates step `t`'s batch with the weights after step `max(0, t-K)`:
//!   logged as `async/policy_version` and `async/staleness`, visible in the rollout-vs-trainer
//!   log-prob gap, and the same on every run however the threads are scheduled;
//! - a checkpoint keeps the batches generated ahead, so a resumed run equals the uninterrupted
//!   one; a sync trainer refuses such a checkpoint; the combinations not built are named.

use rl_core::{StepMetrics, Trainer};
use rl_e2e::*;
use rl_harness::config::TrainerKind;
use rl_harness::config::checks::check_groups;

fn config(task: &TinyTask) -> ExperimentConfig {
    let mut cfg = tiny_grpo_config(task, 5);
    cfg.actor_rollout_ref.rollout.calculate_log_probs = true;
    cfg.actor_rollout_ref.actor.optim.lr = 3e-3;
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps = -1;
    cfg
}

fn with_async(cfg: &ExperimentConfig, max_staleness: u64) -> ExperimentConfig {
    let mut cfg = cfg.clone();
    cfg.async_training.enable = true;
    cfg.async_training.max_staleness = max_staleness;
    cfg
}

/// Everything but timings and the async run's own keys.
fn comparable(m: &StepMetrics) -> Vec<(String, f64)> {
    m.iter()
        .filter(|(k, _)| !rl_core::is_wall_clock(k) && !k.starts_with("async/"))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

fn trainer(task: &TinyTask, cfg: &ExperimentConfig) -> OnPolicyTrainerBox {
    let vocab = task.tokenizer.vocab_size() as i64;
    if !task.model_dir.join("model.safetensors").exists() {
        let lm = fresh_tiny_policy(vocab, 1).unwrap();
        lm.lock().unwrap().save_pretrained(&task.model_dir).unwrap();
    }
    let mut cfg = cfg.clone();
    cfg.actor_rollout_ref.model.path = task.model_dir.clone();
    // as `harness train` loads it: LoRA adapters when the config asks for them
    let policy = rl_workers::roles::share(
        rl_workers::seeded(1, || {
            rl_harness::run::compose::load_policy(&cfg, tch::Device::Cpu)
        })
        .unwrap(),
    );
    Box::new(build_on_policy(&cfg, policy, None, &task.tokenizer).unwrap())
}

type OnPolicyTrainerBox = Box<rl_algos::trainer::OnPolicyTrainer>;

/// `steps` steps with a validation before the first and after the third.
fn run(t: &mut OnPolicyTrainerBox, steps: usize) -> (Vec<StepMetrics>, Vec<StepMetrics>) {
    let mut val = vec![t.validate().unwrap().0];
    let mut out = Vec::new();
    for i in 0..steps {
        out.push(t.step().unwrap());
        if i == 2 {
            val.push(t.validate().unwrap().0);
        }
    }
    (out, val)
}

fn key(ms: &[StepMetrics], k: &str) -> Vec<f64> {
    ms.iter()
        .map(|m| *m.get(k).unwrap_or_else(|| panic!("no `{k}` in {m:?}")))
        .collect()
}

#[test]
fn staleness_0_equals_the_synchronous_run_metric_for_metric() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let cfg = config(&task);
    let (sync, sync_val) = run(&mut trainer(&task, &cfg), 5);
    let (got, got_val) = run(&mut trainer(&task, &with_async(&cfg, 0)), 5);
    for (i, (a, b)) in sync.iter().zip(&got).enumerate() {
        assert_eq!(comparable(b), comparable(a), "step {}", i + 1);
    }
    assert_eq!(got_val, sync_val, "validation");
    assert_eq!(key(&got, "async/staleness"), vec![0.0; 5]);
    assert_eq!(
        key(&got, "async/policy_version"),
        vec![0.0, 1.0, 2.0, 3.0, 4.0]
    );
    assert!(
        got.iter()
            .all(|m| m.contains_key("timing_s/gen_background")),
        "the background's generation time is logged"
    );
}

/// The replica follows a LoRA policy (its adapters, the frozen base its own) and a
/// mixed-precision one (bf16 weights synced as they are).
#[test]
fn staleness_0_equals_the_synchronous_run_with_lora_and_with_bf16() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let mut lora = config(&task);
    lora.actor_rollout_ref.model.lora_rank = 4;
    lora.actor_rollout_ref.model.lora_alpha = 8.0;
    let mut bf16 = config(&task);
    bf16.actor_rollout_ref.actor.mixed_precision.param_dtype = rl_workers::roles::ParamDtype::Bf16;
    for (name, cfg) in [("lora", lora), ("bf16", bf16)] {
        let (sync, sync_val) = run(&mut trainer(&task, &cfg), 3);
        let (got, got_val) = run(&mut trainer(&task, &with_async(&cfg, 0)), 3);
        for (i, (a, b)) in sync.iter().zip(&got).enumerate() {
            assert_eq!(comparable(b), comparable(a), "{name}: step {}", i + 1);
        }
        assert_eq!(got_val, sync_val, "{name}: validation");
    }
}

#[test]
fn staleness_k_generates_with_the_weights_k_steps_old_and_repeats_exactly() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let cfg = config(&task);
    let (sync, _) = run(&mut trainer(&task, &cfg), 5);
    let mut frozen = cfg.clone();
    // an update of 1e-30 moves no float32 weight
    frozen.actor_rollout_ref.actor.optim.lr = 1e-30;
    let (frozen_run, _) = run(&mut trainer(&task, &frozen), 3);
    for k in [1u64, 2] {
        let (a, a_val) = run(&mut trainer(&task, &with_async(&cfg, k)), 5);
        let want: Vec<f64> = (0..5u64).map(|t| t.saturating_sub(k) as f64).collect();
        assert_eq!(key(&a, "async/policy_version"), want, "K = {k}");
        let staleness: Vec<f64> = (0..5u64).map(|t| t.min(k) as f64).collect();
        assert_eq!(key(&a, "async/staleness"), staleness, "K = {k}");
        // step 0 generates with the initial weights in both runs
        assert_eq!(comparable(&a[0]), comparable(&sync[0]), "K = {k}: step 1");
        // the batches of steps 1..=K come from the initial weights: their rollout log-probs
        // are those of a run whose weights never move (lr 0), not the sync run's
        let frozen = &frozen_run;
        let rollout_ppl = |ms: &[StepMetrics]| key(ms, "rollout_corr/rollout_log_ppl");
        let (got, still, moving) = (rollout_ppl(&a), rollout_ppl(frozen), rollout_ppl(&sync));
        for t in 1..=k as usize {
            assert_eq!(
                got[t],
                still[t],
                "K = {k}: step {} generated by the initial weights",
                t + 1
            );
            assert_ne!(
                got[t],
                moving[t],
                "K = {k}: step {} as in the sync run",
                t + 1
            );
        }
        // the same run again: the schedule, not the threads' timing, decides every batch
        let (b, b_val) = run(&mut trainer(&task, &with_async(&cfg, k)), 5);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(
                comparable(y),
                comparable(x),
                "K = {k}: rerun step {}",
                i + 1
            );
        }
        assert_eq!(b_val, a_val, "K = {k}: rerun validation");
    }
}

#[test]
fn a_resume_with_batches_in_flight_equals_the_uninterrupted_run() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let cfg = with_async(&config(&task), 2);
    let mut a = trainer(&task, &cfg);
    let full: Vec<StepMetrics> = (0..5).map(|_| a.step().unwrap()).collect();

    let ckpt = task.root.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut b = trainer(&task, &cfg);
    for want in &full[..2] {
        assert_eq!(comparable(&b.step().unwrap()), comparable(want));
    }
    // steps 3 and 4's batches are in flight or done: the checkpoint keeps both
    b.save_checkpoint(&ckpt).unwrap();
    // and the trainer that wrote it goes on as if it had not
    assert_eq!(comparable(&b.step().unwrap()), comparable(&full[2]));
    drop(b);
    let saved: Vec<String> = std::fs::read_dir(ckpt.join("async_rollout"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(saved.len(), 2, "{saved:?}");

    let mut c = trainer(&task, &cfg);
    c.load_checkpoint(&ckpt).unwrap();
    assert_eq!(c.global_step(), 2);
    for (i, want) in full.iter().enumerate().skip(2) {
        let got = c.step().unwrap();
        assert_eq!(comparable(&got), comparable(want), "step {}", i + 1);
        assert_eq!(got["async/policy_version"], want["async/policy_version"]);
    }

    // a synchronous trainer would skip the batches generated ahead: it refuses them
    let mut sync = trainer(&task, &config(&task));
    let e = sync.load_checkpoint(&ckpt).unwrap_err().to_string();
    assert!(e.contains("async_training.enable"), "{e}");
}

#[test]
fn combinations_not_built_name_their_keys() {
    let task = tiny_task(9, 60, 10, 1).unwrap();
    let cfg = with_async(&config(&task), 1);
    check_groups(&cfg, TrainerKind::OnPolicy).unwrap();
    let err = |c: &ExperimentConfig, kind| check_groups(c, kind).unwrap_err().to_string();

    let e = err(&cfg, TrainerKind::Spin);
    assert!(e.contains("async_training.enable"), "{e}");
    let mut zero3 = cfg.clone();
    zero3.actor_rollout_ref.actor.zero_stage = 3;
    let e = err(&zero3, TrainerKind::OnPolicy);
    assert!(
        e.contains("zero_stage") && e.contains("async_training"),
        "{e}"
    );
    let mut dapo = cfg.clone();
    dapo.algorithm.filter_groups = Some(rl_algos::FilterGroupsConfig {
        enable: true,
        metric: Some("acc".into()),
        ..Default::default()
    });
    let e = err(&dapo, TrainerKind::OnPolicy);
    assert!(
        e.contains("async_training.enable") && e.contains("filter_groups"),
        "{e}"
    );
    let mut tools = cfg.clone();
    tools.actor_rollout_ref.multi_turn.enable = true;
    let e = err(&tools, TrainerKind::OnPolicy);
    assert!(e.contains("async_training.enable"), "{e}");
}

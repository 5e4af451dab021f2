//! The SFT warm-up every learning test starts from, once per initial-weight seed and process:
//! a tiny Llama SFT-trained on carry-free, zero-padded addition of operands up to 99 (1500
//! train, 200 held-out prompts) until its held-out loss first drops below 0.8, which leaves it
//! answering roughly a third of the held-out prompts right (greedy): able to answer, far from
//! perfect at imitating. The on-policy, preference and reward-model learning tests share one
//! test binary (`tests/tests/learning`), so each seed's warm-up runs once for all of them.

use std::path::PathBuf;
use std::sync::{OnceLock, PoisonError};

use rl_workers::roles::{ActorConfig, OptimConfig};

use crate::{TinyTask, env_or, fresh_tiny_policy, sft_until_loss, tiny_task_with};

/// The seeds of the initial weights: every learning bar is asserted over these (a median and a
/// floor for the worst), so that one lucky seed cannot pass it and one CPU's rounding cannot
/// flip it. [`init_seeds`] is the list the tests use.
pub const INIT_SEEDS: [u64; 3] = [7, 1, 2];

/// The initial-weight seeds of this process's learning tests: [`INIT_SEEDS`], or the
/// space-separated list in `LEARN_INIT_SEEDS` (for measuring a recipe on seeds the tests do not
/// use, or on more of them); a list that does not parse, or has fewer than 3 seeds, fails naming
/// the variable.
pub fn init_seeds() -> &'static [u64] {
    static SEEDS: OnceLock<Vec<u64>> = OnceLock::new();
    SEEDS.get_or_init(|| match std::env::var("LEARN_INIT_SEEDS") {
        Err(_) => INIT_SEEDS.to_vec(),
        Ok(list) => {
            let seeds: Vec<u64> = list
                .split_whitespace()
                .map(|s| {
                    s.parse().unwrap_or_else(|_| {
                        panic!("LEARN_INIT_SEEDS: '{s}' is not a seed (a whole number) in '{list}'")
                    })
                })
                .collect();
            assert!(
                seeds.len() >= 3,
                "LEARN_INIT_SEEDS='{list}': a learning bar needs at least 3 seeds"
            );
            seeds
        }
    })
}

/// A value computed once per initial-weight seed and process, shared by every test after that;
/// seeds compute side by side (the lock is held only to find a seed's cell).
pub struct PerSeed<T: 'static> {
    cells: std::sync::Mutex<std::collections::HashMap<u64, &'static OnceLock<T>>>,
}

impl<T: 'static> PerSeed<T> {
    /// An empty cache (for a `static`).
    pub fn new() -> Self {
        Self {
            cells: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The value of `seed`, computed by `init` on first use.
    pub fn get(&self, seed: u64, init: impl FnOnce() -> T) -> &'static T {
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        let cell: &'static OnceLock<T> = match cells.get(&seed) {
            Some(&cell) => cell,
            None => {
                let cell = Box::leak(Box::new(OnceLock::new()));
                cells.insert(seed, cell);
                cell
            }
        };
        drop(cells);
        cell.get_or_init(init)
    }
}

impl<T: 'static> Default for PerSeed<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// The seed of the task's data and of the runs (rollout sampling, shuffling): one task for
/// every initial-weight seed.
pub const TASK_SEED: u64 = 7;

/// The default held-out loss at which SFT stops (`SFT_TARGET_LOSS_E3` / 1000 overrides it).
pub const SFT_TARGET_LOSS: f64 = 0.8;

/// The most SFT steps a warm-up may take before it counts as stalled (`SFT_STEPS` overrides).
pub const SFT_MAX_STEPS: u64 = 800;

/// A warmed-up start point: the task on disk and the SFT checkpoint.
#[derive(Debug)]
pub struct Warm {
    /// The carry-free task (its folder also holds the checkpoint).
    pub task: TinyTask,
    /// The SFT checkpoint, a Hugging Face folder.
    pub ckpt: PathBuf,
    /// The initial-weight seed it was trained from.
    pub init_seed: u64,
    /// Held-out losses: before training, then every 10 steps until the target was met.
    pub losses: Vec<f64>,
}

/// The warm-up of the initial weights `init_seed`, trained on first use and shared by every
/// test of the process after that. Training runs on one intra-op thread (set process-wide):
/// the figures' configuration on any machine, and the seeds of a test then train side by side
/// in threads of their own (see [`crate::per_seed`]). Environment variables change the recipe
/// while tuning: `MAX_OPERAND`, `SFT_LR_E4`, `SFT_STEPS`, `SFT_TARGET_LOSS_E3`.
pub fn carry_free_warm(init_seed: u64) -> &'static Warm {
    try_carry_free_warm(init_seed).unwrap_or_else(|stalled| panic!("{stalled}"))
}

/// [`carry_free_warm`], or why the warm-up stalled (its held-out loss never reached the target
/// within the step budget): for a test that draws more seeds than the fixed ones and skips a
/// seed whose warm-up stalls, by a rule that does not look at what it measures.
pub fn try_carry_free_warm(init_seed: u64) -> Result<&'static Warm, &'static str> {
    static WARM: OnceLock<PerSeed<Result<Warm, String>>> = OnceLock::new();
    WARM.get_or_init(PerSeed::new)
        .get(init_seed, || train_warm(init_seed))
        .as_ref()
        .map_err(String::as_str)
}

/// A wider held-out set of the warm-up's task for measuring a run (`LEARN_EVAL_ROWS` in the
/// on-policy learning tests): the same task and seed with `rows` held-out prompts, the first 200
/// of them the warm-up's own held-out set (the generator draws the training rows first, then
/// the held-out ones, skipping any drawn before). Made once per process; asking for another
/// size later fails.
pub fn wide_held_out(rows: usize) -> &'static std::path::Path {
    static WIDE: OnceLock<(usize, TinyTask)> = OnceLock::new();
    let (made, task) = WIDE.get_or_init(|| {
        let task = tiny_task_with(carry_free_addition(), 1500, rows, TASK_SEED)
            .expect("the wide held-out set");
        (rows, task)
    });
    assert_eq!(
        *made, rows,
        "the wide held-out set has {made} rows, not {rows}"
    );
    &task.test
}

/// The warm-up's task: carry-free, zero-padded addition of operands up to 99 (`MAX_OPERAND`).
fn carry_free_addition() -> rl_data::tasks::tiny_vocab::TinyAddition {
    rl_data::tasks::tiny_vocab::TinyAddition {
        max_operand: env_or("MAX_OPERAND", 99) as i64,
        no_carry: true,
        zero_pad: true,
    }
}

fn train_warm(init_seed: u64) -> Result<Warm, String> {
    let t = std::time::Instant::now();
    tch::set_num_threads(1);
    let task =
        tiny_task_with(carry_free_addition(), 1500, 200, TASK_SEED).expect("the carry-free task");
    let policy = fresh_tiny_policy(task.tokenizer.vocab_size() as i64, init_seed as i64)
        .expect("a fresh tiny policy");
    let actor = ActorConfig {
        ppo_mini_batch_size: 32,
        optim: OptimConfig {
            lr: env_or("SFT_LR_E4", 30) as f64 * 1e-4,
            weight_decay: 0.0,
            ..OptimConfig::default()
        },
        ..ActorConfig::default()
    };
    // a loss target rather than a step count: the loss curve of this task has a sharp
    // transition whose step varies with the seed and with the CPU's rounding
    let max_steps = env_or("SFT_STEPS", SFT_MAX_STEPS);
    let target = env_or("SFT_TARGET_LOSS_E3", (SFT_TARGET_LOSS * 1e3) as u64) as f64 * 1e-3;
    let losses = sft_until_loss(&task, policy.clone(), actor, max_steps, target, TASK_SEED)
        .expect("the SFT warm-up");
    println!(
        "sft (init seed {init_seed}): {} steps in {:.1}s, val/loss every 10 steps {losses:?}",
        10 * (losses.len() - 1),
        t.elapsed().as_secs_f64()
    );
    if losses[losses.len() - 1] >= target {
        return Err(format!(
            "SFT (init seed {init_seed}) did not reach val/loss {target} in {max_steps} steps: {losses:?}"
        ));
    }
    let ckpt = task.root.path().join("sft");
    policy
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .save_pretrained(&ckpt)
        .expect("saving the SFT checkpoint");
    Ok(Warm {
        task,
        ckpt,
        init_seed,
        losses,
    })
}

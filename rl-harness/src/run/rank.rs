//! What a training process is part of, as the code below the launcher sees it: the sweep trial
//! it belongs to ([`Membership`]), its place in a data-parallel group ([`Rank`], joined from
//! torchrun's environment by [`rank_from_env`]), and the contract between the launcher and its
//! ranks (environment variables, exit statuses, the launcher's pipe). Both `train` (a rank) and
//! `launch` (which starts ranks) use it; it uses neither.

use std::io::Read;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rl_core::dist::SharedCollective;

use crate::config::{ExperimentConfig, TrainerKind};

/// Where a run belongs when a sweep starts it.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    /// The sweep's id.
    pub sweep_id: Option<String>,
    /// The trial's id.
    pub trial_id: Option<String>,
}

/// This process's place in a data-parallel job (`docs/distributed.md`).
#[derive(Clone)]
pub struct Rank {
    /// The group of every rank.
    pub group: SharedCollective,
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// The run the launcher recorded (`HARNESS_RUN_ID`; not `RL_`-prefixed, which the config would read); `None` under an outside launcher
    /// (torchrun, Slurm), where rank 0 records the run.
    pub run_id: Option<i64>,
}

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("run_id", &self.run_id)
            .finish_non_exhaustive()
    }
}

/// The environment variable through which the launcher tells its ranks the run it recorded.
pub const RUN_ID_ENV: &str = "HARNESS_RUN_ID";

/// The environment variable through which the launcher of `harness resume` tells its ranks the
/// checkpoint folder it rewound the run to.
pub const RESUME_CHECKPOINT_ENV: &str = "HARNESS_RESUME_CHECKPOINT";

/// Set by the launcher on its ranks: their standard input is a pipe the launcher holds open, and
/// a rank stops at once when it closes (the launcher died, even by SIGKILL), so no rank trains
/// on unsupervised while a `resume` of its run may start.
pub const LAUNCHER_PIPE_ENV: &str = "HARNESS_LAUNCHER_PIPE";

/// The exit status of a rank whose launcher died.
pub const ORPHANED_EXIT: i32 = 75;

/// The exit status of a rank 0 whose rendezvous port was taken (EADDRINUSE's number on
/// Linux): the launcher that chose the port tries another.
pub const PORT_TAKEN_EXIT: i32 = 98;

/// Rank 0 could not bind the rendezvous port (`MASTER_PORT`): someone else holds it. The
/// `harness` binary exits with [`PORT_TAKEN_EXIT`] on this error.
#[derive(Debug)]
pub struct PortTaken(pub String);

impl std::fmt::Display for PortTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the rendezvous port is taken: {}", self.0)
    }
}

impl std::error::Error for PortTaken {}

/// The collective timeout of `--dist-timeout-s`, checked.
pub fn timeout(seconds: f64) -> Result<Duration> {
    // a week at most: larger values overflow deadlines (`Instant + Duration`)
    if !(seconds.is_finite() && seconds > 0.0 && seconds <= 604_800.0) {
        bail!("--dist-timeout-s must be a number of seconds in (0, 604800], got {seconds}");
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The data-parallel rules of a config on `world` ranks, each error naming its key: the
/// trainer must be one of the data-parallel ones (on_policy, sft, dpo, online_dpo, spin,
/// reward_model), every global batch must
/// split over the ranks.
pub fn check_data_parallel(cfg: &ExperimentConfig, world: usize) -> Result<()> {
    if world <= 1 {
        return Ok(());
    }
    let splits = |key: &str, value: usize, what: &str| {
        if !value.is_multiple_of(world) {
            bail!(
                "config key `{key}`: {value} {what} do not split over {world} data-parallel ranks \
                 (it is the global figure; make it a multiple of the world size)"
            );
        }
        Ok(())
    };
    let mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size;
    let mini_key = "actor_rollout_ref.actor.ppo_mini_batch_size";
    match cfg.trainer.algorithm {
        TrainerKind::OnPolicy => {
            splits(
                "data.train_batch_size",
                cfg.data.train_batch_size,
                "prompts",
            )?;
            splits(mini_key, mini, "prompts")?;
            if cfg.algorithm.adv_estimator.needs_critic() {
                splits(
                    "critic.ppo_mini_batch_size",
                    cfg.critic.worker.ppo_mini_batch_size,
                    "prompts",
                )?;
            }
        }
        TrainerKind::Sft | TrainerKind::Spin => {
            splits("sft.train_batch_size", cfg.sft.train_batch_size, "rows")?;
            splits(mini_key, mini, "rows")?;
        }
        TrainerKind::OnlineDpo => {
            splits(
                "data.train_batch_size",
                cfg.data.train_batch_size,
                "prompts",
            )?;
            splits(mini_key, mini, "pairs")?;
        }
        TrainerKind::Dpo => {
            splits(
                "preference_data.train_batch_size",
                cfg.preference_data.train_batch_size,
                "pairs",
            )?;
            splits(mini_key, mini, "pairs")?;
        }
        TrainerKind::RewardModel => {
            splits(
                "preference_data.train_batch_size",
                cfg.preference_data.train_batch_size,
                "pairs",
            )?;
        }
        TrainerKind::Bandit => bail!("{}", TrainerKind::Bandit.not_data_parallel()),
    }
    Ok(())
}

/// This process as a rank when torchrun's `WORLD_SIZE` is set (by this launcher, torchrun, a
/// Slurm or Kubernetes wrapper): joins the group (rendezvous and every collective bounded by
/// `timeout`) and, when `OMP_NUM_THREADS` is set, uses that many intra-op threads. `None`
/// without `WORLD_SIZE`.
pub fn rank_from_env(timeout: Duration) -> Result<Option<Rank>> {
    if std::env::var_os("WORLD_SIZE").is_none() {
        return Ok(None);
    }
    if std::env::var_os(LAUNCHER_PIPE_ENV).is_some() {
        die_with_launcher();
    }
    if let Ok(v) = std::env::var("OMP_NUM_THREADS") {
        let n: i32 = v
            .trim()
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("OMP_NUM_THREADS={v:?} is not a positive thread count"))?;
        tch::set_num_threads(n);
    }
    let run_id = match std::env::var(RUN_ID_ENV) {
        Ok(v) => Some(
            v.trim()
                .parse::<i64>()
                .with_context(|| format!("{RUN_ID_ENV}={v:?} is not a run id"))?,
        ),
        Err(_) => None,
    };
    let joined = rl_dist::shared_from_env(timeout);
    if let Err(e) = &joined {
        let text = e.to_string();
        let lower = text.to_lowercase();
        let rank0 = std::env::var("RANK").is_ok_and(|r| r.trim() == "0");
        if rank0 && (lower.contains("eaddrinuse") || lower.contains("address already in use")) {
            let var = |k: &str| std::env::var(k).unwrap_or_default();
            return Err(PortTaken(format!(
                "MASTER_ADDR={} MASTER_PORT={}: {text}",
                var("MASTER_ADDR"),
                var("MASTER_PORT")
            ))
            .into());
        }
    }
    let group = joined
        .context("joining the data-parallel group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")?
        .context("WORLD_SIZE vanished from the environment")?;
    let (rank, world) = {
        let g = rl_core::dist::lock(&group)?;
        (g.rank(), g.world_size())
    };
    Ok(Some(Rank {
        group,
        rank,
        world,
        run_id,
    }))
}

/// The launcher's pid, when this process is a rank it started.
static LAUNCHER: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// `the launcher (pid P) died` when this process is a rank whose launcher is gone (it was
/// reparented): the cause to record for a rank 0 whose group broke because of it.
///
/// A rank that fails while its launcher lives waits up to `grace` for the launcher to go
/// before answering `None`: when the launcher is killed, a peer rank can see its pipe end,
/// exit, and break this rank's collective before the kernel has reparented this rank or its
/// own watcher thread has run (two cores, busy threads), and the cause to record is still
/// the launcher's death, not the peer's closed socket.
pub fn launcher_gone(grace: Duration) -> Option<String> {
    let launcher = *LAUNCHER.get()?;
    let gone = || std::os::unix::process::parent_id() != launcher;
    let start = std::time::Instant::now();
    while !gone() {
        if start.elapsed() >= grace {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(format!("the launcher (pid {launcher}) died"))
}

/// Watches standard input, the launcher's pipe: at its end (the launcher is gone, however it
/// died) this rank exits at once with [`ORPHANED_EXIT`].
fn die_with_launcher() {
    let _ = LAUNCHER.set(std::os::unix::process::parent_id());
    std::thread::spawn(|| {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 64];
        // the launcher never writes: a read returns only at the pipe's end or on an error
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
        let rank = std::env::var("RANK").unwrap_or_default();
        note!("harness: rank {rank}: the launcher is gone; stopping");
        std::process::exit(ORPHANED_EXIT);
    });
}

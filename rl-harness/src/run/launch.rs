//! `harness train --nproc-per-node N`: the launcher that starts N ranks of a data-parallel run
//! on this machine (`docs/distributed.md`); the rank side, which joins a group from torchrun's
//! environment, is [`super::rank`].
//!
//! The launcher records the run in the store (so it can mark it failed whichever rank dies),
//! picks a free port on 127.0.0.1, starts N copies of this executable with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and
//! [`RUN_ID_ENV`](super::rank::RUN_ID_ENV) set, prefixes their output with `[rank r]`, and waits. When a rank dies, the
//! others get the collective timeout to fail on their own, then are killed; the run is marked
//! failed naming the lost rank and how it ended, and the launcher exits non-zero.
//!
//! Each rank runs in a process group of its own, so signals and the final kill reach whatever
//! a rank started too. A rank 0 that cannot bind the rendezvous port exits with
//! [`PORT_TAKEN_EXIT`](super::rank::PORT_TAKEN_EXIT), and the launcher starts over on another port.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::runtime::Runtime;

use crate::config::ExperimentConfig;
use crate::run::rank::{
    LAUNCHER_PIPE_ENV, Membership, PORT_TAKEN_EXIT, RESUME_CHECKPOINT_ENV, RUN_ID_ENV,
    check_data_parallel,
};
use crate::run::{checkpoint, train};
use crate::store::Store;

/// Kills (SIGKILL) the process group of every child still running when dropped and reaps it,
/// so no rank, nor anything a rank started, outlives a launcher that returns early.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                signal_group(c, "KILL");
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// Sends `SIG<sig>` to the process group of `child` (each rank leads its own group) with
/// kill(1): std only sends SIGKILL to one process, and this crate has no unsafe code.
fn signal_group(child: &Child, sig: &str) {
    let sent = Command::new("kill")
        .args([format!("-{sig}"), "--".into(), format!("-{}", child.id())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if let Err(e) = sent {
        note!(
            "harness: could not run kill(1) to send SIG{sig} to the process group of pid {}: {e}",
            child.id()
        );
    }
}

/// Waits for the output forwarders until `deadline`: a process a rank started may still hold
/// the pipe open, and the launcher must not hang on it (the ones left are detached).
fn join_forwarders(forwarders: Vec<std::thread::JoinHandle<()>>, deadline: Instant) {
    for f in forwarders {
        while !f.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if f.is_finished() {
            let _ = f.join();
        }
    }
}

/// The name of Linux signal `sig`.
fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "signal",
    }
}

/// "exited with status 1" / "was killed by signal 9 (SIGKILL)".
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        _ => format!("ended ({status})"),
    }
}

/// Copies `from` line by line to the launcher's stdout or stderr, each line prefixed with
/// `[rank r] `.
fn forward(
    rank: usize,
    from: impl Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut lines = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match lines.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches(['\n', '\r']);
                    let _ = if to_stderr {
                        writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
                    } else {
                        writeln!(crate::console::stdout(), "[rank {rank}] {text}")
                    };
                }
            }
        }
    })
}

/// Starts `nproc` ranks of this executable running `child_args` (the `train` command line
/// without `--nproc-per-node`) for a run recorded here first; waits for them; returns the run
/// id, or an error naming the lost rank (the run is then marked failed).
pub fn launch(
    rt: &Runtime,
    cfg: ExperimentConfig,
    member: Membership,
    nproc: usize,
    timeout: Duration,
    child_args: &[OsString],
) -> Result<i64> {
    check_launch(nproc)?;
    check_data_parallel(&cfg, nproc)?;
    let store = rt.block_on(Store::open(&cfg.trainer.db_path()))?;
    let (id, run_dir) = train::create_run(rt, &store, &cfg, member)?;
    supervise(rt, &store, id, &run_dir, nproc, timeout, child_args, &[])
        .inspect_err(|e| fail_if_running(rt, &store, id, e))?;
    Ok(id)
}

/// `harness resume RUN --nproc-per-node N`: rewinds the run to its checkpoint here (checking
/// the data-parallel rules first), then starts `nproc` ranks running `child_args` (the
/// `resume` command line without `--nproc-per-node`), told the checkpoint folder by
/// [`RESUME_CHECKPOINT_ENV`]; waits for them as [`launch`] does.
pub fn launch_resume(
    rt: &Runtime,
    db: &Path,
    spec: &str,
    (from_step, overrides): (Option<u64>, &[crate::config::Override]),
    nproc: usize,
    timeout: Duration,
    child_args: &[OsString],
) -> Result<i64> {
    check_launch(nproc)?;
    let store = rt.block_on(Store::open(db))?;
    let r = train::prepare_resume(rt, &store, spec, from_step, overrides, &|cfg| {
        check_data_parallel(cfg, nproc)
    })?;
    note!(
        "harness: resuming run {} from {}",
        r.id,
        r.ckpt_dir.display()
    );
    let env = [(RESUME_CHECKPOINT_ENV, r.ckpt_dir.as_os_str().to_owned())];
    supervise(
        rt, &store, r.id, &r.run_dir, nproc, timeout, child_args, &env,
    )
    .inspect_err(|e| {
        // ranks that failed before rank 0 rewound the run leave it as it was
        match train::restore_claim(rt, &store, &r, &crate::console::one_line(e)) {
            Ok(true) => note!("harness: run {} is left as it was before this resume", r.id),
            Ok(false) => fail_if_running(rt, &store, r.id, e),
            Err(why) => {
                note!("harness: run {}: putting it back as it was: {why:#}", r.id);
                fail_if_running(rt, &store, r.id, e);
            }
        }
    })?;
    Ok(r.id)
}

/// Marks run `id` failed with `e` unless something already ended it, so a run the launcher
/// recorded never stays `running` (a lost rank's diagnosis, written by [`supervise`], stays).
fn fail_if_running(rt: &Runtime, store: &Store, id: i64, e: &anyhow::Error) {
    let running = rt
        .block_on(store.run(id))
        .ok()
        .flatten()
        .is_some_and(|r| r.status == "running");
    if running && let Err(mark) = train::mark_failed(rt, store, id, crate::console::one_line(e)) {
        note!("harness: run {id}: could not mark it failed: {mark:#}");
    }
}

/// `--nproc-per-node` is at least 1, and this process is not already a rank.
fn check_launch(nproc: usize) -> Result<()> {
    if nproc == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if std::env::var_os("WORLD_SIZE").is_some() {
        bail!(
            "--nproc-per-node {nproc}: WORLD_SIZE is already set, so this process is a rank of \
             an outside launcher (torchrun, Slurm); leave --nproc-per-node out"
        );
    }
    Ok(())
}

/// How a set of ranks ended.
struct Ended {
    /// Each rank's exit status (`None` if it could not be reaped).
    exits: Vec<Option<ExitStatus>>,
    /// The first rank that failed (not counting a stop by a signal) and how.
    lost: Option<(usize, ExitStatus)>,
    /// The ranks the launcher killed after the timeout.
    killed: Vec<usize>,
    /// Whether rank 0 exited with [`PORT_TAKEN_EXIT`].
    port_taken: bool,
}

/// Starts `nproc` ranks with `spawn`, forwards their output and waits: when one fails the
/// others get `timeout` (none when the rendezvous port was taken), then are killed; when `stop`
/// is set, the ranks get SIGTERM.
fn wait_ranks(
    id: i64,
    nproc: usize,
    timeout: Duration,
    stop: &AtomicBool,
    mut spawn: impl FnMut(usize) -> Result<Child>,
    started: &dyn Fn(&[u32]),
) -> Result<Ended> {
    let mut children = Children(Vec::with_capacity(nproc));
    let mut forwarders = Vec::new();
    // the write ends of the ranks' stdin: held until the ranks end, closed by the kernel
    // however this process dies (see LAUNCHER_PIPE_ENV)
    let mut lifelines = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let mut child = spawn(rank)?;
        note!("harness: run {id}: rank {rank} is pid {}", child.id());
        lifelines.extend(child.stdin.take());
        if let Some(out) = child.stdout.take() {
            forwarders.push(forward(rank, out, false));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(forward(rank, err, true));
        }
        children.0.push(child);
    }
    started(&children.0.iter().map(Child::id).collect::<Vec<_>>());
    let mut exits: Vec<Option<ExitStatus>> = vec![None; nproc];
    // the first rank to fail (a signal beats an exit code seen in the same poll) and how
    let mut lost: Option<(usize, ExitStatus)> = None;
    let mut deadline: Option<Instant> = None;
    let mut forwarded = false;
    let mut killed = Vec::new();
    loop {
        let mut failed_now = Vec::new();
        for (rank, child) in children.0.iter_mut().enumerate() {
            if exits[rank].is_none()
                && let Some(status) = child.try_wait().context("waiting for the ranks")?
            {
                exits[rank] = Some(status);
                if !status.success() {
                    failed_now.push((rank, status));
                }
            }
        }
        if lost.is_none() && !failed_now.is_empty() && !stop.load(Ordering::SeqCst) {
            failed_now.sort_by_key(|(rank, s)| (s.code().is_some(), *rank));
            let (rank, status) = failed_now[0];
            note!(
                "harness: run {id}: rank {rank} {}; the other ranks have {:.0} s \
                 (--dist-timeout-s) to stop",
                describe(status),
                timeout.as_secs_f64()
            );
            lost = Some((rank, status));
            deadline = Some(Instant::now() + timeout);
        }
        if exits.iter().all(Option::is_some) {
            break;
        }
        let port_taken = exits[0].is_some_and(|s| s.code() == Some(PORT_TAKEN_EXIT));
        if lost.is_some() && port_taken {
            // the others wait for a rendezvous that will not happen
            deadline = Some(Instant::now());
        }
        if stop.load(Ordering::SeqCst) && !forwarded {
            // every rank stops after the same step (they agree over the group), then rank 0
            // checkpoints and records the run as killed
            for (rank, child) in children.0.iter().enumerate() {
                if exits[rank].is_none() {
                    signal_group(child, "TERM");
                }
            }
            forwarded = true;
            deadline.get_or_insert(Instant::now() + timeout);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for (rank, child) in children.0.iter_mut().enumerate() {
                if exits[rank].is_none() {
                    signal_group(child, "KILL");
                    let _ = child.kill();
                    exits[rank] = child.wait().ok();
                    killed.push(rank);
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(lifelines);
    join_forwarders(forwarders, Instant::now() + Duration::from_secs(5));
    let port_taken = exits[0].is_some_and(|s| s.code() == Some(PORT_TAKEN_EXIT));
    Ok(Ended {
        exits,
        lost,
        killed,
        port_taken,
    })
}

/// Starts the ranks of run `id`, forwards their output, waits; when one fails, gives the others
/// `timeout`, kills the rest and marks the run failed naming the lost rank. Any other error
/// (no executable, a bad `MASTER_PORT`, no free port) is left to [`fail_if_running`].
#[allow(clippy::too_many_arguments)]
fn supervise(
    rt: &Runtime,
    store: &Store,
    id: i64,
    run_dir: &Path,
    nproc: usize,
    timeout: Duration,
    child_args: &[OsString],
    extra_env: &[(&str, OsString)],
) -> Result<()> {
    let exe = std::env::current_exe().context("finding the harness executable to start ranks")?;
    let threads = std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / nproc).max(1).to_string()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let signals = train::stop_on_signal(rt, stop.clone(), None);
    let spawn = |rank: usize, port: u16| {
        Command::new(&exe)
            .args(child_args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("OMP_NUM_THREADS", &threads)
            .env(RUN_ID_ENV, id.to_string())
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .env(LAUNCHER_PIPE_ENV, "stdin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()))
    };
    // a port picked free may be taken before rank 0 binds it: then start over on another
    let mut tries = 0;
    let ended = loop {
        tries += 1;
        let port = match std::env::var("MASTER_PORT") {
            // the launcher's own MASTER_PORT, as torchrun's --master-port, on the first try
            Ok(p) if tries == 1 => p
                .trim()
                .parse::<u16>()
                .with_context(|| format!("MASTER_PORT={p:?} is not a port number"))?,
            _ => TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .context("picking a free port on 127.0.0.1 for the ranks' rendezvous")?
                .port(),
        };
        note!(
            "harness: run {id}: starting {nproc} ranks on 127.0.0.1:{port} ({threads} thread(s) \
             each)"
        );
        let record_pids = |pids: &[u32]| {
            if let Err(e) = rt.block_on(store.set_rank_pids(id, pids)) {
                note!("harness: run {id}: {e:#} (liveness then rests on this launcher alone)");
            }
        };
        let ended = match wait_ranks(
            id,
            nproc,
            timeout,
            &stop,
            |rank| spawn(rank, port),
            &record_pids,
        ) {
            Ok(e) => e,
            Err(e) => {
                signals.abort();
                train::mark_failed(rt, store, id, crate::console::one_line(&e))?;
                return Err(e.context(format!("run {id} failed")));
            }
        };
        if ended.port_taken && ended.lost.is_some() && tries < 3 {
            note!("harness: run {id}: port {port} was taken; trying another");
            continue;
        }
        break ended;
    };
    signals.abort();
    let Ended {
        exits,
        lost,
        killed,
        ..
    } = ended;
    if let Some((rank, status)) = lost {
        let others: Vec<String> = exits
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != rank)
            .map(|(r, s)| {
                if killed.contains(&r) {
                    format!("rank {r} killed by the launcher after the timeout")
                } else {
                    format!("rank {r} {}", s.map_or("ended".into(), describe))
                }
            })
            .collect();
        let msg = format!(
            "rank {rank} of {nproc} {} ({})",
            describe(status),
            others.join(", ")
        );
        train::mark_failed(rt, store, id, msg.clone())?;
        checkpoint::remove_partial(run_dir);
        bail!("run {id} failed: {msg}");
    }
    if stop.load(Ordering::SeqCst) {
        // rank 0 records `killed` after its last checkpoint; this covers a rank 0 that the
        // signal reached before it could
        train::mark_ended(rt, store, id, "killed", None)?;
        checkpoint::remove_partial(run_dir);
        bail!("run {id} stopped by a signal; `harness resume {id}` continues it");
    }
    if !killed.is_empty() {
        let msg = format!("ranks {killed:?} did not stop in time and were killed");
        train::mark_failed(rt, store, id, msg.clone())?;
        bail!("run {id} failed: {msg}");
    }
    Ok(())
}

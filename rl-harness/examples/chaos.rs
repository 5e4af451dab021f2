//! Fault injection for the run store and checkpoints (issue 18): an operator's bad day, for a
//! bounded time, against the real `harness` binary on the bandit trainer. `scripts/chaos` builds
//! and runs it; docs/reliability.md records its figures.
//!
//! - **kill/resume**: a run is started, then interrupted at random moments (mid-step,
//!   mid-checkpoint) by SIGKILL, SIGINT, SIGTERM or two SIGINTs, and resumed, again and again
//!   until it finishes; its metrics are then compared, (step, key) pair by pair, with an
//!   uninterrupted run of the same config. Rounds repeat until the time is spent.
//! - **concurrent writers**: ten runs started at once on a store that does not exist yet (they
//!   race the migration), each compared with the uninterrupted run.
//! - **concurrent resumes**: two `harness resume` of one killed run at once.
//! - **sweeps**: two `harness sweep` of one file at once.
//!
//! It prints interruptions, pairs compared, pairs differing, rows missing and rows doubled,
//! and exits non-zero when any pair differs or any row is missing or doubled.
//!
//! `chaos [--seconds S] [--seed N] [--harness PATH] [--keep]`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The bandit run every experiment uses: 40 steps, a checkpoint every 4, a validation every 8.
const CONFIG: &str = r#"
[trainer]
algorithm = "bandit"
project_name = "chaos"
experiment_name = "ref"
total_training_steps = 40
save_freq = 4
test_freq = 8
heartbeat_s = 0.5
seed = 11

[bandit]
batch_size = 32
"#;

/// A slow step (a resume-safe key that changes no metric), so signals land mid-step.
const SLOW: &str = "bandit.step_delay_ms=40";

/// The (step, key) → values of a run's metrics, timings left out (they differ run to run).
type Pairs = BTreeMap<(i64, String), Vec<u64>>;

#[derive(Default)]
struct Tally {
    interruptions: BTreeMap<&'static str, u64>,
    runs_resumed: u64,
    restarts: u64,
    compared: u64,
    differing: u64,
    missing: u64,
    doubled: u64,
    lock_errors: u64,
    notes: Vec<String>,
}

impl Tally {
    /// Compares run `got` with the reference pairs.
    fn compare(&mut self, what: &str, reference: &Pairs, got: &Pairs) {
        for (k, want) in reference {
            match got.get(k) {
                None => {
                    self.missing += 1;
                    self.note(format!("{what}: step {} {} missing", k.0, k.1));
                }
                Some(v) => {
                    self.compared += 1;
                    if v.len() > 1 {
                        self.doubled += v.len() as u64 - 1;
                        self.note(format!(
                            "{what}: step {} {} written {} times",
                            k.0,
                            k.1,
                            v.len()
                        ));
                    }
                    if v[0] != want[0] {
                        self.differing += 1;
                        self.note(format!("{what}: step {} {} differs", k.0, k.1));
                    }
                }
            }
        }
        for k in got.keys().filter(|k| !reference.contains_key(k)) {
            self.doubled += 1;
            self.note(format!("{what}: step {} {} is extra", k.0, k.1));
        }
    }

    fn note(&mut self, n: String) {
        if self.notes.len() < 20 {
            self.notes.push(n);
        }
    }
}

struct Chaos {
    harness: PathBuf,
    dir: PathBuf,
    config: PathBuf,
    rng: ChaCha8Rng,
}

impl Chaos {
    fn cmd(&self, db: &Path, args: &[&str]) -> Command {
        let mut c = Command::new(&self.harness);
        c.current_dir(&self.dir)
            .env("RUST_LOG", "warn")
            .env_remove("RL_TRAINER__DB")
            .arg("--db")
            .arg(db)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    fn run(&self, db: &Path, args: &[&str]) -> Result<Output> {
        self.cmd(db, args)
            .output()
            .with_context(|| format!("running harness {args:?}"))
    }

    fn ok(&self, db: &Path, args: &[&str]) -> Result<()> {
        let out = self.run(db, args)?;
        if !out.status.success() {
            bail!(
                "harness {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    fn train_args<'a>(&'a self, name: &'a str, extra: &[&'a str]) -> Vec<String> {
        let mut a = vec![
            "train".to_string(),
            self.config.display().to_string(),
            format!("trainer.experiment_name={name}"),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }
}

fn pairs(db: &Path, run: i64) -> Result<Pairs> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let store = rl_harness::Store::open_read_only(db).await?;
        let mut out = Pairs::new();
        for (step, key, value, _) in store.all_metrics(run).await? {
            if key.starts_with("timing") || key.starts_with("perf/") {
                continue;
            }
            out.entry((step, key)).or_default().push(value.to_bits());
        }
        Ok(out)
    })
}

/// The id of the newest run named `name`, if any.
fn run_named(db: &Path, name: &str) -> Result<Option<rl_harness::RunRow>> {
    if !db.exists() {
        return Ok(None);
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let store = rl_harness::Store::open_read_only(db).await?;
        Ok(store.resolve_run(name).await.ok())
    })
}

/// How many checkpoints the newest run named `name` has recorded.
fn checkpoints_of(db: &Path, name: &str) -> Result<usize> {
    let Some(run) = run_named(db, name)? else {
        return Ok(0);
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let store = rl_harness::Store::open_read_only(db).await?;
        Ok(store.checkpoints(run.id).await?.len())
    })
}

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), child.id().to_string()])
        .status();
}

/// One kill/resume round: a run interrupted until it finishes, compared with the reference.
fn kill_resume_round(c: &mut Chaos, t: &mut Tally, round: u64, reference: &Pairs) -> Result<()> {
    let db = c.dir.join(format!("kill-{round}.db"));
    let name = "victim";
    let mut fresh = true;
    for _ in 0..500 {
        let args: Vec<String> = if fresh {
            c.train_args(name, &[SLOW])
        } else {
            vec!["resume".into(), name.into(), SLOW.into()]
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = c.cmd(&db, &args).spawn()?;
        // between one step and a few checkpoints in
        let wait = c.rng.random_range(30..900);
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(wait) {
            if child.try_wait()?.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if child.try_wait()?.is_none() {
            let kind = match c.rng.random_range(0..4) {
                0 => "SIGKILL",
                1 => "SIGINT",
                2 => "SIGTERM",
                _ => "SIGINT twice",
            };
            match kind {
                "SIGKILL" => signal(&child, "KILL"),
                "SIGINT" => signal(&child, "INT"),
                "SIGTERM" => signal(&child, "TERM"),
                _ => {
                    signal(&child, "INT");
                    std::thread::sleep(Duration::from_millis(c.rng.random_range(1..60)));
                    signal(&child, "INT");
                }
            }
            *t.interruptions.entry(kind).or_default() += 1;
        }
        let out = child.wait_with_output()?;
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("database is locked") {
            t.lock_errors += 1;
        }
        // killed before its first checkpoint: nothing to resume, so it starts over
        let run = run_named(&db, name)?;
        let resumable = run.is_some()
            && !err.contains("no checkpoint to resume from")
            && !err.contains("before its first checkpoint");
        if !resumable {
            t.restarts += 1;
        }
        fresh = !resumable;
        if !fresh {
            t.runs_resumed += 1;
        }
    }
    let run = run_named(&db, name)?.context("the victim run is missing")?;
    if run.status != "finished" {
        bail!(
            "round {round}: the run ended {} ({:?})",
            run.status,
            run.error
        );
    }
    t.compare(
        &format!("kill/resume round {round}"),
        reference,
        &pairs(&db, run.id)?,
    );
    Ok(())
}

/// Ten runs started at once on a store that does not exist yet.
fn concurrent_writers(c: &Chaos, t: &mut Tally, reference: &Pairs) -> Result<u64> {
    let db = c.dir.join("writers.db");
    let n = 10;
    let children: Vec<Child> = (0..n)
        .map(|i| {
            let name = format!("w{i}");
            let args = c.train_args(&name, &[]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            c.cmd(&db, &args).spawn()
        })
        .collect::<std::io::Result<_>>()?;
    for child in children {
        let out = child.wait_with_output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("locked") {
            t.lock_errors += 1;
        }
        if !out.status.success() {
            t.note(format!("a concurrent writer failed: {err}"));
            t.missing += 1;
        }
    }
    for i in 0..n {
        let run = run_named(&db, &format!("w{i}"))?.context("a writer's run is missing")?;
        t.compare(&format!("writer {i}"), reference, &pairs(&db, run.id)?);
    }
    Ok(n)
}

/// Two resumes of one killed run at once: one runs, the other refuses; every step once.
fn concurrent_resumes(c: &Chaos, t: &mut Tally, reference: &Pairs) -> Result<()> {
    let db = c.dir.join("resumes.db");
    let args = c.train_args("twice", &[SLOW]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut child = c.cmd(&db, &args).spawn()?;
    let start = Instant::now();
    while checkpoints_of(&db, "twice")? < 2 {
        if start.elapsed() > Duration::from_secs(60) {
            bail!("the run to resume twice made no checkpoint in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill()?;
    child.wait()?;
    let a = c.cmd(&db, &["resume", "twice"]).spawn()?;
    let b = c.cmd(&db, &["resume", "twice"]).spawn()?;
    let (a, b) = (a.wait_with_output()?, b.wait_with_output()?);
    let ran = [&a, &b].iter().filter(|o| o.status.success()).count();
    if ran != 1 {
        t.note(format!("{ran} of two concurrent resumes ran"));
        t.doubled += (ran as u64).saturating_sub(1);
    }
    let run = run_named(&db, "twice")?.context("the resumed run is missing")?;
    t.compare("concurrent resumes", reference, &pairs(&db, run.id)?);
    Ok(())
}

/// Two sweeps of one four-trial file at once: every trial once.
fn concurrent_sweeps(c: &Chaos, t: &mut Tally) -> Result<(usize, usize)> {
    let db = c.dir.join("sweeps.db");
    let file = c.dir.join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            "{CONFIG}\n[sweep]\nname = \"lr\"\nstrategy = \"grid\"\nmetric = \"val/test_score\"\n\
             [sweep.grid]\n\"bandit.lr\" = [0.02, 0.05, 0.1, 0.2]\n"
        ),
    )?;
    let f = file.display().to_string();
    let a = c.cmd(&db, &["sweep", &f]).spawn()?;
    let b = c.cmd(&db, &["sweep", &f]).spawn()?;
    for o in [a.wait_with_output()?, b.wait_with_output()?] {
        if !o.status.success() {
            t.note(format!(
                "a sweep failed: {}",
                String::from_utf8_lossy(&o.stderr)
            ));
        }
    }
    let rt = tokio::runtime::Runtime::new()?;
    let runs = rt.block_on(async {
        let s = rl_harness::Store::open_read_only(&db).await?;
        s.runs(None).await
    })?;
    let mut trials: Vec<String> = runs.iter().filter_map(|r| r.trial_id.clone()).collect();
    let n = trials.len();
    trials.sort();
    trials.dedup();
    t.doubled += (n - trials.len()) as u64;
    if trials.len() < 4 {
        t.missing += (4 - trials.len()) as u64;
    }
    Ok((4, runs.len()))
}

fn main() -> Result<()> {
    let mut seconds = 120.0;
    let mut seed = 1u64;
    let mut keep = false;
    let mut harness = std::env::current_exe()?
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("harness"))
        .context("finding the harness binary")?;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seconds" => seconds = value()?.parse().context("--seconds")?,
            "--seed" => seed = value()?.parse().context("--seed")?,
            "--harness" => harness = PathBuf::from(value()?),
            "--keep" => keep = true,
            other => bail!(
                "unknown argument {other:?}; usage: chaos [--seconds S] [--seed N] [--harness PATH] [--keep]"
            ),
        }
    }
    if !harness.is_file() {
        bail!(
            "no harness binary at {} (--harness PATH)",
            harness.display()
        );
    }
    // the runs start in a temp folder
    let harness = std::path::absolute(&harness)?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().to_path_buf();
    let config = dir.join("chaos.toml");
    std::fs::write(&config, CONFIG)?;
    let mut c = Chaos {
        harness,
        dir: dir.clone(),
        config,
        rng: ChaCha8Rng::seed_from_u64(seed),
    };
    let started = Instant::now();
    let budget = Duration::from_secs_f64(seconds);
    let mut t = Tally::default();

    let ref_db = dir.join("reference.db");
    let ref_args = c.train_args("ref", &[]);
    c.ok(
        &ref_db,
        &ref_args.iter().map(String::as_str).collect::<Vec<_>>(),
    )?;
    let reference = pairs(&ref_db, 1)?;

    let writers = concurrent_writers(&c, &mut t, &reference)?;
    concurrent_resumes(&c, &mut t, &reference)?;
    let (trials, sweep_runs) = concurrent_sweeps(&c, &mut t)?;
    let mut rounds = 0;
    while rounds == 0 || started.elapsed() < budget {
        rounds += 1;
        kill_resume_round(&mut c, &mut t, rounds, &reference)?;
    }

    let interruptions: u64 = t.interruptions.values().sum();
    let kinds: Vec<String> = t
        .interruptions
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    println!(
        "chaos: {:.0} s, seed {seed}: {interruptions} interruptions ({}) over {rounds} kill/resume \
         rounds ({} resumes, {} restarts before a first checkpoint)",
        started.elapsed().as_secs_f64(),
        kinds.join(", "),
        t.runs_resumed,
        t.restarts
    );
    println!(
        "chaos: {writers} writers at once on a new store, 2 resumes of one run at once, 2 sweeps \
         of {trials} trials at once ({sweep_runs} runs); {} lock errors",
        t.lock_errors
    );
    println!(
        "chaos: pairs compared {}, pairs differing {}, rows missing {}, rows doubled {}",
        t.compared, t.differing, t.missing, t.doubled
    );
    for n in &t.notes {
        println!("chaos:   {n}");
    }
    if keep {
        println!("chaos: kept {}", tmp.keep().display());
    }
    if t.differing + t.missing + t.doubled + t.lock_errors > 0 {
        bail!("chaos: something was lost, doubled or different (see above)");
    }
    Ok(())
}

//! Sweeps on the bandit trainer: an interrupted sweep re-run completes only the missing trials
//! (finished ones skipped, the interrupted one resumed), a failed trial is recorded while the
//! sweep goes on, `compare --sweep` ranks the trials, two sweeps of one file at once run each
//! trial once, the sweep id does not depend on how the store is named, and `--db` is obeyed.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{BANDIT, Env, wait_for};

fn sweep_file(env: &Env, grid: &str) -> String {
    let text = format!(
        "{BANDIT}\n[sweep]\nname = \"lr\"\nstrategy = \"grid\"\nmetric = \"val/test_score\"\n[sweep.grid]\n{grid}\n"
    );
    env.file("sweep.toml", &text).to_str().unwrap().to_string()
}

#[test]
fn an_interrupted_sweep_rerun_completes_only_the_missing_trials() {
    let env = Env::new();
    let file = sweep_file(
        &env,
        "\"bandit.lr\" = [0.02, 0.05, 0.1, 0.2]\n\"bandit.step_delay_ms\" = [60]",
    );
    // Its own process group, so that kill -9 takes the trial child with it.
    let mut child = {
        use std::os::unix::process::CommandExt;
        env.cmd()
            .args(["sweep", &file])
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for(
        "two finished trials and a checkpoint of the third",
        Duration::from_secs(180),
        || {
            let runs = rt.block_on(store.runs(None)).unwrap_or_default();
            let finished = runs.iter().filter(|r| r.status == "finished").count();
            finished == 2
                && runs.len() == 3
                && rt
                    .block_on(store.checkpoints(runs[2].id))
                    .map(|c| !c.is_empty())
                    .unwrap_or(false)
        },
    );
    let pgid = child.id();
    std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .status()
        .unwrap();
    child.wait().unwrap();
    wait_for("the trial process to die", Duration::from_secs(10), || {
        let r = rt.block_on(store.run(3)).unwrap().unwrap();
        eprintln!(
            "run 3: {} pid {:?} alive {:?}",
            r.effective_status(),
            r.pid,
            r.pid.map(rl_harness::pid_alive)
        );
        r.effective_status() == "dead"
    });

    let out = env.ok(&["sweep", &file]);
    assert!(
        out.contains("2 skipped, 1 started, 1 resumed; 2 finished, 0 failed"),
        "{out}"
    );
    let runs = rt.block_on(store.runs(None)).unwrap();
    assert_eq!(runs.len(), 4, "no trial ran twice");
    assert!(runs.iter().all(|r| r.status == "finished"));
    assert!(
        runs[2].resumed_from.is_some(),
        "the interrupted trial was resumed"
    );
    let sweep_id = runs[0].sweep_id.clone().unwrap();
    // A third run of the command has nothing left to do.
    let out = env.ok(&["sweep", &file]);
    assert!(out.contains("4 skipped"), "{out}");
    let ranked = env.ok(&["compare", "--sweep", &sweep_id]);
    assert!(
        ranked.contains("trials ranked by best val/test_score"),
        "{ranked}"
    );
    assert_eq!(
        ranked.lines().filter(|l| l.contains("finished")).count(),
        4,
        "{ranked}"
    );
    assert!(ranked.contains("bandit.lr=0.2"), "{ranked}");
    let listed = env.ok(&["runs", "--sweep", &sweep_id]);
    assert_eq!(listed.lines().count(), 5, "{listed}");
}

#[test]
fn a_failed_trial_is_recorded_and_the_sweep_goes_on() {
    let env = Env::new();
    // cuda:7 resolves as a config but no such device exists when the trial starts.
    let file = sweep_file(&env, "\"trainer.device\" = ['cuda:7', 'cpu']");
    let out = env.ok(&["sweep", &file, "--parallel", "2"]);
    assert!(out.contains("1 finished, 1 failed"), "{out}");
    let (rt, store) = env.store();
    let runs = rt.block_on(store.runs(None)).unwrap();
    let failed = runs
        .iter()
        .find(|r| r.status == "failed")
        .expect("a failed run");
    assert!(
        failed.error.as_deref().unwrap_or("").contains("cuda:7"),
        "{failed:?}"
    );
    let events = rt.block_on(store.events(failed.id)).unwrap();
    assert!(events.iter().any(|e| e.kind == "error"), "{events:?}");
    // Re-running skips both: the finished one, and the failed one unless asked.
    let out = env.ok(&["sweep", &file]);
    assert!(out.contains("2 skipped"), "{out}");
    let bad = env.file(
        "bad_sweep.toml",
        &format!("{BANDIT}\n[sweep]\nstrategy = \"grid\"\n[sweep.grid]\n\"bandit.lrr\" = [1]\n"),
    );
    let err = env.fails(&["sweep", bad.to_str().unwrap()]);
    assert!(
        err.contains("bandit.lrr") && err.contains("did you mean `bandit.lr`"),
        "{err}"
    );
}

#[test]
fn two_sweeps_of_one_file_at_once_run_each_trial_once() {
    let env = Env::new();
    let file = sweep_file(
        &env,
        "\"bandit.lr\" = [0.02, 0.05, 0.1, 0.2]\n\"bandit.step_delay_ms\" = [40]",
    );
    let outs = env.at_once(2, &["sweep", &file]);
    for o in &outs {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (rt, store) = env.store();
    let runs = rt.block_on(store.runs(None)).unwrap();
    let mut trials: Vec<String> = runs.iter().filter_map(|r| r.trial_id.clone()).collect();
    trials.sort();
    let before = trials.len();
    trials.dedup();
    assert_eq!(before, trials.len(), "a trial ran twice: {runs:?}");
    assert_eq!(trials.len(), 4, "every trial ran");
    assert!(runs.iter().all(|r| r.status == "finished"), "{runs:?}");
}

#[test]
fn the_sweep_id_does_not_depend_on_how_the_store_is_named_and_db_is_obeyed() {
    let env = Env::new();
    let file = sweep_file(&env, "\"bandit.lr\" = [0.05, 0.1]");
    let first = env.ok(&["sweep", &file]);
    assert!(first.contains("0 skipped, 2 started"), "{first}");
    // The same store named through the environment, then by its absolute path.
    let out = env
        .cmd()
        .args(["sweep", &file])
        .env("RL_TRAINER__DB", "runs/harness.db")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("2 skipped, 0 started"),
        "{text}"
    );
    let abs = env.db();
    let again = env.ok(&["--db", abs.to_str().unwrap(), "sweep", &file]);
    assert!(again.contains("2 skipped, 0 started"), "{again}");
    let (rt, store) = env.store();
    assert_eq!(rt.block_on(store.runs(None)).unwrap().len(), 2);
    // Another store through --db: the trials land there, none in the default one.
    let other = env.path().join("other.db");
    let there = env.ok(&["--db", other.to_str().unwrap(), "sweep", &file]);
    assert!(there.contains("0 skipped, 2 started"), "{there}");
    assert_eq!(rt.block_on(store.runs(None)).unwrap().len(), 2);
    let listed = env.ok(&["--db", other.to_str().unwrap(), "runs"]);
    assert_eq!(listed.lines().count(), 3, "{listed}");
}

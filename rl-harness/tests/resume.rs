//! Checkpoint and resume: the kill -9 exactness test, dead-run detection, resume-safe keys,
//! `--from-step`, checkpoint pruning. All on the harness's own bandit trainer (CPU, seconds).

mod common;

use std::time::Duration;

use common::{BANDIT, Env, metrics_of, wait_for};

#[test]
fn kill_9_mid_step_after_a_checkpoint_then_resume_matches_an_uninterrupted_run() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    // A: uninterrupted.
    env.ok(&["train", cfg, "trainer.experiment_name=a"]);
    // B: same config (the step delay is a resume-safe key that changes no metric), killed with
    // SIGKILL in the middle of a step after its second checkpoint.
    let mut child = env.spawn(&[
        "train",
        cfg,
        "trainer.experiment_name=b",
        "bandit.step_delay_ms=150",
    ]);
    let (rt, store) = {
        wait_for("the run store", Duration::from_secs(60), || {
            env.db().exists()
        });
        env.store()
    };
    wait_for(
        "run b's checkpoint at step 10",
        Duration::from_secs(120),
        || {
            rt.block_on(store.checkpoints(2))
                .map(|c| c.iter().any(|c| c.step == 10))
                .unwrap_or(false)
        },
    );
    std::thread::sleep(Duration::from_millis(60));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let b = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(
        b.status, "running",
        "a killed process cannot record its end"
    );
    assert_eq!(b.effective_status(), "dead");
    let listed = env.ok(&["runs"]);
    assert!(
        listed
            .lines()
            .any(|l| l.contains(" b ") && l.contains("dead")),
        "{listed}"
    );
    // The killed run holds metrics past its last checkpoint (steps 11.. may be there).
    let ckpts = rt.block_on(store.checkpoints(2)).unwrap();
    let last = ckpts.last().unwrap().step;
    assert!(last >= 10);

    // A change to a key that is not resume-safe is refused, naming the key.
    let err = env.fails(&["resume", "2", "bandit.lr=0.5"]);
    assert!(err.contains("`bandit.lr` cannot change on resume"), "{err}");

    env.ok(&["resume", "b", "bandit.step_delay_ms=0"]);
    let a_metrics = metrics_of(&rt, &store, 1);
    let b_metrics = metrics_of(&rt, &store, 2);
    assert!(a_metrics.len() > 100, "{}", a_metrics.len());
    assert_eq!(
        a_metrics, b_metrics,
        "resumed run differs from the uninterrupted one"
    );
    let b = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(b.status, "finished");
    assert_eq!(b.resumed_from, Some(last));
    let events = rt.block_on(store.events(2)).unwrap();
    assert!(events.iter().any(|e| e.kind == "resume"), "{events:?}");
    assert!(
        events
            .iter()
            .any(|e| e.kind == "config_change" && e.message.contains("bandit.step_delay_ms")),
        "{events:?}"
    );
    // The resolved config is stored in the run directory and in every checkpoint.
    let ck = rt.block_on(store.checkpoints(2)).unwrap();
    let path = std::path::Path::new(&ck.last().unwrap().path).to_path_buf();
    for f in [
        "config.toml",
        "config.json",
        "harness.json",
        "trainer/trainer.ot",
        "trainer/trainer.json",
    ] {
        assert!(path.join(f).is_file(), "{} lacks {f}", path.display());
    }
    assert!(
        std::path::Path::new(&b.run_dir)
            .join("config.toml")
            .is_file()
    );
    assert!(
        std::path::Path::new(&b.run_dir)
            .join("harness.log")
            .is_file()
    );
}

#[test]
fn resume_from_an_earlier_step_drops_later_metrics_and_checkpoints_and_replays_exactly() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    env.ok(&["train", cfg, "trainer.max_ckpt_to_keep=3"]);
    let (rt, store) = env.store();
    let before = metrics_of(&rt, &store, 1);
    let steps: Vec<i64> = rt
        .block_on(store.checkpoints(1))
        .unwrap()
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(
        steps,
        vec![10, 15, 20],
        "max_ckpt_to_keep=3 keeps the newest three"
    );
    assert!(
        !env.path()
            .join("runs/1-base/checkpoints/global_step_5")
            .exists()
    );
    // A finished run can be resumed from an earlier checkpoint: later history is replaced.
    env.ok(&["resume", "1", "--from-step", "10"]);
    assert_eq!(metrics_of(&rt, &store, 1), before);
    let err = env.fails(&["resume", "1", "--from-step", "5"]);
    assert!(err.contains("has no checkpoint at step 5"), "{err}");
    let err = env.fails(&["resume", "99"]);
    assert!(err.contains("no run 99"), "{err}");
}

#[test]
fn a_running_run_cannot_be_resumed_twice() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let mut child = env.spawn(&["train", cfg.to_str().unwrap(), "bandit.step_delay_ms=100"]);
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for("a checkpoint", Duration::from_secs(60), || {
        rt.block_on(store.checkpoints(1))
            .map(|c| !c.is_empty())
            .unwrap_or(false)
    });
    let err = env.fails(&["resume", "1"]);
    assert!(err.contains("still running"), "{err}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Two `resume` of one run at once: one claims it, the other refuses naming the claimant's
/// pid, and every step is in the store once. Another connection holds the store's write lock
/// while both start, so both pass every check made before their first write and reach it
/// together when the lock is let go.
#[test]
fn two_resumes_at_once_one_runs_and_the_other_names_it() {
    use sqlx::Connection;
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&[
        "train",
        cfg.to_str().unwrap(),
        "trainer.total_training_steps=40",
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut lock = rt
        .block_on(sqlx::SqliteConnection::connect(&format!(
            "sqlite://{}",
            env.db().display()
        )))
        .unwrap();
    rt.block_on(sqlx::query("BEGIN IMMEDIATE").execute(&mut lock))
        .unwrap();
    let children: Vec<_> = (0..2)
        .map(|_| {
            env.cmd()
                .args(["resume", "1", "--from-step", "5", "bandit.step_delay_ms=50"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    rt.block_on(sqlx::query("ROLLBACK").execute(&mut lock))
        .unwrap();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let ok = outs.iter().filter(|o| o.status.success()).count();
    let errs: Vec<String> = outs
        .iter()
        .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
        .collect();
    assert_eq!(ok, 1, "exactly one resume runs: {errs:?}");
    let refused = outs
        .iter()
        .zip(&errs)
        .find(|(o, _)| !o.status.success())
        .unwrap()
        .1;
    assert!(refused.contains("run 1 is still running (pid"), "{refused}");
    let (rt, store) = env.store();
    let series = rt.block_on(store.series(1, "critic/score/mean")).unwrap();
    let steps: Vec<i64> = series.iter().map(|p| p.0).collect();
    assert_eq!(steps, (1..=40).collect::<Vec<_>>(), "each step once");
    assert_eq!(
        rt.block_on(store.run(1)).unwrap().unwrap().status,
        "finished"
    );
}

#[test]
fn sigterm_checkpoints_marks_the_run_killed_and_resume_is_exact() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    env.ok(&[
        "train",
        cfg,
        "trainer.experiment_name=a",
        "trainer.save_freq=-1",
    ]);
    let child = env.spawn(&[
        "train",
        cfg,
        "trainer.experiment_name=b",
        "trainer.save_freq=-1",
        "bandit.step_delay_ms=100",
    ]);
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for("a few steps of run b", Duration::from_secs(60), || {
        rt.block_on(store.series(2, "actor/pg_loss"))
            .map(|s| s.len() >= 3)
            .unwrap_or(false)
    });
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("stopped by a signal") && err.contains("harness resume 2"),
        "{err}"
    );
    let b = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(b.status, "killed");
    let ckpts = rt.block_on(store.checkpoints(2)).unwrap();
    assert_eq!(
        ckpts.len(),
        1,
        "a checkpoint at the step where the signal arrived"
    );
    env.ok(&["resume", "2", "bandit.step_delay_ms=0"]);
    assert_eq!(metrics_of(&rt, &store, 1), metrics_of(&rt, &store, 2));
}

/// A process killed while saving leaves a `.tmp-global_step_N-PID` folder beside the
/// checkpoints; the next resume of that run removes it.
#[test]
fn a_resume_removes_the_partial_checkpoints_a_killed_save_left() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&["train", cfg.to_str().unwrap()]);
    let (rt, store) = env.store();
    let run_dir = std::path::PathBuf::from(rt.block_on(store.run(1)).unwrap().unwrap().run_dir);
    let partial = run_dir.join("checkpoints/.tmp-global_step_7-999999");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("model.safetensors"), b"half").unwrap();
    env.ok(&["resume", "1", "--from-step", "15"]);
    assert!(!partial.exists(), "{} is still there", partial.display());
}

/// The first Ctrl-C says it stops after the step; a second one stops at once, records the run
/// as killed, and the run resumes from its last checkpoint to the same end.
#[test]
fn a_second_ctrl_c_stops_at_once_and_the_run_resumes() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let child = env.spawn(&["train", cfg.to_str().unwrap(), "bandit.step_delay_ms=1500"]);
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    // Step 6 just committed: step 7 has 1.5 s to go, and checkpoint 5 exists.
    wait_for("step 6", Duration::from_secs(60), || {
        rt.block_on(store.series(1, "actor/pg_loss"))
            .map(|s| s.len() >= 6)
            .unwrap_or(false)
    });
    let interrupt = || {
        std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap()
    };
    interrupt();
    std::thread::sleep(Duration::from_millis(100));
    interrupt();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("SIGINT: stopping after this step")
            && err.contains("SIGINT again: stopping now"),
        "{err}"
    );
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    assert_eq!(run.status, "killed", "{run:?}");
    let steps = rt.block_on(store.series(1, "actor/pg_loss")).unwrap().len();
    assert!(
        steps < 8,
        "it went on after the second signal: {steps} steps"
    );
    env.ok(&["resume", "1", "bandit.step_delay_ms=0"]);
    let series = rt.block_on(store.series(1, "actor/pg_loss")).unwrap();
    let got: Vec<i64> = series.iter().map(|p| p.0).collect();
    assert_eq!(got, (1..=20).collect::<Vec<_>>(), "every step once");
}

//! Nothing silently wrong (issue 18, items 6, 9, 10, 13 and 14): checkpoints carry checksums
//! and the run and store they belong to, checked before a resume loads them; a corrupt one is
//! refused naming the file and the previous intact checkpoint; a resume that fails before it
//! rewinds the run leaves the run as it was; two stores sharing a runs folder never share a run
//! folder; a stop before the first step checkpoints step 0; a diverged run stops naming the
//! step. All on the harness's bandit trainer (CPU, seconds).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{BANDIT, Env, metrics_of, wait_for};

/// The folder of run `id`'s checkpoint at `step`.
fn ckpt(rt: &tokio::runtime::Runtime, store: &rl_harness::Store, id: i64, step: i64) -> PathBuf {
    let c = rt.block_on(store.checkpoints(id)).unwrap();
    let c = c.iter().find(|c| c.step == step).unwrap();
    PathBuf::from(&c.path)
}

/// A finished 20-step bandit run (run 1, checkpoints every 5 steps) and its store.
fn trained() -> (Env, tokio::runtime::Runtime, rl_harness::Store) {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&["train", cfg.to_str().unwrap()]);
    let (rt, store) = env.store();
    (env, rt, store)
}

/// The steps of run `id`'s recorded checkpoints.
fn steps(rt: &tokio::runtime::Runtime, store: &rl_harness::Store, id: i64) -> Vec<i64> {
    let c = rt.block_on(store.checkpoints(id)).unwrap();
    c.iter().map(|c| c.step).collect()
}

/// Flips one bit in the middle of `file`, keeping its size.
fn flip_a_bit(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_corrupt_checkpoint_is_refused_naming_the_file_and_the_previous_intact_one() {
    let (env, rt, store) = trained();
    let before = metrics_of(&rt, &store, 1);
    let run_before = rt.block_on(store.run(1)).unwrap().unwrap();
    // bit rot in the newest checkpoint's weights: same size, other bytes
    let c20 = ckpt(&rt, &store, 1, 20);
    flip_a_bit(&c20.join("trainer/trainer.ot"));
    let err = env.fails(&["resume", "1"]);
    assert!(
        err.contains("checkpoint 20 of run 1 is corrupt")
            && err.contains("trainer/trainer.ot: checksum mismatch")
            && err.contains("`harness resume 1 --from-step 15` uses the previous one"),
        "{err}"
    );
    // the same when it is asked for by step
    let err = env.fails(&["resume", "1", "--from-step", "20"]);
    assert!(
        err.contains("trainer/trainer.ot: checksum mismatch"),
        "{err}"
    );
    // a corrupt file whose harness.json was made to agree still differs from the store's record
    let c15 = ckpt(&rt, &store, 1, 15);
    let meta_path = c15.join("harness.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    meta["files"]["trainer/trainer.json"]["sha256"] = serde_json::json!("00".repeat(32));
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
    let err = env.fails(&["resume", "1", "--from-step", "15"]);
    assert!(
        err.contains("differ from the ones the store recorded")
            && err.contains("`harness resume 1 --from-step 10` uses the previous one"),
        "{err}"
    );
    // refusals change nothing: the run is finished with every row
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    assert_eq!(
        (run.status.as_str(), run.ended, run.error.clone()),
        ("finished", run_before.ended, None)
    );
    assert_eq!(metrics_of(&rt, &store, 1), before);
    // and the checkpoint it names continues the run to the same end
    env.ok(&["resume", "1", "--from-step", "10"]);
    assert_eq!(metrics_of(&rt, &store, 1), before);
}

/// Issue 18, item 9: a resume that fails after it claimed the run (here a checkpoint from
/// before checksums whose weights were cut short, so only loading finds the fault) drops no
/// metric and leaves the run finished, as it was, with an event saying what happened.
#[test]
fn a_resume_that_fails_to_load_leaves_the_run_as_it_was() {
    let (env, rt, store) = trained();
    let before = metrics_of(&rt, &store, 1);
    let run_before = rt.block_on(store.run(1)).unwrap().unwrap();
    let c10 = ckpt(&rt, &store, 1, 10);
    // as a checkpoint written before checksums were kept: no sums in the folder or the store
    let meta_path = c10.join("harness.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    meta.as_object_mut().unwrap().remove("files");
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
    rt.block_on(
        sqlx::query("UPDATE checkpoints SET manifest = NULL WHERE run_id = 1 AND step = 10")
            .execute(store.pool()),
    )
    .unwrap();
    let weights = c10.join("trainer/trainer.ot");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = env.fails(&["resume", "1", "--from-step", "10"]);
    assert!(
        err.contains("resuming run 1 from") && err.contains("left as it was"),
        "{err}"
    );
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    assert_eq!(run.status, "finished", "{run:?}");
    assert_eq!(
        (run.ended, run.error.clone(), run.pid, run.started),
        (run_before.ended, None, run_before.pid, run_before.started)
    );
    assert_eq!(metrics_of(&rt, &store, 1), before, "no metric dropped");
    let got = steps(&rt, &store, 1);
    assert_eq!(got, vec![5, 10, 15, 20], "no checkpoint dropped");
    assert!(ckpt(&rt, &store, 1, 20).join("harness.json").is_file());
    let events = rt.block_on(store.events(1)).unwrap();
    assert!(
        events.iter().any(|e| e.kind == "resume_failed"
            && e.message
                .contains("resume from step 10 failed before training")),
        "{events:?}"
    );
    assert!(!events.iter().any(|e| e.kind == "resume"), "{events:?}");
    // the run still resumes from an intact checkpoint
    env.ok(&["resume", "1", "--from-step", "15"]);
    assert_eq!(metrics_of(&rt, &store, 1), before);
}

/// Issue 18, item 6: two stores sharing a runs folder number their runs from 1 each; their
/// folders differ, each resume continues its own run, and a checkpoint of the other store's
/// run put in its place is refused, naming the store.
#[test]
fn two_stores_sharing_a_runs_folder_keep_their_runs_apart() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let x = env.path().join("x.db");
    let y = env.path().join("y.db");
    let (x, y) = (x.to_str().unwrap(), y.to_str().unwrap());
    env.ok(&["--db", x, "train", cfg, "trainer.experiment_name=same"]);
    env.ok(&[
        "--db",
        y,
        "train",
        cfg,
        "trainer.experiment_name=same",
        "trainer.seed=8",
    ]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let open = |db: &str| rt.block_on(rl_harness::Store::open(Path::new(db))).unwrap();
    let (sx, sy) = (open(x), open(y));
    let (rx, ry) = (
        rt.block_on(sx.run(1)).unwrap().unwrap(),
        rt.block_on(sy.run(1)).unwrap().unwrap(),
    );
    assert_ne!(rx.run_dir, ry.run_dir);
    assert!(rx.run_dir.ends_with("runs/1-same"), "{}", rx.run_dir);
    assert!(ry.run_dir.ends_with("runs/1-same-2"), "{}", ry.run_dir);
    assert_ne!(sx.id(), sy.id());
    let before = metrics_of(&rt, &sx, 1);
    env.ok(&["--db", x, "resume", "same", "--from-step", "10"]);
    assert_eq!(metrics_of(&rt, &sx, 1), before, "x resumed its own run");
    // what a shared folder did before: y's checkpoint where x's was
    let (cx, cy) = (ckpt(&rt, &sx, 1, 10), ckpt(&rt, &sy, 1, 10));
    std::fs::remove_dir_all(&cx).unwrap();
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .arg(&cy)
        .arg(&cx)
        .status()
        .unwrap();
    assert!(copied.success());
    let err = env.fails(&["--db", x, "resume", "same", "--from-step", "10"]);
    assert!(
        err.contains("belongs to run 1 of another run store") && err.contains(sy.id()),
        "{err}"
    );
    assert_eq!(metrics_of(&rt, &sx, 1), before);
}

/// Issue 18, item 10: a stop during the validation before training checkpoints step 0, so the
/// resume the message offers exists, and the resumed run equals an uninterrupted one.
#[test]
fn a_stop_before_the_first_step_checkpoints_step_0_and_the_run_resumes() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let child = env.spawn(&[
        "train",
        cfg,
        "trainer.val_before_train=true",
        "bandit.val_delay_ms=4000",
    ]);
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for("run 1", Duration::from_secs(60), || {
        rt.block_on(store.run(1))
            .map(|r| r.is_some())
            .unwrap_or(false)
    });
    // the trainer is built in milliseconds; the validation before step 1 then takes 4 s
    std::thread::sleep(Duration::from_millis(1000));
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("`harness resume 1` continues it"), "{err}");
    let got = steps(&rt, &store, 1);
    assert_eq!(got, vec![0], "{err}");
    assert_eq!(rt.block_on(store.run(1)).unwrap().unwrap().status, "killed");
    env.ok(&["resume", "1", "bandit.val_delay_ms=0"]);
    env.ok(&[
        "train",
        cfg,
        "trainer.val_before_train=true",
        "trainer.experiment_name=straight",
    ]);
    let (a, b) = (metrics_of(&rt, &store, 1), metrics_of(&rt, &store, 2));
    assert!(a.len() > 100, "{}", a.len());
    assert_eq!(a, b, "the resumed run differs from the uninterrupted one");
}

/// Issue 18, item 13: a run whose loss stays non-finite for `trainer.max_nonfinite_steps`
/// steps fails naming the step it diverged at and the checkpoint before it, and takes no
/// checkpoint of a diverged step; with the guard off it trains on.
#[test]
fn a_diverged_run_stops_naming_the_step_and_checkpoints_no_nan() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let err = env.fails(&["train", cfg, "bandit.diverge_at_step=9"]);
    assert!(
        err.contains("training diverged at step 9")
            && err.contains("for 3 step(s) (trainer.max_nonfinite_steps = 3)")
            && err.contains("its newest checkpoint, step 5")
            && err.contains("--from-step 5"),
        "{err}"
    );
    let (rt, store) = env.store();
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    assert_eq!(run.status, "failed");
    let got = steps(&rt, &store, 1);
    assert_eq!(got, vec![5], "no checkpoint of step 10, whose loss was NaN");
    let events = rt.block_on(store.events(1)).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == "nonfinite" && e.message.contains("step 10")),
        "{events:?}"
    );
    let loss = rt.block_on(store.series(1, "actor/pg_loss")).unwrap();
    assert_eq!(
        loss.last().unwrap().0,
        11,
        "it stopped at the third NaN step"
    );
    // the guard off: the run trains to its end
    env.ok(&[
        "train",
        cfg,
        "bandit.diverge_at_step=9",
        "trainer.max_nonfinite_steps=0",
        "trainer.experiment_name=unguarded",
    ]);
    let loss = rt.block_on(store.series(2, "actor/pg_loss")).unwrap();
    assert_eq!(loss.len(), 20);
    assert!(loss.last().unwrap().1.is_nan());
}

/// `scripts/chaos` for a few seconds (its kill/resume round, the concurrent writers, resumes
/// and sweeps): everything it compares is equal, nothing missing or doubled.
#[test]
fn the_chaos_experiments_lose_double_and_change_nothing() {
    let harness = Path::new(env!("CARGO_BIN_EXE_harness"));
    let chaos = harness.parent().unwrap().join("examples/chaos");
    assert!(chaos.is_file(), "cargo test builds {}", chaos.display());
    let out = std::process::Command::new(&chaos)
        .args(["--seconds", "5", "--seed", "3", "--harness"])
        .arg(harness)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("pairs differing 0, rows missing 0, rows doubled 0"),
        "{text}"
    );
    let compared: u64 = text
        .split("pairs compared ")
        .nth(1)
        .and_then(|t| t.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    // the reference has 40 steps of 7 metrics and 5 validations; 12 runs are compared
    assert!(compared > 12 * 280, "{text}");
}

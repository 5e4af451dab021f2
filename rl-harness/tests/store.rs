//! The run store loses nothing when it cannot write: a store on a small tmpfs that fills up in
//! the middle of a run (real SQLite, real ENOSPC). A short full disk delays rows, never drops
//! them; a lasting one fails the run loudly, and what it owed (its metrics and how it ended) is
//! kept in a spill file that the next opening of the store writes in, exactly once.
//!
//! Mounting the tmpfs needs root, as the CI and development machines run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BANDIT, Env, wait_for};

/// A tmpfs of `size` mounted at `dir` until dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("running mount");
        assert!(
            status.success(),
            "mounting a tmpfs at {} failed: these tests need root",
            dir.display()
        );
        Tmpfs(dir.to_path_buf())
    }

    /// Fills it up; returns the filler file.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.0.join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let block = vec![0u8; 64 * 1024];
        while f.write_all(&block).is_ok() {}
        let _ = f.write_all(&[0u8; 512]);
        while f.write_all(&[0u8; 1]).is_ok() {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn open(db: &Path) -> (tokio::runtime::Runtime, rl_harness::Store) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(rl_harness::Store::open(db)).unwrap();
    (rt, store)
}

/// The steps of `key` in run 1, in order.
fn steps(db: &Path, key: &str) -> Vec<i64> {
    let (rt, store) = open(db);
    let s = rt.block_on(store.series(1, key)).unwrap();
    s.into_iter().map(|(step, _)| step).collect()
}

/// Spill files of the store `db` beside it and in `tmp` (the children's TMPDIR).
fn spill_files(db: &Path, tmp: &Path) -> Vec<PathBuf> {
    let name = db.file_name().unwrap().to_string_lossy().into_owned();
    let beside = std::fs::read_dir(db.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().is_some_and(|f| {
                f.to_string_lossy()
                    .starts_with(&format!("{name}.unwritten."))
            })
        });
    let temp = std::fs::read_dir(tmp)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with("harness-unwritten-"))
        });
    beside.chain(temp).collect()
}

#[test]
fn a_full_disk_under_the_store_delays_rows_and_a_lasting_one_fails_the_run_keeping_them() {
    let env = Env::new();
    let disk = Tmpfs::mount(&env.path().join("small"), "16m");
    let db = disk.0.join("harness.db");
    // The children's temp folder: where spills go when the store's disk is the full one.
    let tmp = env.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let cfg = env.file("exp.toml", BANDIT);
    let args = |extra: &[&str]| -> Vec<String> {
        [
            "--db",
            db.to_str().unwrap(),
            "train",
            cfg.to_str().unwrap(),
            "trainer.save_freq=-1",
            "trainer.heartbeat_s=1000",
            "bandit.step_delay_ms=50",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(extra.iter().map(|s| s.to_string()))
        .collect()
    };

    // 1. Full for about 1.5 s (some 30 steps) in the middle of a 60-step run.
    let child = env
        .cmd()
        .env("TMPDIR", &tmp)
        .args(args(&["trainer.total_training_steps=60"]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("step 5 in the store", Duration::from_secs(60), || {
        db.exists() && steps(&db, "critic/score/mean").len() >= 5
    });
    let filler = disk.fill();
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::remove_file(&filler).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("rows kept and retried"),
        "the refusal was not seen: {err}"
    );
    assert_eq!(
        steps(&db, "critic/score/mean"),
        (1..=60).collect::<Vec<_>>(),
        "every step once"
    );
    assert!(
        spill_files(&db, &tmp).is_empty(),
        "{:?}",
        spill_files(&db, &tmp)
    );

    // 2. Full for good: the run fails once trainer.store_patience_s is spent, naming the store;
    // what it owed is spilled outside the full disk and written when the store is next opened.
    let child = env
        .cmd()
        .env("TMPDIR", &tmp)
        .args(args(&[
            "trainer.total_training_steps=400",
            "trainer.store_patience_s=2",
            "trainer.experiment_name=lasting",
        ]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (rt, store) = open(&db);
    wait_for("run 2 at step 5", Duration::from_secs(60), || {
        rt.block_on(store.series(2, "critic/score/mean"))
            .map(|s| s.len() >= 5)
            .unwrap_or(false)
    });
    drop(store);
    drop(rt);
    let filler = disk.fill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the run went on unrecorded: {err}");
    assert!(
        err.contains("has refused every write") && err.contains(db.to_str().unwrap()),
        "{err}"
    );
    assert!(
        !spill_files(&db, &tmp).is_empty(),
        "nothing was kept: {err}"
    );
    std::fs::remove_file(&filler).unwrap();
    // The next process that opens the store for writing writes the spill in.
    let out = env
        .cmd()
        .env("TMPDIR", &tmp)
        .args(["--db", db.to_str().unwrap(), "sync"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (rt, store) = open(&db);
    let run = rt.block_on(store.run(2)).unwrap().unwrap();
    assert_eq!(run.status, "failed", "{run:?}");
    assert!(
        run.error
            .as_deref()
            .unwrap_or("")
            .contains("refused every write"),
        "{run:?}"
    );
    let series = rt.block_on(store.series(2, "critic/score/mean")).unwrap();
    let got: Vec<i64> = series.iter().map(|p| p.0).collect();
    let last = *got.last().unwrap();
    assert!(last > 5, "rows past the full disk were kept: {got:?}");
    assert_eq!(
        got,
        (1..=last).collect::<Vec<_>>(),
        "every trained step once"
    );
    assert!(
        spill_files(&db, &tmp).is_empty(),
        "{:?}",
        spill_files(&db, &tmp)
    );
    // Opening again writes nothing twice.
    env.ok(&["--db", db.to_str().unwrap(), "sync"]);
    assert_eq!(
        steps(&db, "critic/score/mean"),
        (1..=60).collect::<Vec<_>>()
    );
    assert_eq!(
        rt.block_on(store.series(2, "critic/score/mean"))
            .unwrap()
            .len(),
        got.len()
    );
}

/// `runs`, `show`, `compare` and `export` only read: they work on a store whose disk is
/// mounted read-only. A store written by a newer harness is refused with a message saying so.
#[test]
fn read_only_commands_read_a_store_on_a_read_only_disk_and_a_newer_store_is_refused() {
    let env = Env::new();
    let disk = Tmpfs::mount(&env.path().join("ro"), "16m");
    let db = disk.0.join("harness.db");
    let db_s = db.to_str().unwrap();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&["--db", db_s, "train", cfg.to_str().unwrap()]);
    let remount = |mode: &str| {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,{mode}")])
            .arg(&disk.0)
            .status()
            .unwrap();
        assert!(status.success(), "remount {mode}");
    };
    remount("ro");
    let listed = env.ok(&["--db", db_s, "runs"]);
    assert!(listed.contains("finished"), "{listed}");
    for args in [
        &["show", "1"][..],
        &["compare", "1"],
        &["export", "1", "--format", "csv"],
    ] {
        let mut full = vec!["--db", db_s];
        full.extend_from_slice(args);
        env.ok(&full);
    }
    remount("rw");
    let (rt, store) = open(&db);
    rt.block_on(
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99990101000001, 'from a newer harness', 1, x'00', 0)",
        )
        .execute(store.pool()),
    )
    .unwrap();
    drop(store);
    drop(rt);
    for args in [&["runs"][..], &["train", cfg.to_str().unwrap()]] {
        let mut full = vec!["--db", db_s];
        full.extend_from_slice(args);
        let err = env.fails(&full);
        assert!(
            err.contains("written by a newer harness") && err.contains("99990101000001"),
            "{args:?}: {err}"
        );
    }
}

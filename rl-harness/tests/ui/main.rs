//! `harness ui`, the run browser, tested as a user meets it: a real store with a finished, a
//! running and a failed run (made by the `harness` binary itself), the binary serving it, and
//! headless Chromium (Debian's package, installed by `scripts/test`) driving the page over the
//! DevTools protocol: the runs table, the filter box (a match and an error), a chart of two runs
//! whose drawn points are counted against the store, the same view reopened from its address,
//! a band over grouped runs, the live table and chart, a config diff, a run's page and a sweep's
//! ranking. Screenshots land in `target/ui-screenshots/` for a person to look at.
//!
//! Without Chromium the browser test fails, unless `HARNESS_SKIP_BROWSER_TESTS` says why it is
//! skipped (`scripts/test` sets it, loudly, when it cannot install Chromium): never a silent pass.

mod cdp;
#[path = "../common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{BANDIT, Env, Tied, wait_for};
use serde_json::{Value, json};

/// A grid over two learning rates, appended to [`BANDIT`]: a sweep of two trials.
const SWEEP_TABLE: &str = r#"
[sweep]
name = "sw"
strategy = "grid"
metric = "val/test_score"

[sweep.grid]
"bandit.lr" = [0.02, 0.2]
"#;

/// `harness ui --port 0` on `env`'s store, and the address it printed.
fn serve(env: &Env) -> (Tied, String) {
    common::spawn_server(env, &["ui", "--port", "0"], "")
}

/// A store with a finished run (1), a failed one (2: its loss turns NaN at step 5) and one that
/// is still running (3, slow steps), as the binary records them.
fn three_runs(env: &Env) -> Tied {
    env.file("bandit.toml", BANDIT);
    env.ok(&["train", "bandit.toml", "trainer.experiment_name=done"]);
    let out = env.run(&[
        "train",
        "bandit.toml",
        "trainer.experiment_name=diverged",
        "bandit.diverge_at_step=5",
    ]);
    assert!(!out.status.success(), "the diverging run should fail");
    let running = Tied::spawn(
        env.tied_cmd()
            .args([
                "train",
                "bandit.toml",
                "trainer.experiment_name=live",
                "trainer.total_training_steps=100000",
                "bandit.step_delay_ms=250",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let (rt, store) = env.store();
    wait_for(
        "the live run's first steps",
        Duration::from_secs(60),
        || {
            rt.block_on(store.series(3, "actor/pg_loss"))
                .is_ok_and(|s| s.len() >= 2)
        },
    );
    running
}

/// `target/ui-screenshots/` (beside this test's executable's profile folder).
fn screenshots() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test>
    exe.ancestors().nth(3).unwrap().join("ui-screenshots")
}

#[test]
fn the_run_browser_in_a_real_browser() {
    let chromium = match cdp::find_chromium() {
        Ok(c) => c,
        Err(why) => match std::env::var("HARNESS_SKIP_BROWSER_TESTS") {
            Ok(reason) => {
                eprintln!("SKIPPED the browser test: {why}; {reason}");
                return;
            }
            Err(_) => panic!(
                "{why}: install Debian's chromium (scripts/test does), or set \
                 HARNESS_SKIP_BROWSER_TESTS to the reason to skip this test"
            ),
        },
    };
    let env = Env::new();
    let _running = three_runs(&env);
    let (ui, url) = serve(&env);
    let shots = screenshots();
    let mut b = cdp::Browser::start(&chromium);

    // the runs table: all three, each with its status
    b.open(&format!("{url}#/"));
    b.wait(
        "three runs in the table",
        "document.querySelectorAll('#runs tbody tr[data-run]').length === 3",
        Duration::from_secs(20),
    );
    let statuses = b.eval(
        "[...document.querySelectorAll('#runs tbody tr[data-run]')].map(r => \
         [Number(r.dataset.run), r.querySelector('.pill').textContent])",
    );
    let mut statuses: Vec<(i64, String)> = serde_json::from_value(statuses).unwrap();
    statuses.sort();
    assert_eq!(
        statuses,
        [
            (1, "finished".into()),
            (2, "failed".into()),
            (3, "running".into())
        ],
    );
    b.screenshot(&shots.join("runs.png"));

    // live: the running run's step count grows without a reload
    let step_of_3 =
        "Number(document.querySelector('#runs tr[data-run=\"3\"] td:nth-child(6)').textContent)";
    let before = b.eval(step_of_3).as_f64().unwrap();
    b.wait(
        "the running run's steps to grow on the page",
        &format!("{step_of_3} > {before}"),
        Duration::from_secs(20),
    );

    // the filter box: the `runs --filter` language, and its errors inline
    b.type_into(
        "#filter",
        "status = 'failed' or trainer.experiment_name = 'done'",
    );
    b.wait(
        "the filter to keep runs 1 and 2",
        "[...document.querySelectorAll('#runs tbody tr[data-run]')].map(r => r.dataset.run).sort().join() === '1,2'",
        Duration::from_secs(10),
    );
    b.type_into("#filter", "statuz = 'failed'");
    b.wait(
        "the filter's error",
        "!document.getElementById('filter-error').hidden",
        Duration::from_secs(10),
    );
    let err = b.eval("document.getElementById('filter-error').textContent");
    assert!(
        err.as_str().unwrap().contains("no run has `statuz`")
            && err.as_str().unwrap().contains("did you mean `status`"),
        "{err}"
    );
    b.screenshot(&shots.join("filter-error.png"));
    b.type_into("#filter", "");
    b.wait(
        "all runs back",
        "document.querySelectorAll('#runs tbody tr[data-run]').length === 3 && document.getElementById('filter-error').hidden",
        Duration::from_secs(10),
    );

    // a chart of two runs: the main metric, then a second one picked from the searchable list
    b.click("#runs input[data-run=\"1\"]");
    b.click("#runs input[data-run=\"2\"]");
    b.wait(
        "the val/test_score chart",
        "window.harnessUi.charts.has('val/test_score')",
        Duration::from_secs(10),
    );
    b.type_into("#key-search", "pg_loss");
    b.click("#key-list input[data-key=\"actor/pg_loss\"]");
    b.wait(
        "the actor/pg_loss chart",
        "window.harnessUi.charts.has('actor/pg_loss') && window.harnessUi.charts.size === 2",
        Duration::from_secs(10),
    );
    let (rt, store) = env.store();
    for key in ["val/test_score", "actor/pg_loss"] {
        let k = serde_json::to_string(key).unwrap();
        let drawn = b.eval(&format!(
            "(() => {{ const u = window.harnessUi.charts.get({k}); \
             return u.runIds.map((run, i) => [run, u.data[i + 1].filter(v => v !== null).length]); }})()"
        ));
        let drawn: Vec<(i64, usize)> = serde_json::from_value(drawn).unwrap();
        let stored: Vec<(i64, usize)> = [1, 2]
            .iter()
            .map(|&run| {
                let s = rt.block_on(store.series(run, key)).unwrap();
                (run, s.iter().filter(|(_, v)| v.is_finite()).count())
            })
            .collect();
        assert_eq!(drawn, stored, "{key}: points drawn per run vs stored");
        assert!(stored.iter().all(|(_, n)| *n > 1), "{key}: {stored:?}");
    }
    b.screenshot(&shots.join("chart.png"));

    // the view is in the address: reopened from it, the same runs and metrics are charted
    let hash = b.eval("location.hash").as_str().unwrap().to_string();
    let chosen = b.eval(
        "(() => { const p = new URLSearchParams(location.hash.split('?')[1]); \
         return [p.get('runs'), p.getAll('metric')]; })()",
    );
    assert_eq!(
        chosen,
        json!(["1,2", ["val/test_score", "actor/pg_loss"]]),
        "{hash}"
    );
    b.open(&format!("{url}{hash}"));
    b.wait(
        "the charts reopened from the address",
        "window.harnessUi.charts.size === 2",
        Duration::from_secs(10),
    );

    // grouped by project, the two runs become one band: max, mean, min
    b.eval(
        "(() => { const g = document.getElementById('group'); g.value = 'project'; \
         g.dispatchEvent(new Event('change')); })()",
    );
    b.wait(
        "the band of the grouped runs",
        "(() => { const u = window.harnessUi.charts.get('val/test_score'); \
         return u && u.series.length === 4 && u.series[2].label.includes('mean of 2'); })()",
        Duration::from_secs(10),
    );
    b.screenshot(&shots.join("band.png"));

    // the config diff of the two: only the keys that differ
    b.click("#compare");
    b.wait(
        "the config diff",
        "document.getElementById('diff')",
        Duration::from_secs(10),
    );
    assert_eq!(
        b.texts("#diff tbody tr td:first-child"),
        ["bandit.diverge_at_step", "trainer.experiment_name"]
    );
    b.screenshot(&shots.join("diff.png"));

    // the failed run's page: why it failed, its config, the command that resumes it
    b.open(&format!("{url}#/run/2"));
    let page = b.eval("document.getElementById('view').innerText");
    let page = page.as_str().unwrap();
    assert!(page.contains("training diverged at step 5"), "{page}");
    let cmd = b.eval("document.getElementById('resume-command').textContent");
    assert!(cmd.as_str().unwrap().ends_with(" resume 2"), "{cmd}");
    assert_eq!(
        b.eval("document.querySelector('details[data-group=\"bandit\"]').open"),
        json!(true),
        "the run's changed group is unfolded"
    );
    b.screenshot(&shots.join("run.png"));

    // a chart of the running run grows while it trains, without a reload
    b.open(&format!("{url}#/?runs=3&metric=actor%2Fpg_loss"));
    let points = "(() => { const u = window.harnessUi.charts.get('actor/pg_loss'); \
                  return u ? u.data[1].filter(v => v !== null).length : 0; })()";
    b.wait(
        "the running run's chart",
        &format!("{points} > 0"),
        Duration::from_secs(10),
    );
    let first = b.eval(points).as_u64().unwrap();
    b.wait(
        "the running run's chart to grow",
        &format!("{points} > {first}"),
        Duration::from_secs(20),
    );

    // a sweep of two trials: its ranking and the parallel-coordinates view
    env.file("sweep.toml", &format!("{BANDIT}{SWEEP_TABLE}"));
    env.ok(&["sweep", "sweep.toml"]);
    b.open(&format!("{url}#/sweep/sw"));
    b.wait(
        "the sweep's ranking",
        "document.querySelectorAll('#ranking tbody tr').length === 2 && document.getElementById('parallel')",
        Duration::from_secs(10),
    );
    let ranked: Vec<f64> = b
        .texts("#ranking tbody tr td:nth-child(5)")
        .iter()
        .map(|t| t.parse().unwrap())
        .collect();
    assert!(ranked[0] >= ranked[1], "ranked best first: {ranked:?}");
    b.screenshot(&shots.join("sweep.png"));
    eprintln!("screenshots in {}", shots.display());
    drop(ui);
}

/// The views answer a request they cannot serve with an error naming what is at fault, and the
/// server holds the store read-only while a run writes it.
#[test]
fn bad_requests_are_named_and_the_store_is_only_read() {
    let env = Env::new();
    env.file("bandit.toml", BANDIT);
    env.ok(&["train", "bandit.toml"]);
    let before = store_bytes(&env);
    let (ui, url) = serve(&env);
    let get = |path: &str| {
        let r = reqwest::blocking::get(format!("{url}{}", path.trim_start_matches('/'))).unwrap();
        (
            r.status().as_u16(),
            r.json::<Value>().unwrap_or(Value::Null),
        )
    };
    for (path, status, says) in [
        ("/api/run/42", 404, "no run 42 in"),
        ("/api/run/x1", 400, "run id `x1` is not a number"),
        (
            "/api/runs?filter=status%20%3D",
            400,
            "expected a value after `status`",
        ),
        (
            "/api/runs?filter=val%2Ftest_scor%20%3E%201",
            400,
            "did you mean `val/test_score`",
        ),
        ("/api/diff?run=1", 400, "at least 2 run"),
        ("/api/series?run=1", 400, "at least one metric"),
        ("/api/sweep/nosuch", 404, "no sweep \"nosuch\""),
        ("/api/nope", 404, "no view /api/nope"),
    ] {
        let (got, body) = get(path);
        let msg = body["error"].as_str().unwrap_or_default().to_string();
        assert!(got == status && msg.contains(says), "{path}: {got} {body}");
    }
    let post = reqwest::blocking::Client::new()
        .post(format!("{url}api/runs"))
        .send()
        .unwrap();
    assert_eq!(post.status().as_u16(), 405);
    let (ok, body) = get("/api/runs");
    assert_eq!((ok, body["runs"].as_array().map(Vec::len)), (200, Some(1)));
    // the database file is open read-only (SQLite opens the -wal file read-write for any
    // connection, so that one is checked by its bytes below)
    let pid = ui.child.id();
    let mut held = 0;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if target.to_string_lossy().ends_with("harness.db") {
            let fd = fd.file_name().to_string_lossy().into_owned();
            let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap();
            let flags = u32::from_str_radix(flags.trim(), 8).unwrap();
            assert_eq!(
                flags & 0o3,
                0,
                "the store is open for writing (flags {flags:o})"
            );
            held += 1;
        }
    }
    assert!(held > 0, "the server holds no file of the store");
    drop(ui);
    assert_eq!(
        store_bytes(&env),
        before,
        "serving changed the store's files"
    );
}

/// The bytes of the store's database and WAL files.
fn store_bytes(env: &Env) -> Vec<Vec<u8>> {
    let db = env.db();
    ["", "-wal"]
        .iter()
        .map(|ext| std::fs::read(format!("{}{ext}", db.display())).unwrap_or_default())
        .collect()
}

/// A missing store and a taken port are errors naming them, before anything is served.
#[test]
fn a_missing_store_or_a_taken_port_is_named() {
    let env = Env::new();
    let err = env.fails(&["ui", "--db", "nowhere/harness.db", "--port", "0"]);
    assert!(err.contains("no run store at nowhere/harness.db"), "{err}");
    env.file("bandit.toml", BANDIT);
    env.ok(&["train", "bandit.toml", "trainer.total_training_steps=2"]);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let err = env.fails(&["ui", "--port", &port]);
    assert!(
        err.contains(&format!("cannot listen on 127.0.0.1:{port}")) && err.contains("--port"),
        "{err}"
    );
}

//! verl users' own reward files, run unchanged by a pool of real Python workers (the
//! interpreter of `.venv-reward`, which `scripts/reward-env` installs with math-verify), an
//! OpenRLHF-style remote scorer served by a real Python HTTP server, and the bridge's
//! math-verify and geo3k scorers against verl's own scorers called directly in Python (every row
//! of `tests/fixtures/reward_bridge/table.json`, see its README). One binary: one link.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rl_data::reward::python::{OnError, PoolSettings, PythonFunction, PythonPool};
use rl_data::reward::{CustomRewardFunction, RewardConfig, RewardRegistry, ScoreRow};
use serde_json::{Map, Value, json};

/// `.venv-reward/bin/python`; a clear failure when `scripts/reward-env` has not been run.
fn python() -> String {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-reward/bin/python");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/reward-env first (scripts/test does)",
        bin.display()
    );
    bin.to_string_lossy().into_owned()
}

fn settings(workers: usize, timeout_s: f64, on_error: OnError) -> PoolSettings {
    PoolSettings {
        python: python(),
        workers,
        timeout_s,
        on_error,
    }
}

/// A reward file in a fresh folder (kept alive by the returned guard).
fn reward_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("my_reward.py");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

fn pool(path: &Path, settings: PoolSettings) -> rl_data::Result<PythonPool> {
    PythonPool::start(
        PythonFunction::file(path, "compute_score", Map::new()),
        settings,
    )
}

struct Rows {
    sources: Vec<String>,
    responses: Vec<String>,
    truths: Vec<Value>,
    extras: Vec<Value>,
}

impl Rows {
    fn new(items: &[(&str, &str, Value)]) -> Self {
        Self {
            sources: items.iter().map(|i| i.0.to_string()).collect(),
            responses: items.iter().map(|i| i.1.to_string()).collect(),
            truths: items.iter().map(|i| i.2.clone()).collect(),
            extras: items
                .iter()
                .enumerate()
                .map(|(k, _)| json!({"index": k}))
                .collect(),
        }
    }
    fn rows(&self) -> Vec<ScoreRow<'_>> {
        (0..self.sources.len())
            .map(|i| ScoreRow {
                data_source: &self.sources[i],
                prompt: "What is it? ",
                response: &self.responses[i],
                ground_truth: &self.truths[i],
                extra_info: &self.extras[i],
            })
            .collect()
    }
}

/// A verl-style reward file: math-verify from PyPI, a dict return with extra keys, verl's four
/// keyword arguments and `reward_kwargs`, and a print (which must not disturb the protocol).
const MATH_VERIFY_FILE: &str = r#"
from math_verify import parse, verify

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    print("scoring", extra_info["index"], data_source)
    ok = verify(parse("$" + ground_truth + "$"), parse(solution_str))
    return {"score": (1.0 if ok else 0.0) + bonus, "acc": bool(ok), "index": extra_info["index"]}
"#;

#[test]
fn a_verl_reward_file_importing_a_pypi_package_scores_every_row_of_a_batch() {
    let (_dir, path) = reward_file(MATH_VERIFY_FILE);
    let custom = CustomRewardFunction {
        path: Some(path),
        reward_kwargs: serde_json::from_value(json!({"bonus": 0.5})).unwrap(),
        ..CustomRewardFunction::default()
    };
    let cfg = RewardConfig {
        python: python(),
        workers: 2,
        ..RewardConfig::default()
    };
    let registry = RewardRegistry::build(&cfg, &custom).unwrap();
    // the file scores every row, whatever its data_source (verl's custom_reward_function)
    let items: Vec<(&str, &str, Value)> = (0..40)
        .map(|i| match i % 4 {
            0 => ("arithmetic", "The answer is $\\frac{1}{2}$", json!("0.5")),
            1 => ("no/such/source", "so x = 3", json!("4")),
            2 => ("openai/gsm8k", "$\\sqrt{4}$", json!("2")),
            _ => ("anything", "I do not know", json!("7")),
        })
        .collect();
    let rows = Rows::new(&items);
    let out = registry.score_batch(&rows.rows()).unwrap();
    assert_eq!(out.len(), 40);
    for (i, o) in out.iter().enumerate() {
        let right = i % 4 == 0 || i % 4 == 2;
        assert_eq!(o.score, if right { 1.5 } else { 0.5 }, "row {i}: {o:?}");
        assert_eq!(o.extra["acc"], json!(right), "row {i}");
        // the extra keys come back in order: no row was answered for another
        assert_eq!(o.extra["index"], json!(i), "row {i}");
    }
}

/// Sleeps 20 ms per row and appends its pid to a file, so the test can kill a busy worker.
const SLOW_FILE: &str = r#"
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(__file__), "scored.txt"), "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.02)
    return float(len(solution_str))
"#;

#[test]
fn a_worker_killed_mid_batch_is_restarted_and_the_batch_completes() {
    let (dir, path) = reward_file(SLOW_FILE);
    let pool = pool(&path, settings(2, 30.0, OnError::Raise)).unwrap();
    let before = pool.worker_pids();
    assert_eq!(before.len(), 2);
    let items: Vec<(&str, String, Value)> = (0..120)
        .map(|i| ("src", "x".repeat(i % 7 + 1), Value::Null))
        .collect();
    let items: Vec<(&str, &str, Value)> = items
        .iter()
        .map(|(a, b, c)| (*a, b.as_str(), c.clone()))
        .collect();
    let rows = Rows::new(&items);
    let scored = dir.path().join("scored.txt");
    let victim = before[0];
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            // once the victim has scored a few rows, kill it mid-batch
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let text = std::fs::read_to_string(&scored).unwrap_or_default();
                if text.lines().filter(|l| *l == victim.to_string()).count() >= 5 {
                    break;
                }
                assert!(Instant::now() < deadline, "the victim never scored");
                std::thread::sleep(Duration::from_millis(5));
            }
            let st = Command::new("kill")
                .args(["-9", &victim.to_string()])
                .status()
                .unwrap();
            assert!(st.success());
        });
        pool.score_rows(&rows.rows())
    })
    .unwrap();
    assert_eq!(out.len(), 120);
    for (i, o) in out.iter().enumerate() {
        assert_eq!(o.score, (i % 7 + 1) as f64, "row {i}");
    }
    assert!(pool.restarts() >= 1, "the killed worker was not restarted");
    let after = pool.worker_pids();
    assert_eq!(after.len(), 2);
    assert!(!after.contains(&victim), "{after:?} still lists {victim}");
    // the pool keeps working on the next batch
    assert_eq!(pool.score_rows(&rows.rows()[..3]).unwrap()[2].score, 3.0);
}

const RAISING_FILE: &str = r#"
def helper(x):
    return 1 / x

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        return helper(0)
    return 1.0
"#;

#[test]
fn a_raising_function_fails_the_batch_naming_the_row_or_scores_zero_with_its_traceback() {
    let (_dir, path) = reward_file(RAISING_FILE);
    let items = [
        ("a", "fine", Value::Null),
        ("b/src", "boom", Value::Null),
        ("c", "fine", Value::Null),
    ];
    let rows = Rows::new(&items);

    let raise = pool(&path, settings(1, 30.0, OnError::Raise)).unwrap();
    let e = raise.score_rows(&rows.rows()).unwrap_err().to_string();
    for needle in [
        "compute_score",
        "my_reward.py",
        "row 1",
        "data_source `b/src`",
        "ZeroDivisionError",
        "in helper",
        "reward.on_error",
    ] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }

    let zero = pool(&path, settings(2, 30.0, OnError::Zero)).unwrap();
    let out = zero.score_rows(&rows.rows()).unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        [1.0, 0.0, 1.0]
    );
    let why = out[1].extra["reward_error"].as_str().unwrap();
    assert!(
        why.contains("ZeroDivisionError") && why.contains("in helper"),
        "{why}"
    );
    assert!(!out[0].extra.contains_key("reward_error"));
}

const HANGING_FILE: &str = r#"
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    return 2.0
"#;

#[test]
fn a_hanging_scorer_is_cut_off_by_the_timeout() {
    let (_dir, path) = reward_file(HANGING_FILE);
    let items = [
        ("a", "ok", Value::Null),
        ("b", "hang", Value::Null),
        ("c", "ok", Value::Null),
        ("d", "ok", Value::Null),
    ];
    let rows = Rows::new(&items);
    let zero = pool(&path, settings(1, 1.0, OnError::Zero)).unwrap();
    let t = Instant::now();
    let out = zero.score_rows(&rows.rows()).unwrap();
    // an hour-long call cut off: generous bound, only proving the cut
    assert!(t.elapsed() < Duration::from_secs(120), "{:?}", t.elapsed());
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        [2.0, 0.0, 2.0, 2.0]
    );
    let why = out[1].extra["reward_error"].as_str().unwrap();
    assert!(
        why.contains("timed out") && why.contains("reward.timeout_s = 1"),
        "{why}"
    );
    assert_eq!(zero.restarts(), 1);

    let raise = pool(&path, settings(1, 1.0, OnError::Raise)).unwrap();
    let e = raise.score_rows(&rows.rows()).unwrap_err().to_string();
    assert!(e.contains("row 1") && e.contains("timed out"), "{e}");
}

#[test]
fn returns_that_are_not_scores_are_named_errors() {
    let (_dir, path) = reward_file(
        r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {
        "text": "abc",
        "nan": float("nan"),
        "nodict": {"acc": 1},
        "strdict": {"score": "high"},
        "list": [1.0],
        "none": None,
        "int": 3,
        "bool": True,
    }[solution_str]
"#,
    );
    let p = pool(&path, settings(1, 30.0, OnError::Zero)).unwrap();
    let items: Vec<(&str, &str, Value)> = [
        "text", "nan", "nodict", "strdict", "list", "none", "int", "bool",
    ]
    .iter()
    .map(|s| ("src", *s, Value::Null))
    .collect();
    let rows = Rows::new(&items);
    let out = p.score_rows(&rows.rows()).unwrap();
    let why = |i: usize| out[i].extra["reward_error"].as_str().unwrap().to_string();
    assert!(why(0).contains("returned str 'abc'"), "{}", why(0));
    assert!(
        why(1).contains("\"nan\", not a finite number"),
        "{}",
        why(1)
    );
    assert!(
        why(2).contains("without a `score` key (keys: acc)"),
        "{}",
        why(2)
    );
    assert!(why(3).contains("`score` is \"high\""), "{}", why(3));
    assert!(why(4).contains("returned list [1.0]"), "{}", why(4));
    assert!(why(5).contains("returned NoneType None"), "{}", why(5));
    assert_eq!(out[6].score, 3.0);
    assert_eq!(out[7].score, 1.0);
    assert!(!out[6].extra.contains_key("reward_error"));
}

#[test]
fn files_functions_and_interpreters_that_cannot_start_are_named_before_any_row() {
    let (dir, path) = reward_file(
        "import math\nTHRESHOLD = 3\ndef other(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n",
    );
    // a missing function, naming the file and what is there
    let e = pool(&path, settings(1, 30.0, OnError::Raise))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`compute_score`")
            && e.contains("my_reward.py")
            && e.contains("callables there: other"),
        "{e}"
    );
    // a name that is not a function
    let e = PythonPool::start(
        PythonFunction::file(&path, "THRESHOLD", Map::new()),
        settings(1, 30.0, OnError::Raise),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("is a int, not a function"), "{e}");
    // a missing file
    let missing = dir.path().join("nope.py");
    let e = pool(&missing, settings(1, 30.0, OnError::Raise))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.py") && e.contains("no such file"), "{e}");
    // a file that does not import
    let (_d2, broken) = reward_file("import no_such_package_here\n");
    let e = pool(&broken, settings(1, 30.0, OnError::Raise))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot be loaded") && e.contains("No module named 'no_such_package_here'"),
        "{e}"
    );
    let (_d3, syntax) = reward_file("def compute_score(:\n");
    let e = pool(&syntax, settings(1, 30.0, OnError::Raise))
        .unwrap_err()
        .to_string();
    assert!(e.contains("SyntaxError"), "{e}");
    // an interpreter that does not exist, and one that is not Python
    let (_d4, good) = reward_file(RAISING_FILE);
    let mut s = settings(1, 30.0, OnError::Raise);
    s.python = "/no/such/python3".into();
    let e = pool(&good, s).unwrap_err().to_string();
    assert!(
        e.contains("config `reward.python`") && e.contains("/no/such/python3"),
        "{e}"
    );
    let mut s = settings(1, 30.0, OnError::Raise);
    s.python = "false".into();
    let e = pool(&good, s).unwrap_err().to_string();
    assert!(e.contains("exited before it was ready"), "{e}");
    // and the registry names custom_reward_function's file the same way
    let custom = CustomRewardFunction {
        path: Some(missing),
        ..CustomRewardFunction::default()
    };
    let cfg = RewardConfig {
        python: python(),
        ..RewardConfig::default()
    };
    let e = RewardRegistry::build(&cfg, &custom)
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.py"), "{e}");
}

/// A real HTTP scorer: Python's http.server, scoring `len(response) == len(label)`, answering
/// a 500 with its own text when a label is "explode", and printing its port.
const SERVER: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "explode" in body["labels"]:
            out, code = b"scorer exploded: cannot grade label 'explode'", 500
        else:
            assert all(q == p + r for q, p, r in zip(body["query"], body["prompts"], body["responses"]))
            rewards = [float(len(r) == len(l)) + 0.5 * (s == "bonus") for r, l, s in
                       zip(body["responses"], body["labels"], body["data_sources"])]
            out, code = json.dumps({"rewards": rewards, "batch": len(rewards)}).encode(), 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

s = HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_remote_scorer_scores_batches_and_its_http_errors_carry_its_text() {
    let mut child = Command::new(python())
        .args(["-c", SERVER])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _server = Server(child);
    let url = format!("http://127.0.0.1:{}/get_reward", line.trim());
    let cfg = RewardConfig {
        remote_url: Some(url.clone()),
        remote_batch_size: 3,
        ..RewardConfig::default()
    };
    let registry = RewardRegistry::build(&cfg, &CustomRewardFunction::default()).unwrap();
    let items: Vec<(&str, &str, Value)> = (0..8)
        .map(|i| {
            (
                if i == 5 { "bonus" } else { "any" },
                if i % 2 == 0 { "abc" } else { "ab" },
                json!("xyz"),
            )
        })
        .collect();
    let rows = Rows::new(&items);
    let out = registry.score_batch(&rows.rows()).unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        [1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 1.0, 0.0]
    );
    let bad = Rows::new(&[("any", "a", json!("explode"))]);
    let e = registry.score_batch(&bad.rows()).unwrap_err().to_string();
    assert!(
        e.contains(&url)
            && e.contains("500")
            && e.contains("scorer exploded: cannot grade label 'explode'"),
        "{e}"
    );
    // a URL nobody serves: named, after its retries
    let cfg = RewardConfig {
        remote_url: Some("http://127.0.0.1:9/get_reward".into()),
        remote_timeout_s: 2.0,
        ..RewardConfig::default()
    };
    let down = RewardRegistry::build(&cfg, &CustomRewardFunction::default()).unwrap();
    let e = down.score_batch(&bad.rows()).unwrap_err().to_string();
    assert!(
        e.contains("127.0.0.1:9") && e.contains("no answer after 3 tries"),
        "{e}"
    );
    // and both kinds of reward at once is refused, naming the keys
    let cfg = RewardConfig {
        remote_url: Some(url),
        ..RewardConfig::default()
    };
    let custom = CustomRewardFunction {
        path: Some("reward.py".into()),
        ..CustomRewardFunction::default()
    };
    let e = RewardRegistry::build(&cfg, &custom)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("reward.remote_url") && e.contains("custom_reward_function.path"),
        "{e}"
    );
}

#[test]
fn math_verify_geo3k_and_prime_math_through_the_bridge_agree_with_verl_called_directly() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reward_bridge/table.json");
    let table: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rows = table["rows"].as_array().unwrap();
    let n_math = rows.iter().filter(|r| r["fn"] == "math_verify").count();
    assert!(n_math >= 50, "only {n_math} math-verify rows");
    let n_prime = rows.iter().filter(|r| r["fn"] == "prime_math").count();
    assert!(n_prime >= 50, "only {n_prime} prime_math rows");
    // geo3k is verl's data source hiyouga/geometry3k and prime_math its numina_* sources (the
    // fixture names which one verl's default_compute_score was called with); math_verify is
    // named in config, as verl dispatches no data source to it
    let cfg: RewardConfig = toml::from_str(&format!(
        "python = {:?}\nworkers = 2\n[sources.math_verify]\nname = \"math_verify\"\n",
        python()
    ))
    .unwrap();
    let registry = RewardRegistry::with_config(&cfg).unwrap();
    let null = Value::Null;
    let batch: Vec<ScoreRow<'_>> = rows
        .iter()
        .map(|r| ScoreRow {
            data_source: match r["fn"].as_str().unwrap() {
                "geo3k" => "hiyouga/geometry3k",
                "prime_math" => r["data_source"].as_str().unwrap(),
                _ => "math_verify",
            },
            prompt: "",
            response: r["response"].as_str().unwrap(),
            ground_truth: &r["ground_truth"],
            extra_info: &null,
        })
        .collect();
    let out = registry.score_batch(&batch).unwrap();
    let mismatches: Vec<String> = rows
        .iter()
        .zip(&out)
        .filter(|(r, o)| (r["score"].as_f64().unwrap() - o.score).abs() > 1e-12)
        .map(|(r, o)| {
            format!(
                "{} {:?} gt={}: verl {}, bridge {}",
                r["fn"], r["response"], r["ground_truth"], r["score"], o.score
            )
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {} rows differ:\n{}",
        mismatches.len(),
        rows.len(),
        mismatches.join("\n")
    );
    // both outcomes occur, so agreement is not trivial
    assert!(out.iter().any(|o| o.score == 1.0) && out.iter().any(|o| o.score == 0.0));
}

#[test]
fn a_bridged_scorer_without_its_package_says_which_package_to_install() {
    // the system interpreter, not the reward venv: it lacks mathruler
    let has = std::process::Command::new("python3")
        .args(["-c", "import mathruler"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has {
        eprintln!("skipped: the system python3 has mathruler");
        return;
    }
    let cfg = RewardConfig {
        python: "python3".into(),
        workers: 1,
        ..RewardConfig::default()
    };
    let registry = RewardRegistry::with_config(&cfg).unwrap();
    let gt = Value::String("3".into());
    let e = registry
        .score("hiyouga/geometry3k", "\\boxed{3}", &gt, &Value::Null)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mathruler") && e.contains("reward.python") && e.contains("No module named"),
        "{e}"
    );
}

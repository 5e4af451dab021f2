//! The reward bridge's math-verify and geo3k scorers (run by the Python worker pool with the
//! interpreter `scripts/reward-env` installs) agree with verl's own scorers called directly in
//! Python on every row of `tests/fixtures/reward_bridge/table.json` (see its README).

use std::path::Path;

use rl_data::reward::{RewardConfig, RewardRegistry, ScoreRow};
use serde_json::Value;

fn python() -> String {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-reward/bin/python");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/reward-env first (scripts/test does)",
        bin.display()
    );
    bin.to_string_lossy().into_owned()
}

#[test]
fn math_verify_and_geo3k_through_the_bridge_agree_with_verl_called_directly() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reward_bridge/table.json");
    let table: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rows = table["rows"].as_array().unwrap();
    let n_math = rows.iter().filter(|r| r["fn"] == "math_verify").count();
    assert!(n_math >= 50, "only {n_math} math-verify rows");
    // geo3k is verl's data source hiyouga/geometry3k; math_verify is named in config, as verl
    // dispatches no data source to it
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
            data_source: if r["fn"] == "geo3k" {
                "hiyouga/geometry3k"
            } else {
                "math_verify"
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

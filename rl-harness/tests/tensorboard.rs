//! TensorBoard event files (issue 19): verl's `trainer.logger = ["console", "tensorboard"]`
//! writes each step's metrics as scalar summaries, read back here with TensorBoard's own
//! `EventAccumulator` (from PyPI, installed by `scripts/mlflow-env` into `.venv-mlflow/`): every
//! metric the store holds, at its step, as a float32; after a resume from an earlier checkpoint
//! TensorBoard shows each step once, with the resumed run's values.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{BANDIT, Env};

/// TensorBoard's reading of `dir`: tag -> [(step, value as the float32 it stores)].
fn read_back(dir: &Path) -> BTreeMap<String, Vec<(i64, f32)>> {
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let out = std::process::Command::new(common::venv_bin("python"))
        .args(["-c", script])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: BTreeMap<String, Vec<(i64, f64)>> = serde_json::from_slice(&out.stdout).unwrap();
    read.into_iter()
        .map(|(k, v)| (k, v.into_iter().map(|(s, x)| (s, x as f32)).collect()))
        .collect()
}

#[test]
fn tensorboard_reads_every_metric_the_store_holds_and_a_resume_replaces_the_later_steps() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&[
        "train",
        cfg.to_str().unwrap(),
        "trainer.logger=['console','tensorboard']",
    ]);
    let (rt, store) = env.store();
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    let dir = Path::new(&run.run_dir).join("tensorboard");
    let expected = |rt: &tokio::runtime::Runtime| {
        let mut m: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
        for (step, key, value, _) in rt.block_on(store.all_metrics(1)).unwrap() {
            m.entry(key).or_default().push((step, value as f32));
        }
        m
    };
    let first = expected(&rt);
    assert!(
        first.len() > 5 && first["actor/pg_loss"].len() == 20,
        "{first:?}"
    );
    let board = read_back(&dir);
    assert_eq!(board, first);
    // a resume from step 10 appends a second file; TensorBoard drops the first file's steps
    // 11.. and shows the resumed values (bit-equal here, the run being deterministic)
    env.ok(&["resume", "1", "--from-step", "10"]);
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, 2);
    assert_eq!(read_back(&dir), expected(&rt));
}

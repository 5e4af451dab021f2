//! `trainer.stop_when`: a run ends at the first validation that meets the condition, as a
//! finished run with a checkpoint of that step and an event saying why; a condition over a
//! metric the validation does not log fails the run naming it; a malformed one is refused
//! before training. On the harness's own bandit trainer (CPU, seconds).

mod common;

use common::{BANDIT, Env};

#[test]
fn a_met_condition_ends_the_run_as_finished_at_that_validation() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    // the reference: all 20 steps, validated every 5
    env.ok(&["train", cfg, "trainer.experiment_name=full"]);
    let (rt, store) = env.store();
    let full = rt.block_on(store.resolve_run("full")).unwrap();
    let scores: Vec<(i64, f64)> = rt
        .block_on(store.all_metrics(full.id))
        .unwrap()
        .into_iter()
        .filter(|(_, k, _, _)| k == "val/test_score")
        .map(|(s, _, v, _)| (s, v))
        .collect();
    // a bar the run first meets at a validation after step 0 and before the last step
    let (stop_step, bar) = scores
        .iter()
        .find(|(s, v)| *s > 0 && *s < 20 && scores.iter().all(|(s2, v2)| *s2 >= *s || v2 < v))
        .copied()
        .expect("the bandit's validation score rises before the last step");
    let out = env.ok(&[
        "train",
        cfg,
        "trainer.experiment_name=early",
        &format!("trainer.stop_when=val/test_score >= {bar}"),
    ]);
    assert!(out.contains("finished"), "{out}");
    let early = rt.block_on(store.resolve_run("early")).unwrap();
    assert_eq!(early.status, "finished");
    let steps: Vec<i64> = rt
        .block_on(store.all_metrics(early.id))
        .unwrap()
        .into_iter()
        .map(|(s, _, _, _)| s)
        .collect();
    assert_eq!(
        steps.iter().max(),
        Some(&stop_step),
        "no step after the stop"
    );
    let ckpts = rt.block_on(store.checkpoints(early.id)).unwrap();
    assert_eq!(ckpts.last().map(|c| c.step), Some(stop_step), "{ckpts:?}");
    let events = rt.block_on(store.events(early.id)).unwrap();
    let said = events
        .iter()
        .find(|e| e.kind == "stop_when")
        .unwrap_or_else(|| panic!("no stop_when event: {events:?}"));
    assert!(
        said.message
            .contains(&format!("stopped after step {stop_step} of 20"))
            && said.message.contains("val/test_score = "),
        "{}",
        said.message
    );
    // a bar never met trains every step
    env.ok(&[
        "train",
        cfg,
        "trainer.experiment_name=never",
        "trainer.stop_when=val/test_score > 2",
    ]);
    let never = rt.block_on(store.resolve_run("never")).unwrap();
    assert_eq!(
        rt.block_on(store.checkpoints(never.id))
            .unwrap()
            .last()
            .map(|c| c.step),
        Some(20)
    );
}

#[test]
fn a_bad_condition_is_refused_naming_the_key_and_the_problem() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    // not a validation metric: refused before training
    let err = env.fails(&["train", cfg, "trainer.stop_when=actor/lr < 1"]);
    assert!(
        err.contains("trainer.stop_when") && err.contains("`actor/lr`"),
        "{err}"
    );
    // malformed
    let err = env.fails(&["train", cfg, "trainer.stop_when=val/test_score <"]);
    assert!(err.contains("trainer.stop_when"), "{err}");
    // no validation to check it at
    let err = env.fails(&[
        "train",
        cfg,
        "trainer.stop_when=val/test_score > 0.5",
        "trainer.test_freq=0",
    ]);
    assert!(err.contains("trainer.test_freq"), "{err}");
    // a validation metric the trainer does not log: the run fails naming it and what it logs
    let err = env.fails(&["train", cfg, "trainer.stop_when=val/loss < 0.5"]);
    assert!(
        err.contains("`val/loss`") && err.contains("`val/test_score`"),
        "{err}"
    );
}

//! The command line end to end on the bandit trainer: help everywhere, one-line errors,
//! `config show` layering, train → runs (with filters) → show → compare (tables, config diffs,
//! SVG and PNG plots) → export, concurrent writers on one store, the bandit experiment files, and
//! output to readers that went away (closed pipes) or cannot take it (a full disk).

mod common;

use std::process::Stdio;

use common::{BANDIT, Env};

#[test]
fn every_command_has_help() {
    let env = Env::new();
    for args in [
        vec!["--help"],
        vec!["train", "--help"],
        vec!["eval", "--help"],
        vec!["resume", "--help"],
        vec!["sweep", "--help"],
        vec!["runs", "--help"],
        vec!["show", "--help"],
        vec!["compare", "--help"],
        vec!["export", "--help"],
        vec!["sync", "--help"],
        vec!["plan", "--help"],
        vec!["config", "show", "--help"],
        vec!["config", "from-verl", "--help"],
        vec!["data", "--help"],
        vec!["data", "arithmetic", "--help"],
        vec!["data", "gsm8k", "--help"],
        vec!["data", "countdown", "--help"],
        vec!["data", "word-problems", "--help"],
        vec!["model", "import-gguf", "--help"],
    ] {
        let out = env.ok(&args);
        assert!(out.contains("Usage:"), "{args:?}: {out}");
    }
}

/// `harness plan` estimates from config.json alone (the model folder holds no weights), with
/// the overrides `harness train` takes, and for the Qwen2.5 shapes by name; other trainers are
/// refused in one line.
#[test]
fn plan_estimates_memory_from_config_json_alone() {
    let env = Env::new();
    std::fs::create_dir_all(env.path().join("model")).unwrap();
    env.file(
        "model/config.json",
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}"#,
    );
    let cfg = env.file(
        "grpo.toml",
        r#"
[trainer]
algorithm = "on_policy"
[algorithm]
adv_estimator = "grpo"
[data]
train_batch_size = 8
max_prompt_length = 16
[actor_rollout_ref.model]
path = "model"
[actor_rollout_ref.actor]
ppo_mini_batch_size = 8
use_kl_loss = true
[actor_rollout_ref.rollout]
n = 4
response_length = 8
"#,
    );
    let cfg = cfg.to_str().unwrap();
    // 2 layers x (32x32 + 2 x 32x16 + 32x32 + 3 x 32x64 + 2 x 32) + 2 x 128x32 + 32
    let full = env.ok(&["plan", cfg]);
    assert!(
        full.contains("parameters 26,784 total, 26,784 trainable"),
        "{full}"
    );
    assert!(full.contains("a frozen copy"), "{full}");
    assert!(full.contains("peak estimate"), "{full}");
    // LoRA r=4 on all 7 linear layers of both layers: 4 x (in + out) each
    let lora = env.ok(&["plan", cfg, "actor_rollout_ref.model.lora_rank=4"]);
    // (2 x 4 x (64 + 2 x 48 + 64 + 3 x 96) = 4,096; the total counts them too)
    assert!(
        lora.contains("parameters 30,880 total, 4,096 trainable"),
        "{lora}"
    );
    assert!(lora.contains("adapters off"), "{lora}");
    let big = env.ok(&["plan", cfg, "--model-size", "7b"]);
    assert!(big.contains("7,615,616,512 total"), "{big}");
    let err = env.fails(&["plan", cfg, "trainer.algorithm=sft"]);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("on-policy"), "{err}");
}

#[test]
fn failures_exit_non_zero_with_a_one_line_cause() {
    let env = Env::new();
    let bad = env.file("bad.toml", "[trainer]\ntotal_trainig_steps = 3\n");
    let err = env.fails(&["train", bad.to_str().unwrap()]);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("unknown config key `trainer.total_trainig_steps`"),
        "{err}"
    );
    assert!(
        err.contains("did you mean `trainer.total_training_steps`"),
        "{err}"
    );
    let cfg = env.file("exp.toml", BANDIT);
    let err = env.fails(&[
        "config",
        "show",
        cfg.to_str().unwrap(),
        "trainer.save_freq=often",
    ]);
    assert!(
        err.contains("trainer.save_freq") && err.contains("expected"),
        "{err}"
    );
    let err = env.fails(&["train", "missing.toml"]);
    assert!(err.contains("missing.toml"), "{err}");
    let err = env.fails(&["show", "1"]);
    assert!(err.contains("no run store"), "{err}");
    let err = env.fails(&["runs", "--filter", "a = "]);
    assert!(err.contains("filter"), "{err}");
    assert!(!err.contains("panicked"));
}

#[test]
fn config_show_applies_file_env_and_overrides_in_order() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let out = env
        .cmd()
        .args(["config", "show", cfg.to_str().unwrap(), "trainer.seed=11"])
        .env("RL_TRAINER__SAVE_FREQ", "3")
        .env("RL_TRAINER__SEED", "99")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let shown: toml::Table = toml::from_str(&text).unwrap();
    let trainer = shown["trainer"].as_table().unwrap();
    assert_eq!(trainer["save_freq"].as_integer(), Some(3), "env over file");
    assert_eq!(trainer["seed"].as_integer(), Some(11), "override over env");
    assert_eq!(
        trainer["total_training_steps"].as_integer(),
        Some(20),
        "file over default"
    );
    assert_eq!(
        shown["algorithm"]["adv_estimator"].as_str(),
        Some("gae"),
        "default"
    );
}

#[test]
fn train_then_list_filter_show_compare_plot_and_export() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    env.ok(&[
        "train",
        cfg,
        "trainer.experiment_name=low",
        "bandit.lr=0.01",
    ]);
    env.ok(&[
        "train",
        cfg,
        "trainer.experiment_name=high",
        "bandit.lr=0.1",
        "algorithm.adv_estimator=grpo",
    ]);
    let runs = env.ok(&["runs"]);
    assert!(
        runs.contains("low") && runs.contains("high") && runs.contains("finished"),
        "{runs}"
    );
    let filtered = env.ok(&[
        "runs",
        "--filter",
        "algorithm.adv_estimator = 'grpo' and val/test_score >= 0",
    ]);
    assert!(
        filtered.contains("high") && !filtered.contains("low"),
        "{filtered}"
    );
    let filtered = env.ok(&["runs", "--filter", "bandit.lr < 0.05 or status = 'failed'"]);
    assert!(
        filtered.contains("low") && !filtered.contains("high"),
        "{filtered}"
    );

    let show = env.ok(&["show", "high"]);
    for want in [
        "status      finished",
        "val/test_score",
        "global_step_20",
        "lr = 0.1",
        "git ",
    ] {
        assert!(show.contains(want), "show lacks {want:?}:\n{show}");
    }

    let cmp = env.ok(&[
        "compare",
        "1",
        "2",
        "--metric",
        "val/test_score",
        "--metric",
        "actor/pg_loss",
        "--at-step",
        "10",
        "--plot",
        "curves.svg",
        "--smooth",
        "0.5",
    ]);
    assert!(cmp.contains("val/test_score: last / best@step"), "{cmp}");
    assert!(cmp.contains("bandit.lr: 1=0.01  2=0.1"), "{cmp}");
    assert!(cmp.contains("algorithm.adv_estimator"), "{cmp}");
    assert!(
        !cmp.contains("trainer.seed"),
        "identical keys are not differences: {cmp}"
    );
    let svg = std::fs::read_to_string(env.path().join("curves.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("val/test_score") && svg.contains("polyline"),
        "{}",
        &svg[..200.min(svg.len())]
    );
    // the smoothing is labelled, and the sparse validation series carries markers
    assert!(svg.contains("(smoothed, weight 0.5)"), "no smoothing label");
    assert!(
        svg.contains("<circle"),
        "no markers on the validation points"
    );
    env.ok(&[
        "compare",
        "1",
        "2",
        "--metric",
        "critic/score/mean",
        "--plot",
        "curves.png",
    ]);
    let png = std::fs::read(env.path().join("curves.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 5_000);

    let csv = env.ok(&["export", "1", "--format", "csv"]);
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("run_id,step,key,value,wall_time"));
    let (rt, store) = env.store();
    let n = rt.block_on(store.all_metrics(1)).unwrap().len();
    assert_eq!(lines.count(), n);
    env.ok(&["export", "2", "--format", "jsonl", "--out", "m.jsonl"]);
    let jsonl = std::fs::read_to_string(env.path().join("m.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 21, "steps 0..=20");
    assert!(rows[20]["metrics"]["val/test_score"].is_number());
    // The bandit learns: the final greedy score beats the first.
    assert!(
        rows[20]["metrics"]["val/test_score"].as_f64()
            > rows[0]["metrics"]["val/test_score"].as_f64()
    );
}

#[test]
fn two_processes_write_one_store_at_once_without_locking_errors_or_lost_metrics() {
    let env = Env::new();
    let cfg = env.file(
        "exp.toml",
        &BANDIT.replace("total_training_steps = 20", "total_training_steps = 300"),
    );
    let cfg = cfg.to_str().unwrap();
    // Both start on a store that does not exist yet: the migrations race too.
    let children: Vec<_> = (0..2)
        .map(|i| {
            env.spawn(&[
                "train",
                cfg,
                &format!("trainer.experiment_name=w{i}"),
                "trainer.save_freq=50",
            ])
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(!err.contains("locked"), "{err}");
    }
    let (rt, store) = env.store();
    let runs = rt.block_on(store.runs(None)).unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        let m = rt.block_on(store.all_metrics(r.id)).unwrap();
        // 300 steps x 8 training metrics + timing, plus validation at 0, 5, 10, ..., 300.
        let steps: std::collections::BTreeSet<i64> = m.iter().map(|x| x.0).collect();
        assert_eq!(steps.len(), 301, "run {}", r.id);
        assert_eq!(m.iter().filter(|x| x.1 == "actor/pg_loss").count(), 300);
        assert_eq!(m.iter().filter(|x| x.1 == "val/test_score").count(), 61);
    }
}

#[test]
fn the_bandit_experiment_trains_and_plots_its_learning_curve() {
    let env = Env::new();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let quick = root.join("experiments/bandit.toml");
    env.ok(&["train", quick.to_str().unwrap()]);
    env.ok(&[
        "compare",
        "1",
        "--metric",
        "critic/score/mean",
        "--metric",
        "val/test_score",
        "--plot",
        "bandit.svg",
    ]);
    assert!(env.path().join("bandit.svg").is_file());
    let sweep = root.join("experiments/bandit_sweep.toml");
    let shown = env.ok(&["config", "show", sweep.to_str().unwrap()]);
    assert!(
        !shown.contains("[sweep"),
        "the sweep table is not part of the experiment"
    );
}

#[test]
fn the_config_reference_in_docs_is_generated_from_the_code() {
    let env = Env::new();
    let generated = env.ok(&["config", "reference"]);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let committed = std::fs::read_to_string(root.join("docs/config.md")).unwrap_or_default();
    assert!(
        generated.contains("| `actor_rollout_ref.actor.clip_ratio` | `0.2` |")
            && generated.contains("`trainer.algorithm`"),
        "{generated}"
    );
    assert!(
        committed == generated,
        "docs/config.md is stale: regenerate it with \
         `target/debug/harness config reference > docs/config.md`"
    );
}

/// `compare` summarises inside SQLite; the result must equal `summarise` over the whole series
/// for every metric, including ties (the first step wins), NaN values and `--at-step`.
#[test]
fn sql_summaries_equal_the_series_summaries() {
    let env = Env::new();
    let cfg = env.file("exp.toml", common::BANDIT);
    env.ok(&["train", cfg.to_str().unwrap()]);
    let (rt, store) = env.store();
    // a tied series, a NaN-only series and a series with NaN inside
    let rows: &[(i64, &str, Option<f64>)] = &[
        (1, "x/tied", Some(2.0)),
        (2, "x/tied", Some(5.0)),
        (3, "x/tied", Some(5.0)),
        (4, "x/tied", Some(1.0)),
        (1, "x/nan", None),
        (2, "x/nan", None),
        (1, "x/gap", Some(0.5)),
        (2, "x/gap", None),
        (3, "x/gap", Some(0.25)),
    ];
    rt.block_on(async {
        for (step, key, value) in rows {
            sqlx::query(
                "INSERT INTO metrics (run_id, step, key, value, wall_time) VALUES (1, ?, ?, ?, 0)",
            )
            .bind(step)
            .bind(key)
            .bind(value)
            .execute(store.pool())
            .await
            .unwrap();
        }
    });
    let keys = rt.block_on(store.metric_keys(1)).unwrap();
    assert!(keys.len() > 5, "{keys:?}");
    for at in [None, Some(0), Some(2), Some(7)] {
        let found = rt.block_on(store.summaries(1, &keys, at)).unwrap();
        for key in &keys {
            let series = rt.block_on(store.series(1, key)).unwrap();
            for maximise in [true, false] {
                let want = rl_harness::analysis::compare::summarise(&series, maximise, at).unwrap();
                let f = found[key];
                let best = if maximise { f.max } else { f.min };
                let (last_step, last) = f.last.unwrap();
                assert_eq!(last_step, series.last().unwrap().0, "{key}");
                let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
                assert!(same(last, want.last), "{key} last");
                match best {
                    Some(b) => assert!(b == want.best, "{key} best {b:?} vs {:?}", want.best),
                    None => assert!(
                        want.best.1.is_nan(),
                        "{key}: only NaN, best {:?}",
                        want.best
                    ),
                }
                match (f.at, want.at) {
                    (Some(a), Some(b)) => assert!(same(a, b), "{key} at {at:?}"),
                    (a, b) => assert_eq!(a.is_some(), b.is_some(), "{key} at {at:?}"),
                }
            }
        }
    }
}

/// Redirected output is plain text: with stderr a pipe (not a terminal) the logs carry no ANSI
/// colour codes and the progress bars draw nothing; `NO_COLOR` alone turns them off too (the
/// logging unit test covers it on a terminal).
#[test]
fn redirected_logs_and_progress_bars_carry_no_ansi_codes() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    for no_color in [None, Some("1")] {
        let mut cmd = env.cmd();
        cmd.args(["train", cfg.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .env_remove("NO_COLOR")
            .env_remove("CLICOLOR_FORCE");
        if let Some(v) = no_color {
            cmd.env("NO_COLOR", v);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains("INFO") && err.contains("run started"),
            "the info logs reach stderr: {err}"
        );
        assert!(
            !err.contains('\x1b'),
            "NO_COLOR={no_color:?}: escape codes in redirected stderr: {err:?}"
        );
        assert!(!err.contains("step 20/20"), "a progress bar drew: {err:?}");
    }
}

/// `data tiny-addition --pairs` names every file it writes: the RL splits and the pair files.
#[test]
fn tiny_addition_with_pairs_lists_every_file_it_writes() {
    let env = Env::new();
    let out = env.ok(&[
        "data",
        "tiny-addition",
        "d",
        "--train",
        "20",
        "--test",
        "8",
        "--pairs",
    ]);
    let mut written: Vec<String> = std::fs::read_dir(env.path().join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(
        written,
        [
            "test.parquet",
            "test_pairs.parquet",
            "train.parquet",
            "train_pairs.parquet"
        ]
    );
    for name in &written {
        let path = std::path::Path::new("d").join(name);
        assert!(
            out.contains(&path.display().to_string()),
            "{name} is not in {out:?}"
        );
    }
}

/// A reader that went away never stops a run: training with both pipes closed before it writes
/// its first line ends `finished` with exit 0; `runs` into a closed pipe (`runs | head`) ends
/// quietly; stdout on a full disk is an error, never a cut-short answer with exit 0.
#[test]
fn a_gone_reader_never_stops_a_run_and_a_full_disk_is_an_error() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let mut child = env
        .cmd()
        .args(["train", cfg.to_str().unwrap(), "bandit.step_delay_ms=20"])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "train with its pipes closed: {status}");
    let runs = env.ok(&["runs"]);
    assert!(runs.contains("finished"), "{runs}");

    let mut child = env
        .cmd()
        .arg("runs")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "runs into a closed pipe: {err}");
    assert!(err.is_empty(), "runs into a closed pipe says: {err}");

    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    for args in [
        &["runs"][..],
        &["config", "show", cfg.to_str().unwrap()][..],
    ] {
        let out = env
            .cmd()
            .args(args)
            .stdout(full.try_clone().unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?} onto a full disk: {err}"
        );
        assert!(
            err.contains("harness: error:") && err.contains("No space left on device"),
            "{args:?}: {err}"
        );
    }
}

/// Issue 19: an `RL_` variable that is a config key sets it, and its error names the variable
/// as written; one that is not (another tool's `RL_HOME`) is noted and ignored, not fatal.
#[test]
fn rl_environment_variables_are_named_as_written_and_strays_do_not_break_commands() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let out = env
        .cmd()
        .args(["config", "show", cfg])
        .env("RL_HOME", "/opt/rl")
        .env("RL_TRAINER__SAVE_FREQ", "7")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("save_freq = 7"), "{stdout}");
    assert!(
        stderr.contains("environment variable RL_HOME is not a config key"),
        "{stderr}"
    );
    let out = env
        .cmd()
        .args(["config", "show", cfg])
        .env("RL_TRAINER__SAVE_FREQ", "often")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "config key `trainer.save_freq` (in environment variable RL_TRAINER__SAVE_FREQ): \
             expected an integer"
        ),
        "{stderr}"
    );
}

/// Issue 19: with stderr not a terminal (a log file, nohup, CI), every step prints verl's
/// console line; `trainer.console_every_steps` picks the interval (0: none).
#[test]
fn every_step_prints_a_metrics_line_when_stderr_is_not_a_terminal() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let lines = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["train", cfg];
        args.extend_from_slice(extra);
        let out = env.run(&args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        err.lines()
            .filter(|l| l.starts_with("step:"))
            .map(str::to_string)
            .collect()
    };
    let every = lines(&[]);
    assert_eq!(every.len(), 20, "{every:?}");
    assert!(
        every[0].starts_with("step:1/20 - critic/score/mean:"),
        "{every:?}"
    );
    for key in ["actor/pg_loss:", "actor/kl_loss:", "timing_s/step:"] {
        assert!(every.iter().all(|l| l.contains(key)), "{key}: {every:?}");
    }
    // validations (test_freq 5) add their metrics to that step's line
    assert!(every[4].contains("val/test_score:"), "{every:?}");
    assert!(!every[3].contains("val/"), "{every:?}");
    let fifth = lines(&["trainer.console_every_steps=5", "trainer.experiment_name=b"]);
    let steps: Vec<&str> = fifth.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        steps,
        ["step:5/20", "step:10/20", "step:15/20", "step:20/20"]
    );
    assert!(lines(&["trainer.console_every_steps=0", "trainer.experiment_name=c"]).is_empty());
}

/// Issue 19: `trainer.log_val_generations` keeps that many samples of each validation in the
/// store, `show --generations` prints them, and a resume replaces (never doubles) those past
/// its checkpoint.
#[test]
fn validation_generations_are_stored_shown_and_rewound() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    env.ok(&[
        "train",
        cfg.to_str().unwrap(),
        "trainer.log_val_generations=2",
    ]);
    let (rt, store) = env.store();
    let per_step = |rt: &tokio::runtime::Runtime| {
        let mut counts = std::collections::BTreeMap::new();
        for g in rt.block_on(store.generations(1)).unwrap() {
            *counts.entry(g.step).or_insert(0) += 1;
        }
        counts
    };
    let counts = per_step(&rt);
    assert_eq!(
        counts.into_iter().collect::<Vec<_>>(),
        vec![(0, 2), (5, 2), (10, 2), (15, 2), (20, 2)]
    );
    let shown = env.ok(&["show", "1", "--generations"]);
    assert!(
        shown.contains("validation generations:")
            && shown.contains("step 20:")
            && shown.contains("[bandit] score ")
            && shown.contains("prompt:   context 0")
            && shown.contains("response: arm "),
        "{shown}"
    );
    let before = rt.block_on(store.generations(1)).unwrap();
    let resumed = env.ok(&["resume", "1", "--from-step", "10"]);
    assert_eq!(rt.block_on(store.generations(1)).unwrap(), before);
    // resume ends with the summary train prints
    assert!(
        resumed.contains("run 1 finished") && resumed.contains("val/test_score: "),
        "{resumed}"
    );
    // without the key, nothing is kept, and show says so
    env.ok(&[
        "train",
        cfg.to_str().unwrap(),
        "trainer.experiment_name=none",
    ]);
    let shown = env.ok(&["show", "2", "--generations"]);
    assert!(shown.contains("none recorded"), "{shown}");
    // show leaves out the groups at their defaults (a bandit run reads none of the LLM ones)
    assert!(
        !shown.contains("[critic") && shown.contains("[bandit]") && shown.contains("[trainer]"),
        "{shown}"
    );
    assert!(shown.contains("left out (--full shows them): "), "{shown}");
    let full = env.ok(&["show", "2", "--full"]);
    assert!(
        full.contains("[critic") && !full.contains("left out"),
        "{full}"
    );
}

/// Issue 19: `harness runs` shows each run's project, duration and main validation metric,
/// hides runs that failed before their first step (`--all` lists them), selects by project and
/// count, and never answers a typo with an empty list: an unknown filter key, sweep or project
/// is an error naming the nearest; an empty result says so; an ambiguous name says which run
/// it took.
#[test]
fn runs_lists_what_matters_and_never_answers_a_typo_with_nothing() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    env.ok(&["train", cfg]);
    env.ok(&[
        "train",
        cfg,
        "trainer.project_name=other",
        "trainer.experiment_name=o",
    ]);
    // fails before its first step: a data file that is not parquet
    env.ok(&["model", "init-tiny", "m", "--seed", "1"]);
    env.file("bad.parquet", "garbage");
    let err = env.fails(&[
        "train",
        cfg,
        "trainer.algorithm=sft",
        "trainer.experiment_name=bad",
        "data.train_files=bad.parquet",
        "actor_rollout_ref.model.path=m",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    ]);
    assert!(err.contains("not a readable parquet file"), "{err}");
    let out = env.ok(&["runs"]);
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].contains("project") && lines[0].contains("main metric"),
        "{out}"
    );
    assert!(
        lines[1].contains(" base ")
            && lines[1].contains(" test ")
            && lines[1].contains(" val/test_score"),
        "{out}"
    );
    assert!(!out.contains(" bad "), "{out}");
    assert!(
        out.contains("1 run(s) that failed before their first step not shown"),
        "{out}"
    );
    assert!(env.ok(&["runs", "--all"]).contains(" bad "));
    let other = env.ok(&["runs", "--project", "other"]);
    assert!(
        other.contains(" o ") && !other.contains(" base "),
        "{other}"
    );
    let last = env.ok(&["runs", "--limit", "1"]);
    assert!(last.contains(" o ") && !last.contains(" base "), "{last}");
    let none = env.ok(&["runs", "--filter", "val/test_score > 2"]);
    assert!(none.contains("(no runs match the filter)"), "{none}");
    let err = env.fails(&["runs", "--filter", "val/test_scor > 0"]);
    assert!(
        err.contains("no run has `val/test_scor`") && err.contains("did you mean `val/test_score`"),
        "{err}"
    );
    let err = env.fails(&["runs", "--project", "othr"]);
    assert!(err.contains("did you mean `other`"), "{err}");
    let err = env.fails(&["runs", "--sweep", "lr"]);
    assert!(
        err.contains("no sweep \"lr\"") && err.contains("it has no sweeps"),
        "{err}"
    );
    // a name two runs share
    env.ok(&["train", cfg]);
    let out = env.run(&["show", "base"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"base\" names 2 runs; taking the latest, run 4 (the others: 1)"),
        "{err}"
    );
    let err = env.fails(&["show", "bse"]);
    assert!(err.contains("did you mean `base`"), "{err}");
}

/// Issue 19: `compare` never writes an empty answer: a metric no run recorded is an error
/// naming the nearest, a sweep named by its name compares its trials, no `--metric` compares
/// the main metrics (not every one), and many metrics lay out as a grid, not a strip.
#[test]
fn compare_answers_a_typo_with_an_error_and_defaults_to_the_main_metrics() {
    let env = Env::new();
    let sweep = env.file(
        "sweep.toml",
        &format!(
            "{BANDIT}\n[sweep]\nname = \"lr\"\nstrategy = \"grid\"\nmetric = \"val/test_score\"\n\
             [sweep.grid]\n\"bandit.lr\" = [0.02, 0.1]\n"
        ),
    );
    let out = env.run(&["sweep", sweep.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(" starts bandit.lr=0.02"),
        "params as values: {stderr}"
    );
    // trials are named by their parameters
    let runs = env.ok(&["runs"]);
    assert!(
        runs.contains("lr/bandit.lr=0.02") && runs.contains("lr/bandit.lr=0.1"),
        "{runs}"
    );
    let err = env.fails(&[
        "compare",
        "1",
        "2",
        "--metric",
        "val/test_scor",
        "--plot",
        "x.svg",
    ]);
    assert!(
        err.contains("--metric val/test_scor: no run compared recorded it")
            && err.contains("did you mean `val/test_score`"),
        "{err}"
    );
    assert!(!env.path().join("x.svg").exists());
    // the sweep by its name: ranked, then its trials compared and plotted
    let out = env.ok(&["compare", "--sweep", "lr", "--plot", "sweep.svg"]);
    assert!(
        out.contains("trials ranked by best val/test_score"),
        "{out}"
    );
    assert!(out.contains("bandit.lr=0.02"), "{out}");
    let svg = std::fs::read_to_string(env.path().join("sweep.svg")).unwrap();
    assert!(svg.matches("<polyline").count() >= 2, "an empty plot");
    assert!(
        svg.contains("lr/bandit.lr=0.1"),
        "the legend names the trial"
    );
    // runs takes the sweep's name too
    let listed = env.ok(&["runs", "--sweep", "lr"]);
    assert_eq!(
        listed
            .lines()
            .filter(|l| l.contains("lr/bandit.lr="))
            .count(),
        2,
        "{listed}"
    );
    // --mode auto's help says what the code does (entropy is maximised)
    let help = env.ok(&["compare", "--help"]);
    assert!(
        help.contains("gradient norms and timings are minimised"),
        "{help}"
    );
    let err = env.fails(&["compare", "--sweep", "kl_coef", "--plot", "y.svg"]);
    assert!(err.contains("no sweep \"kl_coef\""), "{err}");
    // no --metric: the validation metrics and the main training figures
    let out = env.run(&["compare", "1", "2", "--plot", "main.svg"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("val/test_score") && stdout.contains("critic/score/mean"),
        "{stdout}"
    );
    assert!(!stdout.contains("actor/entropy"), "{stdout}");
    assert!(stderr.contains("--metric KEY picks others"), "{stderr}");
    // six metrics: two rows of three panels
    let mut args = vec!["compare", "1", "2", "--plot", "grid.svg"];
    for m in [
        "val/test_score",
        "critic/score/mean",
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
    ] {
        args.extend(["--metric", m]);
    }
    env.ok(&args);
    let svg = std::fs::read_to_string(env.path().join("grid.svg")).unwrap();
    // a plot into a folder that does not exist yet makes it
    env.ok(&["compare", "1", "--plot", "plots/new/one.svg"]);
    assert!(env.path().join("plots/new/one.svg").is_file());
    assert!(
        svg.contains("width=\"1800\" height=\"640\""),
        "{}",
        &svg[..200]
    );
}

/// Issue 19: `harness eval` validates and records the scores as a finished run of no steps;
/// `total_training_steps = 0` without a validation before training is refused, saying why.
#[test]
fn eval_validates_and_records_a_run_of_no_steps() {
    let env = Env::new();
    let cfg = env.file("exp.toml", BANDIT);
    let cfg = cfg.to_str().unwrap();
    let out = env.ok(&["eval", cfg]);
    assert!(out.contains("val/test_score: "), "{out}");
    let (rt, store) = env.store();
    let run = rt.block_on(store.run(1)).unwrap().unwrap();
    assert_eq!(run.status, "finished");
    let m = rt.block_on(store.all_metrics(1)).unwrap();
    assert!(
        !m.is_empty()
            && m.iter()
                .all(|(s, k, _, _)| *s == 0 && k.starts_with("val/")),
        "{m:?}"
    );
    let err = env.fails(&[
        "train",
        cfg,
        "trainer.total_training_steps=0",
        "trainer.val_before_train=false",
    ]);
    assert!(
        err.contains("or 0 with trainer.val_before_train = true"),
        "{err}"
    );
}

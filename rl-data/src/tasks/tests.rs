//! Tests for the task data: byte-identical seeded output, solvable ground truths, GSM8K's JSONL.

use std::path::PathBuf;

use super::*;
use crate::dataset::{ReadOptions, RlDataset};
use crate::reward::RewardRegistry;

fn read(path: &Path) -> RlDataset {
    RlDataset::open(
        &[path.to_path_buf()],
        &ReadOptions {
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_samples: None,
        },
    )
    .unwrap()
}

type Gen = Box<dyn Fn(&Path, u64) -> Result<GeneratedFiles>>;

fn generators() -> Vec<(&'static str, Gen)> {
    let sizes = SplitSizes {
        train: 40,
        test: 10,
    };
    vec![
        (
            "arithmetic",
            Box::new(move |d: &Path, s| {
                generate_arithmetic(
                    d,
                    &ArithmeticConfig {
                        digits: 3,
                        operators: vec!['+', '-', '*', '/'],
                        operands: 3,
                    },
                    sizes,
                    s,
                )
            }),
        ),
        (
            "countdown",
            Box::new(move |d: &Path, s| {
                generate_countdown(d, &CountdownConfig::default(), sizes, s)
            }),
        ),
        (
            "word_problems",
            Box::new(move |d: &Path, s| {
                generate_word_problems(d, &WordProblemsConfig::default(), sizes, s)
            }),
        ),
    ]
}

#[test]
fn same_seed_gives_byte_identical_files() {
    for (name, generate) in generators() {
        let (a, b, c) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let fa = generate(a.path(), 7).unwrap();
        let fb = generate(b.path(), 7).unwrap();
        let fc = generate(c.path(), 8).unwrap();
        for (x, y, z) in [
            (&fa.train, &fb.train, &fc.train),
            (&fa.test, &fb.test, &fc.test),
        ] {
            let (x, y, z) = (
                std::fs::read(x).unwrap(),
                std::fs::read(y).unwrap(),
                std::fs::read(z).unwrap(),
            );
            assert_eq!(x, y, "{name}: same seed, different bytes");
            assert_ne!(x, z, "{name}: different seeds, same bytes");
        }
    }
}

#[test]
fn generated_rows_are_readable_and_their_ground_truth_is_reachable() {
    let rewards = RewardRegistry::verl_default();
    for (name, generate) in generators() {
        let dir = tempfile::tempdir().unwrap();
        let files = generate(dir.path(), 3).unwrap();
        let (train, test) = (read(&files.train), read(&files.test));
        assert_eq!((train.len(), test.len()), (40, 10), "{name}");
        let train_prompts: std::collections::HashSet<String> = (0..train.len())
            .map(|i| train.row(i).unwrap().prompt[0].content.clone())
            .collect();
        for i in 0..test.len() {
            let row = test.row(i).unwrap();
            assert!(
                !train_prompts.contains(&row.prompt[0].content),
                "{name}: test prompt in train"
            );
            assert_eq!(row.extra_info["split"], "test");
        }
        for i in 0..train.len() {
            let row = train.row(i).unwrap();
            assert_eq!(row.data_source, name);
            let perfect = match name {
                "arithmetic" => format!("The answer is\n{}", row.ground_truth.as_str().unwrap()),
                "countdown" => format!(
                    "<answer>{}</answer>",
                    row.extra_info["solution"].as_str().unwrap()
                ),
                _ => row.extra_info["answer"].as_str().unwrap().to_string(),
            };
            let out = rewards
                .score(
                    &row.data_source,
                    &perfect,
                    &row.ground_truth,
                    &row.extra_info,
                )
                .unwrap();
            assert_eq!(
                out.score, 1.0,
                "{name} row {i}: {perfect:?} vs {}",
                row.ground_truth
            );
            let wrong = rewards
                .score(
                    &row.data_source,
                    "no idea",
                    &row.ground_truth,
                    &row.extra_info,
                )
                .unwrap();
            assert!(wrong.score < 1.0);
        }
    }
}

#[test]
fn bad_generator_options_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = SplitSizes { train: 1, test: 1 };
    let e = generate_arithmetic(
        dir.path(),
        &ArithmeticConfig {
            operators: vec!['^'],
            ..Default::default()
        },
        sizes,
        0,
    )
    .unwrap_err();
    assert!(e.to_string().contains("arithmetic.operators"), "{e}");
    // Only one distinct problem exists; asking for 5 must fail, not loop forever.
    let tiny = ArithmeticConfig {
        digits: 1,
        operators: vec!['+'],
        operands: 2,
    };
    let e = generate_arithmetic(
        dir.path(),
        &tiny,
        SplitSizes {
            train: 200,
            test: 0,
        },
        0,
    )
    .unwrap_err();
    assert!(e.to_string().contains("distinct"), "{e}");
}

fn gsm8k_jsonl(dir: &Path, name: &str, lines: &[&str]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

#[test]
fn gsm8k_jsonl_becomes_verl_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let src = gsm8k_jsonl(
        dir.path(),
        "train.jsonl",
        &[
            r#"{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}"#,
            r#"{"question": "A company pays $1,200 a month. What is that per year?", "answer": "12*1200 = <<12*1200=14400>>14,400\n#### 14,400"}"#,
            r#"{"question": "It is 5 degrees and drops 8. What is it now?", "answer": "5-8 = <<5-8=-3>>-3\n#### -3"}"#,
        ],
    );
    std::fs::copy(&src, dir.path().join("test.jsonl")).unwrap();
    let out = dir.path().join("out");
    let files = preprocess_gsm8k_dir(dir.path(), &out).unwrap();
    let ds = read(&files.train);
    assert_eq!(ds.len(), 3);
    let r0 = ds.row(0).unwrap();
    assert_eq!(r0.data_source, "openai/gsm8k");
    assert_eq!(r0.ability.as_deref(), Some("math"));
    assert_eq!(r0.reward_style.as_deref(), Some("rule"));
    assert!(
        r0.prompt[0]
            .content
            .ends_with(" Let's think step by step and output the final answer after \"####\".")
    );
    assert_eq!(r0.prompt[0].role, "user");
    assert_eq!(r0.ground_truth, "72");
    assert_eq!(r0.extra_info["index"], 0);
    assert_eq!(r0.extra_info["split"], "train");
    assert!(
        r0.extra_info["answer"]
            .as_str()
            .unwrap()
            .ends_with("#### 72")
    );
    assert_eq!(ds.row(1).unwrap().ground_truth, "14400");
    assert_eq!(ds.row(2).unwrap().ground_truth, "-3");
    assert_eq!(
        read(&files.test).row(0).unwrap().extra_info["split"],
        "test"
    );
    // The preprocessed answer scores 1 with verl's strict GSM8K reward.
    let r = RewardRegistry::verl_default();
    let worked = r0.extra_info["answer"].as_str().unwrap();
    assert_eq!(
        r.score(&r0.data_source, worked, &r0.ground_truth, &r0.extra_info)
            .unwrap()
            .score,
        1.0
    );
}

#[test]
fn bad_gsm8k_lines_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = gsm8k_jsonl(
        dir.path(),
        "bad.jsonl",
        &[
            "{\"question\": \"q\", \"answer\": \"#### 1\"}",
            r#"{"question": "q", "answer": "no final"}"#,
        ],
    );
    let e = preprocess_gsm8k(&p, "train", &dir.path().join("o.parquet"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.jsonl") && e.contains("line 2") && e.contains("####"),
        "{e}"
    );
    let p = gsm8k_jsonl(dir.path(), "bad2.jsonl", &[r#"{"question": "q"}"#]);
    let e = preprocess_gsm8k(&p, "train", &dir.path().join("o.parquet"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1") && e.contains("`answer`"), "{e}");
    let p = gsm8k_jsonl(dir.path(), "bad3.jsonl", &["not json"]);
    let e = preprocess_gsm8k(&p, "train", &dir.path().join("o.parquet"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad3.jsonl") && e.contains("line 1"), "{e}");
}

/// Evaluates `a op b` of a worked step (`<<a*b=c>>`), integers only.
fn eval_step(expr: &str) -> i64 {
    let op_at = expr[1..].find(['+', '-', '*', '/']).unwrap() + 1;
    let (a, b) = (
        expr[..op_at].parse::<i64>().unwrap(),
        expr[op_at + 1..].parse::<i64>().unwrap(),
    );
    match &expr[op_at..=op_at] {
        "+" => a + b,
        "-" => a - b,
        "*" => a * b,
        _ => {
            assert_eq!(a % b, 0, "{expr}: not a whole division");
            a / b
        }
    }
}

#[test]
fn word_problem_steps_are_right_and_held_out_kinds_and_phrasings_stay_out_of_training() {
    let dir = tempfile::tempdir().unwrap();
    let sizes = SplitSizes {
        train: 400,
        test: 100,
    };
    // (the config, whether a row's (kind, phrasing) is held out)
    type HeldOut = fn(usize, usize) -> bool;
    let cases: [(WordProblemsConfig, HeldOut); 2] = [
        (
            WordProblemsConfig {
                test_kinds: vec![7, 5],
                ..Default::default()
            },
            |kind, _| kind == 5 || kind == 7,
        ),
        (
            WordProblemsConfig {
                test_phrasing: Some(2),
                ..Default::default()
            },
            |_, phrasing| phrasing == 2,
        ),
    ];
    for (cfg, held_out) in cases {
        let files = generate_word_problems(dir.path(), &cfg, sizes, 5).unwrap();
        let (train, test) = (read(&files.train), read(&files.test));
        let mut train_kinds = std::collections::BTreeSet::new();
        let mut train_phrasings = std::collections::BTreeSet::new();
        for (ds, split) in [(&train, "train"), (&test, "test")] {
            for i in 0..ds.len() {
                let row = ds.row(i).unwrap();
                let kind = row.extra_info["kind"].as_u64().unwrap() as usize;
                let phrasing = row.extra_info["phrasing"].as_u64().unwrap() as usize;
                assert_eq!(
                    split == "test",
                    held_out(kind, phrasing),
                    "{cfg:?}: {split} row {i} is of kind {kind}, phrasing {phrasing}"
                );
                if split == "train" {
                    train_kinds.insert(kind);
                    train_phrasings.insert(phrasing);
                }
                // every worked step `<<a op b=c>>` holds, and the last one is the answer
                let answer = row.extra_info["answer"].as_str().unwrap();
                let mut last = None;
                for step in answer.split("<<").skip(1) {
                    let (expr, value) = step.split_once(">>").unwrap().0.split_once('=').unwrap();
                    let value: i64 = value.parse().unwrap();
                    assert_eq!(eval_step(expr), value, "{split} row {i}: {answer}");
                    assert!(value >= 0, "{split} row {i}: {answer}");
                    last = Some(value);
                }
                assert_eq!(
                    last.map(|v| v.to_string()).as_deref(),
                    row.ground_truth.as_str(),
                    "{answer}"
                );
            }
        }
        let (kinds, phrasings) = match cfg.test_phrasing {
            Some(_) => (WORD_PROBLEM_KINDS, WORD_PROBLEM_PHRASINGS - 1),
            None => (WORD_PROBLEM_KINDS - 2, WORD_PROBLEM_PHRASINGS),
        };
        assert_eq!(
            (train_kinds.len(), train_phrasings.len()),
            (kinds, phrasings)
        );
    }
    let bad: [(WordProblemsConfig, &str, &str); 3] = [
        (
            WordProblemsConfig {
                test_kinds: vec![8],
                ..Default::default()
            },
            "word_problems.test_kinds",
            "kind 8 does not exist",
        ),
        (
            WordProblemsConfig {
                test_kinds: (0..8).collect(),
                ..Default::default()
            },
            "word_problems.test_kinds",
            "none to train on",
        ),
        (
            WordProblemsConfig {
                test_phrasing: Some(3),
                ..Default::default()
            },
            "word_problems.test_phrasing",
            "phrasing 3 does not exist",
        ),
    ];
    for (cfg, key, says) in bad {
        let e = generate_word_problems(dir.path(), &cfg, sizes, 0).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
        assert!(e.to_string().contains(says), "{e}");
    }
}

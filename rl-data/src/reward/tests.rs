//! Tests for the rule rewards: the verl parity table and the tasks' own rewards.

use serde::Deserialize;

use super::*;
use crate::test_support::fixture;

#[derive(Deserialize)]
struct Table {
    rows: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    #[serde(rename = "fn")]
    func: String,
    response: String,
    ground_truth: Value,
    score: f64,
    pred: Option<String>,
}

#[test]
fn verl_parity_table() {
    let table: Table = serde_json::from_str(
        &std::fs::read_to_string(fixture("reward_parity/table.json")).unwrap(),
    )
    .unwrap();
    assert!(
        table
            .rows
            .iter()
            .filter(|r| r.func.starts_with("gsm8k") || r.func.starts_with("math"))
            .count()
            >= 50
    );
    let mut failures = Vec::new();
    for row in &table.rows {
        let gt = row.ground_truth.as_str().unwrap_or_default();
        let out = match row.func.as_str() {
            "gsm8k_strict" => {
                gsm8k::compute_score(&row.response, gt, Gsm8kMethod::Strict, 0.0, 1.0)
            }
            "gsm8k_flexible" => {
                gsm8k::compute_score(&row.response, gt, Gsm8kMethod::Flexible, 0.0, 1.0)
            }
            "gsm8k_strict_format0.1" => {
                gsm8k::compute_score(&row.response, gt, Gsm8kMethod::Strict, 0.1, 1.0)
            }
            "math" => math::compute_score(&row.response, gt),
            "math_dapo" => math::compute_score_dapo(&row.response, gt, false),
            "qa_em" => qa_em::compute_score(
                &row.response,
                &qa_targets(&row.ground_truth).unwrap(),
                0.0,
                1.0,
            ),
            other => panic!("unknown fn {other}"),
        };
        let pred_ok =
            row.pred.is_none() || out.extra.get("pred") == Some(&serde_json::json!(row.pred));
        if out.score != row.score || !pred_ok {
            failures.push(format!(
                "{} {:?} gt={}: verl {} {:?}, ours {} {:?}",
                row.func,
                row.response,
                row.ground_truth,
                row.score,
                row.pred,
                out.score,
                out.extra.get("pred")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn countdown_scores_like_tinyzero() {
    let numbers = [3, 5, 7];
    let score = |r: &str| countdown::compute_score(r, 22.0, &numbers, 0.1, 1.0).score;
    assert_eq!(score("<answer>3 * 5 + 7</answer>"), 1.0);
    assert_eq!(
        score("<think>hmm</think>\n<answer> (7 + 5) * 3 - 14 </answer>"),
        0.1
    ); // wrong numbers
    assert_eq!(score("<answer>3 + 5 + 7</answer>"), 0.1); // wrong value
    assert_eq!(score("<answer>3 * 5 + 7 = 22</answer>"), 0.1); // `=` is not allowed
    assert_eq!(score("3 * 5 + 7"), 0.0); // no tags
    assert_eq!(score("<answer>1</answer> then <answer>3*5+7</answer>"), 1.0); // last one counts
    assert_eq!(score("Assistant: <answer>3*5+7</answer>"), 1.0);
    // TinyZero reads only the last line: an answer followed by more text or a newline is lost
    assert_eq!(score("<answer>3*5+7</answer>\n"), 0.0);
    assert_eq!(score("<answer>3*5+7</answer>\nI am done."), 0.0);
    assert_eq!(score("thinking\nstill\n<answer>3*5+7</answer>"), 1.0);
    assert_eq!(score("<answer>3*5+7</answer>\n<answer>3+5+7</answer>"), 0.1);
    assert_eq!(score("Assistant: x\n<answer>3*5+7</answer>"), 1.0);
    // Python's strip() also strips U+001C..U+001F
    assert_eq!(score("<answer>\u{1f}3*5+7\u{1c}</answer>"), 1.0);
    assert_eq!(
        countdown::compute_score(
            "<answer>7 / (5 - 3) * 2</answer>",
            7.0,
            &[7, 5, 3, 2],
            0.1,
            1.0
        )
        .score,
        1.0
    );
    assert_eq!(countdown::evaluate_equation("7 / (5 - 5)"), None);
    assert_eq!(countdown::evaluate_equation("-2**2"), Some(-4.0));
    assert_eq!(countdown::evaluate_equation("2**3**2"), Some(512.0));
    assert_eq!(countdown::evaluate_equation("7 // 2"), Some(3.0));
    assert_eq!(countdown::evaluate_equation("(1 + 2"), None);
    assert_eq!(countdown::evaluate_equation("01 + 2"), None);
    assert_eq!(countdown::evaluate_equation("1.5 * 2"), Some(3.0));
    assert_eq!(countdown::evaluate_equation("abs(3)"), None);
}

#[test]
fn arithmetic_uses_the_last_number() {
    assert_eq!(arithmetic::compute_score("12 + 30 = 42", "42").score, 1.0);
    assert_eq!(
        arithmetic::compute_score("The result is -1,234.", "-1234").score,
        1.0
    );
    assert_eq!(arithmetic::compute_score("42.0", "42").score, 1.0);
    assert_eq!(arithmetic::compute_score("42 or 43", "42").score, 0.0);
    assert_eq!(arithmetic::compute_score("no number", "42").score, 0.0);
}

#[test]
fn registry_dispatches_like_default_compute_score() {
    let r = RewardRegistry::verl_default();
    let gt = Value::from("72");
    assert_eq!(
        r.score("openai/gsm8k", "#### 72", &gt, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    assert_eq!(
        r.score("lighteval/MATH", "\\boxed{72}", &gt, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    // `math` and `aime*` go to math_dapo, which scores -1 when wrong.
    assert_eq!(
        r.score("math", "Answer: 71", &gt, &Value::Null)
            .unwrap()
            .score,
        -1.0
    );
    assert_eq!(
        r.score("aime2024", "Answer: 72", &gt, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    let qa = serde_json::json!({"target": ["Paris"]});
    assert_eq!(
        r.score("searchR1_nq", "<answer>paris</answer>", &qa, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    let cd = serde_json::json!({"target": 22, "numbers": [3, 5, 7]});
    assert_eq!(
        r.score("countdown", "<answer>3*5+7</answer>", &cd, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    let e = r
        .score("nope", "", &gt, &Value::Null)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`nope`") && e.contains("openai/gsm8k"), "{e}");
    let e = r
        .score("countdown", "", &gt, &Value::Null)
        .unwrap_err()
        .to_string();
    assert!(e.contains("countdown") && e.contains("72"), "{e}");
}

#[test]
fn config_maps_sources_to_builtin_and_custom_functions() {
    let mut r = RewardRegistry::verl_default();
    r.register_function(
        "length_penalty",
        Arc::new(|resp: &str, _: &Value, _: &Value| {
            Ok(RewardOutput::new(-(resp.len() as f64)).with("len", resp.len()))
        }),
    );
    let cfg: RewardConfig = toml::from_str(
        r#"
        [sources."my/gsm8k"]
        name = "gsm8k"
        method = "flexible"
        format_score = 0.1
        [sources.short]
        name = "custom"
        function = "length_penalty"
        "#,
    )
    .unwrap();
    r.apply_config(&cfg).unwrap();
    let gt = Value::from("72");
    assert_eq!(
        r.score("my/gsm8k", "it is 72", &gt, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    assert_eq!(
        r.score("my/gsm8k", "it is 71", &gt, &Value::Null)
            .unwrap()
            .score,
        0.1
    );
    let out = r.score("short", "abc", &gt, &Value::Null).unwrap();
    assert_eq!(out.score, -3.0);
    assert_eq!(out.extra["len"], Value::from(3));
    let bad: RewardConfig =
        toml::from_str("[sources.x]\nname = \"custom\"\nfunction = \"missing\"").unwrap();
    let e = r.apply_config(&bad).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains("length_penalty"), "{e}");
    assert!(toml::from_str::<RewardConfig>("[sources.x]\nname = \"gsm9k\"").is_err());
}

#[test]
fn python_tail_counts_characters() {
    assert_eq!(python_tail("héllo", 3), "llo");
    assert_eq!(python_tail("東京🚀", 2), "京🚀");
    assert_eq!(python_tail("ab", 5), "ab");
    assert_eq!(python_tail("ab", 0), "");
}

#[test]
fn search_r1_sources_with_and_without_the_prefix_go_to_qa_exact_match() {
    let r = RewardRegistry::verl_default();
    let gt = serde_json::json!({"target": ["Oslo", "Kristiania"]});
    for source in [
        "searchR1_nq",
        "searchR1_synthetic",
        "searchR1_anything_new",
        "nq",
        "triviaqa",
        "popqa",
        "hotpotqa",
        "2wikimultihopqa",
        "musique",
        "bamboogle",
    ] {
        let right = r
            .score(
                source,
                "<search>x</search>\n\n<information>..</information>\n\n<answer> the OSLO </answer>",
                &gt,
                &Value::Null,
            )
            .unwrap();
        assert_eq!(right.score, 1.0, "{source}");
        assert_eq!(right.extra["acc"], Value::Bool(true), "{source}");
        let wrong = r.score(source, "<answer>Rome</answer>", &gt, &Value::Null);
        assert_eq!(
            wrong.unwrap().score,
            0.0,
            "{source}: verl's format_score is 0"
        );
    }
    // a bare list and a bare string are targets too
    let list = serde_json::json!(["Oslo"]);
    assert_eq!(
        r.score("nq", "<answer>oslo</answer>", &list, &Value::Null)
            .unwrap()
            .score,
        1.0
    );
    let e = r
        .score(
            "nq",
            "<answer>oslo</answer>",
            &serde_json::json!({"answer": "x"}),
            &Value::Null,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("`target`"), "{e}");
}

#[test]
fn the_search_r1_format_score_is_configurable_and_rewards_only_a_wrong_answer_tag() {
    let cfg: RewardConfig = toml::from_str(
        r#"
        [prefixes.searchR1_]
        name = "qa_em"
        format_score = 0.1
        [sources.nq]
        name = "qa_em"
        format_score = 0.2
        "#,
    )
    .unwrap();
    let r = RewardRegistry::with_config(&cfg).unwrap();
    let gt = serde_json::json!({"target": ["Oslo"]});
    let score =
        |source: &str, response: &str| r.score(source, response, &gt, &Value::Null).unwrap().score;
    // the configured prefix replaces the default one of the same name
    assert_eq!(score("searchR1_synthetic", "<answer>Rome</answer>"), 0.1);
    assert_eq!(score("searchR1_synthetic", "<answer>Oslo</answer>"), 1.0);
    assert_eq!(score("searchR1_synthetic", "Oslo, no tag"), 0.0);
    assert_eq!(score("nq", "<answer>Rome</answer>"), 0.2);
    // exact sources keep their defaults
    assert_eq!(score("searchR1_nq", "<answer>Rome</answer>"), 0.0);
    let bad = toml::from_str::<RewardConfig>("[prefixes.x]\nname = \"qa_em\"\nformat = 1\n")
        .unwrap_err()
        .to_string();
    assert!(bad.contains("format"), "{bad}");
}

#[test]
fn qa_normalisation_uses_python_whitespace() {
    // Python's str.split() splits on U+001C..U+001F; Rust's split_whitespace() does not
    assert_eq!(qa_em::normalize_answer("Paris\u{1f}France"), "paris france");
    assert_eq!(qa_em::normalize_answer("\u{1c}The  Paris\u{1d}"), "paris");
    let gold = vec!["paris france".to_string()];
    assert_eq!(
        qa_em::compute_score("<answer>Paris\u{1f}France</answer>", &gold, 0.0, 1.0).score,
        1.0
    );
    assert_eq!(
        qa_em::extract_solution("<answer>\u{1e} x \u{1f}</answer>").as_deref(),
        Some("x")
    );
}

#[test]
fn qa_subem_matches_a_target_inside_the_answer() {
    let gold = vec!["Paris".to_string()];
    let subem = |r: &str| qa_em::compute_score_subem(r, &gold, 0.1, 1.0).score;
    assert_eq!(subem("<answer>It is Paris, France.</answer>"), 1.0);
    assert_eq!(subem("<answer>Lyon</answer>"), 0.1);
    assert_eq!(subem("Paris"), 0.0); // no answer tag
    // exact match refuses what substring match accepts
    assert_eq!(
        qa_em::compute_score("<answer>It is Paris, France.</answer>", &gold, 0.1, 1.0).score,
        0.1
    );
    // no quarter score for many tags, unlike compute_score
    let many = "<answer>x</answer>".repeat(11) + "<answer>paris</answer>";
    assert_eq!(subem(&many), 1.0);
    assert_eq!(qa_em::compute_score(&many, &gold, 0.0, 1.0).score, 0.25);
    // by name in config
    let cfg: RewardConfig = toml::from_str("[sources.\"my/qa\"]\nname = \"qa_subem\"\n").unwrap();
    let r = RewardRegistry::with_config(&cfg).unwrap();
    let gt = serde_json::json!({"target": ["Paris"]});
    let out = r
        .score("my/qa", "<answer>in Paris</answer>", &gt, &Value::Null)
        .unwrap();
    assert_eq!(out.score, 1.0);
}

#[test]
fn verl_and_extension_tables_are_disjoint_and_verl_refuses_the_extensions() {
    let DispatchTable {
        sources: verl,
        prefixes: verl_prefixes,
    } = verl_table();
    let DispatchTable {
        sources: ours,
        prefixes: our_prefixes,
    } = extension_table();
    for (name, _) in &ours {
        assert!(
            !verl.iter().any(|(v, _)| v == name),
            "{name} is in both tables"
        );
        assert!(
            !verl_prefixes.iter().any(|(p, _)| name.starts_with(p)),
            "{name} is verl's by prefix"
        );
    }
    assert_eq!(
        verl_prefixes.iter().map(|p| p.0).collect::<Vec<_>>(),
        ["aime"]
    );
    assert_eq!(
        our_prefixes.iter().map(|p| p.0).collect::<Vec<_>>(),
        ["searchR1_"]
    );
    // verl's table is exactly default_compute_score's sources that this crate scores
    let names: Vec<&str> = verl.iter().map(|(n, _)| *n).collect();
    for must in [
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
        "math",
        "math_dapo_reasoning",
        "hiyouga/geometry3k",
        "searchR1_nq",
        "searchR1_bamboogle",
    ] {
        assert!(names.contains(&must), "{must} missing from verl's table");
    }
    assert!(ours.iter().any(|(n, _)| *n == "countdown"));
    assert!(ours.iter().any(|(n, _)| *n == "nq"));
}

/// The data sources of one marked table of docs/rewards.md (a prefix ends in `*`).
fn documented(marker: &str) -> Vec<String> {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/rewards.md"),
    )
    .unwrap();
    let start = doc.find(&format!("<!-- {marker} -->")).unwrap();
    let end = doc.find(&format!("<!-- /{marker} -->")).unwrap();
    doc[start..end]
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(name, _)| name.to_string())
        .collect()
}

#[test]
fn docs_list_exactly_the_verl_and_extension_tables() {
    for (marker, DispatchTable { sources, prefixes }) in [
        ("verl-table", verl_table()),
        ("extension-table", extension_table()),
    ] {
        let mut want: Vec<String> = sources.iter().map(|(n, _)| n.to_string()).collect();
        want.extend(prefixes.iter().map(|(p, _)| format!("{p}*")));
        want.sort();
        let mut got = documented(marker);
        got.sort();
        assert_eq!(
            got, want,
            "docs/rewards.md's {marker} drifted from the code"
        );
    }
}

#[test]
fn data_sources_sharing_a_scorer_share_one_instance_and_so_one_python_pool() {
    let r = RewardRegistry::verl_default();
    let numina = r.get("numina_olympiads").unwrap();
    for s in ["numina_aops_forum", "numina_cn_k12", "numina_amc_aime"] {
        assert!(Arc::ptr_eq(&numina, &r.get(s).unwrap()), "{s}");
    }
    // a configured source with the same scorer and parameters joins it; other parameters do not
    let cfg: RewardConfig =
        toml::from_str("[sources.mine]\nname = \"prime_math\"\n[sources.other]\nname = \"geo3k\"\nformat_score = 0.5\n")
            .unwrap();
    let r = RewardRegistry::with_config(&cfg).unwrap();
    assert!(Arc::ptr_eq(
        &r.get("mine").unwrap(),
        &r.get("numina_olympiads").unwrap()
    ));
    assert!(!Arc::ptr_eq(
        &r.get("other").unwrap(),
        &r.get("hiyouga/geometry3k").unwrap()
    ));
}

//! `harness retriever index|serve` and `harness data search-task` through the binary: index a
//! corpus, serve it on a free port, query it over HTTP, and check that the synthetic task's SFT
//! traces hold exactly what the search tool returns from the served index.

mod common;

use common::{Env, Tied};

const CORPUS: &str = r#"{"id": "a", "contents": "\"Paris\"\nParis is the capital of France."}
{"id": "b", "contents": "\"Berlin\"\nBerlin is the capital of Germany."}
{"id": "c", "contents": "\"Zorbu\"\nZorbu color is teal."}
"#;

/// A running `harness retriever serve`, killed on drop or when the test binary ends, however
/// it ends (a SIGKILLed test binary would otherwise leave it serving).
struct Server {
    _process: Tied,
    url: String,
}

/// Starts `harness retriever serve DIR --port 0` and reads the URL it prints.
fn serve(env: &Env, dir: &str) -> Server {
    let (process, url) = common::spawn_server(
        env,
        &["retriever", "serve", dir, "--port", "0"],
        "/retrieve",
    );
    Server {
        _process: process,
        url,
    }
}

#[test]
fn index_then_serve_answers_search_r1_requests_on_a_free_port() {
    let env = Env::new();
    env.file("corpus.jsonl", CORPUS);
    let out = env.ok(&["retriever", "index", "corpus.jsonl", "idx"]);
    assert!(out.contains("3 passages indexed"), "{out}");
    let server = serve(&env, "idx");
    let r: serde_json::Value = reqwest::blocking::Client::new()
        .post(&server.url)
        .json(&serde_json::json!({
            "queries": ["capital of Germany", "zorbu color"],
            "topk": 2,
            "return_scores": true
        }))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let result = r["result"].as_array().unwrap();
    assert_eq!(result.len(), 2);
    assert_eq!(result[0].as_array().unwrap().len(), 2);
    assert_eq!(result[0][0]["document"]["id"], "b");
    assert_eq!(result[1][0]["document"]["id"], "c");
    assert!(result[0][0]["score"].as_f64().unwrap() > result[0][1]["score"].as_f64().unwrap());
    let bad = reqwest::blocking::Client::new()
        .post(&server.url)
        .body(r#"{"queries": [1]}"#)
        .send()
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
    assert!(bad.text().unwrap().contains("queries[0]"));
}

#[test]
fn bad_corpora_and_non_loopback_hosts_fail_with_one_line_naming_the_cause() {
    let env = Env::new();
    env.file(
        "corpus.jsonl",
        "{\"id\": \"a\", \"contents\": \"x\"}\n{\"id\": \"b\"}\n",
    );
    let err = env.fails(&["retriever", "index", "corpus.jsonl", "idx"]);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("corpus.jsonl:2:") && err.contains("contents"),
        "{err}"
    );
    let err = env.fails(&["retriever", "serve", "missing"]);
    assert!(err.contains("no index here"), "{err}");
    env.file("ok.jsonl", CORPUS);
    env.ok(&["retriever", "index", "ok.jsonl", "idx"]);
    let err = env.fails(&[
        "retriever",
        "serve",
        "idx",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]);
    assert!(err.contains("not a loopback address"), "{err}");
}

#[test]
fn search_task_traces_hold_what_the_served_index_returns() {
    let env = Env::new();
    let out = env.ok(&[
        "data",
        "search-task",
        "task",
        "--train",
        "12",
        "--test",
        "3",
        "--seed",
        "5",
        "--topk",
        "2",
    ]);
    assert!(out.contains("topk = 2"), "{out}");
    for f in [
        "corpus.jsonl",
        "train.parquet",
        "test.parquet",
        "sft.parquet",
    ] {
        assert!(env.path().join("task").join(f).is_file(), "{f}");
    }
    // Generating again into the same folder replaces the index.
    env.ok(&[
        "data",
        "search-task",
        "task",
        "--train",
        "12",
        "--test",
        "3",
        "--seed",
        "5",
        "--topk",
        "2",
    ]);
    let server = serve(&env, "task/index");
    let search = rl_tools::build_tool(&rl_tools::ToolSpec::Search {
        url: server.url.clone(),
        topk: 2,
        timeout_s: 10.0,
        retries: 0,
    })
    .unwrap();
    let sft = rl_data::SftDataset::open(
        &[env.path().join("task/sft.parquet")],
        &rl_data::SftDataConfig {
            prompt_key: "prompt".into(),
            response_key: "response".into(),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(sft.len(), 12);
    for i in 0..sft.len() {
        let msgs = sft.messages(i).unwrap();
        let trace = &msgs[1].content;
        let query = trace
            .strip_prefix("<search>")
            .and_then(|t| t.split_once("</search>"))
            .map(|(q, _)| q.to_string())
            .unwrap_or_else(|| panic!("{trace:?}"));
        let obs = search.call(std::slice::from_ref(&query));
        assert!(obs[0].valid, "{obs:?}");
        let answer = trace.rsplit_once("<answer>").unwrap().1;
        assert_eq!(
            trace,
            &format!("<search>{query}</search>{}<answer>{answer}", obs[0].text),
            "row {i}"
        );
    }
}

#[test]
fn the_search_commands_have_help_and_search_r1_writes_qa_parquet() {
    let env = Env::new();
    for args in [
        vec!["retriever", "--help"],
        vec!["retriever", "index", "--help"],
        vec!["retriever", "serve", "--help"],
        vec!["data", "search-task", "--help"],
        vec!["data", "search-r1", "--help"],
    ] {
        let out = env.ok(&args);
        assert!(out.contains("Usage:"), "{args:?}: {out}");
    }
    env.file(
        "nq.jsonl",
        "{\"id\": \"1\", \"question\": \"capital of norway\", \"golden_answers\": [\"Oslo\"]}\n",
    );
    let out = env.ok(&["data", "search-r1", "nq.jsonl", "nq/train.parquet"]);
    assert!(out.contains("1 rows, data_source nq"), "{out}");
    let ds = rl_data::RlDataset::open(
        &[env.path().join("nq/train.parquet")],
        &rl_data::ReadOptions {
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_samples: None,
        },
    )
    .unwrap();
    let row = ds.row(0).unwrap();
    assert_eq!(
        row.prompt[0].content,
        rl_data::tasks::search_r1_prompt("capital of norway")
    );
    env.file("bad.jsonl", "{\"question\": \"q\"}\n");
    let err = env.fails(&["data", "search-r1", "bad.jsonl", "x.parquet"]);
    assert!(
        err.contains("bad.jsonl: line 1") && err.contains("golden_answers"),
        "{err}"
    );
}

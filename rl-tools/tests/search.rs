//! The search tool against a real retriever on 127.0.0.1 (a real index in a tempdir), and
//! against servers that are down, slow or answer garbage.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rl_core::{Observation, Tool};
use rl_tools::retriever::{ServerHandle, build_index, serve_in_background};
use rl_tools::{LocalSearchTool, SearchTool, ToolSpec, build_tool, failed_information};

const CORPUS: &str = r#"{"id": "0", "contents": "\"Paris\"\nParis is the capital of France."}
{"id": "1", "contents": "\"Berlin\"\nBerlin is the capital of Germany."}
{"id": "2", "contents": "\"Zorbu\"\nZorbu color is teal."}
{"id": "3", "contents": "\"Kelani\"\nKelani city is Oslo."}
{"id": "4", "contents": "\"Rhine\"\nThe Rhine flows through Germany."}
"#;

fn server() -> (tempfile::TempDir, ServerHandle) {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.jsonl");
    std::fs::write(&corpus, CORPUS).unwrap();
    build_index(&corpus, &tmp.path().join("idx")).unwrap();
    let h = serve_in_background(&tmp.path().join("idx"), 0).unwrap();
    (tmp, h)
}

fn tool(url: &str, topk: usize, timeout_s: f64, retries: u32) -> Box<dyn Tool> {
    build_tool(&ToolSpec::Search {
        url: url.into(),
        topk,
        timeout_s,
        retries,
    })
    .unwrap()
}

#[test]
fn index_serve_and_search_round_trip_returns_the_right_passage_first() {
    let (_tmp, h) = server();
    assert!(h.url().starts_with("http://127.0.0.1:"));
    assert_eq!(h.num_docs(), 5);
    let out = tool(&h.url(), 2, 5.0, 0).call(&["capital of Germany".into()]);
    assert_eq!(out.len(), 1);
    assert!(out[0].valid, "{:?}", out[0]);
    assert!(
        out[0].text.starts_with(
            "\n\n<information>Doc 1(Title: \"Berlin\") Berlin is the capital of Germany.\nDoc 2(Title: "
        ),
        "{:?}",
        out[0].text
    );
    assert!(out[0].text.ends_with("</information>\n\n"));
    let direct = SearchTool::new(&h.url(), 2, Duration::from_secs(5), 0).unwrap();
    assert_eq!((direct.url(), direct.topk()), (h.url().as_str(), 2));
    assert_eq!(direct.call(&["capital of Germany".into()]), out);
}

#[test]
fn a_batch_of_queries_is_one_request_answered_in_order() {
    let (tmp, h) = server();
    let search = tool(&h.url(), 1, 5.0, 0);
    let queries: Vec<String> = ["Zorbu color", "", "Kelani city", "capital of France"]
        .map(String::from)
        .to_vec();
    let out = search.call(&queries);
    assert_eq!(h.requests(), 1);
    assert_eq!(
        out,
        vec![
            Observation::ok(
                "\n\n<information>Doc 1(Title: \"Zorbu\") Zorbu color is teal.</information>\n\n"
            ),
            Observation::failed(failed_information("empty query")),
            Observation::ok(
                "\n\n<information>Doc 1(Title: \"Kelani\") Kelani city is Oslo.</information>\n\n"
            ),
            Observation::ok(
                "\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France.</information>\n\n"
            ),
        ]
    );
    // The in-process twin gives the same observations.
    let local = build_tool(&ToolSpec::LocalSearch {
        index_dir: tmp.path().join("idx"),
        topk: 1,
    })
    .unwrap();
    assert_eq!(local.call(&queries), out);
    assert_eq!(h.requests(), 1);
    let direct = LocalSearchTool::new(
        rl_tools::retriever::Retriever::open(&tmp.path().join("idx")).unwrap(),
        1,
    )
    .unwrap();
    assert_eq!(direct.call(&queries[..1]), out[..1].to_vec());
}

#[test]
fn a_retriever_that_is_down_gives_failed_observations_within_the_timeout() {
    // a port nobody listens on
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let search = tool(&format!("http://127.0.0.1:{port}/retrieve"), 3, 2.0, 1);
    let t = Instant::now();
    let out = search.call(&["a".into(), "b".into()]);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(
        out,
        vec![Observation::failed(failed_information("connection refused")); 2]
    );
}

/// A server that accepts connections and answers each with `response` (or never, when
/// `None`), counting them.
fn fake_server(response: Option<&'static str>) -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/retrieve", l.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in l.incoming() {
            let Ok(mut s) = stream else { return };
            seen.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 4096];
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = s.read(&mut buf);
            match response {
                Some(r) => {
                    let _ = s.write_all(r.as_bytes());
                }
                None => held.push(s),
            }
        }
    });
    (url, count)
}

#[test]
fn a_slow_retriever_times_out_each_attempt_and_the_run_goes_on() {
    let (url, count) = fake_server(None);
    let search = tool(&url, 3, 0.3, 1);
    let t = Instant::now();
    let out = search.call(&["a".into()]);
    let elapsed = t.elapsed();
    assert!(elapsed >= Duration::from_millis(600), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
    assert_eq!(
        out,
        vec![Observation::failed(failed_information(
            "timed out after 0.3s"
        ))]
    );
    assert_eq!(count.load(Ordering::SeqCst), 2);
}

#[test]
fn garbage_and_server_errors_become_failed_observations() {
    let (url, count) = fake_server(Some(
        "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 6\r\nconnection: close\r\n\r\n<html>",
    ));
    let out = tool(&url, 3, 2.0, 2).call(&["a".into()]);
    assert_eq!(
        out,
        vec![Observation::failed(failed_information("bad response"))]
    );
    assert_eq!(count.load(Ordering::SeqCst), 1, "garbage is not retried");

    let (url, count) = fake_server(Some(
        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
    ));
    let out = tool(&url, 3, 2.0, 2).call(&["a".into()]);
    assert_eq!(
        out,
        vec![Observation::failed(failed_information("HTTP 500"))]
    );
    assert_eq!(count.load(Ordering::SeqCst), 3, "5xx is retried");

    let (url, _) = fake_server(Some(
        "HTTP/1.1 200 OK\r\ncontent-length: 14\r\nconnection: close\r\n\r\n{\"result\": []}",
    ));
    let out = tool(&url, 3, 2.0, 0).call(&["a".into(), "b".into()]);
    assert_eq!(
        out,
        vec![Observation::failed(failed_information("bad response")); 2]
    );
}

#[test]
fn the_server_answers_bad_requests_with_400_naming_the_field() {
    let (_tmp, h) = server();
    let client = reqwest::blocking::Client::new();
    let post = |body: &str| {
        let r = client
            .post(h.url())
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .unwrap();
        let status = r.status().as_u16();
        let v: serde_json::Value = r.json().unwrap();
        (status, v)
    };
    let (status, v) = post(r#"{"queries": "capital"}"#);
    assert_eq!(status, 400);
    assert!(v["error"].as_str().unwrap().contains("`queries`"), "{v}");
    let (status, v) = post(r#"{"queries": ["capital"], "topk": -1}"#);
    assert_eq!(status, 400);
    assert!(v["error"].as_str().unwrap().contains("`topk`"), "{v}");
    // Without scores: plain documents, as Search-R1's server answers.
    let (status, v) = post(r#"{"queries": ["Zorbu", "Kelani"], "topk": 1}"#);
    assert_eq!(status, 200);
    assert_eq!(v["result"][0][0]["id"], "2");
    assert_eq!(
        v["result"][1][0]["contents"],
        "\"Kelani\"\nKelani city is Oslo."
    );
    let (status, v) = post(r#"{"queries": ["Zorbu"], "return_scores": true}"#);
    assert_eq!(status, 200);
    assert_eq!(v["result"][0][0]["document"]["id"], "2");
    assert!(v["result"][0][0]["score"].as_f64().unwrap() > 0.0);
    let r = client.get(h.url()).send().unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let r = client
        .post(h.url().replace("/retrieve", "/search"))
        .body("{}")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

#[test]
fn non_loopback_binds_are_refused_unless_allowed() {
    let (tmp, _h) = server();
    let opts = rl_tools::retriever::ServeOptions {
        addr: "0.0.0.0:0".parse().unwrap(),
        ..Default::default()
    };
    let e = rl_tools::retriever::start_server(&tmp.path().join("idx"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a loopback address"), "{e}");
}

#[test]
fn dropping_the_handle_stops_the_server() {
    let (_tmp, h) = server();
    let url = h.url();
    drop(h);
    let out = tool(&url, 1, 1.0, 0).call(&["Zorbu".into()]);
    assert_eq!(
        out,
        vec![Observation::failed(failed_information(
            "connection refused"
        ))]
    );
}

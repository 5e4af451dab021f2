//! The search tool: Search-R1's retrieval client ([`SearchTool`], one HTTP request per turn)
//! and its in-process twin ([`LocalSearchTool`]), both formatting passages as Search-R1 does.

use std::sync::mpsc;
use std::time::Duration;

use rl_core::{Observation, Tool};
use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::retriever::{Doc, MAX_TOPK, Retriever};

/// Search-R1's `_passages2string`: `Doc {i}(Title: {title}) {text}\n` per passage, `i` from 1,
/// the title being the first line of `contents` and the text the rest.
pub fn passages_to_string(docs: &[Doc]) -> String {
    let mut s = String::new();
    for (i, d) in docs.iter().enumerate() {
        s.push_str(&format!(
            "Doc {}(Title: {}) {}\n",
            i + 1,
            d.title(),
            d.text()
        ));
    }
    s
}

/// The text appended after a search call, as Search-R1's `execute_predictions` writes it:
/// `\n\n<information>{passages.trim()}</information>\n\n`.
pub fn format_information(passages: &str) -> String {
    format!("\n\n<information>{}</information>\n\n", passages.trim())
}

/// A failed search's observation text: `\n\n<information>search failed: {reason}</information>\n\n`.
pub fn failed_information(reason: &str) -> String {
    format_information(&format!("search failed: {reason}"))
}

/// Runs the non-empty queries of a turn through `search` and gives one observation per
/// argument, in order; an empty query fails alone, a failed search fails every other query.
fn observe(
    arguments: &[String],
    search: impl FnOnce(&[String]) -> std::result::Result<Vec<Vec<Doc>>, String>,
) -> Vec<Observation> {
    let queries: Vec<String> = arguments
        .iter()
        .map(|a| a.trim().to_string())
        .filter(|q| !q.is_empty())
        .collect();
    let mut results = if queries.is_empty() {
        Ok(Vec::new())
    } else {
        search(&queries).and_then(|r| {
            if r.len() == queries.len() {
                Ok(r)
            } else {
                Err(format!(
                    "bad response: {} results for {} queries",
                    r.len(),
                    queries.len()
                ))
            }
        })
    };
    let (mut hits, failure) = match results.as_mut() {
        Ok(r) => (Some(r.drain(..)), None),
        Err(reason) => (None, Some(reason.clone())),
    };
    arguments
        .iter()
        .map(|a| {
            if a.trim().is_empty() {
                return Observation::failed(failed_information("empty query"));
            }
            match hits.as_mut().and_then(Iterator::next) {
                Some(docs) => Observation::ok(format_information(&passages_to_string(&docs))),
                None => Observation::failed(failed_information(
                    failure.as_deref().unwrap_or("bad response"),
                )),
            }
        })
        .collect()
}

type Reply = std::result::Result<Vec<Vec<Doc>>, String>;
type Job = (Vec<String>, mpsc::SyncSender<Reply>);

/// Search-R1's search tool: all the queries of a turn go in one `POST {url}` with
/// `{"queries": [...], "topk": k, "return_scores": true}`; each query's passages come back as
/// `\n\n<information>Doc 1(Title: ...) ...</information>\n\n`.
///
/// Requests run on a thread of the tool's own with a blocking client (so a caller inside an
/// async runtime is fine), each attempt bounded by `timeout`; connection errors, timeouts and
/// HTTP 5xx are retried `retries` times. A retriever that is down, slow or answers garbage
/// yields failed observations (`search failed: connection refused`), never an error.
#[derive(Debug)]
pub struct SearchTool {
    url: String,
    topk: usize,
    jobs: mpsc::Sender<Job>,
}

impl SearchTool {
    /// A client of the retriever at `url` (`http://127.0.0.1:8000/retrieve`); checks the
    /// arguments and starts the client thread.
    pub fn new(url: &str, topk: usize, timeout: Duration, retries: u32) -> Result<SearchTool> {
        let bad = |key: &str, message: String| Error::Config {
            key: format!("search.{key}"),
            message,
        };
        let parsed = reqwest::Url::parse(url).map_err(|e| bad("url", format!("{url:?}: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(bad(
                "url",
                format!("{url:?}: must be an http:// or https:// URL"),
            ));
        }
        if !(1..=MAX_TOPK).contains(&topk) {
            return Err(bad(
                "topk",
                format!("must be in 1..={MAX_TOPK}, got {topk}"),
            ));
        }
        if timeout.is_zero() {
            return Err(bad("timeout_s", "must be positive".into()));
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let client_url = url.to_string();
        std::thread::Builder::new()
            .name("search-tool".into())
            .spawn(move || client_loop(&client_url, topk, timeout, retries, rx))
            .map_err(|e| bad("url", format!("starting the client thread: {e}")))?;
        Ok(SearchTool {
            url: url.to_string(),
            topk,
            jobs: tx,
        })
    }

    /// The retriever's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Passages asked per query.
    pub fn topk(&self) -> usize {
        self.topk
    }
}

impl Tool for SearchTool {
    fn name(&self) -> &str {
        "search"
    }

    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        observe(arguments, |queries| {
            let (tx, rx) = mpsc::sync_channel(1);
            self.jobs
                .send((queries.to_vec(), tx))
                .map_err(|_| "the client stopped".to_string())?;
            rx.recv()
                .unwrap_or_else(|_| Err("the client stopped".to_string()))
        })
    }
}

/// The client thread: answers jobs until the tool is dropped.
fn client_loop(url: &str, topk: usize, timeout: Duration, retries: u32, jobs: mpsc::Receiver<Job>) {
    let client = reqwest::blocking::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout)
        .build()
        .map_err(|e| {
            tracing::warn!("search tool: cannot build the HTTP client: {e}");
            "cannot start the HTTP client".to_string()
        });
    for (queries, reply) in jobs {
        let result = match &client {
            Ok(c) => request(c, url, &queries, topk, timeout, retries),
            Err(e) => Err(e.clone()),
        };
        let _ = reply.send(result);
    }
}

/// The short reason a request failed, for the model; the details go to the log.
fn short_reason(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return format!("timed out after {}s", timeout.as_secs_f64());
    }
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return "connection refused".into(),
                std::io::ErrorKind::TimedOut => {
                    return format!("timed out after {}s", timeout.as_secs_f64());
                }
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof => {
                    return "connection closed".into();
                }
                _ => {}
            }
        }
        source = s.source();
    }
    if e.is_connect() {
        "cannot connect".into()
    } else {
        "request failed".into()
    }
}

/// One turn's request with retries.
fn request(
    client: &reqwest::blocking::Client,
    url: &str,
    queries: &[String],
    topk: usize,
    timeout: Duration,
    retries: u32,
) -> Reply {
    let body = json!({ "queries": queries, "topk": topk, "return_scores": true });
    let mut reason = String::new();
    for attempt in 0..=retries {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(100 * u64::from(attempt)));
        }
        let response = match client.post(url).json(&body).send() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("search tool: POST {url} (attempt {}): {e:?}", attempt + 1);
                reason = short_reason(&e, timeout);
                continue;
            }
        };
        let status = response.status();
        let text = match response.text() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("search tool: reading the answer of {url}: {e:?}");
                reason = short_reason(&e, timeout);
                continue;
            }
        };
        if status.is_server_error() {
            tracing::warn!("search tool: {url} answered {status}: {text}");
            reason = format!("HTTP {}", status.as_u16());
            continue;
        }
        if !status.is_success() {
            tracing::warn!("search tool: {url} answered {status}: {text}");
            return Err(format!("HTTP {}", status.as_u16()));
        }
        return parse_response(&text, queries.len()).map_err(|detail| {
            tracing::warn!("search tool: bad answer from {url}: {detail}");
            "bad response".to_string()
        });
    }
    Err(reason)
}

/// Reads `{"result": [[{"document": {"contents": ...}, "score": s} | {"contents": ...}, ...]]}`.
fn parse_response(text: &str, n_queries: usize) -> std::result::Result<Vec<Vec<Doc>>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let result = v
        .get("result")
        .and_then(Value::as_array)
        .ok_or("no `result` list")?;
    if result.len() != n_queries {
        return Err(format!("{} results for {n_queries} queries", result.len()));
    }
    result
        .iter()
        .enumerate()
        .map(|(i, hits)| {
            hits.as_array()
                .ok_or(format!("`result[{i}]` is not a list"))?
                .iter()
                .enumerate()
                .map(|(j, hit)| {
                    let doc = hit.get("document").unwrap_or(hit);
                    let contents = doc
                        .get("contents")
                        .and_then(Value::as_str)
                        .ok_or(format!("`result[{i}][{j}]` has no `contents` string"))?;
                    let id = match doc.get("id") {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Null) | None => String::new(),
                        Some(other) => other.to_string(),
                    };
                    Ok(Doc {
                        id,
                        contents: contents.to_string(),
                    })
                })
                .collect()
        })
        .collect()
}

/// [`SearchTool`]'s twin over an index opened in this process: the same observations, no
/// server (for data generation and single-process runs).
#[derive(Debug, Clone)]
pub struct LocalSearchTool {
    retriever: Retriever,
    topk: usize,
}

impl LocalSearchTool {
    /// Searches `retriever` for `topk` passages per query.
    pub fn new(retriever: Retriever, topk: usize) -> Result<LocalSearchTool> {
        if !(1..=MAX_TOPK).contains(&topk) {
            return Err(Error::Config {
                key: "local_search.topk".into(),
                message: format!("must be in 1..={MAX_TOPK}, got {topk}"),
            });
        }
        Ok(LocalSearchTool { retriever, topk })
    }
}

impl Tool for LocalSearchTool {
    fn name(&self) -> &str {
        "search"
    }

    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        observe(arguments, |queries| {
            self.retriever
                .search(queries, self.topk)
                .map(|r| {
                    r.into_iter()
                        .map(|hits| hits.into_iter().map(|(d, _)| d).collect())
                        .collect()
                })
                .map_err(|e| {
                    tracing::warn!("local search: {e}");
                    "index error".to_string()
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(contents: &str) -> Doc {
        Doc {
            id: "0".into(),
            contents: contents.into(),
        }
    }

    #[test]
    fn passages_are_formatted_as_search_r1_does() {
        let docs = [
            doc("\"Paris\"\nParis is the capital of France."),
            doc("\"Lyon\"\nLyon is a city.\nIt has two rivers."),
            doc("\"No text\""),
        ];
        let s = passages_to_string(&docs);
        assert_eq!(
            s,
            "Doc 1(Title: \"Paris\") Paris is the capital of France.\n\
             Doc 2(Title: \"Lyon\") Lyon is a city.\nIt has two rivers.\n\
             Doc 3(Title: \"No text\") \n"
        );
        assert_eq!(
            format_information(&s),
            format!("\n\n<information>{}</information>\n\n", s.trim())
        );
        assert_eq!(
            failed_information("timed out after 1s"),
            "\n\n<information>search failed: timed out after 1s</information>\n\n"
        );
    }

    #[test]
    fn responses_with_and_without_scores_parse_and_garbage_is_named() {
        let with = r#"{"result": [[{"document": {"id": "1", "contents": "\"T\"\nx"}, "score": 1.5}], []]}"#;
        let r = parse_response(with, 2).unwrap();
        assert_eq!(r[0][0].contents, "\"T\"\nx");
        assert!(r[1].is_empty());
        let without = r#"{"result": [[{"id": 7, "contents": "\"T\"\nx"}]]}"#;
        assert_eq!(parse_response(without, 1).unwrap()[0][0].id, "7");
        assert!(
            parse_response("<html>", 1)
                .unwrap_err()
                .contains("not JSON")
        );
        assert!(
            parse_response(r#"{"x": 1}"#, 1)
                .unwrap_err()
                .contains("`result`")
        );
        assert!(
            parse_response(r#"{"result": []}"#, 1)
                .unwrap_err()
                .contains("0 results")
        );
        assert!(
            parse_response(r#"{"result": [[{"id": 1}]]}"#, 1)
                .unwrap_err()
                .contains("`result[0][0]` has no `contents`")
        );
    }

    #[test]
    fn empty_queries_fail_alone_and_a_failed_search_fails_the_rest() {
        let ok = observe(&["a".into(), " ".into(), "b".into()], |q| {
            assert_eq!(q, ["a", "b"]);
            Ok(vec![vec![doc("\"A\"\na")], vec![]])
        });
        assert!(ok[0].valid && !ok[1].valid && ok[2].valid);
        assert_eq!(
            ok[0].text,
            "\n\n<information>Doc 1(Title: \"A\") a</information>\n\n"
        );
        assert_eq!(ok[1].text, failed_information("empty query"));
        assert_eq!(ok[2].text, "\n\n<information></information>\n\n");
        let down = observe(&["a".into(), String::new()], |_| {
            Err("connection refused".into())
        });
        assert_eq!(
            down[0],
            Observation::failed(failed_information("connection refused"))
        );
        assert_eq!(
            down[1],
            Observation::failed(failed_information("empty query"))
        );
        let none = observe(&[String::new()], |_| panic!("no request for empty queries"));
        assert!(!none[0].valid);
    }

    #[test]
    fn bad_arguments_are_config_errors_naming_the_key() {
        let e = SearchTool::new("not a url", 3, Duration::from_secs(1), 0).unwrap_err();
        assert!(e.to_string().starts_with("search.url"), "{e}");
        let e = SearchTool::new("ftp://x/retrieve", 3, Duration::from_secs(1), 0).unwrap_err();
        assert!(e.to_string().contains("http://"), "{e}");
        let e = SearchTool::new("http://x/retrieve", 0, Duration::from_secs(1), 0).unwrap_err();
        assert!(e.to_string().starts_with("search.topk"), "{e}");
        let e = SearchTool::new("http://x/retrieve", 3, Duration::ZERO, 0).unwrap_err();
        assert!(e.to_string().starts_with("search.timeout_s"), "{e}");
    }
}

//! [`ToolSpec`], the config of one tool, and [`build_tool`].

use std::path::PathBuf;
use std::time::Duration;

use rl_core::Tool;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::retriever::Retriever;
use crate::{CalculatorTool, LocalSearchTool, SearchTool};

/// One tool the model may call, chosen by `type`:
///
/// ```toml
/// [[tools]]
/// type = "search"
/// url = "http://127.0.0.1:8000/retrieve"
/// topk = 3
///
/// [[tools]]
/// type = "calculator"
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToolSpec {
    /// Search-R1's retriever over HTTP ([`SearchTool`]), called as `<search>query</search>`.
    Search {
        /// The retrieval endpoint, e.g. `http://127.0.0.1:8000/retrieve` (what
        /// `harness retriever serve` prints).
        url: String,
        /// Passages per query, 1..=1000; default 3 (Search-R1's `retriever.topk`).
        #[serde(default = "default_topk")]
        topk: usize,
        /// Seconds one request attempt may take, > 0; default 30.
        #[serde(default = "default_timeout_s")]
        timeout_s: f64,
        /// Extra attempts after a connection error, a timeout or an HTTP 5xx, 0..=10; default 2.
        /// A call takes at most `(retries + 1) * timeout_s` plus `0.1 * retries * (retries + 1)
        /// / 2` seconds of back-off before it gives failed observations.
        #[serde(default = "default_retries")]
        retries: u32,
    },
    /// The exact `+ - * /` calculator ([`CalculatorTool`]), called as
    /// `<calculator>2+3*4</calculator>`.
    Calculator {},
    /// The search tool over an index opened in this process ([`LocalSearchTool`]): the same
    /// observations as `search` against a server of that index, without the server.
    LocalSearch {
        /// A folder made by `harness retriever index`.
        index_dir: PathBuf,
        /// Passages per query, 1..=1000; default 3.
        #[serde(default = "default_topk")]
        topk: usize,
    },
}

fn default_topk() -> usize {
    3
}
fn default_timeout_s() -> f64 {
    30.0
}
fn default_retries() -> u32 {
    2
}

impl ToolSpec {
    /// The tag the model writes to call it (`search`, `calculator`).
    pub fn name(&self) -> &'static str {
        match self {
            ToolSpec::Search { .. } | ToolSpec::LocalSearch { .. } => "search",
            ToolSpec::Calculator {} => "calculator",
        }
    }
}

/// Builds the tool a spec describes; a value out of range is an error naming its key
/// (`search.timeout_s: must be a positive number of seconds, got -1`).
pub fn build_tool(spec: &ToolSpec) -> Result<Box<dyn Tool>> {
    Ok(match spec {
        ToolSpec::Search {
            url,
            topk,
            timeout_s,
            retries,
        } => {
            if !(timeout_s.is_finite() && *timeout_s > 0.0 && *timeout_s <= 86_400.0) {
                return Err(Error::Config {
                    key: "search.timeout_s".into(),
                    message: format!("must be a number of seconds in (0, 86400], got {timeout_s}"),
                });
            }
            if *retries > 10 {
                return Err(Error::Config {
                    key: "search.retries".into(),
                    message: format!("must be in 0..=10, got {retries}"),
                });
            }
            Box::new(SearchTool::new(
                url,
                *topk,
                Duration::from_secs_f64(*timeout_s),
                *retries,
            )?)
        }
        ToolSpec::Calculator {} => Box::new(CalculatorTool),
        ToolSpec::LocalSearch { index_dir, topk } => {
            Box::new(LocalSearchTool::new(Retriever::open(index_dir)?, *topk)?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Cfg {
        tools: Vec<ToolSpec>,
    }

    #[test]
    fn specs_parse_with_documented_defaults_and_reject_unknown_keys() {
        let cfg: Cfg = toml::from_str(
            r#"
            [[tools]]
            type = "search"
            url = "http://127.0.0.1:8000/retrieve"
            [[tools]]
            type = "calculator"
            [[tools]]
            type = "local_search"
            index_dir = "idx"
            topk = 1
            "#,
        )
        .unwrap();
        assert_eq!(
            cfg.tools,
            vec![
                ToolSpec::Search {
                    url: "http://127.0.0.1:8000/retrieve".into(),
                    topk: 3,
                    timeout_s: 30.0,
                    retries: 2
                },
                ToolSpec::Calculator {},
                ToolSpec::LocalSearch {
                    index_dir: "idx".into(),
                    topk: 1
                },
            ]
        );
        let names: Vec<_> = cfg.tools.iter().map(ToolSpec::name).collect();
        assert_eq!(names, ["search", "calculator", "search"]);
        let bad =
            toml::from_str::<Cfg>("[[tools]]\ntype = \"search\"\nurl = \"http://x\"\ntop_k = 2\n")
                .unwrap_err();
        assert!(bad.to_string().contains("top_k"), "{bad}");
        let bad = toml::from_str::<Cfg>("[[tools]]\ntype = \"grep\"\n").unwrap_err();
        assert!(bad.to_string().contains("grep"), "{bad}");
    }

    #[test]
    fn build_tool_checks_values_and_names_the_key() {
        let spec = |timeout_s: f64, retries: u32| ToolSpec::Search {
            url: "http://127.0.0.1:9/retrieve".into(),
            topk: 3,
            timeout_s,
            retries,
        };
        let e = build_tool(&spec(-1.0, 0)).unwrap_err().to_string();
        assert!(e.starts_with("search.timeout_s"), "{e}");
        let e = build_tool(&spec(1.0, 11)).unwrap_err().to_string();
        assert!(e.starts_with("search.retries"), "{e}");
        assert_eq!(build_tool(&spec(1.0, 0)).unwrap().name(), "search");
        assert_eq!(
            build_tool(&ToolSpec::Calculator {}).unwrap().name(),
            "calculator"
        );
        let missing = tempfile::tempdir().unwrap();
        let e = build_tool(&ToolSpec::LocalSearch {
            index_dir: missing.path().into(),
            topk: 3,
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("no index here"), "{e}");
    }
}

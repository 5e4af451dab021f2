//! Tools the model calls during multi-turn rollouts (Search-R1 style), behind
//! [`rl_core::Tool`], and the retriever that answers the search tool.
//!
//! - [`ToolSpec`] is the config of one tool (`type = "search" | "calculator" | "local_search"`);
//!   [`build_tool`] turns it into a `Box<dyn Tool>`.
//! - [`SearchTool`] speaks Search-R1's retrieval protocol over HTTP (`POST {url}` with
//!   `{"queries", "topk", "return_scores"}`), one request per turn, and formats the passages as
//!   Search-R1's `_passages2string` does; [`LocalSearchTool`] gives the same text from an
//!   index opened in-process.
//! - [`CalculatorTool`] evaluates `+ - * /` and parentheses exactly.
//! - [`retriever`]: [`retriever::build_index`] makes a BM25 (tantivy) index of a Search-R1
//!   corpus (`{"id", "contents": "\"Title\"\ntext"}` per line), [`retriever::Retriever`]
//!   searches it and [`retriever::start_server`] serves it on `POST /retrieve`.
//!
//! A tool never fails the run: a retriever that is down, slow or answers garbage gives
//! [`rl_core::Observation::failed`] with a short reason the model reads.

mod calculator;
mod error;
pub mod http;
pub mod retriever;
mod search;
mod spec;

pub use calculator::{CalculatorTool, evaluate};
pub use error::{Error, Result};
pub use search::{
    LocalSearchTool, SearchTool, failed_information, format_information, passages_to_string,
};
pub use spec::{ToolSpec, build_tool};

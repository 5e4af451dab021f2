//! The `harness` library: the CLI ([`Cli`], [`run`]), the layered experiment config
//! ([`config`]), the SQLite run store ([`Store`]), the training loop with exact
//! checkpoint/resume ([`train`]), sweeps ([`sweep`]), comparisons and plots ([`compare`]), the
//! `runs --filter` language ([`filter`]), the MLflow tracker ([`tracker`]) and a small
//! deterministic trainer of its own ([`bandit`]) for fast tests. [`experiment`] holds the LLM
//! config groups under verl's names and [`compose`] builds the LLM trainers from them.
//!
//! This crate is the only one that knows the CLI, figment, SQLite, the run directory and
//! wall-clock time. `main.rs` only parses the command line and prints errors. Nothing prints with
//! `println!`/`eprintln!`: see [`console`].

#![deny(clippy::print_stdout, clippy::print_stderr)]

#[macro_use]
pub mod console;
pub mod bandit;
pub mod checkpoint;
mod cli;
pub mod compare;
pub mod compose;
pub mod config;
pub mod device;
pub mod experiment;
pub mod filter;
pub mod launch;
mod logging;
pub mod plan;
mod retriever;
mod store;
pub mod sweep;
pub mod tensorboard;
pub mod tracker;
pub mod train;

pub use cli::{Cli, Command};
pub use store::{
    BoxFuture, CheckpointRow, EventRow, GenerationRow, MetricSummary, RunRow, Store, WriteFn,
    hostname, now, pid_alive,
};

/// Runs a parsed command line (installs logging first).
pub fn run(cli: Cli) -> anyhow::Result<()> {
    logging::init();
    cli::run(cli)
}

/// An error and its causes on one line, `outer: cause: root`, leaving out a cause whose text
/// the line already ends with (errors that print their source as part of their own message).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

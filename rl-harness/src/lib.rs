//! The `harness` library: the CLI ([`Cli`], [`run()`]) over six parts, each a folder:
//!
//! - [`store`]: the SQLite run store ([`Store`]) and the `runs --filter` / `trainer.stop_when`
//!   language ([`store::filter`]);
//! - [`config`]: the layered experiment config, its LLM groups under verl's names
//!   ([`config::groups`]) and the rules of the groups a trainer reads ([`config::checks`]);
//! - [`integrations`]: what runs report to or serve beside them: the MLflow tracker, TensorBoard
//!   event files, the BM25 retriever;
//! - [`run`](mod@run): composing the LLM trainers ([`run::compose`]), the training loop with exact
//!   checkpoint/resume ([`run::train`], [`run::checkpoint`]), a rank of a data-parallel group
//!   ([`run::rank`]) and the launcher of ranks ([`run::launch`]);
//! - [`analysis`]: sweeps, comparisons and plots of runs, and the memory plan of a config;
//! - [`ui`]: `harness ui`, the read-only run browser served by the binary (JSON views over the
//!   store and `analysis`, an embedded page).
//!
//! Below them sit leaves that use nothing else in the crate: [`console`] (all printing),
//! `logging`, [`suggest`] (the nearest name to a typo), [`device`] and [`bandit`] (a small
//! deterministic trainer of the harness's own, for fast tests). The layers, bottom to top:
//! leaves, `store`, `config`, `integrations` and `analysis`, `run` and `ui`, `cli`; a module uses
//! only modules of its layer or below, so there is no import cycle (`scripts/module-deps` lists
//! the edges).
//!
//! This crate is the only one that knows the CLI, figment, SQLite, the run directory and
//! wall-clock time. `main.rs` only parses the command line and prints errors. Nothing prints with
//! `println!`/`eprintln!`: see [`console`].

#![deny(clippy::print_stdout, clippy::print_stderr)]

#[macro_use]
pub mod console;
pub mod analysis;
pub mod bandit;
mod cli;
pub mod config;
pub mod device;
pub mod integrations;
mod logging;
pub mod run;
pub mod serve;
pub mod store;
pub mod suggest;
pub mod ui;

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

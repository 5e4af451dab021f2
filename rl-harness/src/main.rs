//! The `harness` binary: parses the command line and runs it; failures print one line and exit 1 (98 for a
//! rank 0 whose rendezvous port was taken).

#![deny(clippy::print_stdout, clippy::print_stderr)]

use clap::Parser;
use rl_harness::run::rank::{PORT_TAKEN_EXIT, PortTaken};
use rl_harness::{console, note};

fn main() {
    // a training step frees and allocates the same large tensors again and again: keep freed
    // memory for them instead of having the kernel zero fresh pages each time (rl_workers::heap)
    rl_workers::heap::keep_freed_memory();
    let cli = rl_harness::Cli::parse();
    let result = rl_harness::run(cli);
    // What could not be written to stdout (other than to a reader that went away) is an error.
    if let (Ok(()), Some(e)) = (&result, console::output_error()) {
        note!("harness: error: writing to standard output: {e}");
        std::process::exit(1);
    }
    if let Err(e) = result {
        note!("harness: error: {}", console::one_line(&e));
        // a rank 0 that could not bind the rendezvous port tells its launcher so
        let port_taken = e.downcast_ref::<PortTaken>().is_some();
        std::process::exit(if port_taken { PORT_TAKEN_EXIT } else { 1 });
    }
}

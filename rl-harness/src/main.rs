//! The `harness` binary: parses the command line and runs it; failures print one line and exit 1.

use clap::Parser;

fn main() {
    let cli = rl_harness::Cli::parse();
    if let Err(e) = rl_harness::run(cli) {
        eprintln!("harness: error: {}", rl_harness::one_line(&e));
        std::process::exit(1);
    }
}

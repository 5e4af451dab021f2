//! The `harness` binary: parses the command line and runs it; failures print one line and exit 1 (98 for a
//! rank 0 whose rendezvous port was taken).

use clap::Parser;

fn main() {
    let cli = rl_harness::Cli::parse();
    if let Err(e) = rl_harness::run(cli) {
        eprintln!("harness: error: {}", rl_harness::one_line(&e));
        // a rank 0 that could not bind the rendezvous port tells its launcher so
        let port_taken = e.downcast_ref::<rl_harness::launch::PortTaken>().is_some();
        std::process::exit(if port_taken {
            rl_harness::launch::PORT_TAKEN_EXIT
        } else {
            1
        });
    }
}

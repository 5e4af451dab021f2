//! Questions asked across runs or before one, rather than a run itself: sweeps (trials started
//! as `harness train` processes and ranked from the store, [`sweep`]), comparisons and plots of
//! runs ([`compare`]), what a listing of runs shows of each ([`listing`]), and the memory a config's run needs ([`plan`]). It uses `config`, `store`
//! and the crate's leaves; `run` does not use it.

pub mod compare;
pub mod listing;
pub mod plan;
pub mod sweep;

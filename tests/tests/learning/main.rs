//! The learning tests, end to end on CPU, in one binary so that each initial-weight seed's SFT
//! warm-up (`rl_e2e::carry_free_warm`) runs once for all of them: every on-policy algorithm
//! (`on_policy`), the preference trainers (`preference`) and reward-model training and RL on a
//! learned reward (`reward_model`) must raise a held-out metric over that start, asserted as a
//! median over `rl_e2e::init_seeds()` with a floor for the worst seed.
//!
//! `cargo test -p rl-e2e --test learning -- --nocapture` runs them all (`on_policy::`,
//! `preference::` or `reward_model::` picks one group) and prints every seed's figures.

mod on_policy;
mod pairs;
mod preference;
mod reward_model;

//! Placeholder until the store benchmark lands.
fn main() {}

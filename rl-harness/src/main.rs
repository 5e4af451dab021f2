//! The `harness` binary: the thin entry point over the library crates.

fn main() {
    println!("harness: the CLI arrives with the harness issue");
}

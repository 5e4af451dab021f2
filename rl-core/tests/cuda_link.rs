//! Regression test for issue #2: a binary built against a CUDA libtorch loads `libtorch_cuda`.

use std::fs;
use std::path::Path;

/// The shared objects mapped into this process, by file name.
fn mapped_libraries() -> Vec<String> {
    let maps = fs::read_to_string("/proc/self/maps").expect("reading /proc/self/maps");
    let mut names: Vec<String> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter_map(|path| Path::new(path).file_name()?.to_str().map(str::to_owned))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The libtorch folder this crate was built against, as `build.rs` resolved it.
fn libtorch_lib() -> &'static Path {
    let lib = env!("RL_CORE_LIBTORCH_LIB");
    assert!(
        !lib.is_empty(),
        "rl-core's build script found no LIBTORCH; run scripts/setup"
    );
    Path::new(lib)
}

#[test]
fn issue_2_libtorch_cuda_is_loaded_exactly_when_libtorch_has_it() {
    // Use rl-core and libtorch as every binary of the workspace does: rustc links only the
    // crates a binary names, so one that used tch alone would not get rl-core's guarantee.
    assert!(rl_core::Batch::new().is_empty());
    let _ = tch::Cuda::is_available();
    let lib = libtorch_lib();
    let mapped = mapped_libraries();
    let is_mapped = |name: &str| mapped.iter().any(|m| m == name);
    // The parse must see libtorch itself, or the CPU branch below would pass vacuously.
    assert!(
        is_mapped("libtorch_cpu.so"),
        "libtorch_cpu.so not found in /proc/self/maps: {mapped:?}"
    );

    for name in ["libtorch_cuda.so", "libc10_cuda.so"] {
        let installed = lib.join(name).exists();
        assert_eq!(
            is_mapped(name),
            installed,
            "{name} exists in {}: {installed}, but mapped into the test process: {} \
             (a CUDA libtorch must keep it linked, a CPU one must not pull it in)",
            lib.display(),
            is_mapped(name),
        );
    }
}

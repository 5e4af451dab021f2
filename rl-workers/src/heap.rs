//! How the process keeps the memory it frees.
//!
//! glibc's allocator maps every large block (above 128 KiB, rising to 32 MiB as blocks are
//! freed) straight from the kernel and unmaps it when freed, and gives the top of its heap back
//! once 128 KiB or more is free there. A training step allocates and frees the same large
//! tensors again and again (the logits of a micro-batch, `[rows, tokens, vocab]` in float32,
//! are 660 MB for 32 x 105 tokens of SmolLM2; their log-softmax and gradients as much again), so
//! each step's first touch of each of their pages is a page fault in which the kernel zeroes
//! the page: on the Intel Xeon VM of docs/perf.md a profile of forward+backward put 25% of all
//! samples in the kernel's `clear_page_erms`. [`keep_freed_memory`] keeps every freed block in
//! the process for the next allocation instead: forward+backward of SmolLM2 at `[32, 105]` took
//! 16.3-16.6 s against 23.5-25.1 s there, for a peak RSS 6-14% higher (fragmentation: freed
//! blocks are reused, not returned).
//!
//! Off the main thread glibc allocates from heaps of at most 64 MiB each, so a larger block
//! allocated there is still mapped and unmapped (a training step runs on the main thread).
//!
//! `harness` calls it first thing, as do the end-to-end tests' `per_seed` (which train
//! in-process, each seed on its own thread: blocks under 64 MiB are then kept there); a user
//! who prefers glibc's defaults sets any of glibc's own variables (`MALLOC_MMAP_MAX_`,
//! `MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`, or `GLIBC_TUNABLES`), which are then
//! left to decide.

/// Keeps freed memory in the process (see the module docs) unless the environment sets glibc's
/// allocator variables; whether it did. A no-op, false, off glibc.
pub fn keep_freed_memory() -> bool {
    const GLIBC_VARS: [&str; 4] = [
        "MALLOC_MMAP_MAX_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_MMAP_THRESHOLD_",
        "GLIBC_TUNABLES",
    ];
    if GLIBC_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
        return false;
    }
    crate::ffi::malloc_keep_freed_memory()
}

#[cfg(test)]
mod tests {
    /// Set in the child process the test below runs itself in.
    const ALONE: &str = "RL_WORKERS_HEAP_TEST_ALONE";

    /// The settings take: a large block is then served from a heap, not mapped from the kernel
    /// (glibc's default maps any block above 32 MiB). The allocator's statistics are the
    /// process's, and the other tests of this binary map blocks of their own meanwhile, so the
    /// test runs itself alone in a child process (the test binary, filtered to this test).
    /// (48 MiB: a thread other than the main one allocates from heaps of at most 64 MiB, and
    /// maps a larger block whatever the setting.)
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn large_blocks_come_from_the_heap() {
        let name = concat!(module_path!(), "::large_blocks_come_from_the_heap");
        let name = name.split_once("::").expect("a crate path").1;
        if std::env::var_os(ALONE).is_none() {
            let exe = std::env::current_exe().expect("the test binary's path");
            let out = std::process::Command::new(exe)
                .args([name, "--exact", "--test-threads=1", "--nocapture"])
                .env(ALONE, "1")
                .output()
                .expect("the test binary runs");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{text}");
            assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
            return;
        }
        assert!(crate::ffi::malloc_keep_freed_memory());
        let before = crate::ffi::malloc_mapped_bytes();
        let block = std::hint::black_box(vec![1u8; 48 << 20]);
        let after = crate::ffi::malloc_mapped_bytes();
        drop(block);
        assert!(
            after < before + (48 << 20),
            "mapped {before} -> {after} bytes"
        );
    }
}

//! One training step of an experiment, measured: the peak resident set size (Linux `VmHWM`)
//! while the trainer is built and while it takes its first step, for `scripts/memory-table`
//! (issue 21), which compares them with `harness plan`'s estimate.
//!
//! The config is resolved as `harness train` resolves it (defaults, the file, `RL_` variables,
//! the overrides) and the trainer is built by the same `compose::build`; then one `step()` runs,
//! without validation, checkpoints, the run store or the final export, so that the figure is
//! the step's and nothing else's. The peak is reset between the two (`/proc/self/clear_refs`).
//!
//! `memory_step CONFIG [key=value ...]` prints one line of `key=value` fields:
//! `start_kib` (RSS before anything), `build_peak_kib`, `built_kib` (RSS once built),
//! `step_peak_kib`, `peak_kib` (the larger peak: the process's), `step_s`. With
//! `MEMORY_STEP_WARMUP=N`, N steps run first and the figures are the next step's;
//! `MEMORY_STEP_BUILD_ONLY=1` stops after building and prints `start_kib`, `build_peak_kib`
//! and `built_kib` alone.
//! On a CUDA device it adds the caching allocator's peaks in bytes (`torch.cuda`'s
//! `max_memory_allocated` / `max_memory_reserved`): `cuda_build_peak_reserved_b` while building,
//! `cuda_step_peak_allocated_b` and `cuda_step_peak_reserved_b` during the step.
//!
//! Started with torchrun's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), it
//! is one rank of a data-parallel group, built as `harness train` builds a rank, and its line
//! starts with `rank=R`: `scripts/zero-memory` (issue 22) measures ZeRO's stages that way.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use rl_harness::config::{self, Override, Sources};

/// A `VmHWM:` / `VmRSS:` field of /proc/self/status, in KiB.
fn status_kib(field: &str) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(field) {
            let kib = rest.trim().trim_end_matches("kB").trim();
            return kib
                .parse()
                .with_context(|| format!("{field} {kib:?} is not a number"));
        }
    }
    bail!("no {field} in /proc/self/status (Linux only)")
}

/// Resets the peak RSS to the current RSS (Linux >= 4.0).
fn reset_peak() -> Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
        .context("resetting VmHWM via /proc/self/clear_refs")
}

fn main() -> Result<()> {
    // as `harness` runs (rl_workers::heap)
    rl_workers::heap::keep_freed_memory();
    let start = status_kib("VmRSS:")?;
    let mut args = std::env::args().skip(1);
    let Some(file) = args.next() else {
        bail!("usage: memory_step CONFIG [key=value ...]");
    };
    let overrides = args
        .map(|a| Override::parse(&a))
        .collect::<Result<Vec<_>>>()?;
    let cfg = config::load(&Sources {
        file: Some(PathBuf::from(file)),
        env: true,
        overrides,
    })?;
    let device = rl_harness::device::open(&cfg.trainer.device)?;
    let group = rl_dist::shared_from_env(std::time::Duration::from_secs(600))?;
    let rank = match &group {
        Some(g) => format!("rank={} ", rl_core::dist::lock(g)?.rank()),
        None => String::new(),
    };
    let mut built = rl_harness::run::compose::build_with_group(&cfg, device, None, group.as_ref())?;
    let build_peak = status_kib("VmHWM:")?;
    let build_device = rl_core::device_memory::stats(device)?;
    let built_rss = status_kib("VmRSS:")?;
    match std::env::var("MEMORY_STEP_BUILD_ONLY").as_deref() {
        Err(_) | Ok("0") => {}
        Ok("1") => {
            println!("{rank}start_kib={start} build_peak_kib={build_peak} built_kib={built_rss}");
            return Ok(());
        }
        Ok(v) => bail!("MEMORY_STEP_BUILD_ONLY={v:?} is not 0 or 1"),
    }
    // MEMORY_STEP_WARMUP=N steps first (their peak is not reported): the optimiser allocates
    // its state in the first step, so a steady-state step is the second
    let warmup: u32 = match std::env::var("MEMORY_STEP_WARMUP") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("MEMORY_STEP_WARMUP={v:?} is not a count"))?,
        Err(_) => 0,
    };
    for i in 0..warmup {
        built
            .trainer
            .step()
            .map_err(|e| anyhow::anyhow!("warm-up step {} failed: {e}", i + 1))?;
    }
    reset_peak()?;
    rl_core::device_memory::reset_peak(device)?;
    let t0 = Instant::now();
    built
        .trainer
        .step()
        .map_err(|e| anyhow::anyhow!("the step failed: {e}"))?;
    let step_s = t0.elapsed().as_secs_f64();
    let step_peak = status_kib("VmHWM:")?;
    let cuda = match (build_device, rl_core::device_memory::stats(device)?) {
        (Some(b), Some(s)) => format!(
            " cuda_build_peak_reserved_b={} cuda_step_peak_allocated_b={} cuda_step_peak_reserved_b={}",
            b.peak_reserved, s.peak_allocated, s.peak_reserved
        ),
        _ => String::new(),
    };
    println!(
        "{rank}start_kib={start} build_peak_kib={build_peak} built_kib={built_rss} step_peak_kib={step_peak} peak_kib={} step_s={step_s:.1}{cuda}",
        build_peak.max(step_peak)
    );
    Ok(())
}

//! `trainer.device` strings (`cpu`, `cuda`, `cuda:N`) to `tch::Device`.

use anyhow::{Result, bail};
use tch::Device;

/// Parses a device string; CUDA devices must exist on this machine only when used.
pub fn parse(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Ok(Device::Cuda(i)),
            _ => bail!("unknown device {other:?}; expected cpu, cuda or cuda:N"),
        },
    }
}

/// Resolves a device for use now: a CUDA device must be present.
pub fn open(s: &str) -> Result<Device> {
    let d = parse(s)?;
    if let Device::Cuda(i) = d
        && i >= tch::Cuda::device_count() as usize
    {
        bail!(
            "device {s:?} asked for but {} CUDA device(s) found",
            tch::Cuda::device_count()
        );
    }
    Ok(d)
}

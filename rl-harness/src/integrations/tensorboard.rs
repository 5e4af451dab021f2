//! TensorBoard event files (verl's `trainer.logger = ["tensorboard"]`): each step's metrics as
//! scalar summaries, one `events.out.tfevents.*` file per process in the run's TensorBoard
//! folder, which `tensorboard --logdir` reads.
//!
//! The format is small enough to write here rather than pull in protobuf: a file is a sequence
//! of TFRecords (`u64` length, masked CRC-32C of the length, the bytes, masked CRC-32C of the
//! bytes), each holding one `tensorflow.Event` protobuf: `wall_time` (field 1, double), `step`
//! (2, int64), `file_version` (3, string; the first record, `brain.Event:2`), `summary` (5), a
//! `Summary` of `Value`s with a `tag` (1, string) and a `simple_value` (2, float), or
//! `session_log` (7), a `SessionLog` whose `status` (1) `START` (1) marks a (re)start. The test
//! reads the files back with TensorBoard's own `EventAccumulator`.
//!
//! A resume appends a new file to the same folder, starting with a `SessionLog.START` at the
//! first step it will write: TensorBoard then drops every point from that step on that older
//! files hold (its "orphaned data" purge), so the curves show what the store holds.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rl_core::StepMetrics;

/// One process's event file.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` if needed and a new event file in it: the version record, then a session
    /// start at `first_step`, the first step this process will write (TensorBoard drops what
    /// older files hold from there on).
    pub fn create(dir: &Path, first_step: u64) -> Result<EventWriter> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the TensorBoard folder {}", dir.display()))?;
        let now = crate::store::now();
        // TensorBoard reads a folder's files in name order, and the name's timestamp leads it:
        // later than every file there, so that this file's session start comes after them
        let latest = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("events.out.tfevents.")?
                    .split('.')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        let stamp = latest.map_or(now as u64, |l| (now as u64).max(l + 1));
        let path = dir.join(format!(
            "events.out.tfevents.{stamp}.{}.{}.0",
            crate::store::hostname(),
            std::process::id()
        ));
        let file = File::options()
            .create_new(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let mut w = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        double_field(&mut event, 1, now);
        bytes_field(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        let mut start = Vec::new();
        double_field(&mut start, 1, now);
        varint(&mut start, 2 << 3);
        varint(&mut start, first_step);
        // session_log { status: START }
        bytes_field(&mut start, 7, &[1 << 3, 1]);
        w.record(&start)?;
        w.flush()?;
        Ok(w)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes step `step`'s metrics as one event of scalar summaries, and flushes it.
    pub fn scalars(&mut self, step: u64, metrics: &StepMetrics) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in metrics {
            let mut v = Vec::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            // simple_value is a float: field 2, wire type 5
            varint(&mut v, (2 << 3) | 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        double_field(&mut event, 1, crate::store::now());
        varint(&mut event, 2 << 3);
        varint(&mut event, step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)?;
        self.flush()
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&rec)
            .with_context(|| format!("writing {}", self.path.display()))
    }

    fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A double field (wire type 1).
fn double_field(out: &mut Vec<u8>, field: u64, v: f64) {
    varint(out, (field << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

/// CRC-32C (Castagnoli), bitwise: records are small and few.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 bits plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // the CRC-32C of "123456789" (RFC 3720, appendix B.4)
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xAC, 0x02]);
    }
}

//! Logs via `tracing`: to stderr (filtered by `RUST_LOG`, default `info`) and, once a run has a
//! directory, to its `harness.log`. Colours only on a terminal, and never under `NO_COLOR`.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;

static RUN_LOG: OnceLock<Mutex<Option<File>>> = OnceLock::new();

fn run_log() -> &'static Mutex<Option<File>> {
    RUN_LOG.get_or_init(|| Mutex::new(None))
}

/// Writes to the current run's log file, if one is open.
#[derive(Clone, Copy)]
struct RunLogWriter;

impl Write for RunLogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut guard) = run_log().lock()
            && let Some(f) = guard.as_mut()
        {
            f.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if let Ok(mut guard) = run_log().lock()
            && let Some(f) = guard.as_mut()
        {
            f.flush()?;
        }
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for RunLogWriter {
    type Writer = RunLogWriter;
    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// Whether stderr may carry ANSI escape codes: it is a terminal and `NO_COLOR` is unset or
/// empty (<https://no-color.org>). Redirected output (a file, a pipe, a test capturing it) gets
/// plain text.
pub(crate) fn stderr_ansi() -> bool {
    ansi_allowed(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

fn ansi_allowed(is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the subscriber (once per process).
pub(crate) fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let console = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Its default reports a failed write with `eprintln!`, which panics once stderr's
        // reader is gone; a log line that cannot be shown is dropped instead.
        .log_internal_errors(false)
        .with_ansi(stderr_ansi())
        .with_target(false)
        .with_filter(filter);
    let file = tracing_subscriber::fmt::layer()
        .with_writer(RunLogWriter)
        .with_ansi(false)
        .with_filter(EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(console)
        .with(file)
        .try_init();
}

/// From now on, logs also go to `path` (appended).
pub(crate) fn to_file(path: &Path) {
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => {
            if let Ok(mut guard) = run_log().lock() {
                *guard = Some(f);
            }
        }
        Err(e) => tracing::warn!("cannot open the run log {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::ansi_allowed;
    use std::ffi::OsStr;

    #[test]
    fn ansi_only_on_a_terminal_without_no_color() {
        assert!(ansi_allowed(true, None));
        assert!(
            ansi_allowed(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!ansi_allowed(true, Some(OsStr::new("1"))));
        assert!(!ansi_allowed(false, None));
        assert!(!ansi_allowed(false, Some(OsStr::new("1"))));
    }
}

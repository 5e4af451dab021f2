//! What the harness prints for people: results on stdout, notes on stderr.
//!
//! Neither may stop the process. `println!` panics once its reader is gone (`harness runs |
//! head`, a closed terminal, a supervisor that dropped the pipe), which would end a training
//! run before it records how it ended. Here, output to a reader that went away is dropped
//! quietly; any other failure to write stdout (a full disk behind `>`) is kept and turns the
//! command's exit status into an error at the end ([`output_error`]), so an answer is never
//! cut short with exit 0. Notes on stderr are best effort: there is nowhere else to say that
//! they failed.
//!
//! `rl-harness` denies `clippy::print_stdout` and `clippy::print_stderr`: everything goes
//! through [`outln!`], [`out!`], [`note!`] or [`stdout`]; an error goes on one line with
//! [`one_line`].
//!
//! A leaf of the crate: every module may print, and this one uses no other.

use std::fmt;
use std::io::{self, Write};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once stdout's reader is gone: everything after it is dropped.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// The first failure to write stdout other than a gone reader.
static STDOUT_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Standard output that drops what a reader that went away can no longer take; other write
/// errors are returned (and remembered for [`output_error`]).
pub struct Stdout(io::StdoutLock<'static>);

/// Locks standard output.
pub fn stdout() -> Stdout {
    Stdout(io::stdout().lock())
}

fn settle<T>(r: io::Result<T>, gone: T) -> io::Result<T> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
            STDOUT_GONE.store(true, Ordering::Relaxed);
            Ok(gone)
        }
        Err(e) => {
            if let Ok(mut first) = STDOUT_ERROR.lock() {
                first.get_or_insert_with(|| e.to_string());
            }
            Err(e)
        }
        ok => ok,
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if STDOUT_GONE.load(Ordering::Relaxed) {
            return Ok(buf.len());
        }
        let r = self.0.write(buf);
        settle(r, buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if STDOUT_GONE.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.0.flush();
        settle(r, ())
    }
}

/// Writes to stdout (see [`outln!`]).
pub fn print(args: fmt::Arguments<'_>) {
    let mut out = stdout();
    // A failure is remembered by `settle` and reported at exit.
    let _ = out.write_fmt(args).and_then(|()| out.flush());
}

/// Writes a line to stderr, best effort.
pub fn note(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// The first failure to write stdout, other than its reader going away.
pub fn output_error() -> Option<String> {
    STDOUT_ERROR.lock().ok().and_then(|e| e.clone())
}

/// An error and its causes on one line, `outer: cause: root`, leaving out a cause whose text
/// the line already ends with (errors that print their source as part of their own message).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// `print!` that never panics (see the module docs).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::console::print(format_args!($($arg)*)) };
}

/// `println!` that never panics (see the module docs).
#[macro_export]
macro_rules! outln {
    () => { $crate::console::print(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::console::print(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `eprintln!` that never panics (see the module docs).
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => { $crate::console::note(format_args!($($arg)*)) };
}

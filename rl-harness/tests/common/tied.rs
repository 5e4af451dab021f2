//! Processes that cannot outlive the test process (issue 17).
//!
//! A test that starts a long-lived process (the MLflow server, a retriever server, a launcher
//! and its ranks) must not leave it, or anything it started, running once the test binary ends,
//! however it ends: normally (a server shared through a `static OnceLock` is never dropped, so
//! no destructor runs for it), by a panic, by SIGTERM or by SIGKILL. [`Tied`] does it with two
//! pieces, neither of which needs code to run in the test process at exit:
//!
//! - The process runs through `setsid(1)`, so it leads a session of its own, and everything it
//!   starts stays in that session: MLflow's uvicorn, job runner and huey consumers, and the
//!   launcher's ranks, which the launcher puts in process groups of their own (so a process
//!   group would not hold them). A freshly spawned child never leads a process group, so
//!   `setsid` execs the program in place: the child's pid is the program's and the session id.
//! - A watchdog `sh`, in a process group of its own (a Ctrl-C at the terminal reaches the test
//!   binary's group, not it), blocks in `cat` on a pipe whose only write end this process holds
//!   (std opens pipes close-on-exec, so no other child inherits it). However this process ends,
//!   the kernel closes that end, `cat` reads end-of-file and the watchdog SIGKILLs every process
//!   in the session; SIGKILL, since the huey consumers survive SIGTERM. Dropping a [`Tied`]
//!   closes the pipe the same way and waits for the watchdog, so every way out takes the same
//!   path.
//!
//! Not `PR_SET_PDEATHSIG`: it needs an `unsafe` `pre_exec`, reaches only the direct child (not
//! the server's workers or the ranks), and fires when the *thread* that spawned the child ends,
//! which for a server shared by a binary's tests is whichever test thread started it first.
//! `scripts/check-leftovers` checks after the suite that nothing was left running.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// A child process in a session of its own, killed with the whole session when this is dropped
/// or when the test process ends in any way.
pub struct Tied {
    /// The process itself (its pid is the session id). Do not move it out: wait on it, take its
    /// pipes, signal it.
    pub child: Child,
    /// The `sh` that kills the session when its stdin, held here, reaches end-of-file.
    watchdog: Child,
}

impl Tied {
    /// A command that runs `program` in a session of its own: add arguments, environment and
    /// stdio, then [`Tied::spawn`] it. Do not give it a `process_group`: `setsid` would then
    /// fork, and the pid spawned would not be the session's.
    pub fn command(program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("setsid");
        c.arg(program);
        c
    }

    /// Spawns `cmd` (from [`Tied::command`]) and the watchdog of its session.
    pub fn spawn(cmd: &mut Command) -> Tied {
        assert_eq!(
            cmd.get_program(),
            "setsid",
            "Tied::spawn takes a command from Tied::command"
        );
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let session = child.id().to_string();
        let watchdog = Command::new("sh")
            .args([
                "-c",
                "cat >/dev/null; pkill -KILL -s \"$1\"",
                // $0, so that the watchdog is recognisable in `ps`
                "rl-test-watchdog",
                &session,
            ])
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn();
        match watchdog {
            Ok(watchdog) => Tied { child, watchdog },
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("spawning the watchdog of {cmd:?}: {e}");
            }
        }
    }
}

impl Drop for Tied {
    fn drop(&mut self) {
        // end-of-file for the watchdog: it SIGKILLs the session, then exits
        drop(self.watchdog.stdin.take());
        let _ = self.watchdog.wait();
        // the child itself in case it was not in its session yet (still in `setsid`); a no-op
        // once it has been reaped
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

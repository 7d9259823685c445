//! Child processes of this binary: spawned with a parent-death signal so that no child outlives
//! its parent (a `kill -9` of the local runner included), and killed when their handle drops.

use std::ffi::OsStr;
use std::process::Stdio;

use tokio::process::{Child, Command};

/// Path of the running executable, for re-spawning it as a child role.
pub fn self_exe() -> std::io::Result<std::path::PathBuf> {
    std::env::current_exe()
}

/// A command that runs this binary with `args`, ready to spawn as a supervised child.
pub fn self_command<I, S>(args: I) -> std::io::Result<Command>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new(self_exe()?);
    cmd.args(args);
    supervise(&mut cmd);
    Ok(cmd)
}

/// Makes `cmd`'s child die with this process (Linux `PR_SET_PDEATHSIG`), start in its own
/// process group (so a terminal's Ctrl-C reaches the supervisor, which stops children in order),
/// and be killed when its handle drops.
pub fn supervise(cmd: &mut Command) {
    cmd.kill_on_drop(true).stdin(Stdio::null()).process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id();
        // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
        // functions (prctl, getppid, raise).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() as u32 != parent {
                    libc::raise(libc::SIGKILL);
                }
                Ok(())
            });
        }
    }
}

/// Sends SIGTERM to a child (a no-op if it already exited).
pub fn terminate(child: &Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) with a pid we spawned; at worst the process is already gone.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGTERM);
        }
    }
}

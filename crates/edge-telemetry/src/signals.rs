//! The signals a daemon obeys once it is ready: SIGTERM and SIGINT stop it in order, SIGHUP
//! reloads its configuration.
//!
//! [`Signals::listen`] must run **before** the daemon reports READY. Tokio installs a handler
//! only when asked; until then a signal takes its default action, which for all three is to end
//! the process at once. A supervisor that stops or reloads the daemon as soon as READY arrives
//! (systemd may) would otherwise find it killed mid-way instead of stopped or reloaded.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// What a received signal asks of the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// SIGTERM or SIGINT: the orderly shutdown.
    Stop,
    /// SIGHUP: read the configuration again.
    Reload,
}

/// The daemon's signal handlers, installed by [`Signals::listen`].
#[derive(Debug)]
pub struct Signals {
    term: Signal,
    interrupt: Signal,
    hangup: Signal,
}

impl Signals {
    /// Installs the handlers. Needs a Tokio runtime with I/O enabled.
    pub fn listen() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
            hangup: signal(SignalKind::hangup())?,
        })
    }

    /// The next request. Cancel safe: a signal that arrives while this future is dropped (in a
    /// `select!`) is returned by the next call.
    pub async fn next(&mut self) -> Request {
        tokio::select! {
            _ = self.term.recv() => Request::Stop,
            _ = self.interrupt.recv() => Request::Stop,
            _ = self.hangup.recv() => Request::Reload,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signal that arrives before anyone awaits [`Signals::next`] is kept for it, not acted
    /// on by default (which would end this test process).
    #[tokio::test]
    async fn a_signal_before_the_first_await_is_kept() -> std::io::Result<()> {
        let mut signals = Signals::listen()?;
        let status = std::process::Command::new("kill").args(["-HUP", &std::process::id().to_string()]).status()?;
        assert!(status.success());
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), signals.next()).await;
        assert_eq!(got.ok(), Some(Request::Reload));
        Ok(())
    }
}

//! systemd `sd_notify` messages. Every function is a no-op when `NOTIFY_SOCKET` is unset, so the
//! daemons call them unconditionally.

use sd_notify::NotifyState;

fn send(state: &[NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}

/// The daemon is ready: its durable state is open and it accepts work.
pub fn ready() {
    send(&[NotifyState::Ready]);
}

/// Liveness ping for `WatchdogSec`.
pub fn watchdog() {
    send(&[NotifyState::Watchdog]);
}

/// The daemon began an orderly shutdown.
pub fn stopping() {
    send(&[NotifyState::Stopping]);
}

/// A one-line status shown by `systemctl status`.
pub fn status(text: &str) {
    send(&[NotifyState::Status(text)]);
}

/// The watchdog interval systemd asked for, halved as systemd recommends; `None` when disabled,
/// or when `WATCHDOG_PID` names another process (the variables were inherited).
pub fn watchdog_interval() -> Option<std::time::Duration> {
    sd_notify::watchdog_enabled().filter(|d| !d.is_zero()).map(|d| d / 2)
}

/// A daemon's storage thread in one write or fsync this long is stuck: every producer, ack or
/// chunk waits for it, where a healthy disk takes milliseconds. Both daemons' `status` call it
/// degraded from here.
pub const STUCK_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a storage thread may be in one operation before the daemon withholds its watchdog
/// ping, so that systemd restarts it if it stays stuck: a ping interval (half of `WatchdogSec`),
/// and never less than [`STUCK_AFTER`]. A short `WatchdogSec` set by an operator must not
/// restart a daemon over one slow fsync of a flash card: a restart does not make the disk
/// faster, and costs a recovery.
pub fn withhold_after(ping_interval: std::time::Duration) -> std::time::Duration {
    ping_interval.max(STUCK_AFTER)
}

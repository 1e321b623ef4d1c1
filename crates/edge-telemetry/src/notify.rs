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

/// The watchdog pings of a daemon whose storage thread can get stuck: each ping is sent unless
/// that thread has been in one operation for [`withhold_after`] the interval, and withholding
/// starts and ends with one log line each.
#[derive(Debug)]
pub struct Watchdog {
    interval: Option<std::time::Duration>,
    /// Who systemd restarts, for the log ("the agent").
    restarts: &'static str,
    withheld: bool,
}

impl Watchdog {
    /// The watchdog systemd asked for ([`watchdog_interval`]).
    pub fn from_env(restarts: &'static str) -> Self {
        Watchdog { interval: watchdog_interval(), restarts, withheld: false }
    }

    /// How often to call [`Watchdog::ping_unless_stuck`]; `None` when there is no watchdog.
    pub fn interval(&self) -> Option<std::time::Duration> {
        self.interval
    }

    /// Pings, unless `busy` (how long the storage thread has been in its current operation)
    /// reaches [`withhold_after`] the interval. `stuck` says what waits, for the log line of the
    /// first ping withheld; `back` starts the line of the first ping sent again.
    pub fn ping_unless_stuck(
        &mut self,
        busy: Option<std::time::Duration>,
        stuck: impl FnOnce(std::time::Duration) -> String,
        back: &str,
    ) {
        let Some(interval) = self.interval else { return };
        match busy.filter(|d| *d >= withhold_after(interval)) {
            Some(d) => {
                if !self.withheld {
                    tracing::error!(
                        busy_s = d.as_secs_f64(),
                        "{}; withholding the watchdog ping, so systemd restarts {} if it stays stuck",
                        stuck(d),
                        self.restarts
                    );
                }
                self.withheld = true;
            }
            None => {
                if self.withheld {
                    tracing::warn!("{back}; sending the watchdog ping again");
                }
                self.withheld = false;
                watchdog();
            }
        }
    }
}

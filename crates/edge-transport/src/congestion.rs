//! The agent's congestion controller: quinn's Cubic (or its BBR, by
//! [`Tuning::congestion_controller`](crate::Tuning::congestion_controller)), except that the
//! loss of a packet sent before the path had delivered anything is not taken as a sign of
//! congestion.
//!
//! An agent reconnects while the path or the server is still down: its first Initial goes
//! nowhere, quinn sends it again after the probe timeout, and once the path is back the copy
//! is answered and the first one is declared lost. Plain Cubic treats that as congestion: it
//! leaves slow start at 70 % of the initial window (8,400 bytes) and then grows the window by
//! its congestion-avoidance curve, just when a backlog waits to be drained: over a 100 Mbit/s
//! uplink at 20 ms round trip the agent's drain reached 0.68 × raw quinn's throughput on the
//! same path before this controller, 0.99 × with it and the uploader's chunk priorities
//! (`edge-bench uplink`, `BENCHMARKS.md`).
//! A packet sent before any packet of the connection got through says the path was not there,
//! not that it was full. TCP makes the same distinction for a lost SYN: it restarts from a
//! small window but stays in slow start.
//!
//! So [`OutageTolerant`] passes every event to the controller it wraps (Cubic by default, or
//! quinn's BBR: [`Tuning::congestion_controller`](crate::Tuning::congestion_controller)),
//! except congestion events whose latest lost packet was sent before the earliest packet that
//! was acknowledged. Anything lost after the path has been shown to work counts as usual.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics, CubicConfig};
use quinn_proto::RttEstimator;

/// Builds [`OutageTolerant`] controllers around the controllers of another factory
/// (by default Cubic with quinn's defaults).
pub struct OutageTolerantConfig {
    inner: Arc<dyn ControllerFactory + Send + Sync>,
}

impl OutageTolerantConfig {
    /// Wraps the controllers that `inner` builds.
    pub fn new(inner: Arc<dyn ControllerFactory + Send + Sync>) -> Self {
        Self { inner }
    }
}

impl Default for OutageTolerantConfig {
    fn default() -> Self {
        Self::new(Arc::new(CubicConfig::default()))
    }
}

impl std::fmt::Debug for OutageTolerantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutageTolerantConfig").finish_non_exhaustive()
    }
}

impl ControllerFactory for OutageTolerantConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(OutageTolerant { inner: self.inner.clone().build(now, current_mtu), path: PathUp::default() })
    }
}

/// A controller that ignores the losses of packets sent before the path delivered anything.
pub struct OutageTolerant {
    inner: Box<dyn Controller>,
    path: PathUp,
}

impl std::fmt::Debug for OutageTolerant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutageTolerant").field("window", &self.inner.window()).field("path", &self.path).finish()
    }
}

/// When the path was first shown to work: the send time of the earliest packet acknowledged.
#[derive(Debug, Default, Clone, Copy)]
struct PathUp {
    since: Option<Instant>,
}

impl PathUp {
    fn acked(&mut self, sent: Instant) {
        self.since = Some(self.since.map_or(sent, |s| s.min(sent)));
    }

    /// Whether a loss whose latest packet was sent at `sent` is a congestion signal.
    fn is_congestion(&self, sent: Instant) -> bool {
        self.since.is_some_and(|up| sent >= up)
    }
}

impl Controller for OutageTolerant {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: &RttEstimator) {
        self.path.acked(sent);
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, largest_packet_num_acked: Option<u64>) {
        self.inner.on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, is_persistent_congestion: bool, lost_bytes: u64) {
        if self.path.is_congestion(sent) {
            self.inner.on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
        } else {
            tracing::debug!(lost_bytes, "loss of packets sent before the path answered; not congestion");
        }
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.inner.window()
    }

    fn metrics(&self) -> ControllerMetrics {
        self.inner.metrics()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(OutageTolerant { inner: self.inner.clone_box(), path: self.path })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn controller(now: Instant) -> OutageTolerant {
        OutageTolerant { inner: Arc::new(CubicConfig::default()).build(now, 1200), path: PathUp::default() }
    }

    #[test]
    fn a_loss_from_before_the_path_answered_keeps_the_window_and_a_later_one_shrinks_it() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut c = controller(t0);
        let initial = c.window();
        // The first Initial, sent into an outage, is declared lost once its copy (sent at
        // 1000 ms) is acknowledged.
        c.path.acked(ms(1000));
        c.on_congestion_event(ms(1040), ms(0), false, 1200);
        assert_eq!(c.window(), initial);
        // A packet sent once the path works, lost: congestion.
        c.on_congestion_event(ms(1300), ms(1200), false, 1200);
        assert!(c.window() < initial, "{} !< {initial}", c.window());
    }

    #[test]
    fn nothing_acknowledged_yet_means_no_congestion_and_the_earliest_ack_counts() {
        let t0 = Instant::now();
        let mut up = PathUp::default();
        assert!(!up.is_congestion(t0));
        up.acked(t0 + Duration::from_millis(50));
        up.acked(t0 + Duration::from_millis(10));
        assert!(!up.is_congestion(t0 + Duration::from_millis(9)));
        assert!(up.is_congestion(t0 + Duration::from_millis(10)));
    }
}

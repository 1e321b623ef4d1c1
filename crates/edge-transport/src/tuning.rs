//! [`Tuning`]: the QUIC transport knobs that measurably matter for bulk chunk uploads, with
//! defaults taken from the loopback measurements of quinn 0.11 on the development VM, and the
//! translation into quinn `TransportConfig`s for each side.
//!
//! What the measurements say, in short (`edge-bench sweep`, BENCHMARKS.md "The sweep"): GSO is
//! the most important knob (off, raw quinn moved 0.43 × the bytes at 2.3 × the sender's CPU
//! per byte), MTU discovery is worth about 10 % of CPU per byte, 4 MiB socket buffers remove
//! kernel UDP drops under bursts, and the windows do not matter on loopback but cap
//! throughput on a WAN (a window `W` caps a path with round-trip time `RTT` at `W / RTT`). quinn's connection-level receive window is
//! unbounded by default; we bound it so one connection cannot pin unbounded server memory.
//! Asking the receiver for fewer ACKs changed nothing on loopback, where it already sends one
//! per batch of datagrams it reads (BENCHMARKS.md, "Done and tried since the `a54f6d1` run", 12).

use std::sync::Arc;
use std::time::Duration;

use quinn::congestion::{BbrConfig, ControllerFactory, CubicConfig};
use quinn::{AckFrequencyConfig, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};

use crate::TransportError;

const MIB: u64 = 1024 * 1024;

/// Transport tuning shared by both ends. Build with `Tuning::default()` and override fields.
///
/// The server and client transports derived from it differ only in stream limits: the server
/// lets an agent open one bidirectional (control) stream and
/// [`max_concurrent_uni_streams`](Self::max_concurrent_uni_streams) chunk streams; the client
/// lets the server open none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuning {
    /// Flow-control window of one stream, in bytes: how much a sender may have unacknowledged
    /// on a single stream. Default 16 MiB, enough for 128 MB/s per stream at 100 ms RTT
    /// (quinn's default of 1.25 MB caps a stream at about 12.5 MB/s there).
    pub stream_receive_window: u64,
    /// Connection-level flow-control window, in bytes: the sum over all streams of one
    /// connection. Default 64 MiB. Must be bounded: quinn's default (`VarInt::MAX`) lets a
    /// single connection with many streams pin `streams x stream window` of server memory.
    pub receive_window: u64,
    /// How many bytes the sender buffers unacknowledged across all streams. Default 64 MiB
    /// (quinn's 10 MB caps a connection at about 100 MB/s at 100 ms RTT).
    pub send_window: u64,
    /// Server side: how many chunk (uni) streams an agent may have open at once. Default 256,
    /// above the 32-128 chunks an uploader keeps in flight.
    pub max_concurrent_uni_streams: u32,
    /// Interval of QUIC PINGs on an otherwise idle connection, so NAT bindings and the idle
    /// timer stay alive. Default 3 s. `Duration::ZERO` disables keep-alives; otherwise it must
    /// be shorter than [`max_idle_timeout`](Self::max_idle_timeout).
    pub keep_alive_interval: Duration,
    /// A connection with no traffic for this long is dropped. The effective value is the
    /// smaller of both ends' settings. Default 10 s: a peer that died without closing (a
    /// crash, a power cut: UDP tells nobody) is noticed within it, and the agent reconnects;
    /// with keep-alives every 3 s a healthy idle connection never comes near it (the 30 s NAT
    /// bindings of RFC 9308 §3.2 stay refreshed too). Must be non-zero.
    pub max_idle_timeout: Duration,
    /// Probe for a path MTU above the 1200-byte QUIC minimum (up to 1452 by default).
    /// Default on: worth 10-15 % CPU per byte.
    pub mtu_discovery: bool,
    /// `SO_RCVBUF` and `SO_SNDBUF` of the UDP socket, in bytes. Default 4 MiB, which removed
    /// kernel UDP drops in the measurements. The kernel caps the value at
    /// `net.core.rmem_max` / `net.core.wmem_max`; a warning with the granted size is logged
    /// when it does. `0` keeps the kernel default.
    pub socket_buffer_bytes: usize,
    /// RTT assumed before the first measurement. Default 333 ms, quinn's (and RFC 9002's)
    /// value.
    pub initial_rtt: Duration,
    /// Hand the kernel several packets per `sendmsg` (UDP GSO) where it supports it. Default on,
    /// as in quinn; off only to measure what it is worth (`edge-bench sweep`).
    pub segmentation_offload: bool,
    /// Client side: losses of packets sent before the path delivered anything (an Initial sent
    /// into an outage) are not taken as congestion, so a reconnection still starts in slow
    /// start (see [`crate::congestion`]). Default on; off gives quinn's plain controller.
    pub outage_tolerant_congestion: bool,
    /// Client side: the congestion controller of the agent's connections. Default Cubic.
    pub congestion_controller: CongestionController,
    /// Ask the peer (by the QUIC ACK-frequency extension, which quinn peers support) to send an
    /// ACK only once more than this many ack-eliciting packets have arrived, instead of for every
    /// second one. `None` (the default) leaves the peer at its own rate.
    pub ack_eliciting_threshold: Option<u32>,
}

/// The congestion controller of the agent's connections (the sender of nearly every byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CongestionController {
    /// quinn's Cubic (RFC 9438): loss-based, it cuts its window to 70 % at every loss event.
    #[default]
    Cubic,
    /// quinn's BBR (version 1, marked experimental by quinn): does not read each loss as
    /// congestion, so with random loss it carries several times Cubic's throughput; but it
    /// sent about twice the payload's bytes, the excess dropped at the bottleneck, on every
    /// path measured (`edge-bench uplink`, BENCHMARKS.md "Cubic or BBR over the same paths").
    Bbr,
}

impl CongestionController {
    /// Every controller, in the order the benches measure them.
    pub const ALL: [CongestionController; 2] = [CongestionController::Cubic, CongestionController::Bbr];

    /// The name used in configuration files and bench output.
    pub fn name(self) -> &'static str {
        match self {
            CongestionController::Cubic => "cubic",
            CongestionController::Bbr => "bbr",
        }
    }

    /// Parses a [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    fn factory(self) -> Arc<dyn ControllerFactory + Send + Sync> {
        match self {
            CongestionController::Cubic => Arc::new(CubicConfig::default()),
            CongestionController::Bbr => Arc::new(BbrConfig::default()),
        }
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Self {
            stream_receive_window: 16 * MIB,
            receive_window: 64 * MIB,
            send_window: 64 * MIB,
            max_concurrent_uni_streams: 256,
            keep_alive_interval: Duration::from_secs(3),
            max_idle_timeout: Duration::from_secs(10),
            mtu_discovery: true,
            socket_buffer_bytes: 4 * MIB as usize,
            initial_rtt: Duration::from_millis(333),
            segmentation_offload: true,
            outage_tolerant_congestion: true,
            congestion_controller: CongestionController::default(),
            ack_eliciting_threshold: None,
        }
    }
}

impl Tuning {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), TransportError> {
        self.base_transport().map(drop)
    }

    /// The transport for the ingest server: one bidirectional stream per connection (the
    /// agent's control stream), [`max_concurrent_uni_streams`](Self::max_concurrent_uni_streams)
    /// unidirectional chunk streams.
    pub fn server_transport(&self) -> Result<TransportConfig, TransportError> {
        let mut transport = self.base_transport()?;
        transport
            .max_concurrent_bidi_streams(VarInt::from_u32(1))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_concurrent_uni_streams));
        Ok(transport)
    }

    /// The transport for the agent: the server may open no streams of either kind.
    pub fn client_transport(&self) -> Result<TransportConfig, TransportError> {
        let mut transport = self.base_transport()?;
        transport.max_concurrent_bidi_streams(VarInt::from_u32(0)).max_concurrent_uni_streams(VarInt::from_u32(0));
        // Chunks in flight go out one after another instead of round-robin, so that on a thin
        // uplink the oldest chunk arrives whole (and is stored and acked) first, rather than
        // every chunk in flight finishing together at the end, and a connection lost midway
        // leaves fewer chunks half sent. On its own that holds only without loss: quinn queues
        // a stream's resends behind every pending stream of the same priority, so the agent
        // also gives each chunk stream a priority by age (see the uploader's `chunk_priority`;
        // `edge-bench uplink` measured no difference from it at 0.5 % loss). On loopback it changed neither the drain nor the
        // agent's CPU beyond the noise (6 alternated `edge-bench pipeline` runs per build,
        // `5ed2ebd`).
        transport.send_fairness(false);
        let factory = self.congestion_controller.factory();
        if self.outage_tolerant_congestion {
            transport.congestion_controller_factory(Arc::new(crate::congestion::OutageTolerantConfig::new(factory)));
        } else {
            transport.congestion_controller_factory(factory);
        }
        Ok(transport)
    }

    fn base_transport(&self) -> Result<TransportConfig, TransportError> {
        let stream_receive_window = window("stream_receive_window", self.stream_receive_window)?;
        let receive_window = window("receive_window", self.receive_window)?;
        if receive_window == VarInt::MAX {
            return Err(invalid(
                "receive_window",
                self.receive_window,
                "must be bounded; VarInt::MAX leaves server memory per connection unbounded",
            ));
        }
        if self.send_window == 0 {
            return Err(invalid("send_window", self.send_window, "must be > 0"));
        }
        if self.max_concurrent_uni_streams == 0 {
            return Err(invalid(
                "max_concurrent_uni_streams",
                self.max_concurrent_uni_streams,
                "must be > 0, or agents cannot open any chunk stream",
            ));
        }
        if self.max_idle_timeout.is_zero() {
            return Err(invalid(
                "max_idle_timeout",
                format!("{:?}", self.max_idle_timeout),
                "must be > 0; connections of vanished peers would never be freed",
            ));
        }
        let idle = IdleTimeout::try_from(self.max_idle_timeout).map_err(|_| {
            invalid(
                "max_idle_timeout",
                format!("{:?}", self.max_idle_timeout),
                "is too large for QUIC (at most 2^62 ms)",
            )
        })?;
        if !self.keep_alive_interval.is_zero() && self.keep_alive_interval >= self.max_idle_timeout {
            return Err(invalid(
                "keep_alive_interval",
                format!("{:?}", self.keep_alive_interval),
                "must be shorter than max_idle_timeout, or idle connections time out anyway",
            ));
        }
        if self.initial_rtt.is_zero() {
            return Err(invalid("initial_rtt", format!("{:?}", self.initial_rtt), "must be > 0"));
        }
        if i32::try_from(self.socket_buffer_bytes).is_err() {
            return Err(invalid(
                "socket_buffer_bytes",
                self.socket_buffer_bytes,
                "must fit the kernel's int (< 2 GiB)",
            ));
        }

        let mut transport = TransportConfig::default();
        transport
            .stream_receive_window(stream_receive_window)
            .receive_window(receive_window)
            .send_window(self.send_window)
            .max_idle_timeout(Some(idle))
            .keep_alive_interval((!self.keep_alive_interval.is_zero()).then_some(self.keep_alive_interval))
            .mtu_discovery_config(self.mtu_discovery.then(MtuDiscoveryConfig::default))
            .initial_rtt(self.initial_rtt)
            // GSO is quinn's default; said explicitly because it is the knob that matters most.
            .enable_segmentation_offload(self.segmentation_offload)
            // The protocol uses no datagrams: do not advertise a datagram buffer to peers.
            .datagram_receive_buffer_size(None);
        if let Some(threshold) = self.ack_eliciting_threshold {
            let mut ack = AckFrequencyConfig::default();
            ack.ack_eliciting_threshold(VarInt::from_u32(threshold));
            transport.ack_frequency_config(Some(ack));
        }
        Ok(transport)
    }
}

fn window(field: &'static str, value: u64) -> Result<VarInt, TransportError> {
    if value == 0 {
        return Err(invalid(field, value, "must be > 0"));
    }
    VarInt::from_u64(value).map_err(|_| invalid(field, value, "exceeds the QUIC maximum of 2^62 - 1"))
}

fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> TransportError {
    TransportError::InvalidTuning { field, value: value.to_string(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(err: TransportError) -> &'static str {
        match err {
            TransportError::InvalidTuning { field, .. } => field,
            other => panic!("expected InvalidTuning, got {other}"),
        }
    }

    #[test]
    fn defaults_match_the_measured_profile() {
        let t = Tuning::default();
        assert_eq!(t.stream_receive_window, 16 * MIB);
        assert_eq!(t.receive_window, 64 * MIB);
        assert_eq!(t.send_window, 64 * MIB);
        assert_eq!(t.max_concurrent_uni_streams, 256);
        assert_eq!(t.keep_alive_interval, Duration::from_secs(3));
        assert_eq!(t.max_idle_timeout, Duration::from_secs(10));
        assert!(t.mtu_discovery);
        assert_eq!(t.socket_buffer_bytes, 4 * 1024 * 1024);
        assert_eq!(t.initial_rtt, Duration::from_millis(333));
        assert!(t.segmentation_offload);
        assert_eq!(t.ack_eliciting_threshold, None);
        t.validate().expect("defaults are valid");
    }

    #[test]
    fn an_ack_threshold_asks_the_peer_by_the_ack_frequency_extension() {
        let asks = |t: &Tuning| {
            let debug = format!("{:?}", t.client_transport().expect("valid"));
            !debug.contains("ack_frequency_config: None")
        };
        assert!(!asks(&Tuning::default()));
        assert!(asks(&Tuning { ack_eliciting_threshold: Some(10), ..Tuning::default() }));
    }

    #[test]
    fn unbounded_connection_receive_window_is_rejected() {
        let t = Tuning { receive_window: VarInt::MAX.into_inner(), ..Tuning::default() };
        assert_eq!(field_of(t.validate().expect_err("unbounded")), "receive_window");
    }

    #[test]
    fn window_beyond_varint_range_is_rejected_naming_the_field() {
        let t = Tuning { stream_receive_window: u64::MAX, ..Tuning::default() };
        assert_eq!(field_of(t.validate().expect_err("too large")), "stream_receive_window");
    }

    #[test]
    fn keep_alive_not_shorter_than_idle_timeout_is_rejected() {
        let t = Tuning { keep_alive_interval: Duration::from_secs(30), ..Tuning::default() };
        assert_eq!(field_of(t.validate().expect_err("keep-alive too long")), "keep_alive_interval");
    }

    #[test]
    fn zero_keep_alive_disables_keep_alives_and_is_valid() {
        let t = Tuning { keep_alive_interval: Duration::ZERO, ..Tuning::default() };
        t.validate().expect("zero keep-alive means disabled");
    }

    #[test]
    fn zero_idle_timeout_and_zero_streams_are_rejected() {
        let t = Tuning { max_idle_timeout: Duration::ZERO, ..Tuning::default() };
        assert_eq!(field_of(t.validate().expect_err("zero idle")), "max_idle_timeout");
        let t = Tuning { max_concurrent_uni_streams: 0, ..Tuning::default() };
        assert_eq!(field_of(t.validate().expect_err("zero streams")), "max_concurrent_uni_streams");
    }

    #[test]
    fn server_and_client_transports_build_from_defaults() {
        let t = Tuning::default();
        let server = format!("{:?}", t.server_transport().expect("server transport"));
        let client = format!("{:?}", t.client_transport().expect("client transport"));
        // TransportConfig has no getters; its Debug output is the only window into it.
        assert!(server.contains("max_concurrent_bidi_streams: 1"), "{server}");
        assert!(server.contains("max_concurrent_uni_streams: 256"), "{server}");
        assert!(client.contains("max_concurrent_bidi_streams: 0"), "{client}");
        assert!(client.contains("max_concurrent_uni_streams: 0"), "{client}");
        assert!(server.contains("enable_segmentation_offload: true"), "{server}");
        assert!(server.contains("receive_window: 67108864"), "{server}");
    }

    #[test]
    fn every_congestion_controller_is_named_and_parsed_back_and_builds_a_client_transport() {
        for cc in CongestionController::ALL {
            assert_eq!(CongestionController::from_name(cc.name()), Some(cc));
            for outage_tolerant_congestion in [true, false] {
                let t = Tuning { congestion_controller: cc, outage_tolerant_congestion, ..Tuning::default() };
                t.client_transport().expect("client transport");
            }
        }
        assert_eq!(CongestionController::from_name("reno"), None);
        assert_eq!(CongestionController::from_name("BBR"), None);
    }
}

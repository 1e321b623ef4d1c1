//! Shaped uplinks: the paths of `edge-bench uplink`, and the userspace proxy that shapes them.
//!
//! On loopback both daemons share the machine's two cores, so the throughput cases measure CPU.
//! A gateway's uplink is usually the narrower limit: tens of Mbit/s, tens of milliseconds of
//! round trip, some loss. Each path here is the `edge-testkit` proxy with a rate limit (a token
//! bucket whose queue holds one round trip of the rate, as a bottleneck link's buffer would),
//! a one-way delay each way and, on the lossy paths, independent loss on the way up. The same
//! path carries raw quinn and the agent in turn, so their ratio says how much of what QUIC
//! itself gets through the link the agent turns into stored records.
//!
//! The proxy runs on a runtime of its own: the bench's waits for a drain (`World::wait_drained`)
//! sleep on the calling thread, which must not stall the packets in flight.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use edge_testkit::netem::{Faults, Loss, Netem, NetemConfig, NetemHandle};

/// One shaped path.
#[derive(Debug, Clone, Copy)]
pub struct Uplink {
    pub name: &'static str,
    /// Rate of the way up (agent → ingest), Mbit/s; the way down is not limited.
    pub mbit_s: u64,
    pub rtt: Duration,
    /// Probability that a packet on the way up is lost.
    pub loss: f64,
    /// Payload moved per case: about eight seconds of the link's rate where nothing is lost;
    /// 4 MiB (the in-flight budget, about eight chunks) on the lossy paths, where quinn's Cubic
    /// gets a fraction of the rate through.
    pub mib: u64,
}

/// The paths measured: a fixed-line uplink, and two lossy ones where the loss, not the rate,
/// sets what a loss-based congestion controller gets through (so their payloads are smaller).
pub const UPLINKS: [Uplink; 3] = [
    Uplink { name: "100 Mbit/s, 20 ms RTT", mbit_s: 100, rtt: Duration::from_millis(20), loss: 0.0, mib: 96 },
    Uplink {
        name: "20 Mbit/s, 60 ms RTT, 0.5 % loss up",
        mbit_s: 20,
        rtt: Duration::from_millis(60),
        loss: 0.005,
        mib: 4,
    },
    Uplink {
        name: "5 Mbit/s, 150 ms RTT, 2 % loss up",
        mbit_s: 5,
        rtt: Duration::from_millis(150),
        loss: 0.02,
        mib: 4,
    },
];

/// The paths whose name contains one of `only` (all of them if it is empty).
pub fn matching(only: &[String]) -> anyhow::Result<Vec<Uplink>> {
    let paths: Vec<Uplink> =
        UPLINKS.into_iter().filter(|u| only.is_empty() || only.iter().any(|o| u.name.contains(o.as_str()))).collect();
    anyhow::ensure!(!paths.is_empty(), "no path matches --only {only:?}");
    Ok(paths)
}

impl Uplink {
    /// The link's rate in MB/s (10^6 bytes), the ceiling of every figure on it.
    pub fn mb_s(&self) -> f64 {
        self.mbit_s as f64 / 8.0
    }

    pub fn config(&self) -> NetemConfig {
        let one_way = self.rtt / 2;
        let loss = if self.loss > 0.0 { Loss::uniform(self.loss) } else { Loss::None };
        let to_server = Faults {
            delay: one_way,
            loss,
            rate: Some(self.mbit_s * 1_000_000 / 8),
            rate_queue: self.rtt,
            ..Faults::default()
        };
        let to_client = Faults { delay: one_way, ..Faults::default() };
        NetemConfig { to_server, to_client }
    }
}

/// The proxy of one path, on its own single-worker runtime.
pub struct Proxy {
    rt: Option<tokio::runtime::Runtime>,
    netem: Option<Netem>,
    handle: NetemHandle,
}

impl Proxy {
    /// Starts relaying from a fresh port on 127.0.0.1 to `upstream` with `config`.
    pub async fn start(upstream: SocketAddr, config: NetemConfig) -> anyhow::Result<Proxy> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("uplink-proxy")
            .enable_all()
            .build()
            .context("building the proxy's runtime")?;
        let netem = rt
            .spawn(Netem::start(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, config, 1))
            .await
            .context("the proxy's start task")?
            .context("starting the UDP proxy")?;
        let handle = netem.handle();
        Ok(Proxy { rt: Some(rt), netem: Some(netem), handle })
    }

    pub fn addr(&self) -> SocketAddr {
        self.handle.local_addr()
    }

    pub fn handle(&self) -> &NetemHandle {
        &self.handle
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The relay task is aborted on its own runtime, which is then left to wind down on
        // its thread: dropping a runtime where the bench's runtime runs is not allowed.
        drop(self.netem.take());
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_lossless_path_moves_about_eight_seconds_of_its_rate() {
        for u in UPLINKS.iter().filter(|u| u.loss == 0.0) {
            let secs = (u.mib << 20) as f64 / (u.mb_s() * 1e6);
            assert!((6.0..=12.0).contains(&secs), "{}: {secs:.1} s", u.name);
        }
    }

    #[test]
    fn the_rate_and_the_loss_apply_on_the_way_up_only() {
        let c = UPLINKS[1].config();
        assert_eq!(c.to_server.rate, Some(2_500_000));
        assert_eq!(c.to_server.loss.average(), 0.005);
        assert_eq!(c.to_server.delay + c.to_client.delay, Duration::from_millis(60));
        assert_eq!((c.to_client.rate, c.to_client.loss.average()), (None, 0.0));
    }
}

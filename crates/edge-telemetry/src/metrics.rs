//! Prometheus plumbing shared by both daemons: [`Live`] metric families built at scrape time from
//! live state and the [`LiveCollector`] that serves them, and the `/metrics` HTTP server
//! ([`bind`], [`MetricsServer`], [`encode`]), which can serve a daemon's extra routes too
//! ([`MetricsServer::start_with`]).
//!
//! The metric names, the handles, the collectors and the [`Registry`] itself belong to each
//! daemon's `metrics` module; nothing here knows either daemon's domain.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// One counter or gauge family built at scrape time, with at most one label: for collectors that
/// read atomics or statistics snapshots rather than keeping prometheus handles.
///
/// Declared as a `const` ([`Live::counter`], [`Live::gauge`], [`Live::labelled`]) and listed in a
/// [`LiveCollector`], whose reader builds the samples with [`Live::family`].
#[derive(Debug, Clone, Copy)]
pub struct Live {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    label: Option<&'static str>,
}

impl Live {
    /// A counter family without labels.
    pub const fn counter(name: &'static str, help: &'static str) -> Self {
        Self { name, help, kind: MetricType::COUNTER, label: None }
    }

    /// A gauge family without labels.
    pub const fn gauge(name: &'static str, help: &'static str) -> Self {
        Self { name, help, kind: MetricType::GAUGE, label: None }
    }

    /// The same family with one label, named `label`.
    pub const fn labelled(self, label: &'static str) -> Self {
        Self { label: Some(label), ..self }
    }

    /// The family's descriptor, for `Collector::desc`.
    pub fn desc(&self) -> prometheus::Result<Desc> {
        let labels = self.label.map(|l| vec![l.to_owned()]).unwrap_or_default();
        Desc::new(self.name.to_owned(), self.help.to_owned(), labels, HashMap::new())
    }

    /// One sample per `(label value, value)`; the label value is ignored without a label.
    pub fn family(&self, samples: &[(&str, f64)]) -> MetricFamily {
        let metrics = samples
            .iter()
            .map(|&(label_value, v)| {
                let mut m = Metric::default();
                if let Some(name) = self.label {
                    let mut pair = LabelPair::default();
                    pair.set_name(name.to_owned());
                    pair.set_value(label_value.to_owned());
                    m.set_label(vec![pair]);
                }
                if self.kind == MetricType::COUNTER {
                    let mut c = prometheus::proto::Counter::default();
                    c.set_value(v);
                    m.set_counter(c);
                } else {
                    let mut g = prometheus::proto::Gauge::default();
                    g.set_value(v);
                    m.set_gauge(g);
                }
                m
            })
            .collect();
        let mut family = MetricFamily::default();
        family.set_name(self.name.to_owned());
        family.set_help(self.help.to_owned());
        family.set_field_type(self.kind);
        family.set_metric(metrics);
        family
    }
}

/// A collector of [`Live`] families: `read` builds them from live state (atomics, statistics
/// snapshots) at every scrape.
pub struct LiveCollector<F> {
    descs: Vec<Desc>,
    read: F,
}

impl<F> LiveCollector<F>
where
    F: Fn() -> Vec<MetricFamily> + Send + Sync,
{
    /// `families` are the ones `read` returns; their descriptors let the registry refuse a name
    /// registered twice.
    pub fn new(families: &[&Live], read: F) -> prometheus::Result<Self> {
        let descs = families.iter().map(|l| l.desc()).collect::<prometheus::Result<_>>()?;
        Ok(Self { descs, read })
    }
}

impl<F> Collector for LiveCollector<F>
where
    F: Fn() -> Vec<MetricFamily> + Send + Sync,
{
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        (self.read)()
    }
}

impl<F> std::fmt::Debug for LiveCollector<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCollector").field("descs", &self.descs).finish_non_exhaustive()
    }
}

/// The `/metrics` listener could not be bound (address in use, not local, no permission...).
#[derive(Debug, thiserror::Error)]
#[error("binding the /metrics listener to {addr}")]
pub struct BindError {
    addr: SocketAddr,
    #[source]
    source: std::io::Error,
}

impl BindError {
    /// The address that could not be bound.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Binds the metrics listener (`None` when metrics are disabled). Done before READY so a port
/// clash is a start-up error rather than a silent gap in the graphs.
pub async fn bind(listen: Option<SocketAddr>) -> Result<Option<TcpListener>, BindError> {
    let Some(addr) = listen else { return Ok(None) };
    let listener = TcpListener::bind(addr).await.map_err(|source| BindError { addr, source })?;
    info!(listen = %listener.local_addr().unwrap_or(addr), "metrics listening on /metrics");
    Ok(Some(listener))
}

/// The address to ask a metrics listener on: `listen` itself, or loopback on its port where it
/// listens on every address (`0.0.0.0`, `::`), as the daemons' `status` commands do.
pub fn local_addr_of(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => (std::net::Ipv4Addr::LOCALHOST, listen.port()).into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => (std::net::Ipv6Addr::LOCALHOST, listen.port()).into(),
        _ => listen,
    }
}

/// The `/metrics` HTTP server.
#[derive(Debug)]
pub struct MetricsServer {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `registry` on `listener`; does nothing without a listener.
    pub fn start(listener: Option<TcpListener>, registry: Registry) -> Self {
        Self::start_with(listener, registry, Router::new())
    }

    /// As [`MetricsServer::start`], also serving the routes of `extra` (for example a daemon's
    /// `/v1/status`) on the same listener. `extra` must not route `/metrics`.
    pub fn start_with(listener: Option<TcpListener>, registry: Registry, extra: Router) -> Self {
        let cancel = CancellationToken::new();
        let task = listener.map(|listener| {
            let app = Router::new().route("/metrics", get(scrape)).with_state(registry).merge(extra);
            let stop = cancel.clone().cancelled_owned();
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(stop).await {
                    warn!(error = %e, "metrics server stopped");
                }
            })
        });
        Self { cancel, task }
    }

    /// Stops serving; a scrape still running gets a second to finish.
    pub async fn stop(self) {
        self.cancel.cancel();
        if let Some(mut task) = self.task
            && tokio::time::timeout(Duration::from_secs(1), &mut task).await.is_err()
        {
            task.abort();
        }
    }
}

async fn scrape(State(registry): State<Registry>) -> Response {
    match encode(&registry) {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The registry in the Prometheus text format.
pub fn encode(registry: &Registry) -> prometheus::Result<String> {
    TextEncoder::new().encode_to_string(&registry.gather())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONNECTED: &str = "edge_test_connected";
    const LIVE_CONNECTED: Live = Live::gauge(CONNECTED, "1 while connected.");

    #[tokio::test]
    async fn the_server_answers_metrics_in_the_text_format_and_nothing_else() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let registry = Registry::new();
        let live = LiveCollector::new(&[&LIVE_CONNECTED], || vec![LIVE_CONNECTED.family(&[("", 1.0)])]);
        registry.register(Box::new(live.expect("descs"))).expect("register");
        let listener = bind(Some(SocketAddr::from(([127, 0, 0, 1], 0)))).await.expect("bind").expect("enabled");
        let addr = listener.local_addr().expect("addr");
        let server = MetricsServer::start(Some(listener), registry.clone());
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{ok}");
        assert!(ok.contains(&format!("# TYPE {CONNECTED} gauge")), "{ok}");
        let missing = get("/").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        server.stop().await;
        assert!(bind(None).await.expect("disabled").is_none());
    }

    #[tokio::test]
    async fn extra_routes_are_served_next_to_metrics() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = bind(Some(SocketAddr::from(([127, 0, 0, 1], 0)))).await.expect("bind").expect("enabled");
        let addr = listener.local_addr().expect("addr");
        let extra = Router::new().route("/v1/status", get(|| async { "{\"version\":1}" }));
        let server = MetricsServer::start_with(Some(listener), Registry::new(), extra);
        for (path, expect) in [("/v1/status", "{\"version\":1}"), ("/metrics", "")] {
            let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.expect("write");
            let mut out = String::new();
            s.read_to_string(&mut out).await.expect("read");
            assert!(out.starts_with("HTTP/1.1 200"), "{path}: {out}");
            assert!(out.ends_with(expect), "{path}: {out}");
        }
        server.stop().await;
    }

    #[tokio::test]
    async fn a_port_in_use_is_an_error_naming_the_address() {
        let taken = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = bind(Some(addr)).await.expect_err("the port is taken");
        assert_eq!(err.addr(), addr);
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        assert!(std::error::Error::source(&err).is_some(), "the io::Error is kept as the source");
    }
}

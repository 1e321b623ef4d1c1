//! The agent daemon: wires spool, intake and uploader together and runs the shutdown sequence.
//!
//! Start-up order: open the spool (recovering or quarantining a damaged file), start the spool
//! thread, bind the intake sockets, report READY (the cloud need not be reachable), start the
//! uploader. Shutdown order: STOPPING, intake answers 503 and stops accepting, the uploader stops
//! opening streams and waits for acks of chunks in flight up to the grace period, the connection
//! closes politely, the spool thread commits what it holds and exits. Nothing is lost whether or
//! not the grace period was long enough: unacked chunks stay in the spool.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use edge_spool::{Spool, SpoolStats};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::intake::{Intake, IntakeCounters};
use crate::spool_task::{ReaderHandle, SpoolHandle, SpoolThread};
use crate::uploader::{UploadCounters, UploaderOptions};

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    spool: SpoolHandle,
    spool_thread: Option<SpoolThread>,
    intake: Arc<Intake>,
    upload: Arc<UploadCounters>,
    cancel_intake: CancellationToken,
    cancel_upload: CancellationToken,
    tasks: TaskTracker,
    uploader: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// Socket files to remove at shutdown.
    intake_sockets: Vec<PathBuf>,
    /// Shared with the uploader; its files are read again by a configuration reload.
    tls: Arc<crate::client_tls::ClientTls>,
    /// Shared with the uploader; changed by a configuration reload.
    max_in_flight: Arc<AtomicU32>,
    /// Shared with the uploader; changed by a configuration reload.
    max_in_flight_bytes: Arc<AtomicU64>,
    /// Where `intake.stream_tcp` listens, once bound.
    stream_tcp_addr: Option<std::net::SocketAddr>,
}

impl Agent {
    /// Opens the spool, binds the intake and starts uploading. Returns once the agent accepts
    /// records (the moment to report READY).
    pub async fn start(config: &Config) -> anyhow::Result<Agent> {
        let mut opts = config.spool.clone();
        if let Some(file) = &config.machine_id_file {
            match crate::machine_id::read(file) {
                Ok(id) => opts.host_id = Some(id),
                Err(why) => warn!(
                    %why,
                    "spool.machine_id_file gives no machine id: the spool cannot tell whether its file was copied \
                     from another machine (a cloned disk image), whose records would then collide with this one's \
                     at the ingest"
                ),
            }
        }
        let path = opts.path.clone();
        let (spool, report) = tokio::task::spawn_blocking(move || Spool::open(opts))
            .await
            .context("spool open task")?
            .with_context(|| format!("opening spool {}", path.display()))?;
        if let Some(q) = &report.quarantined {
            warn!(quarantined = %q.display(), "spool file was damaged; moved aside and a new spool was created");
        }
        info!(path = %path.display(), id = %spool.id(), created = report.created, sealed_chunks = report.sealed_chunks, "spool open");
        let reader = ReaderHandle::new(spool.reader().context("opening spool reader")?);
        let (spool, spool_thread) = SpoolHandle::spawn(spool).context("starting spool thread")?;

        let upload = Arc::new(UploadCounters::default());
        let intake = Arc::new(Intake {
            spool: spool.clone(),
            max_record_bytes: config.intake.max_record_bytes,
            max_request_bytes: config.intake.max_request_bytes,
            stream_pending_bytes: config.intake.stream_pending_bytes,
            stream_budget: crate::record_stream::PendingBudget::new(config.intake.stream_pending_total_bytes),
            request_budget: crate::intake::RequestBudget::new(config.intake.request_pending_total_bytes),
            request_idle_timeout: config.intake.request_idle_timeout,
            connections: crate::intake::ConnectionLimit::new(config.intake.max_connections),
            batch_target: usize::try_from(config.spool.chunk_target_bytes).unwrap_or(usize::MAX),
            accepting: AtomicBool::new(true),
            counters: Arc::new(IntakeCounters::default()),
            upload: upload.clone(),
            settings: std::sync::Mutex::new(serde_json::Value::Null),
            rates: crate::status::RateWindow::default(),
            spool_copied_from: match report.host {
                edge_spool::HostCheck::Moved { from, old_id, .. } => Some((from, old_id)),
                _ => None,
            },
        });
        intake.set_settings(config);
        let cancel_intake = CancellationToken::new();
        let tasks = TaskTracker::new();
        {
            // Counter history for the rates in `status`; stops with the intake.
            let intake = intake.clone();
            let cancel = cancel_intake.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(crate::status::RateWindow::PERIOD);
                loop {
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        _ = tick.tick() => intake.rates.sample(crate::status::now_ms(), intake.rate_counters()),
                    }
                }
            });
        }
        let unix = bind_unix(&config.intake.socket, config.intake.socket_mode, "intake.socket")?;
        tasks.spawn(crate::intake::serve(unix, intake.clone(), cancel_intake.clone()));
        if let Some(addr) = config.intake.tcp {
            let tcp = TcpListener::bind(addr).await.with_context(|| format!("binding intake.tcp {addr}"))?;
            tasks.spawn(crate::intake::serve(tcp, intake.clone(), cancel_intake.clone()));
        }
        if let Some(path) = &config.intake.stream_socket {
            let listener = bind_unix(path, config.intake.socket_mode, "intake.stream_socket")?;
            tasks.spawn(crate::record_stream::serve(listener, intake.clone(), cancel_intake.clone(), tasks.clone()));
        }
        let mut stream_tcp_addr = None;
        if let Some(addr) = config.intake.stream_tcp {
            let listener =
                TcpListener::bind(addr).await.with_context(|| format!("binding intake.stream_tcp {addr}"))?;
            stream_tcp_addr = Some(listener.local_addr().context("intake.stream_tcp's bound address")?);
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
                let _ = tcp.set_nodelay(true);
            });
            tasks.spawn(crate::record_stream::serve(listener, intake.clone(), cancel_intake.clone(), tasks.clone()));
        }
        info!(socket = %config.intake.socket.display(), tcp = ?config.intake.tcp, stream_socket = ?config.intake.stream_socket, stream_tcp = ?config.intake.stream_tcp, "intake listening");

        let tls = crate::client_tls::ClientTls::from_files(config.upload.tls.clone(), config.upload.tuning.clone())
            .context("loading the agent's TLS files (upload.ca, upload.cert, upload.key)")?;
        let tls = Arc::new(tls);
        // The order of the provider every connection uses, not a second computation of it.
        let suites = edge_transport::crypto_provider()
            .cipher_suites
            .iter()
            .filter(|suite| suite.tls13().is_some())
            .map(|suite| suite.suite())
            .collect::<Vec<_>>();
        info!(
            aes_instructions = edge_transport::cpu_has_aes_instructions(),
            ?suites,
            "TLS 1.3 cipher suites offered in this order; the ingest takes the first it has"
        );
        let cancel_upload = CancellationToken::new();
        let max_in_flight = Arc::new(AtomicU32::new(config.upload.max_in_flight));
        let max_in_flight_bytes = Arc::new(AtomicU64::new(config.upload.max_in_flight_bytes));
        let uopts = UploaderOptions {
            server: config.upload.server.clone(),
            server_name: config.upload.server_name.clone(),
            tls: tls.clone(),
            bind: config.upload.bind,
            max_in_flight: max_in_flight.clone(),
            max_in_flight_bytes: max_in_flight_bytes.clone(),
            connect_timeout: config.upload.connect_timeout,
            early_chunks: true,
            backoff_min: config.upload.backoff_min,
            backoff_max: config.upload.backoff_max,
            compression: config.upload.compression,
            limits: edge_proto::Limits::default(),
            drain_grace: Duration::from_secs(5),
            tuning: config.upload.tuning.clone(),
            network: watch_network(config.upload.watch_network, &cancel_upload),
            probe_interval: config.upload.probe_interval,
        };
        let uploader =
            tokio::spawn(crate::uploader::run(uopts, spool.clone(), reader, upload.clone(), cancel_upload.clone()));
        Ok(Agent {
            spool,
            spool_thread: Some(spool_thread),
            intake,
            upload,
            cancel_intake,
            cancel_upload,
            tasks,
            uploader,
            intake_sockets: std::iter::once(config.intake.socket.clone())
                .chain(config.intake.stream_socket.clone())
                .collect(),
            tls,
            max_in_flight,
            max_in_flight_bytes,
            stream_tcp_addr,
        })
    }

    /// The address `intake.stream_tcp` is bound to (its port chosen by the kernel if the
    /// configuration said 0); `None` without that listener.
    pub fn stream_tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.stream_tcp_addr
    }

    /// The spool's latest statistics.
    pub fn spool_stats(&self) -> SpoolStats {
        self.spool.stats()
    }

    /// Handle to the spool thread.
    pub fn spool(&self) -> &SpoolHandle {
        &self.spool
    }

    /// Upload counters.
    pub fn upload(&self) -> &Arc<UploadCounters> {
        &self.upload
    }

    /// Intake counters.
    pub fn intake(&self) -> &Arc<IntakeCounters> {
        &self.intake.counters
    }

    /// What the record-stream connections gather and commit, against
    /// `intake.stream_pending_total_bytes`.
    pub fn stream_budget(&self) -> &crate::record_stream::PendingBudget {
        &self.intake.stream_budget
    }

    /// What the HTTP requests being read, framed or committed claim together,
    /// `intake.request_pending_total_bytes`.
    pub fn request_budget(&self) -> &crate::intake::RequestBudget {
        &self.intake.request_budget
    }

    /// Applies what can change at run time from a freshly loaded, valid configuration: the
    /// device's TLS files, the log level, the spool's size limit, full policy and cap on
    /// streams, and the chunks and bytes in flight. Returns the keys whose change needs a
    /// restart (they keep their running values).
    ///
    /// # Errors
    /// When the TLS files do not load: nothing is applied, and the running configuration stays
    /// as a whole.
    pub fn reload(&self, running: &Config, new: &Config) -> Result<Vec<&'static str>, edge_transport::TransportError> {
        // The device's TLS files, at the new paths: a renewed certificate without a restart.
        // First, as the only part that can fail.
        self.tls.reload(new.upload.tls.clone())?;
        info!(cert = %new.upload.tls.cert.display(), "device TLS files read again; the next connection uses them");
        if let Err(e) = edge_telemetry::logging::set_level(&new.log_level) {
            warn!(error = %e, "log.level not applied");
        }
        self.spool.set_limits(new.spool.max_bytes, new.spool.full_policy, new.spool.max_streams);
        self.max_in_flight.store(new.upload.max_in_flight, Ordering::Relaxed);
        self.max_in_flight_bytes.store(new.upload.max_in_flight_bytes, Ordering::Relaxed);
        self.intake.set_settings(new);
        let (a, b) = (running, new);
        let fixed: [(&'static str, bool); 24] = [
            ("spool.machine_id_file", a.machine_id_file != b.machine_id_file),
            ("intake.socket", a.intake.socket != b.intake.socket || a.intake.socket_mode != b.intake.socket_mode),
            ("intake.tcp", a.intake.tcp != b.intake.tcp),
            (
                "intake.stream_socket",
                a.intake.stream_socket != b.intake.stream_socket || a.intake.stream_tcp != b.intake.stream_tcp,
            ),
            ("intake.max_record_bytes", a.intake.max_record_bytes != b.intake.max_record_bytes),
            ("intake.max_request_bytes", a.intake.max_request_bytes != b.intake.max_request_bytes),
            ("intake.stream_pending_bytes", a.intake.stream_pending_bytes != b.intake.stream_pending_bytes),
            (
                "intake.stream_pending_total_bytes",
                a.intake.stream_pending_total_bytes != b.intake.stream_pending_total_bytes,
            ),
            (
                "intake.request_pending_total_bytes",
                a.intake.request_pending_total_bytes != b.intake.request_pending_total_bytes,
            ),
            ("intake.request_idle_timeout", a.intake.request_idle_timeout != b.intake.request_idle_timeout),
            ("intake.max_connections", a.intake.max_connections != b.intake.max_connections),
            ("spool.path", a.spool.path != b.spool.path),
            ("spool.durability", a.spool.durability != b.spool.durability),
            ("spool.chunk_target", a.spool.chunk_target_bytes != b.spool.chunk_target_bytes),
            ("spool.linger", a.spool.linger != b.spool.linger),
            ("upload.server", a.upload.server != b.upload.server || a.upload.server_name != b.upload.server_name),
            (
                "upload.backoff",
                a.upload.backoff_min != b.upload.backoff_min || a.upload.backoff_max != b.upload.backoff_max,
            ),
            ("upload.connect_timeout", a.upload.connect_timeout != b.upload.connect_timeout),
            ("spool.compression", a.upload.compression != b.upload.compression),
            ("upload.bind", a.upload.bind != b.upload.bind),
            ("upload.congestion_controller", a.upload.tuning != b.upload.tuning),
            ("upload.watch_network", a.upload.watch_network != b.upload.watch_network),
            ("upload.probe_interval", a.upload.probe_interval != b.upload.probe_interval),
            ("metrics.listen", a.metrics_listen != b.metrics_listen),
        ];
        Ok(fixed.into_iter().filter(|(_, changed)| *changed).map(|(k, _)| k).collect())
    }

    /// The shutdown sequence described in the module docs.
    pub async fn shutdown(mut self) {
        self.intake.accepting.store(false, Ordering::Release);
        self.cancel_intake.cancel();
        self.tasks.close();
        if tokio::time::timeout(Duration::from_secs(5), self.tasks.wait()).await.is_err() {
            warn!("intake connections still open after 5 s");
        }
        self.cancel_upload.cancel();
        match self.uploader.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, "uploader ended with an error"),
            Err(e) => warn!(error = %e, "uploader task failed"),
        }
        for socket in &self.intake_sockets {
            let _ = std::fs::remove_file(socket);
        }
        let thread = self.spool_thread.take();
        drop(self.intake);
        drop(self.spool);
        if let Some(t) = thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT (SIGHUP reloads the configuration).
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Metrics (see `metrics`): the daemon's one registry, served until the agent has stopped.
    let metrics_listener = crate::metrics::bind(config.metrics_listen).await?;
    let agent = Agent::start(&config).await?;
    let registry = prometheus::Registry::new();
    crate::metrics::register(&registry, agent.spool.stats_view(), agent.intake(), agent.upload())
        .context("registering metrics")?;
    // `/v1/status` there too, outside the intake's connection limit (see `status::fetch_metrics`).
    let metrics = crate::metrics::MetricsServer::start_with(
        metrics_listener,
        registry,
        crate::intake::status_router(&agent.intake),
    );
    // Before READY: a stop or reload sent on READY must find the handlers (see `signals`).
    let mut signals = edge_telemetry::signals::Signals::listen().context("listening for SIGTERM, SIGINT and SIGHUP")?;
    edge_telemetry::notify::ready();
    #[cfg(feature = "failpoints")]
    fail::fail_point!("agent::ready");
    let mut watchdog = edge_telemetry::notify::Watchdog::from_env("the agent");
    let mut running = config;
    let mut sync_failed = None;
    loop {
        tokio::select! {
            failed = agent.spool.sync_failed() => {
                // Producers were answered for what the spool holds; the stop answers those in
                // the middle of a request too. Exit status 74 for the supervisor to start the
                // agent again (`Restart=always`), whose open syncs the WAL first.
                error!(error = %failed, "could not fsync the spool's WAL: stopping, so that the next start syncs it and sends what was sealed since");
                sync_failed = Some(failed);
                break;
            }
            request = signals.next() => {
                if request == edge_telemetry::signals::Request::Stop {
                    break;
                }
                // An invalid new file is refused as a whole; the running configuration stays.
                match crate::config::load(running.source.as_deref()) {
                    Ok(new) => {
                        let restart = match agent.reload(&running, &new) {
                            Ok(restart) => restart,
                            Err(e) => {
                                error!(error = %edge_telemetry::logging::error_chain(&e), "configuration reload refused: the device TLS files do not load; the running configuration stays in force, and the previous TLS files stay in use");
                                continue;
                            }
                        };
                        if !restart.is_empty() {
                            warn!(keys = ?restart, "changed keys take effect at the next restart");
                        }
                        info!(log_level = %new.log_level, max_bytes = new.spool.max_bytes, max_in_flight = new.upload.max_in_flight, max_in_flight_bytes = new.upload.max_in_flight_bytes, "configuration reloaded");
                        running.log_level = new.log_level;
                        running.spool.max_bytes = new.spool.max_bytes;
                        running.spool.full_policy = new.spool.full_policy;
                        running.upload.max_in_flight = new.upload.max_in_flight;
                        running.upload.max_in_flight_bytes = new.upload.max_in_flight_bytes;
                    }
                    Err(e) => error!(error = %edge_telemetry::logging::error_chain(e.as_ref()), "configuration reload refused; the running configuration stays in force"),
                }
            }
            () = async { match watchdog.interval() { Some(i) => tokio::time::sleep(i).await, None => std::future::pending().await } } => {
                // A spool thread stuck in one commit or fsync stops every producer and ack while
                // this loop runs on: the ping is withheld, so that systemd restarts the agent if
                // it stays stuck (after `WatchdogSec`).
                let busy = agent.spool.busy();
                watchdog.ping_unless_stuck(
                    busy.map(|(_, d)| d),
                    |d| {
                        let doing = busy.map_or("one operation", |(kind, _)| kind.doing());
                        format!("the spool has been in {doing} for {}: producers and acks wait", humantime::format_duration(Duration::from_secs(d.as_secs())))
                    },
                    "the spool thread is back",
                );
            }
        }
    }
    edge_telemetry::notify::stopping();
    info!("shutting down");
    agent.shutdown().await;
    metrics.stop().await;
    info!("stopped");
    match sync_failed {
        Some(e) => Err(crate::spool_task::SyncFailed(e).into()),
        None => Ok(()),
    }
}

/// The gateway's network watch for the uploader (`upload.watch_network`), or `None` when it is
/// off or cannot be opened: then the backoff alone decides when to try again.
fn watch_network(on: bool, cancel: &CancellationToken) -> Option<crate::netwatch::NetEvents> {
    if !on {
        return None;
    }
    match crate::netwatch::spawn(cancel.clone()) {
        Ok(events) => Some(events),
        Err(e) => {
            warn!(error = %e, "cannot watch the gateway's links and routes (rtnetlink); reconnecting on the backoff alone");
            None
        }
    }
}

/// Binds the intake socket, replacing a stale socket file but never another kind of file.
fn bind_unix(path: &Path, mode: u32, key: &str) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                anyhow::bail!("{key}: {} exists and is not a socket; refusing to replace it", path.display());
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                anyhow::bail!("{key}: {} is in use by another process", path.display());
            }
            std::fs::remove_file(path).with_context(|| format!("removing stale socket {}", path.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    let listener = UnixListener::bind(path).with_context(|| format!("binding {key} {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting mode {mode:o} on {}", path.display()))?;
    Ok(listener)
}

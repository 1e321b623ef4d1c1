//! The `edge-ingest` command line: the server daemon, its status, PKI set-up and export.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use edge_ingest::jetstream::JetStreamSink;
use edge_ingest::server::Server;
use edge_ingest::sink::Sink;
use edge_ingest::store::{ExportFilter, Store, StoreHandle};
use edge_ingest::{EXIT_CONFIG, config};
use edge_telemetry::signals::{Request, Signals};

/// jemalloc instead of glibc's allocator: chunk buffers of hundreds of KiB are allocated and
/// freed all the time, and glibc gives their pages back to the kernel and faults them in again
/// (page faults plus malloc and free were a tenth of the agent's CPU in a profile; BENCHMARKS.md).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read once at start (the environment variable `_RJEM_MALLOC_CONF` can
/// override them): one arena (two cores; the default of four per core held twice the memory),
/// freed pages given back after one second rather than ten. With these, peak RSS matched
/// glibc's while CPU per GiB stayed jemalloc's (`edge-bench pipeline`, BENCHMARKS.md).
// jemalloc reads this symbol by name; exporting a symbol is what `unsafe_code` flags.
#[allow(unsafe_code, non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8] = b"narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

#[derive(Parser, Debug)]
#[command(name = "edge-ingest", version, about = "Ingest server for edge-uploader agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the ingest server.
    Run {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Show the running server's connected devices, rates and sink health. Exit 0 healthy,
    /// 1 degraded (sink unhealthy, or the server accepts but does not answer), 3 not running,
    /// 4 unknown (status disabled or not edge-ingest).
    Status {
        /// Config file whose `[metrics] listen` names the status address (only that key is read).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// HOST:PORT of the metrics listener, instead of the config's (default 127.0.0.1:9172).
        #[arg(long)]
        addr: Option<String>,
        /// One JSON object (`"version": 1`) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Validate the configuration and exit 0 (valid) or 78 (invalid).
    CheckConfig {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Certificate authority for a deployment, without openssl.
    Pki {
        #[command(subcommand)]
        command: PkiCommand,
    },
    /// Print stored records in order (device, spool, stream, sequence), each exactly once.
    /// Exit 0 every record exported, 1 the export failed or skipped damaged entries or regions
    /// (named on stderr; what was readable is exported), 2 usage error.
    Export {
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        device: Option<String>,
        #[arg(long)]
        stream: Option<String>,
        /// Only chunks of this spool id (32 hex digits).
        #[arg(long)]
        spool: Option<String>,
        /// Only chunks of this sequence number.
        #[arg(long)]
        seq: Option<u64>,
        #[arg(long, value_enum, default_value_t = Format::Ndjson)]
        format: Format,
    },
    /// Whether one chunk is stored, by its key: for a chunk an agent holds in quarantine that
    /// it may have sent before (`edge-uploader spool export-quarantined` names them). Reads
    /// the sink of the config, or the store in --data-dir. Without --spool, every spool's
    /// chunk of that device, stream and seq is listed. Exit 0 stored in full, 1 not stored, 2
    /// usage error, 3 could not tell (the store or NATS could not be read, the store has
    /// damaged regions the chunk may be in, or without --spool several spools' chunks, or
    /// damage, leave open which one is the agent's), 4 only in part (JetStream), 78
    /// configuration error.
    Stored {
        /// Config file whose `[sink]` and `[store] data_dir` say where to look.
        #[arg(long, short, conflicts_with = "data_dir")]
        config: Option<PathBuf>,
        /// The file store's directory, instead of a config.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        #[arg(long)]
        device: String,
        #[arg(long)]
        stream: String,
        /// The spool id, 32 hex digits; without it, every spool's chunk of that seq.
        #[arg(long)]
        spool: Option<String>,
        #[arg(long)]
        seq: u64,
    },
}

#[derive(Subcommand, Debug)]
enum PkiCommand {
    /// Create a CA and a server certificate in DIR.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// DNS names or IP addresses the agents will dial (repeatable).
        #[arg(long = "server-name")]
        server_names: Vec<String>,
        #[arg(long, default_value_t = 825)]
        days: u32,
        /// Overwrite an existing CA.
        #[arg(long)]
        force: bool,
    },
    /// Issue a device certificate and key signed by the CA in DIR.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 825)]
        days: u32,
    },
    /// Revoke device certificates issued by the CA in DIR: keeps a copy of each in DIR/revoked/
    /// and writes DIR/crl.pem revoking all of them (list it in the ingest's `[tls] crls`).
    Revoke {
        #[arg(long)]
        dir: PathBuf,
        /// The device certificates (PEM files) to revoke.
        #[arg(required = true)]
        certs: Vec<PathBuf>,
        /// Validity of the CRL; re-issue it with `pki crl` before it runs out.
        #[arg(long, default_value_t = edge_transport::pki::DEFAULT_CRL_VALIDITY_DAYS)]
        days: u32,
    },
    /// Write DIR/crl.pem again from DIR/revoked/, valid for --days: run it before the CRL's
    /// nextUpdate (the ingest refuses an outdated CRL and keeps the previous one).
    Crl {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = edge_transport::pki::DEFAULT_CRL_VALIDITY_DAYS)]
        days: u32,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    /// Each record followed by a newline (records are expected to be JSON lines).
    Ndjson,
    /// Each record as a 4-byte little-endian length and its bytes: binary-safe.
    Raw,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Crash points (`FAILPOINTS=name=actions;...`) exist only in test builds (`failpoints`).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    match cli.command {
        Command::CheckConfig { config } => match config::load_checked_as_service(config.as_deref()) {
            Ok(c) => {
                for note in c.notes() {
                    eprintln!("edge-ingest: note: {note}");
                }
                println!("config ok{}", c.source.map(|p| format!(": {}", p.display())).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("edge-ingest: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                ExitCode::from(EXIT_CONFIG as u8)
            }
        },
        Command::Run { config } => {
            let cfg = match config::load_checked(config.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("edge-ingest: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                    return ExitCode::from(EXIT_CONFIG as u8);
                }
            };
            if let Err(e) = edge_telemetry::logging::init(&cfg.log_level, cfg.log_format) {
                eprintln!("edge-ingest: {e}");
                return ExitCode::from(EXIT_CONFIG as u8);
            }
            report(runtime().and_then(|rt| rt.block_on(run(cfg))))
        }
        Command::Status { config, addr, json } => status(config, addr, json),
        Command::Pki { command } => report(pki(command)),
        Command::Export { data_dir, device, stream, spool, seq, format } => {
            let spool = match spool.as_deref().map(edge_ingest::server::parse_spool_id).transpose() {
                Ok(spool) => spool,
                Err(e) => {
                    eprintln!("edge-ingest: --spool: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            // Entries the export skips are logged with their segment and offset: on stderr.
            let _ = edge_telemetry::logging::init("warn", edge_telemetry::logging::LogFormat::Text);
            match export(data_dir, ExportFilter { device, stream, spool, seq }, format) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => report(Err(e)),
            }
        }
        Command::Stored { config, data_dir, device, stream, spool, seq } => {
            let _ = edge_telemetry::logging::init("warn", edge_telemetry::logging::LogFormat::Text);
            stored(config, data_dir, device, stream, spool.as_deref(), seq)
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the tokio runtime")
}

fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("edge-ingest: {}", edge_telemetry::logging::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(cfg: config::Config) -> anyhow::Result<()> {
    for note in cfg.notes() {
        tracing::warn!("{note}");
    }
    let metrics_listener = edge_ingest::metrics::bind(cfg.metrics_listen).await?;
    let store = open_sink(&cfg).await?;
    let mut server_config = edge_transport::server_config(&cfg.tls, &cfg.tuning)
        .context("loading TLS files (tls.cert, tls.key, tls.client_ca)")?;
    server_config.migration(cfg.allow_migration);
    // The stateless-reset key comes from the server's private key, so that after a restart this
    // process can reset its predecessor's connections and the agents reconnect at once.
    let secret = std::fs::read(&cfg.tls.key).with_context(|| format!("reading tls.key {}", cfg.tls.key.display()))?;
    let endpoint =
        edge_transport::server_endpoint_with_reset_secret(cfg.server.listen, server_config, &cfg.tuning, &secret)
            .with_context(|| format!("binding server.listen {}", cfg.server.listen))?;
    drop(secret);
    let server = Server::start(endpoint, store.clone(), cfg.server.clone())?;
    tracing::info!(listen = %server.local_addr(), "edge-ingest serving");
    // Metrics (see `edge_ingest::metrics`): the daemon's one registry, served until the server stopped.
    let registry = prometheus::Registry::new();
    edge_ingest::metrics::register(&registry, server.counters(), store.stats_view()).context("registering metrics")?;
    // `/v1/status` (for `edge-ingest status`) shares the metrics listener.
    let status = edge_ingest::status::router(server.counters(), store.stats_view(), sink_description(&cfg));
    let metrics = edge_ingest::metrics::MetricsServer::start_with(metrics_listener, registry, status);
    // Before READY: a stop or reload sent on READY must find the handlers (see `signals`).
    let mut signals = Signals::listen().context("listening for SIGTERM, SIGINT and SIGHUP")?;
    edge_telemetry::notify::ready();
    #[cfg(feature = "failpoints")]
    fail::fail_point!("ingest::ready");
    let mut watchdog = edge_telemetry::notify::Watchdog::from_env("the server");
    let stats = store.stats_view();
    let source = cfg.source.clone();
    loop {
        tokio::select! {
            request = signals.next() => match request {
                Request::Stop => break,
                Request::Reload => match config::load(source.as_deref()) {
                    // Only the log level changes at run time; everything else needs a restart.
                    Ok(new) => {
                        match edge_telemetry::logging::set_level(&new.log_level) {
                            Ok(()) => tracing::info!(log_level = %new.log_level, "configuration reloaded (log level; other keys apply at the next restart)"),
                            Err(e) => tracing::error!(error = %e, "log.level not applied"),
                        }
                        if new.tls.crls != cfg.tls.crls {
                            // The files named at start are re-read when they change; another list
                            // of files (the first CRL listed, say) is not, and a revocation an
                            // operator believes in force would not be.
                            tracing::warn!(
                                running = ?cfg.tls.crls,
                                configured = ?new.tls.crls,
                                "tls.crls names other files than at start: restart edge-ingest to revoke with them"
                            );
                        }
                    }
                    Err(e) => tracing::error!(error = %edge_telemetry::logging::error_chain(e.as_ref()), "configuration reload refused; the running configuration stays in force"),
                },
            },
            () = async { match watchdog.interval() { Some(i) => tokio::time::sleep(i).await, None => std::future::pending().await } } => {
                // A store thread stuck in one write or fsync (a disk that stopped answering)
                // holds every chunk unanswered while this loop runs on: the ping is withheld, so
                // that systemd restarts the server if it stays stuck.
                watchdog.ping_unless_stuck(
                    stats.busy(),
                    |d| format!("the store has been in one batch of writes and fsyncs for {}: chunks wait", humantime::format_duration(Duration::from_secs(d.as_secs()))),
                    "the store is back",
                );
            }
        }
    }
    edge_telemetry::notify::stopping();
    tracing::info!("shutting down");
    server.shutdown().await;
    metrics.stop().await;
    store.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// What `/v1/status` says of the sink beside its statistics.
fn sink_description(cfg: &config::Config) -> serde_json::Map<String, serde_json::Value> {
    let v = match &cfg.sink {
        config::SinkOptions::Files => serde_json::json!({"kind": "files", "data_dir": cfg.store.data_dir}),
        config::SinkOptions::JetStream(o) => serde_json::json!({
            "kind": "jetstream",
            "stream": o.stream,
            "subject_prefix": o.subject_prefix,
            "servers": o.servers.iter().map(|s| edge_ingest::jetstream::without_credentials(s)).collect::<Vec<_>>(),
        }),
    };
    v.as_object().cloned().unwrap_or_default()
}

/// Opens the configured sink: the file store (recovered first) or the JetStream stream.
async fn open_sink(cfg: &config::Config) -> anyhow::Result<Sink> {
    match &cfg.sink {
        config::SinkOptions::Files => {
            let dir = cfg.store.data_dir.clone();
            let opts = cfg.store.clone();
            let (store, report) = tokio::task::spawn_blocking(move || Store::open(opts))
                .await?
                .with_context(|| format!("opening the store in {}", dir.display()))?;
            tracing::info!(dir = %dir.display(), ?report, "store open");
            Ok(StoreHandle::spawn(store).into())
        }
        config::SinkOptions::JetStream(opts) => {
            let sink = JetStreamSink::start(opts.clone()).await.with_context(|| {
                format!(
                    "starting the JetStream sink (stream {:?} on {})",
                    opts.stream,
                    edge_ingest::jetstream::shown(&opts.servers)
                )
            })?;
            Ok(sink.into())
        }
    }
}

fn status(config: Option<PathBuf>, addr: Option<String>, json: bool) -> ExitCode {
    use edge_ingest::status::{self, Fetched};
    use serde_json::json;
    let unknown = |addr: Option<&str>, why: String| {
        if json {
            println!("{}", json!({"version": 1, "running": null, "addr": addr, "error": why}));
        } else {
            eprintln!("edge-ingest: status unknown: {why}");
        }
        ExitCode::from(status::EXIT_UNKNOWN)
    };
    let Some(target) = addr.or_else(|| status::addr_from_config(config.as_deref())) else {
        return unknown(None, "metrics.listen is empty, so the status endpoint is disabled; use --addr".to_owned());
    };
    let sock = match status::resolve(&target) {
        Ok(a) => a,
        Err(why) => return unknown(Some(&target), why),
    };
    match status::fetch(sock, status::FETCH_TIMEOUT) {
        Fetched::Status(mut doc) => {
            let reasons = status::degraded_reasons(&doc);
            if json {
                doc["addr"] = json!(sock.to_string());
                doc["healthy"] = json!(reasons.is_empty());
                doc["degraded_reasons"] = json!(reasons);
                println!("{doc}");
            } else {
                print!("{}", status::render(&doc, &reasons, status::now_ms(), status::use_color()));
            }
            ExitCode::from(if reasons.is_empty() { status::EXIT_HEALTHY } else { status::EXIT_DEGRADED })
        }
        Fetched::NotRunning(why) => {
            if json {
                println!("{}", json!({"version": 1, "running": false, "addr": sock.to_string(), "error": why}));
            } else {
                eprintln!("edge-ingest is not running (nothing answers on {sock}: {why})");
            }
            ExitCode::from(status::EXIT_NOT_RUNNING)
        }
        Fetched::NoAnswer(why) => {
            if json {
                let doc = json!({"version": 1, "running": true, "answered": false, "addr": sock.to_string(),
                    "healthy": false, "degraded_reasons": [why]});
                println!("{doc}");
            } else {
                eprintln!("edge-ingest: degraded\n  ! {why}");
            }
            ExitCode::from(status::EXIT_DEGRADED)
        }
        Fetched::Unknown(why) => unknown(Some(&target), why),
    }
}

fn pki(cmd: PkiCommand) -> anyhow::Result<()> {
    match cmd {
        PkiCommand::Init { dir, server_names, days, force } => {
            let mut opts = edge_transport::pki::InitOptions::default();
            if !server_names.is_empty() {
                opts.server_names = server_names;
            }
            opts.validity_days = days;
            opts.force = force;
            let paths = edge_transport::pki::init(&dir, &opts)?;
            println!("CA and server certificate written to {}: {paths:?}", dir.display());
        }
        PkiCommand::Issue { dir, device, out, days } => {
            let paths = edge_transport::pki::issue_device(&dir, &device, &out, days)?;
            println!("device certificate for {device} written to {}: {paths:?}", out.display());
        }
        PkiCommand::Revoke { dir, certs, days } => {
            let w = edge_transport::pki::revoke(&dir, &certs, days)?;
            println!(
                "{} certificate(s) newly revoked; {} revokes {} in all, valid for {days} days: list it in \
                 [tls] crls and run `edge-ingest pki crl --dir {}` before then",
                w.added,
                w.crl.display(),
                w.revoked,
                dir.display()
            );
        }
        PkiCommand::Crl { dir, days } => {
            let w = edge_transport::pki::reissue_crl(&dir, days)?;
            println!("{} re-issued: revokes {}, valid for {days} days", w.crl.display(), w.revoked);
        }
    }
    Ok(())
}

/// `edge-ingest export`; `Ok(false)` when it skipped damaged entries or regions.
fn export(data_dir: PathBuf, filter: ExportFilter, format: Format) -> anyhow::Result<bool> {
    ensure_store(&data_dir)?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    let report = edge_ingest::store::export(&data_dir, &filter, |chunk| {
        for rec in &chunk.records {
            match format {
                Format::Ndjson => {
                    out.write_all(rec)?;
                    out.write_all(b"\n")?;
                }
                Format::Raw => {
                    let len = u32::try_from(rec.len()).map_err(std::io::Error::other)?;
                    out.write_all(&len.to_le_bytes())?;
                    out.write_all(rec)?;
                }
            }
        }
        Ok(())
    })
    .with_context(|| format!("exporting from {}", data_dir.display()))?;
    out.flush()?;
    eprintln!("{}", export_summary(&data_dir, &report));
    Ok(report.corrupt == 0 && report.corrupt_regions == 0)
}

/// What `edge-ingest export` says on stderr when it is done: what it exported, and what it
/// skipped (each skipped entry or region is logged above it with its segment and offset).
fn export_summary(data_dir: &std::path::Path, r: &edge_ingest::store::ExportReport) -> String {
    let mut text = format!(
        "exported {} records of {} chunks ({} payload bytes) from {} segment(s) in {}",
        r.records,
        r.chunks,
        r.bytes,
        r.segments,
        data_dir.display()
    );
    let mut skipped = Vec::new();
    if r.corrupt > 0 {
        skipped.push(format!(
            "{} entries that do not read back whole ({} of them fail to decode, the rest their checksum)",
            r.corrupt, r.decode_errors
        ));
    }
    if r.corrupt_regions > 0 {
        skipped.push(format!("{} regions of {} bytes that do not parse", r.corrupt_regions, r.corrupt_bytes));
    }
    if !skipped.is_empty() {
        text.push_str("; skipped, as damaged: ");
        text.push_str(&skipped.join(", "));
    }
    if r.tail_bytes > 0 {
        text.push_str(&format!(
            "; {} bytes at the end of the newest segment hold no whole entry (a commit being written, or torn)",
            r.tail_bytes
        ));
    }
    text
}

/// `edge-ingest stored`: prints whether the chunk of that key is stored and returns the exit
/// code (see the command's doc).
fn stored(
    config: Option<PathBuf>,
    data_dir: Option<PathBuf>,
    device: String,
    stream: String,
    spool: Option<&str>,
    seq: u64,
) -> ExitCode {
    let spool = match spool.map(edge_ingest::server::parse_spool_id).transpose() {
        Ok(spool) => spool,
        Err(e) => {
            eprintln!("edge-ingest: --spool: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let asked = Asked { device, stream, spool, seq };
    let found = match data_dir {
        Some(dir) => stored_in_files(&dir, &asked),
        // Only the sink's settings are read (as the service has them): the TLS files are the
        // server's business.
        None => match config::load_as_service(config.as_deref()) {
            Ok(cfg) => match cfg.sink {
                config::SinkOptions::Files => stored_in_files(&cfg.store.data_dir, &asked),
                config::SinkOptions::JetStream(opts) => stored_in_jetstream(&opts, &asked),
            },
            Err(e) => {
                eprintln!("edge-ingest: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                return ExitCode::from(EXIT_CONFIG as u8);
            }
        },
    };
    match found {
        Ok(found) => {
            for line in &found.lines {
                println!("{line}");
            }
            ExitCode::from(found.code)
        }
        Err(e) => {
            eprintln!(
                "edge-ingest: looking up {}: {}",
                asked.shown(None),
                edge_telemetry::logging::error_chain(e.as_ref())
            );
            ExitCode::from(EXIT_LOOKUP_FAILED)
        }
    }
}

/// Exit code of a command line that does not parse, as clap exits for its own usage errors.
const EXIT_USAGE: u8 = 2;

/// `edge-ingest stored`'s exit code when it could not tell.
const EXIT_LOOKUP_FAILED: u8 = 3;

/// `edge-ingest stored`'s exit code when JetStream holds some of the chunk's parts only.
const EXIT_IN_PART: u8 = 4;

/// The chunk `edge-ingest stored` asks about; `spool` `None` for every spool's.
struct Asked {
    device: String,
    stream: String,
    spool: Option<[u8; 16]>,
    seq: u64,
}

impl Asked {
    /// The chunk as the output names it, in the spool of hex id `spool` (or the one asked for).
    fn shown(&self, spool: Option<&str>) -> String {
        let asked = self.spool.as_ref().map(|s| edge_ingest::server::hex(s));
        let spool = spool.or(asked.as_deref()).unwrap_or("any");
        format!("chunk (device {:?}, stream {:?}, spool {spool}, seq {})", self.device, self.stream, self.seq)
    }
}

/// What `edge-ingest stored` prints, and its exit code.
struct Found {
    lines: Vec<String>,
    code: u8,
}

impl Found {
    fn not_stored(asked: &Asked, place: String) -> Self {
        Found { lines: vec![format!("{}: not stored in {place}", asked.shown(None))], code: 1 }
    }

    /// The chunks found, as (line, whole): exit 4 when one is there only in part; asked
    /// without a spool id, 0 only for one spool's chunk, whole, where nothing could hide
    /// another (`damaged`), else 3, for which one is the agent's cannot be told here.
    fn listed(asked: &Asked, found: Vec<(String, bool)>, damaged: bool) -> Self {
        let in_part = found.iter().any(|(_, whole)| !whole);
        let several = found.len() > 1;
        let mut lines: Vec<String> = found.into_iter().map(|(line, _)| line).collect();
        let code = if in_part {
            EXIT_IN_PART
        } else if asked.spool.is_some() {
            0
        } else if several {
            lines.push(
                "several spools hold this seq of the stream: each spool numbers its own chunks, so only the one \
                 under the agent's spool id is its chunk; ask again with --spool"
                    .into(),
            );
            EXIT_LOOKUP_FAILED
        } else if damaged {
            lines.push(
                "the store has damaged regions, which may hold another spool's chunk of this seq: ask again with \
                 --spool"
                    .into(),
            );
            EXIT_LOOKUP_FAILED
        } else {
            0
        };
        Found { lines, code }
    }
}

/// An error unless `dir` is an ingest store: every store the server opened has its segments
/// directory, so a directory without one is another (a `data_dir` or `--data-dir` mistaken).
fn ensure_store(dir: &std::path::Path) -> anyhow::Result<()> {
    let segments = dir.join(edge_ingest::store::format::SEGMENTS_DIR);
    anyhow::ensure!(
        segments.is_dir(),
        "{} is not an ingest store: it has no {} directory (the config's [store] data_dir, or --data-dir, names \
         another directory?)",
        dir.display(),
        edge_ingest::store::format::SEGMENTS_DIR
    );
    Ok(())
}

/// Whether the file store in `dir` holds the chunk: one line per spool's chunk found. A store
/// that has no segments directory, or damaged regions the chunk may be in, cannot tell.
fn stored_in_files(dir: &std::path::Path, asked: &Asked) -> anyhow::Result<Found> {
    ensure_store(dir)?;
    let filter = ExportFilter {
        device: Some(asked.device.clone()),
        stream: Some(asked.stream.clone()),
        spool: asked.spool,
        seq: Some(asked.seq),
    };
    let mut found = Vec::new();
    let report = edge_ingest::store::export(dir, &filter, |chunk| {
        let at = humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(chunk.stored_ms));
        let line = format!(
            "{}: stored, {} records, at {at} (the server's clock), in segment {} of {}",
            asked.shown(Some(&edge_ingest::server::hex(&chunk.key.spool))),
            chunk.records.len(),
            chunk.segment,
            dir.display()
        );
        found.push((line, true));
        Ok(())
    })
    .with_context(|| format!("reading the store in {}", dir.display()))?;
    // The last segment's tail is the commit being written while a server runs; anything else
    // that did not parse, or an entry of this key that does not read back, may be the chunk.
    let damaged = report.corrupt > 0 || report.corrupt_regions > 0;
    if !found.is_empty() {
        return Ok(Found::listed(asked, found, damaged));
    }
    anyhow::ensure!(
        !damaged,
        "not found, but the store cannot rule it out: {} entries of it do not read back whole (checksum or \
         decoding), and {} regions of {} bytes do not parse",
        report.corrupt,
        report.corrupt_regions,
        report.corrupt_bytes
    );
    Ok(Found::not_stored(asked, dir.display().to_string()))
}

/// Whether the JetStream stream of `opts` holds every part of the chunk: one line per spool's
/// chunk found. Exit 0 when one is whole, 4 when some are there only in part.
fn stored_in_jetstream(opts: &edge_ingest::jetstream::JetStreamOptions, asked: &Asked) -> anyhow::Result<Found> {
    let rt =
        tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the tokio runtime")?;
    let lookup = edge_ingest::jetstream::lookup(opts, &asked.device, &asked.stream, asked.spool.as_ref(), asked.seq);
    let found = rt.block_on(lookup).with_context(|| {
        format!("in JetStream stream {:?} on {}", opts.stream, edge_ingest::jetstream::shown(&opts.servers))
    })?;
    let stream = &opts.stream;
    if found.is_empty() {
        return Ok(Found::not_stored(asked, format!("JetStream stream {stream:?}")));
    }
    let mut lines = Vec::new();
    for (spool, held) in &found {
        let records = held.records.map_or_else(|| "records not counted".to_owned(), |r| format!("{r} records"));
        if held.whole() {
            let line = format!(
                "{}: stored, {records} in {} part(s), in JetStream stream {stream:?}",
                asked.shown(Some(spool)),
                held.parts
            );
            lines.push((line, true));
        } else {
            let parts: Vec<String> = held.found.iter().map(usize::to_string).collect();
            let line = format!(
                "{}: only in part in JetStream stream {stream:?}: part(s) {} of {} ({records}); the other parts' \
                 records are not stored, and pushing all of the chunk's records again would store these parts' twice",
                asked.shown(Some(spool)),
                parts.join(", "),
                held.parts
            );
            lines.push((line, false));
        }
    }
    Ok(Found::listed(asked, lines, false))
}

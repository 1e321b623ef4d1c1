//! The `edge-uploader` command line: the daemon and the tools an operator needs next to it.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use edge_uploader::status::Fetched;
use edge_uploader::{EXIT_CONFIG, config};

/// jemalloc instead of glibc's allocator: chunk buffers of hundreds of KiB are allocated and
/// freed all the time, and glibc gives their pages back to the kernel and faults them in again
/// (page faults plus malloc and free were a tenth of the agent's CPU in a profile; BENCHMARKS.md).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's settings, read once at start (the environment variable `_RJEM_MALLOC_CONF` can
/// override them): one arena (two cores; the default of four per core held twice the memory),
/// freed pages given back after one second rather than ten. With these, peak RSS matched
/// glibc's while CPU per GiB stayed jemalloc's (`edge-bench pipeline`, BENCHMARKS.md). Without
/// a background thread jemalloc gives pages back only while the process allocates, so an agent
/// whose producers had gone quiet kept what they had freed: its thread gives them back on time
/// (`edge-bench producers --idle`, BENCHMARKS.md).
// jemalloc reads this symbol by name; exporting a symbol is what `unsafe_code` flags.
#[allow(unsafe_code, non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8] = b"narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0,background_thread:true\0";

#[derive(Parser, Debug)]
#[command(
    name = "edge-uploader",
    version,
    about = "Edge agent: spools sensor data durably and uploads it exactly once over QUIC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the agent daemon.
    Run {
        /// Config file (default /etc/edge-uploader/edge-uploader.toml if present).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Validate the configuration and exit 0 (valid) or 78 (invalid).
    CheckConfig {
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Send a file (or stdin) to the running agent's intake socket. Exit 0 accepted, 1 not (the
    /// reason on stderr), 78 the config named by --config cannot be read or parsed.
    Push {
        /// Stream name ([A-Za-z0-9_.-]{1,64}).
        #[arg(long)]
        stream: String,
        /// Send the input as one record instead of one record per line.
        #[arg(long)]
        raw: bool,
        /// Read the input as records each preceded by its 4-byte little-endian length (what
        /// `spool export-quarantined --format raw` and `edge-ingest export --format raw` print)
        /// and send each as a record of its own, in order; binary-safe. The whole input is
        /// checked before anything is sent; a refusal names how many records were accepted.
        #[arg(long, conflicts_with = "raw")]
        framed: bool,
        /// With --framed: skip the first N records of the input (to go on after a push that
        /// stopped part-way, from the number it printed).
        #[arg(long, requires = "framed", default_value_t = 0)]
        skip: usize,
        /// Intake socket (default: from the config).
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Input file; stdin when absent or "-".
        file: Option<PathBuf>,
    },
    /// Show the running agent's state. Exit 0 healthy, 1 degraded, 3 not running, 4 unknown (the
    /// socket cannot be asked, e.g. permission denied, and no metrics listener answered), 78 the
    /// config named by --config cannot be read or parsed.
    Status {
        /// Print one JSON object (with "version": 1) instead of text.
        #[arg(long)]
        json: bool,
        /// Degraded when the oldest unacknowledged data is older than this.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        max_backlog_age: Duration,
        /// Socket of the agent (default: from the config).
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Inspect or maintain the spool file.
    Spool {
        #[command(subcommand)]
        command: SpoolCommand,
    },
    /// Start an ingest server and an agent locally, stream synthetic sensor data, verify delivery.
    Demo {
        /// Stop after this many records (default 100000 when --duration is not given).
        #[arg(long)]
        records: Option<u64>,
        /// Stop producing after this many seconds.
        #[arg(long)]
        duration: Option<f64>,
        /// Working directory, kept afterwards (default: a temporary one).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print the final summary as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum SpoolCommand {
    /// Audit the spool read-only: SQLite integrity_check plus the checksum of every batch.
    /// Reports damaged chunks and streams with the records and bytes affected. Safe while the
    /// agent runs. Exit 0 clean (quarantined chunks do not count), 1 damage found, 78 usage or
    /// configuration error (e.g. no such file).
    Check(SpoolTarget),
    /// Delete the chunks held in quarantine (found corrupt, or rejected by the ingest server),
    /// listing each. Needs the agent stopped: the spool has one writer at a time. Exit 0 done,
    /// 1 the spool could not be opened or written (e.g. the agent runs), 78 usage or
    /// configuration error.
    PurgeQuarantined(SpoolTarget),
    /// Print the records of the chunks held in quarantine (every batch whose checksums pass),
    /// to look at them or push them again before a purge; each chunk, with what was exported of
    /// it and why it is in quarantine, goes to stderr. Read-only: safe while the agent runs.
    /// Chunks that may be stored at the ingest already come with the `edge-ingest stored`
    /// command that asks it. Exit 0 every record exported, 1 some could not be (named on
    /// stderr) or no chunk of --seq is in quarantine, 2 usage error, 78 configuration error.
    ExportQuarantined {
        /// Config file naming the spool (default /etc/edge-uploader/edge-uploader.toml).
        #[arg(long, short, conflicts_with = "spool")]
        config: Option<PathBuf>,
        /// The spool database file (instead of --config).
        #[arg(long)]
        spool: Option<PathBuf>,
        /// Only this stream's chunks.
        #[arg(long)]
        stream: Option<String>,
        /// Only the chunk of this sequence number (with --stream, one chunk).
        #[arg(long, requires = "stream")]
        seq: Option<i64>,
        /// How the records are written.
        #[arg(long, value_enum, default_value = "ndjson")]
        format: edge_uploader::spool_export::Format,
    },
}

/// Which spool a `spool` subcommand works on, and how it reports.
#[derive(clap::Args, Debug)]
struct SpoolTarget {
    /// Config file naming the spool (default /etc/edge-uploader/edge-uploader.toml).
    #[arg(long, short, conflicts_with = "spool")]
    config: Option<PathBuf>,
    /// The spool database file (instead of --config).
    #[arg(long)]
    spool: Option<PathBuf>,
    /// Print one JSON object (with "version": 1) instead of text.
    #[arg(long)]
    json: bool,
}

/// Caps glibc's malloc arenas at two. Rust's allocations go to jemalloc (above), but the C code
/// linked in (SQLite's page caches and statements) still allocates from glibc, where by default
/// every thread that allocates under contention gets its own arena (up to 8 per core), each
/// keeping the pages it freed. (When Rust allocated from glibc too, the request bodies held
/// that way were a quarter of the agent's peak RSS with large intake requests.)
/// Must run before any thread is started.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn limit_malloc_arenas() {
    // SAFETY: `mallopt` only sets an allocator parameter; it is called before any other thread
    // exists, so no allocation races with it. Failure (0) leaves glibc's default in place.
    let _ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn limit_malloc_arenas() {}

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = Cli::parse();
    // Crash points (`FAILPOINTS=name=actions;...`) exist only in test builds (`failpoints`).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    match cli.command {
        Command::CheckConfig { config } => match config::load_checked_as_service(config.as_deref()) {
            Ok(c) => {
                println!("config ok{}", c.source.map(|p| format!(": {}", p.display())).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("edge-uploader: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                ExitCode::from(EXIT_CONFIG as u8)
            }
        },
        Command::Spool { command: SpoolCommand::Check(SpoolTarget { config, spool, json }) } => {
            ExitCode::from(edge_uploader::spool_check::run(config.as_deref(), spool, json))
        }
        Command::Spool { command: SpoolCommand::PurgeQuarantined(SpoolTarget { config, spool, json }) } => {
            ExitCode::from(edge_uploader::spool_purge::run(config.as_deref(), spool, json))
        }
        Command::Spool { command: SpoolCommand::ExportQuarantined { config, spool, stream, seq, format } } => {
            let select = edge_spool::Selection { stream: stream.as_deref(), seq };
            ExitCode::from(edge_uploader::spool_export::run(config.as_deref(), spool, select, format))
        }
        Command::Run { config } => {
            let cfg = match config::load_checked(config.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("edge-uploader: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                    return ExitCode::from(EXIT_CONFIG as u8);
                }
            };
            if let Err(e) = edge_telemetry::logging::init(&cfg.log_level, cfg.log_format) {
                eprintln!("edge-uploader: {e}");
                return ExitCode::from(EXIT_CONFIG as u8);
            }
            report(runtime().and_then(|rt| rt.block_on(edge_uploader::agent::run(cfg))))
        }
        Command::Status { json, max_backlog_age, socket, config } => {
            // With --socket the config is not read: the metrics listener is asked only for the
            // agent whose socket the config names.
            let (socket, metrics) = match socket {
                Some(socket) => (socket, None),
                None => match read_config_for_status(config) {
                    Ok(c) => (c.socket, c.metrics),
                    Err(e) => {
                        eprintln!("edge-uploader: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                        return ExitCode::from(EXIT_CONFIG as u8);
                    }
                },
            };
            let fetched = runtime().map(|rt| {
                rt.block_on(async {
                    let timeout = edge_uploader::status::FETCH_TIMEOUT;
                    let first = edge_uploader::status::fetch(&socket, timeout).await;
                    // The intake socket did not answer (every connection slot may be taken), or
                    // could not be asked (permission denied). The metrics listener is outside
                    // that limit and needs no permission on the socket; its status document is
                    // shown, with the socket's silence (not this user's lack of permission) as a
                    // reason to be degraded.
                    let (why, silent) = match &first {
                        Fetched::NoAnswer(why) => (why.clone(), true),
                        Fetched::Unreachable(why) => (why.clone(), false),
                        _ => return (first, None),
                    };
                    let Some(addr) = metrics else { return (first, None) };
                    match edge_uploader::status::fetch_metrics(addr, timeout).await {
                        Ok(doc) => (Fetched::Answer(doc), Some((why, addr, silent))),
                        Err(also) if silent => (Fetched::NoAnswer(format!("{why}; {also}")), None),
                        Err(also) => (Fetched::Unreachable(format!("{why}; {also}")), None),
                    }
                })
            });
            match fetched {
                Ok((Fetched::Answer(mut doc), detour)) => {
                    let now = edge_uploader::status::now_ms();
                    let mut reasons = edge_uploader::status::degraded_reasons(&doc, max_backlog_age, now);
                    if let Some((why, addr, silent)) = detour {
                        if silent {
                            reasons.insert(0, format!("{why}; this status came from the metrics listener {addr}"));
                        } else {
                            doc["intake_socket_error"] = serde_json::json!(why);
                        }
                        doc["intake_socket_answered"] = serde_json::Value::Bool(false);
                        doc["answered_on"] = serde_json::json!(addr.to_string());
                    }
                    if json {
                        let mut doc = doc;
                        doc["healthy"] = serde_json::Value::Bool(reasons.is_empty());
                        doc["degraded_reasons"] = serde_json::json!(reasons);
                        doc["notes"] = serde_json::json!(edge_uploader::status::notes(&doc));
                        println!("{doc}");
                    } else {
                        print!("{}", edge_uploader::status::render(&doc, &reasons, now));
                    }
                    ExitCode::from(if reasons.is_empty() {
                        edge_uploader::status::EXIT_HEALTHY
                    } else {
                        edge_uploader::status::EXIT_DEGRADED
                    })
                }
                Ok((Fetched::NoAnswer(why), _)) => {
                    if json {
                        let doc = serde_json::json!({"version": 1, "running": true, "answered": false, "socket": socket,
                            "healthy": false, "degraded_reasons": [why]});
                        println!("{doc}");
                    } else {
                        eprintln!("edge-uploader: degraded\n  ! {why}");
                    }
                    ExitCode::from(edge_uploader::status::EXIT_DEGRADED)
                }
                Ok((Fetched::NotRunning, _)) => {
                    if json {
                        println!("{}", serde_json::json!({"version": 1, "running": false, "socket": socket}));
                    } else {
                        eprintln!("edge-uploader is not running (nothing answers on {})", socket.display());
                    }
                    ExitCode::from(edge_uploader::status::EXIT_NOT_RUNNING)
                }
                Ok((Fetched::Unreachable(why), _)) => {
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"version": 1, "running": null, "socket": socket, "error": why})
                        );
                    } else {
                        eprintln!("edge-uploader: status unknown: {why}");
                    }
                    ExitCode::from(edge_uploader::status::EXIT_UNKNOWN)
                }
                Err(e) => report(Err(e)),
            }
        }
        Command::Push { stream, raw, framed, skip, socket, config, file } => {
            let mode = match (raw, framed) {
                (true, _) => PushMode::OneRecord,
                (_, true) => PushMode::Framed { skip },
                _ => PushMode::Lines,
            };
            let socket = match socket.map_or_else(|| socket_from_config(config), Ok) {
                Ok(socket) => socket,
                Err(e) => {
                    eprintln!("edge-uploader: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                    return ExitCode::from(EXIT_CONFIG as u8);
                }
            };
            report(runtime().and_then(|rt| rt.block_on(push(stream, mode, socket, file))))
        }
        Command::Demo { records, duration, dir, json } => {
            let _ = edge_telemetry::logging::init("warn", edge_telemetry::logging::LogFormat::Text);
            let opts = edge_uploader::demo::DemoOptions {
                records,
                duration: duration.map(Duration::from_secs_f64),
                dir,
                json,
            };
            match runtime().and_then(|rt| rt.block_on(edge_uploader::demo::run(opts))) {
                Ok(s) => {
                    if json {
                        match serde_json::to_string(&s) {
                            Ok(j) => println!("{j}"),
                            Err(e) => eprintln!("edge-uploader: {e}"),
                        }
                    } else {
                        edge_uploader::demo::print_human(&s);
                    }
                    let ok = s.records_stored == s.records_sent
                        && s.duplicates_stored == 0
                        && s.records_missing == 0
                        && s.records_corrupt == 0;
                    if ok {
                        ExitCode::SUCCESS
                    } else {
                        eprintln!("edge-uploader: demo verification FAILED");
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("edge-uploader: demo failed: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                    ExitCode::FAILURE
                }
            }
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
            eprintln!("edge-uploader: {}", edge_telemetry::logging::error_chain(e.as_ref()));
            if e.downcast_ref::<edge_uploader::spool_task::SyncFailed>().is_some() {
                ExitCode::from(edge_uploader::spool_task::EXIT_SYNC_FAILED as u8)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// How `push` reads its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PushMode {
    /// One record per line (NDJSON), in one request.
    Lines,
    /// The whole input as one record.
    OneRecord,
    /// Length-prefixed records, one request each, after the first `skip`.
    Framed { skip: usize },
}

async fn push(stream: String, mode: PushMode, socket: PathBuf, file: Option<PathBuf>) -> anyhow::Result<()> {
    edge_proto::StreamName::new(&stream).with_context(|| format!("stream name {stream:?}"))?;
    let data = match file.as_deref() {
        None => read_stdin()?,
        Some(p) if p.as_os_str() == "-" => read_stdin()?,
        Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
    };
    let mut client = edge_uploader::client::IntakeClient::new(&socket);
    if let PushMode::Framed { skip } = mode {
        return push_framed(&mut client, &stream, Bytes::from(data), skip).await;
    }
    let ctype = if mode == PushMode::OneRecord { "application/octet-stream" } else { "application/x-ndjson" };
    let resp = client.post(&stream, ctype, Bytes::from(data)).await?;
    if resp.status == 200 {
        println!(
            "accepted {} records ({} bytes) on stream {stream}",
            resp.records(),
            resp.body.get("bytes").and_then(serde_json::Value::as_u64).unwrap_or(0)
        );
        Ok(())
    } else {
        anyhow::bail!("intake refused the data (HTTP {}): {}", resp.status, resp.body)
    }
}

/// Most answers "retry later" (503, 507) `push --framed` waits out for one record.
const PUSH_RETRIES: u32 = 10;

/// `push --framed`: every record is read (a truncated input sends nothing) and then, after the
/// first `skip`, sent as a request of its own, in order. Each answer 200 means that record is
/// durable in the spool, so a failure part-way says which records were accepted, whether the
/// one that failed may have been stored, and the `--skip` to go on with. An answer to retry later
/// (a full request budget or spool: 503, 507) is waited out, as its `Retry-After` asks, up to
/// [`PUSH_RETRIES`] times per record.
async fn push_framed(
    client: &mut edge_uploader::client::IntakeClient,
    stream: &str,
    data: Bytes,
    skip: usize,
) -> anyhow::Result<()> {
    let mut records = Vec::new();
    for r in edge_proto::records::RecordIter::new(&data) {
        let r = r.with_context(|| {
            format!("the input is not length-prefixed records: record {} is cut short", records.len() + 1)
        })?;
        records.push(data.slice_ref(r));
    }
    let n = records.len();
    anyhow::ensure!(skip <= n, "--skip {skip}: the input holds {n} records");
    // What is in the spool before record `i + 1` (from 0), for the messages.
    let so_far = |i: usize| match (i - skip, skip) {
        (0, 0) => format!("no record of {n} on stream {stream} was accepted"),
        (0, _) => format!("no record after the {skip} skipped was accepted on stream {stream}"),
        (_, 0) => format!("records 1-{i} of {n} on stream {stream} were accepted"),
        (done, _) => {
            format!("records {}-{i} of {n} on stream {stream} were accepted ({done} after the skipped)", skip + 1)
        }
    };
    let mut bytes = 0u64;
    for (i, rec) in records.into_iter().enumerate().skip(skip) {
        let len = rec.len() as u64;
        let mut tries = 0;
        loop {
            client.connected().await.with_context(|| {
                format!("{}; record {} and the rest were not sent: go on with --skip {i}", so_far(i), i + 1)
            })?;
            let resp = client.post(stream, "application/octet-stream", rec.clone()).await.with_context(|| {
                format!(
                    "{}; record {} may or may not have been stored (it was sent, its answer not read): look for it \
                     before going on with --skip {i} or --skip {}",
                    so_far(i),
                    i + 1,
                    i + 1
                )
            })?;
            match resp.status {
                200 => break,
                503 | 507 if tries < PUSH_RETRIES => {
                    tries += 1;
                    let wait = Duration::from_secs(resp.retry_after.unwrap_or(1).clamp(1, 30));
                    eprintln!(
                        "edge-uploader: record {} refused for now (HTTP {}): {}; trying again in {wait:?}",
                        i + 1,
                        resp.status,
                        resp.body
                    );
                    tokio::time::sleep(wait).await;
                }
                status => anyhow::bail!(
                    "{}; record {} was refused (HTTP {status}): {}; it and the rest were not stored: go on with --skip {i} \
                     once it is fixed",
                    so_far(i),
                    i + 1,
                    resp.body
                ),
            }
        }
        bytes += len;
    }
    println!("accepted {} records ({bytes} bytes) on stream {stream}", n - skip);
    Ok(())
}

/// The intake socket named in the config (or the default). Only that key is needed, so the
/// file is read without requiring the TLS files to exist; an unreadable file means the default.
fn socket_from_config(config: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    Ok(raw_config_or_default(config)?.intake.socket)
}

/// Where `status` asks: the intake socket and the metrics listener (if any) of the config.
struct StatusAddrs {
    socket: PathBuf,
    metrics: Option<std::net::SocketAddr>,
}

fn read_config_for_status(config: Option<PathBuf>) -> anyhow::Result<StatusAddrs> {
    let raw = raw_config_or_default(config)?;
    let metrics =
        raw.metrics.listen.trim().parse::<std::net::SocketAddr>().ok().map(edge_telemetry::metrics::local_addr_of);
    Ok(StatusAddrs { socket: raw.intake.socket, metrics })
}

/// The keys of the config file at `config` (or the default path) with the overrides the service
/// sees (`config::service_overrides`: for the packaged config, `/etc/default/edge-uploader`'s
/// too); where those do not parse, the file's alone. Not validated: `status` and `push` need a
/// socket path, not a config `run` would accept.
///
/// A file named with `--config` must read and parse: an error names it (the caller exits 78),
/// rather than asking the packaged agent's socket about another agent. The default path may be
/// missing, unreadable to this user or broken: then the built-in defaults, said on stderr.
fn raw_config_or_default(config: Option<PathBuf>) -> anyhow::Result<config::RawConfig> {
    let with_env = match config::raw_with_env(config.as_deref(), config::service_overrides(config.as_deref())) {
        Ok((raw, _)) => return Ok(raw),
        Err(e) => e,
    };
    let path = config.clone().unwrap_or_else(|| PathBuf::from(config::DEFAULT_CONFIG_PATH));
    let file = match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str::<config::RawConfig>(&text)
            .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && config.is_none() => {
            return Ok(config::RawConfig::default());
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("reading {}", path.display()))),
    };
    match (file, config) {
        // The file parses; only the environment's overrides did not.
        (Ok(raw), _) => {
            eprintln!(
                "edge-uploader: ignoring the environment's overrides: {}",
                edge_telemetry::logging::error_chain(with_env.as_ref())
            );
            Ok(raw)
        }
        (Err(e), Some(_)) => Err(e.context("the config named by --config")),
        (Err(e), None) => {
            eprintln!(
                "edge-uploader: using the built-in defaults: {}",
                edge_telemetry::logging::error_chain(e.as_ref())
            );
            Ok(config::RawConfig::default())
        }
    }
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut v = Vec::new();
    std::io::stdin().read_to_end(&mut v).context("reading stdin")?;
    Ok(v)
}

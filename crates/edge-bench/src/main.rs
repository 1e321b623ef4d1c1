//! `edge-bench`: measures edge-uploader against the physical limits of the machine (raw quinn,
//! TLS 1.3 over TCP) and against the peers a user would pick instead (Mosquitto QoS 1,
//! NATS JetStream), in one run, and reports ratios (the machines are shared and noisy, so
//! ratios measured side by side mean more than absolute figures).
//!
//! * `edge-bench all [--reps 3] [--out FILE]`: everything, each case repeated, progress on
//!   stderr, a Markdown table (median [min-max]) on stdout and in `--out`.
//! * `edge-bench quick --json`: a short run (under 90 s) printing one JSON object.
//!
//! Every party runs as its own process: the daemons are the release binaries next to this one
//! (`cargo build --release --workspace` first), the baselines are this binary re-executed in a
//! server and a client role.

mod baseline;
mod cases;
mod peers;
mod reconnect;
mod spool;
mod sys;
mod uplink;
mod world;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "edge-bench", about = "Benchmarks edge-uploader against raw quinn, TLS/TCP and real peers")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every case, repeated; Markdown table on stdout (and in --out).
    All {
        /// Repetitions per case (at least 3 for a median with spread).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Also write the Markdown report here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Also write every sample as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Measure the daemon binaries even if older than their sources.
        #[arg(long)]
        allow_stale: bool,
    },
    /// A short run (under 90 s); prints one JSON object with --json, a table otherwise.
    Quick {
        #[arg(long)]
        json: bool,
        #[arg(long)]
        allow_stale: bool,
    },
    /// Runs the agent under a profiler (e.g. `--wrapper "valgrind --tool=callgrind"`) through
    /// one live phase and its drain, then stops it with SIGTERM so the profiler writes out.
    /// Or, with `--attach`, runs a command against the running daemons for the measured phase
    /// only (`{agent}` and `{ingest}` are replaced by their pids) and stops it with SIGINT.
    Profile {
        /// Command line the agent is started under.
        #[arg(long, required_unless_present = "attach")]
        wrapper: Option<String>,
        /// Command line started when the measured phase begins, e.g.
        /// `perf record -F 999 -g -o drain.data -p {agent}`.
        #[arg(long, conflicts_with = "wrapper")]
        attach: Option<String>,
        /// Measure a drain (the spool filled with the ingest down, then the ingest started)
        /// instead of a live phase.
        #[arg(long)]
        drain: bool,
        #[arg(long, default_value_t = 32)]
        mib: u64,
        /// 10 KiB records per request. Default: the measured case's own load, so the spool's
        /// layout is the one the case reads: with `--drain` the drain case's prefill (4
        /// producers, one stream each, 100 records per request), otherwise the live case's (32
        /// producers on 4 streams, one record per request). 0: the record-stream intake
        /// (4 producers, 256 records unacknowledged each), as the record-stream live case.
        #[arg(long)]
        per_request: Option<usize>,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The agent's own cases only (drain of 512 MiB, live 10 KiB one per request, raw quinn
    /// for the ratio), repeated: for comparing two builds of the agent.
    Pipeline {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The `all` run's cases that post HTTP bodies (10 KiB and 100 KiB records one per request,
    /// 10 KiB records 100 per request, small records 1000 per request), repeated: for comparing
    /// settings of the HTTP intake, such as `intake.request_pending_total_bytes`.
    Http {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The record-stream live case, HTTP producers of 4 MiB requests (`--request-mib`; under
    /// the default request budget and under 1 GiB) and of 100 KiB requests (with a
    /// Content-Length and chunked) with more and more producer connections: what the agent
    /// stores, its CPU and its peak RSS at each count; then quiet connections, under the default
    /// `intake.max_connections` and without it.
    Producers {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Producer connections, one count per case (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
        counts: Vec<usize>,
        /// Size of the large HTTP requests in MiB (of 10 KiB records, 100 per MiB): 4 fits the
        /// default request budget twice, 16 is larger than all of it.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
        request_mib: u16,
        /// Only the large HTTP requests' cases (default budget and 1 GiB).
        #[arg(long)]
        large_only: bool,
        /// Then this many connections (half record stream, half HTTP) that send 64 KiB each and
        /// go quiet: the agent's RSS with them under the default `intake.max_connections` and
        /// with it at 16384; 0 skips it.
        #[arg(long, default_value_t = 2000)]
        idle: usize,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The agent's reconnect only: new connections through a delaying proxy with a full
    /// handshake, and reconnections after an outage with the chunk sent after the Welcome and
    /// right behind the Hello, timed to the session, the first chunk sent and its ack.
    Reconnect {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Bytes of the one record each connection uploads.
        #[arg(long, default_value_t = 10240)]
        record: usize,
        #[arg(long)]
        allow_stale: bool,
    },
    /// Shaped uplinks (rate limit, delay, loss through a userspace proxy): raw quinn and the
    /// agent's drain over the same path, and their ratio.
    Uplink {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Only the paths whose name contains one of these (comma-separated), e.g. `100 Mbit`.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// The congestion controllers to measure, each for raw quinn and the agent
        /// (comma-separated: `cubic`, `bbr`); ratios are to the first.
        #[arg(long, value_delimiter = ',', default_value = "cubic,bbr")]
        controllers: Vec<String>,
        /// Backlog per case in MiB instead of each path's own (96 MiB on the clean path,
        /// 4 MiB on the lossy ones, about one in-flight budget).
        #[arg(long)]
        mib: Option<u64>,
        /// Instead: the agent draining sensor readings (fresh JSON lines) without compression
        /// and with zstd, beside raw quinn, with Cubic.
        #[arg(long, conflicts_with = "controllers")]
        readings: bool,
        #[arg(long)]
        allow_stale: bool,
    },
    /// An uplink outage on each shaped path: four devices post sensor readings at a sensor's
    /// pace while the path is down, then the path opens; the chunks the backlog went up in,
    /// what went up the path per record byte, the time to store it all and the agent's CPU.
    Outage {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Only the paths whose name contains one of these (comma-separated), e.g. `100 Mbit`.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// How long the path is down while the devices post.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        outage: std::time::Duration,
        /// `spool.compression` settings to measure in turn (comma-separated: `zstd`, `none`).
        #[arg(long, value_delimiter = ',', default_value = "zstd", value_parser = ["zstd", "none"])]
        compression: Vec<String>,
        /// The agent's default reconnect backoff (200 ms to 30 s) instead of the bench's 20 to
        /// 100 ms: how late it connects after a long outage.
        #[arg(long)]
        default_backoff: bool,
        /// `upload.probe_interval` settings to measure in turn (comma-separated, e.g. `5s,0s`;
        /// `0s` is no probing); none given: the agent's default.
        #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration)]
        probe_interval: Vec<std::time::Duration>,
        #[arg(long)]
        allow_stale: bool,
    },
    /// Compression on loopback, where the cores are the limit: the drain of fresh sensor
    /// readings and of random (incompressible) records, without compression and with zstd at
    /// levels 1 and 3: records/s, CPU per GiB of records, bytes sent per record byte.
    Compression {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Record bytes per drain, in MiB.
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        /// Record bytes of the large-backlog drains (zstd level 3 only, for the agent's peak
        /// RSS), in MiB; 0 leaves them out.
        #[arg(long, default_value_t = 4096)]
        backlog_mib: u64,
        /// Also measure latency with zstd level 3 at each of these `spool.linger` settings
        /// (comma-separated, e.g. `5ms,10ms`); the default configuration's is 20 ms.
        #[arg(long, value_delimiter = ',', value_parser = parse_linger)]
        lingers: Vec<String>,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The ingest's sinks side by side: the same drain into the file store, into the machine's
    /// JetStream (127.0.0.1:4222) and into a bench-started one with `sync_interval: always`.
    Sink {
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Bytes of backlog per drain, in MiB.
        #[arg(long, default_value_t = 512)]
        mib: u64,
        #[arg(long)]
        allow_stale: bool,
    },
    /// Configuration sweep: raw quinn per transport knob (GSO, MTU discovery, socket buffers,
    /// windows, ACK frequency); live and drain per agent setting (durability, chunk size, chunks in flight,
    /// linger, zstd).
    Sweep {
        #[arg(long, default_value_t = 1)]
        reps: usize,
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only the variants whose name contains one of these (comma-separated), e.g.
        /// `default,zstd`; the raw quinn variants are named `raw quinn, transport NAME`.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        #[arg(long)]
        allow_stale: bool,
    },
    /// The spool alone, in process: write (group commits) and read+ack phases at several SQLite
    /// page sizes, against an append-only file doing the same durable work.
    Spool {
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Bytes per record (one record per request).
        #[arg(long, default_value_t = 10240)]
        record: usize,
        /// Requests per commit.
        #[arg(long, default_value_t = 32)]
        per_commit: usize,
        #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536")]
        page_sizes: Vec<u32>,
        /// Streams the spool knows while the one under test is written (comma-separated), at the
        /// first page size: each count past 1 is a variant of its own, its other streams idle
        /// (one record each, sealed and acked before the phases are measured).
        #[arg(long, value_delimiter = ',', default_value = "1")]
        streams: Vec<u64>,
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Where the files go (default: target/edge-bench-work/spool).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Internal: one party of a baseline.
    #[command(hide = true)]
    Role {
        side: Side,
        #[arg(long, value_enum)]
        kind: baseline::Kind,
        #[arg(long)]
        pki: PathBuf,
        #[arg(long)]
        bytes: u64,
        #[arg(long, default_value_t = 10240)]
        msg_size: usize,
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Client: send one message-long buffer again and again instead of distinct bytes.
        #[arg(long)]
        one_buffer: bool,
        /// raw quinn: the transport tuning of both parties (the same on both sides).
        #[arg(long, value_enum, default_value = "default")]
        transport: baseline::TransportVariant,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Side {
    Server,
    Client,
    HandshakeServer,
    HandshakeClient,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Role { side, kind, pki, bytes, msg_size, port, one_buffer, transport } => match side {
            Side::Server | Side::Client => {
                let source = if one_buffer { baseline::Source::OneBuffer } else { baseline::Source::Distinct };
                let r = baseline::Role {
                    server: side == Side::Server,
                    kind,
                    bytes,
                    msg_size,
                    port,
                    source,
                    variant: transport,
                };
                baseline::role(r, &pki)
            }
            Side::HandshakeServer | Side::HandshakeClient => {
                baseline::handshake_role(side == Side::HandshakeServer, &pki, bytes, port)
            }
        },
        Cmd::Spool { mib, record, per_commit, page_sizes, streams, reps, dir } => {
            let opts = spool::Opts { mib, record, per_commit, page_sizes, streams, reps: reps.max(1) };
            let dir = dir.unwrap_or_else(|| PathBuf::from("target/edge-bench-work/spool"));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let samples = spool::run(&opts, &dir)?;
            let command = format!(
                "cargo run --release -p edge-bench -- spool --mib {mib} --record {record} --per-commit {per_commit} \
                 --page-sizes {} --streams {} --reps {}",
                opts.page_sizes.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
                opts.streams.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
                opts.reps
            );
            println!("{}", spool::markdown(&samples, &opts, &command));
            Ok(())
        }
        Cmd::Quick { json, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let ctx = cases::Ctx::new(allow_stale, 1, true)?;
            let results = rt.block_on(cases::quick(&ctx))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&results.quick_json())?);
            } else {
                println!("{}", results.markdown(&ctx));
            }
            Ok(())
        }
        Cmd::Pipeline { reps, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!("cargo run --release -p edge-bench -- pipeline --reps {}", ctx.reps);
            let results = rt.block_on(cases::pipeline(&ctx))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Http { reps, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!("cargo run --release -p edge-bench -- http --reps {}", ctx.reps);
            let results = rt.block_on(cases::http(&ctx))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Producers { reps, counts, request_mib, large_only, idle, allow_stale } => {
            anyhow::ensure!(counts.iter().all(|&n| n > 0), "--counts: every count must be at least 1");
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            let list: Vec<String> = counts.iter().map(usize::to_string).collect();
            ctx.command = format!(
                "cargo run --release -p edge-bench -- producers --reps {} --counts {} --request-mib {request_mib}{} --idle {idle}",
                ctx.reps,
                list.join(","),
                if large_only { " --large-only" } else { "" },
            );
            let results = rt.block_on(cases::producers(&ctx, &counts, usize::from(request_mib), large_only, idle))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Profile { wrapper, attach, drain, mib, per_request, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let ctx = cases::Ctx::new(allow_stale, 1, true)?;
            let words = |s: Option<String>| s.map(|s| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
            let how = match (words(wrapper), words(attach)) {
                (Some(w), _) => cases::Profiler::Wrap(w),
                (None, Some(a)) => cases::Profiler::Attach(a),
                (None, None) => anyhow::bail!("give --wrapper or --attach"),
            };
            rt.block_on(cases::profile(&ctx, how, drain, mib << 20, per_request))
        }
        Cmd::Reconnect { reps, record, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command =
                format!("cargo run --release -p edge-bench -- reconnect --reps {} --record {record}", ctx.reps);
            let mut results = cases::Results::default();
            rt.block_on(cases::agent_reconnect(&ctx, &mut results, record))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Uplink { reps, only, controllers, mib, readings, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!("cargo run --release -p edge-bench -- uplink --reps {}", ctx.reps);
            if !only.is_empty() {
                ctx.command.push_str(&format!(" --only {:?}", only.join(",")));
            }
            let paths: Vec<uplink::Uplink> = uplink::matching(&only)?
                .into_iter()
                .map(|u| uplink::Uplink { mib: mib.unwrap_or(u.mib), ..u })
                .collect();
            if let Some(m) = mib {
                anyhow::ensure!(m > 0, "--mib must be at least 1");
                ctx.command.push_str(&format!(" --mib {m}"));
            }
            if readings {
                ctx.command.push_str(" --readings");
                let results = rt.block_on(cases::uplink_readings(&ctx, &paths))?;
                println!("{}", results.markdown(&ctx));
                return Ok(());
            }
            let controllers = controllers
                .iter()
                .map(|c| {
                    edge_transport::CongestionController::from_name(c)
                        .with_context(|| format!("--controllers: {c:?} is not a controller (cubic, bbr)"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            anyhow::ensure!(!controllers.is_empty(), "--controllers names none");
            if controllers != edge_transport::CongestionController::ALL {
                let names: Vec<&str> = controllers.iter().map(|c| c.name()).collect();
                ctx.command.push_str(&format!(" --controllers {}", names.join(",")));
            }
            let results = rt.block_on(cases::uplink(&ctx, &paths, &controllers))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Outage { reps, only, outage, compression, default_backoff, probe_interval, allow_stale } => {
            anyhow::ensure!(!outage.is_zero(), "--outage must be above zero");
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!(
                "cargo run --release -p edge-bench -- outage --reps {} --outage {:?} --compression {}",
                ctx.reps,
                humantime::format_duration(outage).to_string(),
                compression.join(",")
            );
            if !only.is_empty() {
                ctx.command.push_str(&format!(" --only {:?}", only.join(",")));
            }
            if default_backoff {
                ctx.command.push_str(" --default-backoff");
            }
            let probes: Vec<Option<String>> = if probe_interval.is_empty() {
                vec![None]
            } else {
                probe_interval.iter().map(|p| Some(humantime::format_duration(*p).to_string())).collect()
            };
            if !probe_interval.is_empty() {
                let list: Vec<&str> = probes.iter().flatten().map(String::as_str).collect();
                ctx.command.push_str(&format!(" --probe-interval {}", list.join(",")));
            }
            let paths = uplink::matching(&only)?;
            let compressions: Vec<&'static str> =
                compression.iter().map(|c| if c == "none" { "none" } else { "zstd" }).collect();
            let results = rt.block_on(cases::outage(&ctx, &paths, outage, &compressions, default_backoff, &probes))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Compression { reps, mib, backlog_mib, lingers, allow_stale } => {
            anyhow::ensure!(mib > 0, "--mib must be at least 1");
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!(
                "cargo run --release -p edge-bench -- compression --reps {} --mib {mib} --backlog-mib {backlog_mib}",
                ctx.reps
            );
            if !lingers.is_empty() {
                ctx.command.push_str(&format!(" --lingers {}", lingers.join(",")));
            }
            let results = rt.block_on(cases::compression(&ctx, mib << 20, backlog_mib << 20, &lingers))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Sink { reps, mib, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!("cargo run --release -p edge-bench -- sink --reps {} --mib {mib}", ctx.reps);
            let results = rt.block_on(cases::sinks(&ctx, mib << 20))?;
            println!("{}", results.markdown(&ctx));
            Ok(())
        }
        Cmd::Sweep { reps, out, only, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let mut ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            ctx.command = format!("cargo run --release -p edge-bench -- sweep --reps {}", ctx.reps);
            if !only.is_empty() {
                ctx.command.push_str(&format!(" --only {}", only.join(",")));
            }
            let results = rt.block_on(cases::sweep(&ctx, &only))?;
            let md = results.markdown(&ctx);
            println!("{md}");
            if let Some(out) = out {
                std::fs::write(&out, &md).with_context(|| format!("writing {}", out.display()))?;
            }
            Ok(())
        }
        Cmd::All { reps, out, json, allow_stale } => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let ctx = cases::Ctx::new(allow_stale, reps.max(1), false)?;
            let results = rt.block_on(cases::all(&ctx))?;
            let md = results.markdown(&ctx);
            println!("{md}");
            if let Some(out) = out {
                std::fs::write(&out, &md).with_context(|| format!("writing {}", out.display()))?;
            }
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&results.samples_json())?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(())
        }
    }
}

/// A `spool.linger` value as the agent's configuration takes it (`5ms`, `1s`).
fn parse_linger(s: &str) -> Result<String, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(s.to_owned()),
        Ok(_) => Err(format!("linger {s:?}: expected above zero")),
        Err(e) => Err(format!("linger {s:?}: {e}")),
    }
}

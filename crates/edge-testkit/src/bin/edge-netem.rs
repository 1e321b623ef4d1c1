//! `edge-netem`: a fault-injecting UDP proxy for trying the agent against a bad network by hand.
//!
//! Point the agent's `[upload] server` at `--listen` and run the proxy towards the real ingest
//! server (`--upstream`). Faults are set by flags at start and changed while it runs by commands
//! on stdin; `stats` prints the counters as JSON. See `edge_testkit::netem` for the model.

use std::io::BufRead;
use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use clap::Parser;
use edge_testkit::netem::{self, Faults, Netem, NetemConfig, NetemHandle, Which};

const COMMANDS: &str = "\
commands (one per line on stdin):
  [up|down] SETTING VALUE   change a fault; without up/down both directions
                            e.g. `loss 10%`, `down blackhole on`, `up delay 80ms`, `rate off`
  blackhole on|off          shorthand for both directions
  rebind [IP]               move to a new upstream source port (and address, e.g. 127.0.0.2)
  stats                     print the counters as JSON
  show                      print the current faults as JSON
  help                      this text
  quit                      stop (as does end of input or Ctrl-C)";

/// Fault-injecting UDP proxy between an edge-uploader agent and an edge-ingest server.
#[derive(Debug, Parser)]
#[command(
    name = "edge-netem",
    after_help = format!("settings: {}\n\n{COMMANDS}", netem::SETTINGS),
)]
struct Args {
    /// Address the agent sends to.
    #[arg(long, value_name = "ADDR")]
    listen: SocketAddr,
    /// The ingest server's address.
    #[arg(long, value_name = "ADDR")]
    upstream: SocketAddr,
    /// Seed of every random decision (same seed, same packets: same verdicts).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Uniform loss, both directions (e.g. 5%).
    #[arg(long, value_name = "P")]
    loss: Option<String>,
    /// Bursty (Gilbert-Elliott) loss, both directions: average and mean burst in packets (e.g. 5%,4).
    #[arg(long, value_name = "AVG,BURST")]
    burst_loss: Option<String>,
    /// One-way delay, both directions (e.g. 50ms).
    #[arg(long, value_name = "D")]
    delay: Option<String>,
    /// Delay jitter: each packet's delay is uniform in delay ± jitter (e.g. 10ms).
    #[arg(long, value_name = "D")]
    jitter: Option<String>,
    /// Share of packets held back by --reorder-gap (e.g. 1%).
    #[arg(long, value_name = "P")]
    reorder: Option<String>,
    /// Extra delay of reordered packets (default 20ms).
    #[arg(long, value_name = "D")]
    reorder_gap: Option<String>,
    /// Share of packets duplicated (e.g. 1%).
    #[arg(long, value_name = "P")]
    dup: Option<String>,
    /// Share of packets with one bit flipped (e.g. 0.1%).
    #[arg(long, value_name = "P")]
    flip: Option<String>,
    /// Rate limit per direction (e.g. 1MB/s, 10Mbit/s).
    #[arg(long, value_name = "R")]
    rate: Option<String>,
    /// Start with the blackhole on (both directions).
    #[arg(long)]
    blackhole: bool,
    /// Client → server only: SETTING=VALUE (repeatable), e.g. --up loss=20%.
    #[arg(long, value_name = "SETTING=VALUE")]
    up: Vec<String>,
    /// Server → client only: SETTING=VALUE (repeatable), e.g. --down delay=100ms.
    #[arg(long, value_name = "SETTING=VALUE")]
    down: Vec<String>,
    /// Print the counters every so often (e.g. 5s).
    #[arg(long, value_name = "D")]
    stats_every: Option<String>,
}

fn config_from(args: &Args) -> anyhow::Result<NetemConfig> {
    let mut f = Faults::default();
    let both: [(&str, &Option<String>); 10] = [
        ("loss", &args.loss),
        ("burst-loss", &args.burst_loss),
        ("delay", &args.delay),
        ("jitter", &args.jitter),
        ("reorder", &args.reorder),
        ("reorder-gap", &args.reorder_gap),
        ("dup", &args.dup),
        ("flip", &args.flip),
        ("rate", &args.rate),
        ("blackhole", &args.blackhole.then(|| "on".to_owned())),
    ];
    for (key, value) in both {
        if let Some(v) = value {
            netem::apply_setting(&mut f, key, v).with_context(|| format!("--{key}"))?;
        }
    }
    let mut cfg = NetemConfig::symmetric(f);
    for (flag, list, faults) in [("--up", &args.up, &mut cfg.to_server), ("--down", &args.down, &mut cfg.to_client)] {
        for item in list {
            let (key, value) = item
                .split_once('=')
                .with_context(|| format!("{flag} {item:?}: expected SETTING=VALUE, e.g. {flag} loss=5%"))?;
            netem::apply_setting(faults, key.trim(), value).with_context(|| format!("{flag} {item:?}"))?;
        }
    }
    Ok(cfg)
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("edge-netem: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let config = config_from(&args)?;
    let stats_every = args.stats_every.as_deref().map(netem::parse_duration).transpose().context("--stats-every")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let proxy = Netem::start(args.listen, args.upstream, config, args.seed)
            .await
            .with_context(|| format!("--listen {}", args.listen))?;
        let handle = proxy.handle();
        eprintln!(
            "edge-netem: {} -> {} (seed {}); type `help` for commands",
            proxy.local_addr(),
            args.upstream,
            args.seed
        );
        // Stdin is read on a thread of its own: a blocking read must not hold a runtime worker.
        let (tx, mut lines) = tokio::sync::mpsc::channel::<String>(16);
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.blocking_send(line).is_err() {
                    break;
                }
            }
        });
        let mut ticker = stats_every.filter(|d| !d.is_zero()).map(tokio::time::interval);
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                () = tick(&mut ticker) => print_stats(&handle),
                line = lines.recv() => {
                    let Some(line) = line else { break };
                    match command(&handle, &line).await {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => eprintln!("error: {e:#}"),
                    }
                }
            }
        }
        print_stats(&handle);
        proxy.shutdown().await;
        Ok(())
    })
}

async fn tick(ticker: &mut Option<tokio::time::Interval>) {
    match ticker {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

fn print_stats(handle: &NetemHandle) {
    println!("{}", serde_json::to_string(&handle.stats()).unwrap_or_default());
}

/// Runs one stdin command; `Ok(false)` means quit.
async fn command(handle: &NetemHandle, line: &str) -> anyhow::Result<bool> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        [] => {}
        ["quit" | "exit"] => return Ok(false),
        ["help"] => eprintln!("settings: {}\n{COMMANDS}", netem::SETTINGS),
        ["stats"] => print_stats(handle),
        ["show"] => println!("{}", serde_json::to_string(&handle.config())?),
        ["rebind"] => report_rebind(handle.rebind(None).await?),
        ["rebind", ip] => {
            let ip: IpAddr = ip.parse().with_context(|| format!("rebind {ip:?}: not an IP address"))?;
            report_rebind(handle.rebind(Some(ip)).await?);
        }
        [dir @ ("up" | "down" | "both"), key, value @ ..] if !value.is_empty() => {
            set(handle, dir.parse()?, key, &value.join(" "))?;
        }
        [key, value @ ..] if !value.is_empty() => set(handle, Which::Both, key, &value.join(" "))?,
        _ => anyhow::bail!("{line:?}: not a command; type `help`"),
    }
    Ok(true)
}

fn set(handle: &NetemHandle, which: Which, key: &str, value: &str) -> anyhow::Result<()> {
    // Validate on a copy first, so a bad value changes nothing.
    let mut probe = handle.config().to_server;
    netem::apply_setting(&mut probe, key, value)?;
    handle.update(which, |f| {
        let _ = netem::apply_setting(f, key, value);
    });
    eprintln!("ok: {key} = {value} ({which:?})");
    Ok(())
}

fn report_rebind(addrs: Vec<SocketAddr>) {
    if addrs.is_empty() {
        eprintln!("ok: no client yet; new clients get the new source address");
    } else {
        let list: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        eprintln!("ok: upstream now from {}", list.join(", "));
    }
}

//! Agent configuration in two phases: a raw TOML schema (`RawConfig`, unknown keys are errors)
//! and the validated runtime [`Config`] the daemon uses. Only this module knows about serde; the
//! libraries receive plain option structs.
//!
//! Sources, later ones winning: built-in defaults, the TOML file, environment variables named
//! `EDGE_UPLOADER__SECTION__KEY` (for example `EDGE_UPLOADER__SPOOL__MAX_BYTES=2GiB`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use bytesize::ByteSize;
use edge_spool::{Durability, FullPolicy, SpoolOptions};
use serde::Deserialize;

/// Default config file location.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/edge-uploader/edge-uploader.toml";
/// Environment prefix for overrides.
pub const ENV_PREFIX: &str = "EDGE_UPLOADER";

/// The shortest `upload.probe_interval` other than zero (off): each probe is 1,200 bytes.
pub const MIN_PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// File name of the record-stream socket when `intake.stream_socket` is not set: it sits in the
/// directory of `intake.socket`.
pub const DEFAULT_STREAM_SOCKET: &str = "records.sock";

/// The most `intake.max_connections` may be: a quarter of the descriptors the systemd unit
/// allows (`LimitNOFILE=65536`), so the spool, the upload and the metrics always have theirs.
pub const MAX_CONNECTIONS_LIMIT: u32 = 16384;

/// Default of `spool.machine_id_file`: systemd's machine id, drawn at a machine's first boot.
pub const DEFAULT_MACHINE_ID_FILE: &str = "/etc/machine-id";

/// Largest `spool.chunk_target` (see where it is checked).
pub const MAX_CHUNK_TARGET: u64 = 4 << 20;

/// A loopback address from `key`, or `None` when unset or empty.
fn loopback(key: &str, value: Option<&str>, example: &str) -> anyhow::Result<Option<SocketAddr>> {
    match value {
        None | Some("") => Ok(None),
        Some(s) => {
            let addr: SocketAddr =
                s.parse().map_err(|_| anyhow::anyhow!("{key}: {s:?} is not an address like {example}"))?;
            if !addr.ip().is_loopback() {
                bail!("{key}: {addr} is not a loopback address; the intake has no authentication");
            }
            Ok(Some(addr))
        }
    }
}

/// The file as written by the operator.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub intake: RawIntake,
    pub spool: RawSpool,
    pub upload: RawUpload,
    pub metrics: RawMetrics,
    pub log: RawLog,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIntake {
    pub socket: PathBuf,
    pub socket_mode: String,
    pub tcp: Option<String>,
    pub stream_socket: Option<PathBuf>,
    pub stream_tcp: Option<String>,
    pub max_record_bytes: ByteSize,
    pub max_request_bytes: ByteSize,
    pub stream_pending_bytes: ByteSize,
    pub stream_pending_total_bytes: ByteSize,
    pub request_pending_total_bytes: ByteSize,
    #[serde(with = "humantime_serde_compat")]
    pub request_idle_timeout: Duration,
    pub max_connections: u32,
}

impl Default for RawIntake {
    fn default() -> Self {
        Self {
            socket: PathBuf::from("/run/edge-uploader/intake.sock"),
            socket_mode: "0660".into(),
            tcp: None,
            stream_socket: None,
            stream_tcp: None,
            max_record_bytes: ByteSize::b(u64::from(edge_proto::DEFAULT_MAX_RECORD_BYTES)),
            max_request_bytes: ByteSize::mib(64),
            stream_pending_bytes: ByteSize::b(crate::record_stream::PENDING_CAP as u64),
            stream_pending_total_bytes: ByteSize::b(crate::record_stream::PENDING_TOTAL as u64),
            request_pending_total_bytes: ByteSize::b(crate::intake::REQUEST_PENDING_TOTAL as u64),
            request_idle_timeout: Duration::from_secs(30),
            max_connections: crate::intake::MAX_CONNECTIONS,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSpool {
    pub path: PathBuf,
    pub max_bytes: ByteSize,
    pub full_policy: String,
    pub durability: String,
    pub chunk_target: ByteSize,
    #[serde(with = "humantime_serde_compat")]
    pub linger: Duration,
    pub compression: String,
    pub zstd_level: i32,
    pub max_streams: u64,
    pub machine_id_file: PathBuf,
}

impl Default for RawSpool {
    fn default() -> Self {
        Self {
            path: PathBuf::from("/var/lib/edge-uploader/spool.db"),
            max_bytes: ByteSize::gib(1),
            full_policy: "reject".into(),
            durability: "full".into(),
            chunk_target: ByteSize::kib(512),
            linger: Duration::from_millis(20),
            compression: "zstd".into(),
            zstd_level: 3,
            max_streams: edge_spool::DEFAULT_MAX_STREAMS,
            machine_id_file: PathBuf::from(DEFAULT_MACHINE_ID_FILE),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawUpload {
    pub server: String,
    pub server_name: Option<String>,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub max_in_flight: u32,
    pub max_in_flight_bytes: ByteSize,
    #[serde(with = "humantime_serde_compat")]
    pub connect_timeout: Duration,
    #[serde(with = "humantime_serde_compat")]
    pub backoff_min: Duration,
    #[serde(with = "humantime_serde_compat")]
    pub backoff_max: Duration,
    pub bind: String,
    pub congestion_controller: String,
    pub watch_network: bool,
    #[serde(with = "humantime_serde_compat")]
    pub probe_interval: Duration,
}

impl Default for RawUpload {
    fn default() -> Self {
        Self {
            server: "localhost:4433".into(),
            server_name: None,
            ca: PathBuf::from("/etc/edge-uploader/tls/ca.pem"),
            cert: PathBuf::from("/etc/edge-uploader/tls/device.pem"),
            key: PathBuf::from("/etc/edge-uploader/tls/device.key"),
            max_in_flight: 32,
            max_in_flight_bytes: ByteSize::mib(8),
            connect_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            bind: "0.0.0.0:0".into(),
            congestion_controller: "cubic".into(),
            watch_network: true,
            probe_interval: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawMetrics {
    /// `host:port` of the Prometheus `/metrics` endpoint; empty disables it.
    pub listen: String,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self { listen: "127.0.0.1:9171".into() }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLog {
    pub level: String,
    pub format: String,
}

impl Default for RawLog {
    fn default() -> Self {
        Self { level: "info".into(), format: "text".into() }
    }
}

/// Durations as humantime strings ("500ms", "2m 30s").
mod humantime_serde_compat {
    use serde::{Deserialize, Deserializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }
}

/// Payload compression on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Send raw record framing.
    None,
    /// zstd at the given level.
    Zstd(i32),
}

/// Validated intake settings.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    pub socket: PathBuf,
    pub socket_mode: u32,
    pub tcp: Option<SocketAddr>,
    /// The record-stream intake's Unix socket (`None`: off).
    pub stream_socket: Option<PathBuf>,
    /// The record-stream intake's loopback TCP address, if any.
    pub stream_tcp: Option<SocketAddr>,
    pub max_record_bytes: usize,
    pub max_request_bytes: usize,
    /// Records a record-stream connection gathers while its previous append commits.
    pub stream_pending_bytes: usize,
    /// Records all record-stream connections together gather and commit.
    pub stream_pending_total_bytes: usize,
    /// Body bytes all HTTP requests being read, framed or committed claim together.
    pub request_pending_total_bytes: usize,
    /// How long a request's body may send nothing before the request is refused (408), and an
    /// HTTP connection may take to send a request's head before it is closed.
    pub request_idle_timeout: Duration,
    /// Producer connections served at once, on all intake sockets together.
    pub max_connections: u32,
}

/// Validated upload settings.
#[derive(Debug, Clone)]
pub struct UploadConfig {
    /// `host:port`, resolved at every connection attempt so a changed DNS answer is followed.
    pub server: String,
    pub server_name: String,
    pub tls: edge_transport::ClientTls,
    pub max_in_flight: u32,
    /// Payload bytes in flight at most (checked before each chunk is read; see the uploader).
    pub max_in_flight_bytes: u64,
    /// Bound on one connection attempt (resolve and QUIC handshake).
    pub connect_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    pub bind: SocketAddr,
    pub compression: Compression,
    pub tuning: edge_transport::Tuning,
    /// End a reconnect backoff early when a link comes up or a default route appears.
    pub watch_network: bool,
    /// After attempts that got no answer, probe the server this often while the backoff waits;
    /// `None` (`"0s"` in the file): never.
    pub probe_interval: Option<Duration>,
}

/// The validated runtime configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub intake: IntakeConfig,
    pub spool: SpoolOptions,
    /// The file with this machine's identity, which the spool compares with the machine it was
    /// last opened on (`spool.machine_id_file`; `None` when set empty). `spool.host_id` is
    /// filled from it when the agent starts.
    pub machine_id_file: Option<PathBuf>,
    pub upload: UploadConfig,
    /// Address of the `/metrics` endpoint; `None` when disabled.
    pub metrics_listen: Option<SocketAddr>,
    pub log_level: String,
    pub log_format: edge_telemetry::logging::LogFormat,
    /// Where the config came from, for messages.
    pub source: Option<PathBuf>,
}

/// Reads the file (if given or present at the default path), applies environment overrides and
/// validates. `explicit` = the operator named the file, so its absence is an error.
pub fn load(path: Option<&Path>) -> anyhow::Result<Config> {
    load_with_env(path, None, TlsFiles::Required)
}

/// Where the packaged unit reads environment overrides from (`EnvironmentFile=`).
pub const SERVICE_ENV_FILE: &str = "/etc/default/edge-uploader";

/// The overrides the commands that look at the running service apply: for the packaged
/// service's config (no `--config`, or the default path), those of [`SERVICE_ENV_FILE`] under
/// this process's own, as the service sees them; for another config, this process's own
/// (`None`).
pub fn service_overrides(path: Option<&Path>) -> Option<std::collections::HashMap<String, String>> {
    service_overrides_in(path, Path::new(SERVICE_ENV_FILE))
}

fn service_overrides_in(path: Option<&Path>, env_file: &Path) -> Option<std::collections::HashMap<String, String>> {
    edge_telemetry::service_env::for_packaged_config(
        path,
        Path::new(DEFAULT_CONFIG_PATH),
        env_file,
        ENV_PREFIX,
        "edge-uploader",
    )
}

/// [`load`] for the commands that look at the running service's spool (`spool check`, `spool
/// export-quarantined`, `spool purge-quarantined`): with the overrides of [`service_overrides`],
/// and without asking for the TLS files, which these commands do not connect with (a gateway
/// without its certificate yet, or an operator outside the group that may read `tls/`).
pub fn load_as_service(path: Option<&Path>) -> anyhow::Result<Config> {
    load_with_env(path, service_overrides(path), TlsFiles::NotNeeded)
}

/// [`load_checked`] as the packaged service would see it: with the overrides of
/// [`service_overrides`] (what `check-config` checks, so that it checks what `run` under the
/// unit will get).
pub fn load_checked_as_service(path: Option<&Path>) -> anyhow::Result<Config> {
    let cfg = load_with_env(path, service_overrides(path), TlsFiles::Required)?;
    check_tls(&cfg)?;
    Ok(cfg)
}

/// Whether a load asks for the TLS files to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TlsFiles {
    Required,
    NotNeeded,
}

/// The file's keys with environment overrides on top, not validated: from `env` when given,
/// else from this process's environment.
pub fn raw_with_env(
    path: Option<&Path>,
    env_vars: Option<std::collections::HashMap<String, String>>,
) -> anyhow::Result<(RawConfig, Option<PathBuf>)> {
    let (path, explicit) = match path {
        Some(p) => (p.to_path_buf(), true),
        None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
    };
    let mut builder = config::Config::builder();
    let exists = path.exists();
    if explicit && !exists {
        bail!("config file {} does not exist", path.display());
    }
    if exists {
        // Parse with toml first: its errors carry the line and column, and unknown keys are
        // reported with their section.
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str::<RawConfig>(&text)
            .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
        builder = builder.add_source(config::File::from(path.as_path()).format(config::FileFormat::Toml));
    }
    // The file alone parsed above: what fails from here on, the overrides caused.
    let names = edge_telemetry::service_env::override_names(env_vars.as_ref(), ENV_PREFIX);
    let env = config::Environment::with_prefix(ENV_PREFIX).prefix_separator("__").separator("__").try_parsing(false);
    builder = builder.add_source(env.source(env_vars.map(|m| m.into_iter().collect())));
    let raw: RawConfig = builder
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(|e| anyhow::Error::msg(names.blame(exists.then_some(path.as_path()), e)))?;
    Ok((raw, exists.then_some(path)))
}

fn load_with_env(
    path: Option<&Path>,
    env: Option<std::collections::HashMap<String, String>>,
    tls: TlsFiles,
) -> anyhow::Result<Config> {
    let (raw, source) = raw_with_env(path, env)?;
    let origin =
        source.as_ref().map_or_else(|| "built-in defaults and environment".into(), |p| p.display().to_string());
    let valid = match tls {
        TlsFiles::Required => validate(raw, source),
        TlsFiles::NotNeeded => validate_settings(raw, source),
    };
    valid.map_err(|e| anyhow::anyhow!("{origin}: {}", edge_telemetry::logging::error_chain(e.as_ref())))
}

/// [`load`], then [`check_tls`]: what `check-config` and `run` accept.
pub fn load_checked(path: Option<&Path>) -> anyhow::Result<Config> {
    let cfg = load(path)?;
    check_tls(&cfg)?;
    Ok(cfg)
}

/// Reads and parses the TLS files of `cfg` as `run` will, as the user this runs as: a key the
/// service account cannot read, or a file that is not PEM, is then a configuration error (exit
/// 78, which systemd does not restart) rather than a failure at start restarted for ever.
/// `check-config` and `run` call it; commands that only need the paths (`status`, `spool
/// check`) do not.
pub fn check_tls(cfg: &Config) -> anyhow::Result<()> {
    let origin =
        cfg.source.as_ref().map_or_else(|| "built-in defaults and environment".into(), |p| p.display().to_string());
    edge_transport::client_config(&cfg.upload.tls, &cfg.upload.tuning)
        .map(drop)
        .map_err(|e| anyhow::anyhow!("{origin}: [upload] TLS files: {}", edge_telemetry::logging::error_chain(&e)))
}

/// Turns a raw config into a runtime config, naming the key on every error; the TLS files must
/// exist.
pub fn validate(raw: RawConfig, source: Option<PathBuf>) -> anyhow::Result<Config> {
    for (key, p) in [("upload.ca", &raw.upload.ca), ("upload.cert", &raw.upload.cert), ("upload.key", &raw.upload.key)]
    {
        edge_transport::check_regular_file(key, p).map_err(anyhow::Error::msg)?;
    }
    validate_settings(raw, source)
}

/// [`validate`] without looking at the TLS files.
fn validate_settings(raw: RawConfig, source: Option<PathBuf>) -> anyhow::Result<Config> {
    let full_policy = match raw.spool.full_policy.as_str() {
        "reject" => FullPolicy::Reject,
        "drop_oldest" => FullPolicy::DropOldest,
        other => bail!("spool.full_policy: expected \"reject\" or \"drop_oldest\", got {other:?}"),
    };
    let durability = match raw.spool.durability.as_str() {
        "full" => Durability::Full,
        "normal" => Durability::Normal,
        other => bail!("spool.durability: expected \"full\" or \"normal\", got {other:?}"),
    };
    let compression = match raw.spool.compression.as_str() {
        "none" => Compression::None,
        "zstd" => {
            if !(1..=19).contains(&raw.spool.zstd_level) {
                bail!("spool.zstd_level: expected 1..=19, got {}", raw.spool.zstd_level);
            }
            Compression::Zstd(raw.spool.zstd_level)
        }
        other => bail!("spool.compression: expected \"none\" or \"zstd\", got {other:?}"),
    };
    let congestion_controller = edge_transport::CongestionController::from_name(&raw.upload.congestion_controller)
        .with_context(|| {
            format!(
                "upload.congestion_controller: expected \"cubic\" or \"bbr\", got {:?}",
                raw.upload.congestion_controller
            )
        })?;
    if raw.spool.max_streams == 0 {
        bail!("spool.max_streams: expected at least 1, got 0");
    }
    if raw.spool.max_bytes.as_u64() < raw.spool.chunk_target.as_u64() {
        bail!(
            "spool.max_bytes ({}) must be at least spool.chunk_target ({})",
            raw.spool.max_bytes,
            raw.spool.chunk_target
        );
    }
    // At most 4 MiB: a batch is at most the target, so one batch of the smallest records
    // (5 bytes framed) stays under the ingest's 2^20 records per chunk, which the spool keeps
    // every chunk under by sealing before a batch that would pass it.
    if raw.spool.chunk_target.as_u64() == 0 || raw.spool.chunk_target.as_u64() > MAX_CHUNK_TARGET {
        bail!("spool.chunk_target: expected 1 B..=4 MiB, got {}", raw.spool.chunk_target);
    }
    let max_record = usize::try_from(raw.intake.max_record_bytes.as_u64()).unwrap_or(usize::MAX);
    if max_record == 0 || max_record > 16 << 20 {
        bail!("intake.max_record_bytes: expected 1 B..=16 MiB, got {}", raw.intake.max_record_bytes);
    }
    let max_request = usize::try_from(raw.intake.max_request_bytes.as_u64()).unwrap_or(usize::MAX);
    if max_request < max_record {
        bail!(
            "intake.max_request_bytes ({}) must be at least intake.max_record_bytes ({})",
            raw.intake.max_request_bytes,
            raw.intake.max_record_bytes
        );
    }
    let stream_pending = usize::try_from(raw.intake.stream_pending_bytes.as_u64()).unwrap_or(usize::MAX);
    if !(4 << 10..=64 << 20).contains(&stream_pending) {
        bail!("intake.stream_pending_bytes: expected 4 KiB..=64 MiB, got {}", raw.intake.stream_pending_bytes);
    }
    let stream_pending_total = usize::try_from(raw.intake.stream_pending_total_bytes.as_u64()).unwrap_or(usize::MAX);
    if !(stream_pending..=1 << 30).contains(&stream_pending_total) {
        bail!(
            "intake.stream_pending_total_bytes: expected intake.stream_pending_bytes ({})..=1 GiB, got {}",
            raw.intake.stream_pending_bytes,
            raw.intake.stream_pending_total_bytes
        );
    }
    let request_pending_total = usize::try_from(raw.intake.request_pending_total_bytes.as_u64()).unwrap_or(usize::MAX);
    if !(64 << 10..=1 << 30).contains(&request_pending_total) {
        bail!(
            "intake.request_pending_total_bytes: expected 64 KiB..=1 GiB, got {}",
            raw.intake.request_pending_total_bytes
        );
    }
    if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&raw.intake.request_idle_timeout) {
        bail!(
            "intake.request_idle_timeout: expected 1s..=1h, got {}",
            humantime::format_duration(raw.intake.request_idle_timeout)
        );
    }
    if !(1..=MAX_CONNECTIONS_LIMIT).contains(&raw.intake.max_connections) {
        bail!(
            "intake.max_connections: expected 1..={MAX_CONNECTIONS_LIMIT} (the systemd unit allows the agent 65536 descriptors), got {}",
            raw.intake.max_connections
        );
    }
    let socket_mode = u32::from_str_radix(raw.intake.socket_mode.trim_start_matches("0o"), 8).map_err(|_| {
        anyhow::anyhow!("intake.socket_mode: expected an octal mode such as \"0660\", got {:?}", raw.intake.socket_mode)
    })?;
    let tcp = loopback("intake.tcp", raw.intake.tcp.as_deref(), "127.0.0.1:8086")?;
    let stream_tcp = loopback("intake.stream_tcp", raw.intake.stream_tcp.as_deref(), "127.0.0.1:8087")?;
    // By default the record-stream socket sits beside the HTTP one; "" turns it off.
    let stream_socket = match raw.intake.stream_socket {
        None => Some(raw.intake.socket.with_file_name(DEFAULT_STREAM_SOCKET)),
        Some(p) if p.as_os_str().is_empty() => None,
        Some(p) => Some(p),
    };
    if stream_socket.as_ref() == Some(&raw.intake.socket) {
        bail!(
            "intake.stream_socket: {} is also intake.socket; the two intakes need their own sockets",
            raw.intake.socket.display()
        );
    }
    if stream_tcp.is_some() && stream_tcp == tcp {
        bail!(
            "intake.stream_tcp: {} is also intake.tcp; the two intakes need their own ports",
            raw.intake.tcp.unwrap_or_default()
        );
    }
    let bind: SocketAddr = raw
        .upload
        .bind
        .parse()
        .map_err(|_| anyhow::anyhow!("upload.bind: {:?} is not an address like 0.0.0.0:0", raw.upload.bind))?;
    // Checked whether or not `upload.server_name` names the certificate: every connection
    // attempt resolves `upload.server`.
    let server_host = host_of(&raw.upload.server)
        .ok_or_else(|| anyhow::anyhow!("upload.server: expected host:port, got {:?}", raw.upload.server))?;
    let server_name = match raw.upload.server_name.clone() {
        Some(n) => n,
        None => server_host,
    };
    // quinn checks the name at every connection attempt, which would then all fail.
    rustls::pki_types::ServerName::try_from(server_name.as_str()).map_err(|e| {
        anyhow::anyhow!(
            "upload.server_name: {server_name:?} is not a DNS name or IP address the certificate could name: {e}"
        )
    })?;
    if raw.upload.max_in_flight == 0 || raw.upload.max_in_flight > 1024 {
        bail!("upload.max_in_flight: expected 1..=1024, got {}", raw.upload.max_in_flight);
    }
    if raw.upload.max_in_flight_bytes.as_u64() == 0 || raw.upload.max_in_flight_bytes.as_u64() > 1 << 30 {
        bail!("upload.max_in_flight_bytes: expected 1 B..=1 GiB, got {}", raw.upload.max_in_flight_bytes);
    }
    if raw.upload.connect_timeout.is_zero() || raw.upload.connect_timeout > Duration::from_secs(300) {
        bail!(
            "upload.connect_timeout: expected above zero and at most 5m, got {}",
            humantime::format_duration(raw.upload.connect_timeout)
        );
    }
    if raw.upload.backoff_min.is_zero() || raw.upload.backoff_min > raw.upload.backoff_max {
        bail!("upload.backoff_min must be above zero and at most upload.backoff_max");
    }
    let probe_interval = raw.upload.probe_interval;
    if !probe_interval.is_zero() && probe_interval < MIN_PROBE_INTERVAL {
        bail!(
            "upload.probe_interval: {} is below {}; each probe is a datagram of 1,200 bytes (\"0s\" turns probing off)",
            humantime::format_duration(probe_interval),
            humantime::format_duration(MIN_PROBE_INTERVAL)
        );
    }
    let metrics_listen = match raw.metrics.listen.trim() {
        "" => None,
        s => Some(s.parse::<SocketAddr>().map_err(|_| {
            anyhow::anyhow!("metrics.listen: {s:?} is not an address like 127.0.0.1:9171 (empty disables metrics)")
        })?),
    };
    let log_format = match raw.log.format.as_str() {
        "text" => edge_telemetry::logging::LogFormat::Text,
        "json" => edge_telemetry::logging::LogFormat::Json,
        other => bail!("log.format: expected \"text\" or \"json\", got {other:?}"),
    };
    edge_telemetry::logging::parse_filter(&raw.log.level).map_err(|e| anyhow::anyhow!("log.level: {e}"))?;

    let mut spool = SpoolOptions::new(raw.spool.path.clone());
    spool.durability = durability;
    spool.max_bytes = raw.spool.max_bytes.as_u64();
    spool.full_policy = full_policy;
    spool.chunk_target_bytes = raw.spool.chunk_target.as_u64();
    spool.chunk_max_records = edge_proto::Limits::default().max_records_per_chunk;
    spool.linger = raw.spool.linger;
    spool.max_streams = raw.spool.max_streams;
    // Read at start (`Agent::start`), not here: `check-config` runs on other machines too.
    let machine_id_file = (!raw.spool.machine_id_file.as_os_str().is_empty()).then_some(raw.spool.machine_id_file);

    Ok(Config {
        intake: IntakeConfig {
            socket: raw.intake.socket,
            socket_mode,
            tcp,
            stream_socket,
            stream_tcp,
            max_record_bytes: max_record,
            max_request_bytes: max_request,
            stream_pending_bytes: stream_pending,
            stream_pending_total_bytes: stream_pending_total,
            request_pending_total_bytes: request_pending_total,
            request_idle_timeout: raw.intake.request_idle_timeout,
            max_connections: raw.intake.max_connections,
        },
        spool,
        machine_id_file,
        upload: UploadConfig {
            server: raw.upload.server,
            server_name: server_name.clone(),
            tls: edge_transport::ClientTls {
                cert: raw.upload.cert,
                key: raw.upload.key,
                server_ca: raw.upload.ca,
                server_name,
            },
            max_in_flight: raw.upload.max_in_flight,
            max_in_flight_bytes: raw.upload.max_in_flight_bytes.as_u64(),
            connect_timeout: raw.upload.connect_timeout,
            backoff_min: raw.upload.backoff_min,
            backoff_max: raw.upload.backoff_max,
            bind,
            compression,
            tuning: edge_transport::Tuning { congestion_controller, ..edge_transport::Tuning::default() },
            watch_network: raw.upload.watch_network,
            probe_interval: (!probe_interval.is_zero()).then_some(probe_interval),
        },
        metrics_listen,
        log_level: raw.log.level,
        log_format,
        source,
    })
}

/// The host part of `host:port` (IPv6 literals in brackets).
fn host_of(server: &str) -> Option<String> {
    if let Some(rest) = server.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        tail.strip_prefix(':')?.parse::<u16>().ok()?;
        return Some(host.to_owned());
    }
    let (host, port) = server.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    (!host.is_empty()).then(|| host.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_documents_the_defaults() {
        let text = include_str!("../../../config/edge-uploader.toml");
        let raw: RawConfig = toml::from_str(text).expect("config/edge-uploader.toml parses");
        assert_eq!(raw, RawConfig::default());
    }

    #[test]
    fn host_of_handles_names_ipv4_and_ipv6() {
        assert_eq!(host_of("ingest.example.com:4433").as_deref(), Some("ingest.example.com"));
        assert_eq!(host_of("10.0.0.1:4433").as_deref(), Some("10.0.0.1"));
        assert_eq!(host_of("[::1]:4433").as_deref(), Some("::1"));
        assert_eq!(host_of("nohost"), None);
        assert_eq!(host_of("host:notaport"), None);
    }

    #[test]
    fn unknown_key_is_refused_with_its_name() {
        let err = toml::from_str::<RawConfig>("[spool]\nmax_byte = \"1GiB\"\n").expect_err("unknown key");
        assert!(err.to_string().contains("max_byte"), "{err}");
    }

    #[test]
    fn sizes_and_durations_parse_in_human_form() {
        let raw: RawConfig = toml::from_str("[spool]\nmax_bytes = \"2GiB\"\nlinger = \"500ms\"\n").expect("valid");
        assert_eq!(raw.spool.max_bytes.as_u64(), 2 << 30);
        assert_eq!(raw.spool.linger, Duration::from_millis(500));
        let err = toml::from_str::<RawConfig>("[spool]\nlinger = \"soon\"\n").expect_err("bad duration");
        assert!(err.to_string().contains("linger") || err.to_string().contains("soon"), "{err}");
    }

    #[test]
    fn the_units_environment_file_applies_to_the_packaged_config_over_its_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let env_file = dir.path().join("edge-uploader");
        std::fs::write(
            &env_file,
            "EDGE_UPLOADER__INTAKE__SOCKET=/run/elsewhere/intake.sock\nEDGE_UPLOADER__SPOOL__PATH='/data/spool.db'\n",
        )
        .expect("write");
        let other = dir.path().join("edge-uploader.toml");
        std::fs::write(&other, "[intake]\nsocket = \"/run/from-file.sock\"\n").expect("write");
        // Another config than the packaged one: the service's file does not apply to it.
        assert!(service_overrides_in(Some(&other), &env_file).is_none());
        let vars = service_overrides_in(None, &env_file).expect("the packaged config");
        assert_eq!(
            service_overrides_in(Some(Path::new(DEFAULT_CONFIG_PATH)), &env_file).as_ref(),
            Some(&vars),
            "naming the default path is the packaged config too"
        );
        // The overrides win over the file's keys, as they do for the service.
        let (raw, source) = raw_with_env(Some(&other), Some(vars)).expect("parses");
        assert_eq!(source.as_deref(), Some(other.as_path()));
        assert_eq!(raw.intake.socket, Path::new("/run/elsewhere/intake.sock"));
        assert_eq!(raw.spool.path, Path::new("/data/spool.db"));
        let (raw, _) = raw_with_env(Some(&other), Some(std::collections::HashMap::new())).expect("parses");
        assert_eq!(raw.intake.socket, Path::new("/run/from-file.sock"));
    }
}

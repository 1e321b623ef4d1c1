//! Ingest server configuration: a raw TOML schema (unknown keys are errors) validated into the
//! runtime [`Config`]. Sources, later ones winning: built-in defaults, the TOML file,
//! `EDGE_INGEST__SECTION__KEY` environment variables.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use bytesize::ByteSize;
use serde::Deserialize;

/// Default config file location.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/edge-ingest/edge-ingest.toml";
/// Environment prefix for overrides.
pub const ENV_PREFIX: &str = "EDGE_INGEST";
/// The least `store.max_index_gaps_per_device` accepted.
pub const MIN_INDEX_GAPS_PER_DEVICE: u64 = 1024;

/// The file as written by the operator.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub server: RawServer,
    pub tls: RawTls,
    pub store: RawStore,
    pub sink: RawSink,
    pub metrics: RawMetrics,
    pub log: RawLog,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    pub listen: String,
    pub max_in_flight: u32,
    pub max_chunk_bytes: ByteSize,
    pub memory_budget: ByteSize,
    pub shutdown_grace: String,
    /// Let a connection follow its agent to a new address (QUIC migration); `false` makes the
    /// agent reconnect instead.
    pub allow_migration: bool,
    /// Most TLS handshakes in progress at once (Retry from half of it, refused beyond it).
    pub max_pending_handshakes: u32,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:4433".into(),
            max_in_flight: 64,
            max_chunk_bytes: ByteSize::mib(32),
            memory_budget: ByteSize::mib(512),
            shutdown_grace: "10s".into(),
            allow_migration: true,
            max_pending_handshakes: crate::server::DEFAULT_MAX_PENDING_HANDSHAKES,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
    pub crls: Vec<PathBuf>,
}

impl Default for RawTls {
    fn default() -> Self {
        Self {
            cert: PathBuf::from("/etc/edge-ingest/tls/server.pem"),
            key: PathBuf::from("/etc/edge-ingest/tls/server.key"),
            client_ca: PathBuf::from("/etc/edge-ingest/tls/ca.pem"),
            crls: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStore {
    pub data_dir: PathBuf,
    pub segment_max_bytes: ByteSize,
    pub direct_writes: bool,
    pub max_index_gaps_per_device: u64,
    pub max_index_streams_per_device: u64,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/var/lib/edge-ingest"),
            segment_max_bytes: ByteSize::mib(256),
            direct_writes: true,
            max_index_gaps_per_device: crate::store::DEFAULT_MAX_INDEX_GAPS_PER_DEVICE,
            max_index_streams_per_device: crate::store::DEFAULT_MAX_INDEX_STREAMS_PER_DEVICE,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSink {
    /// `"files"` (the `[store]` directory) or `"jetstream"` (`[sink.jetstream]`).
    pub kind: String,
    pub jetstream: RawJetStream,
}

impl Default for RawSink {
    fn default() -> Self {
        Self { kind: "files".into(), jetstream: RawJetStream::default() }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawJetStream {
    pub servers: Vec<String>,
    pub stream: String,
    pub subject_prefix: String,
    pub replicas: u32,
    pub max_message_bytes: ByteSize,
    pub ack_timeout: String,
    pub connect_timeout: String,
    /// CA of the NATS servers' certificates; empty: TLS only if a `tls://` URL asks for it,
    /// verified against the system's roots.
    pub tls_ca: PathBuf,
    /// Client certificate and key for NATS servers that verify clients; both or neither.
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
}

impl Default for RawJetStream {
    fn default() -> Self {
        let d = crate::jetstream::JetStreamOptions::default();
        Self {
            servers: d.servers,
            stream: d.stream,
            subject_prefix: d.subject_prefix,
            replicas: 1,
            max_message_bytes: ByteSize::kib(1020),
            ack_timeout: "10s".into(),
            connect_timeout: "5s".into(),
            tls_ca: PathBuf::new(),
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawMetrics {
    /// `host:port` of the Prometheus `/metrics` endpoint and of `/v1/status` (read by
    /// `edge-ingest status`); empty disables both.
    pub listen: String,
}

impl Default for RawMetrics {
    fn default() -> Self {
        Self { listen: "127.0.0.1:9172".into() }
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

/// Which sink the server writes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkOptions {
    /// The file store, with [`Config::store`].
    Files,
    /// A JetStream stream.
    JetStream(crate::jetstream::JetStreamOptions),
}

/// The validated runtime configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: crate::server::ServerOptions,
    pub tls: edge_transport::ServerTls,
    pub store: crate::store::StoreOptions,
    pub sink: SinkOptions,
    pub tuning: edge_transport::Tuning,
    /// `server.allow_migration`: whether QUIC connections may move to a new client address.
    pub allow_migration: bool,
    /// Address of the `/metrics` endpoint; `None` when disabled.
    pub metrics_listen: Option<SocketAddr>,
    pub log_level: String,
    pub log_format: edge_telemetry::logging::LogFormat,
    pub source: Option<PathBuf>,
}

/// Reads and validates the config (file optional unless named explicitly).
pub fn load(path: Option<&Path>) -> anyhow::Result<Config> {
    load_with_env(path, None, TlsFiles::Required)
}

/// [`load`] for commands that look at what the service stored (`stored`): for the packaged
/// config, with the overrides of the service's environment file, under this process's own, which
/// win (`edge_telemetry::service_env::overrides`). The `[tls]` files, the server's to serve
/// with, are not asked for (the sink's own, for NATS, are).
pub fn load_as_service(path: Option<&Path>) -> anyhow::Result<Config> {
    load_with_env(path, service_overrides(path), TlsFiles::NotNeeded)
}

/// [`load_checked`] with the overrides the packaged service gets ([`load_as_service`]): what
/// `check-config` checks, so that it checks what `run` under the unit will get.
pub fn load_checked_as_service(path: Option<&Path>) -> anyhow::Result<Config> {
    let cfg = load_with_env(path, service_overrides(path), TlsFiles::Required)?;
    check_tls(&cfg)?;
    Ok(cfg)
}

fn service_overrides(path: Option<&Path>) -> Option<std::collections::HashMap<String, String>> {
    edge_telemetry::service_env::for_packaged_config(
        path,
        Path::new(DEFAULT_CONFIG_PATH),
        Path::new(crate::status::SERVICE_ENV_FILE),
        ENV_PREFIX,
        "edge-ingest",
    )
}

/// What the packaged unit gives a stop (`TimeoutStopSec=` in `systemd/edge-ingest.service`)
/// before it kills the server.
pub const UNIT_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The part of [`UNIT_STOP_TIMEOUT`] a shutdown needs after its grace: the last commit's sync.
const STOP_AFTER_GRACE: Duration = Duration::from_secs(5);

impl Config {
    /// Settings that are valid but that the operator should look at, in words (`check-config`
    /// prints them, `run` logs them).
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let grace = self.server.shutdown_grace;
        if grace + STOP_AFTER_GRACE > UNIT_STOP_TIMEOUT {
            notes.push(format!(
                "server.shutdown_grace ({}) leaves less than {} of the packaged unit's TimeoutStopSec={} for the \
                 last sync: systemd would kill the server mid-stop (nothing stored is lost; chunks still in flight \
                 are sent again); raise TimeoutStopSec in a drop-in (systemctl edit edge-ingest) too",
                humantime::format_duration(grace),
                humantime::format_duration(STOP_AFTER_GRACE),
                UNIT_STOP_TIMEOUT.as_secs()
            ));
        }
        notes
    }
}

/// Whether a load asks for the `[tls]` files to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TlsFiles {
    Required,
    NotNeeded,
}

/// [`load`] with the environment `env_vars` instead of this process's, when given.
fn load_with_env(
    path: Option<&Path>,
    env_vars: Option<std::collections::HashMap<String, String>>,
    tls: TlsFiles,
) -> anyhow::Result<Config> {
    let (path, explicit) = match path {
        Some(p) => (p.to_path_buf(), true),
        None => (PathBuf::from(DEFAULT_CONFIG_PATH), false),
    };
    let exists = path.exists();
    if explicit && !exists {
        bail!("config file {} does not exist", path.display());
    }
    let mut builder = config::Config::builder();
    if exists {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str::<RawConfig>(&text)
            .map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
        builder = builder.add_source(config::File::from(path.as_path()).format(config::FileFormat::Toml));
    }
    // The file alone parsed above: what fails from here on, the overrides caused.
    let names = edge_telemetry::service_env::override_names(env_vars.as_ref(), ENV_PREFIX);
    // List keys take comma-separated values from the environment; the list parser needs
    // `try_parsing`, which also reads numbers and booleans as such (every key still accepts them).
    builder = builder.add_source(
        config::Environment::with_prefix(ENV_PREFIX)
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("tls.crls")
            .with_list_parse_key("sink.jetstream.servers")
            .source(env_vars.map(|m| m.into_iter().collect())),
    );
    let raw: RawConfig = builder
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(|e| anyhow::Error::msg(names.blame(exists.then_some(path.as_path()), e)))?;
    let origin = if exists { path.display().to_string() } else { "built-in defaults and environment".into() };
    let valid = match tls {
        TlsFiles::Required => validate(raw, exists.then_some(path)),
        TlsFiles::NotNeeded => validate_settings(raw, exists.then_some(path)),
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
    edge_transport::server_config(&cfg.tls, &cfg.tuning)
        .map_err(|e| anyhow::anyhow!("{origin}: [tls]: {}", edge_telemetry::logging::error_chain(&e)))?;
    // The TLS config only parses the CRLs; `run` also refuses one past its `nextUpdate` (with
    // which rustls would refuse every device) or not signed by a client CA.
    if !cfg.tls.crls.is_empty() {
        edge_transport::tls::RevocationList::load(&cfg.tls.client_ca, &cfg.tls.crls)
            .map_err(|e| anyhow::anyhow!("{origin}: tls.crls: {}", edge_telemetry::logging::error_chain(&e)))?;
    }
    Ok(())
}

/// Turns a raw config into a runtime config, naming the key on every error; the `[tls]` files
/// must exist.
pub fn validate(raw: RawConfig, source: Option<PathBuf>) -> anyhow::Result<Config> {
    for (key, p) in [("tls.cert", &raw.tls.cert), ("tls.key", &raw.tls.key), ("tls.client_ca", &raw.tls.client_ca)] {
        edge_transport::check_regular_file(key, p).map_err(anyhow::Error::msg)?;
    }
    for p in &raw.tls.crls {
        edge_transport::check_regular_file("tls.crls", p).map_err(anyhow::Error::msg)?;
    }
    validate_settings(raw, source)
}

/// [`validate`] without looking at the `[tls]` files.
fn validate_settings(raw: RawConfig, source: Option<PathBuf>) -> anyhow::Result<Config> {
    let listen: SocketAddr =
        raw.server.listen.parse().map_err(|_| {
            anyhow::anyhow!("server.listen: {:?} is not an address like 0.0.0.0:4433", raw.server.listen)
        })?;
    let grace = humantime::parse_duration(&raw.server.shutdown_grace)
        .map_err(|e| anyhow::anyhow!("server.shutdown_grace: {:?}: {e}", raw.server.shutdown_grace))?;
    if raw.server.max_in_flight == 0 || raw.server.max_in_flight > 1024 {
        bail!("server.max_in_flight: expected 1..=1024, got {}", raw.server.max_in_flight);
    }
    let max_chunk =
        u32::try_from(raw.server.max_chunk_bytes.as_u64()).ok().filter(|v| (1024..=256 << 20).contains(v)).ok_or_else(
            || anyhow::anyhow!("server.max_chunk_bytes: expected 1 KiB..=256 MiB, got {}", raw.server.max_chunk_bytes),
        )?;
    if !(1..=65_536).contains(&raw.server.max_pending_handshakes) {
        bail!("server.max_pending_handshakes: expected 1..=65536, got {}", raw.server.max_pending_handshakes);
    }
    if raw.server.memory_budget.as_u64() < u64::from(max_chunk) {
        bail!("server.memory_budget must be at least server.max_chunk_bytes");
    }
    if raw.store.segment_max_bytes.as_u64() < 1 << 20 {
        bail!("store.segment_max_bytes: expected at least 1 MiB, got {}", raw.store.segment_max_bytes);
    }
    if raw.store.max_index_gaps_per_device < MIN_INDEX_GAPS_PER_DEVICE {
        bail!(
            "store.max_index_gaps_per_device: expected at least {MIN_INDEX_GAPS_PER_DEVICE} (an agent's uploads in \
             parallel leave gaps for a while), got {}",
            raw.store.max_index_gaps_per_device
        );
    }
    if raw.store.max_index_streams_per_device == 0 {
        bail!("store.max_index_streams_per_device: expected at least 1, got 0");
    }
    let sink = validate_sink(&raw.sink)?;
    let metrics_listen = match raw.metrics.listen.trim() {
        "" => None,
        s => Some(s.parse::<SocketAddr>().map_err(|_| {
            anyhow::anyhow!("metrics.listen: {s:?} is not an address like 127.0.0.1:9172 (empty disables metrics)")
        })?),
    };
    let log_format = match raw.log.format.as_str() {
        "text" => edge_telemetry::logging::LogFormat::Text,
        "json" => edge_telemetry::logging::LogFormat::Json,
        other => bail!("log.format: expected \"text\" or \"json\", got {other:?}"),
    };
    edge_telemetry::logging::parse_filter(&raw.log.level).map_err(|e| anyhow::anyhow!("log.level: {e}"))?;
    let limits = edge_proto::Limits { max_chunk_payload: max_chunk, ..edge_proto::Limits::default() };
    let tls = edge_transport::ServerTls {
        cert: raw.tls.cert,
        key: raw.tls.key,
        client_ca: raw.tls.client_ca,
        crls: raw.tls.crls,
    };
    let tuning = edge_transport::Tuning::default();
    // With CRLs configured, the server re-reads them when they change (and on SIGHUP).
    let revocation = (!tls.crls.is_empty()).then(|| crate::server::RevocationWatch {
        tls: tls.clone(),
        tuning: tuning.clone(),
        allow_migration: raw.server.allow_migration,
        interval: crate::server::RevocationWatch::DEFAULT_INTERVAL,
        on_sighup: true,
    });
    let mut store = crate::store::StoreOptions::new(raw.store.data_dir);
    store.segment_max_bytes = raw.store.segment_max_bytes.as_u64();
    store.direct_writes = raw.store.direct_writes;
    store.max_index_gaps_per_device = raw.store.max_index_gaps_per_device;
    store.max_index_streams_per_device = raw.store.max_index_streams_per_device;
    Ok(Config {
        server: crate::server::ServerOptions {
            listen,
            limits,
            max_in_flight: raw.server.max_in_flight,
            memory_budget: raw.server.memory_budget.as_u64(),
            shutdown_grace: grace,
            max_pending_handshakes: raw.server.max_pending_handshakes,
            tls_handshake_timeout: crate::server::ServerOptions::default().tls_handshake_timeout,
            revocation,
            certificate_sweep: crate::server::ServerOptions::default().certificate_sweep,
            payload_stall: crate::server::ServerOptions::default().payload_stall,
        },
        tls,
        store,
        sink,
        tuning,
        allow_migration: raw.server.allow_migration,
        metrics_listen,
        log_level: raw.log.level,
        log_format,
        source,
    })
}

/// The `[sink]` section, naming the key on every error.
fn validate_sink(raw: &RawSink) -> anyhow::Result<SinkOptions> {
    match raw.kind.as_str() {
        "files" => return Ok(SinkOptions::Files),
        "jetstream" => {}
        other => bail!("sink.kind: expected \"files\" or \"jetstream\", got {other:?}"),
    }
    let j = &raw.jetstream;
    if j.servers.is_empty() {
        bail!("sink.jetstream.servers: give at least one NATS URL, like \"nats://127.0.0.1:4222\"");
    }
    for s in &j.servers {
        s.parse::<async_nats::ServerAddr>().map_err(|e| anyhow::anyhow!("sink.jetstream.servers: {s:?}: {e}"))?;
    }
    let forbidden = |c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\');
    if j.stream.is_empty() || j.stream.len() > 255 || j.stream.contains(forbidden) {
        bail!(
            "sink.jetstream.stream: {:?} is not a JetStream stream name (1 to 255 characters, none of \
             whitespace . * > / \\)",
            j.stream
        );
    }
    if j.subject_prefix
        .split('.')
        .any(|t| t.is_empty() || t.contains(|c: char| c.is_whitespace() || c == '*' || c == '>'))
    {
        bail!(
            "sink.jetstream.subject_prefix: {:?} is not a subject prefix (tokens separated by '.', none empty, \
             no whitespace or wildcards)",
            j.subject_prefix
        );
    }
    if !(1..=5).contains(&j.replicas) {
        bail!("sink.jetstream.replicas: expected 1..=5, got {}", j.replicas);
    }
    let max_message_bytes = usize::try_from(j.max_message_bytes.as_u64())
        .ok()
        .filter(|v| (1024..=64 << 20).contains(v))
        .ok_or_else(|| {
            anyhow::anyhow!("sink.jetstream.max_message_bytes: expected 1 KiB..=64 MiB, got {}", j.max_message_bytes)
        })?;
    let duration = |key: &str, v: &str| {
        humantime::parse_duration(v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| anyhow::anyhow!("sink.jetstream.{key}: {v:?} is not a duration like \"10s\""))
    };
    let file = |key: &str, p: &Path| -> anyhow::Result<Option<PathBuf>> {
        if p.as_os_str().is_empty() {
            return Ok(None);
        }
        edge_transport::check_regular_file(&format!("sink.jetstream.{key}"), p).map_err(anyhow::Error::msg)?;
        Ok(Some(p.to_path_buf()))
    };
    let tls_ca = file("tls_ca", &j.tls_ca)?;
    let tls_client = match (file("tls_cert", &j.tls_cert)?, file("tls_key", &j.tls_key)?) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => bail!("sink.jetstream.tls_cert and sink.jetstream.tls_key: give both or neither"),
    };
    Ok(SinkOptions::JetStream(crate::jetstream::JetStreamOptions {
        servers: j.servers.clone(),
        stream: j.stream.clone(),
        subject_prefix: j.subject_prefix.clone(),
        replicas: j.replicas as usize,
        max_message_bytes,
        ack_timeout: duration("ack_timeout", &j.ack_timeout)?,
        connect_timeout: duration("connect_timeout", &j.connect_timeout)?,
        tls_ca,
        tls_client,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_documents_the_defaults() {
        let text = include_str!("../../../config/edge-ingest.toml");
        let raw: RawConfig = toml::from_str(text).expect("config/edge-ingest.toml parses");
        assert_eq!(raw, RawConfig::default());
    }

    #[test]
    fn unknown_key_is_refused_with_its_name() {
        let err = toml::from_str::<RawConfig>(
            "[server]
listen_addr = \"0.0.0.0:1\"\n",
        )
        .expect_err("unknown key");
        assert!(err.to_string().contains("listen_addr"), "{err}");
    }

    #[test]
    fn direct_writes_can_be_turned_off_and_a_non_boolean_is_refused_with_its_name() {
        let raw: RawConfig = toml::from_str("[store]\ndirect_writes = false\n").expect("parses");
        assert!(!raw.store.direct_writes);
        assert!(RawConfig::default().store.direct_writes, "on by default");
        let err = toml::from_str::<RawConfig>("[store]\ndirect_writes = \"sometimes\"\n").expect_err("refused");
        assert!(err.to_string().contains("direct_writes"), "{err}");
    }

    #[test]
    fn the_jetstream_sink_is_validated_key_by_key() {
        let sink = |kind: &str, f: &dyn Fn(&mut RawJetStream)| {
            let mut raw = RawSink { kind: kind.into(), ..RawSink::default() };
            f(&mut raw.jetstream);
            validate_sink(&raw)
        };
        assert_eq!(sink("files", &|_| {}).expect("files"), SinkOptions::Files);
        let SinkOptions::JetStream(opts) = sink("jetstream", &|_| {}).expect("defaults") else {
            panic!("jetstream expected");
        };
        assert_eq!(opts, crate::jetstream::JetStreamOptions::default());
        let err = |kind: &str, f: &dyn Fn(&mut RawJetStream)| format!("{:#}", sink(kind, f).expect_err("refused"));
        assert!(err("kafka", &|_| {}).starts_with("sink.kind"));
        assert!(err("jetstream", &|j| j.servers.clear()).starts_with("sink.jetstream.servers"));
        assert!(err("jetstream", &|j| j.stream = "a.b".into()).starts_with("sink.jetstream.stream"));
        assert!(
            err("jetstream", &|j| j.subject_prefix = "edge..x".into()).starts_with("sink.jetstream.subject_prefix")
        );
        assert!(err("jetstream", &|j| j.replicas = 0).starts_with("sink.jetstream.replicas"));
        assert!(
            err("jetstream", &|j| j.max_message_bytes = ByteSize::b(10))
                .starts_with("sink.jetstream.max_message_bytes")
        );
        assert!(err("jetstream", &|j| j.ack_timeout = "soon".into()).starts_with("sink.jetstream.ack_timeout"));
        assert!(err("jetstream", &|j| j.tls_ca = "/nonexistent/ca.pem".into()).starts_with("sink.jetstream.tls_ca"));
        assert!(
            err("jetstream", &|j| j.tls_cert = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml").into())
                .contains("give both or neither")
        );
    }
}

//! Log setup.
//!
//! Two destinations, chosen once at start-up:
//!
//! - **The systemd journal**, when the process runs under systemd with stderr connected to the
//!   journal (`$JOURNAL_STREAM` names stderr, see `systemd.exec(5)`). Every tracing event is turned
//!   into a `log::Record` and written with `systemd-journal-logger` over journald's native
//!   protocol. The event's fields, and those of the spans it happened in, travel as the record's
//!   key-values, which become journal fields: `chunk_id = 42` is `CHUNK_ID=42` in
//!   `journalctl -o verbose` and can be matched with `journalctl CHUNK_ID=42`. The level becomes
//!   `PRIORITY` (error 3, warn 4, info 5, debug 6, trace 7), the message `MESSAGE`, and the
//!   executable name `SYSLOG_IDENTIFIER`, so `journalctl -t edge-uploader` works. `format` is not
//!   used there: the journal keeps structure itself.
//! - **stderr** otherwise: human text or one JSON object per line, as `format` says.
//!
//! Records that dependencies emit through the `log` facade (quinn, rustls) are bridged into
//! tracing first (`tracing-log`), so they reach the same destination with their own target.

use std::fmt::Write as _;

use systemd_journal_logger::JournalLog;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, reload};

/// How log lines are written to stderr (not used when logging to the journal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable text on stderr.
    #[default]
    Text,
    /// One JSON object per line on stderr.
    Json,
}

/// The log filter directive could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("invalid log level {directive:?}: {reason}")]
pub struct LogInitError {
    directive: String,
    reason: String,
}

/// Checks a level directive such as `info` or `edge_uploader=debug,warn` without installing it.
pub fn parse_filter(directive: &str) -> Result<EnvFilter, LogInitError> {
    EnvFilter::try_new(directive).map_err(|e| LogInitError { directive: directive.to_owned(), reason: e.to_string() })
}

/// Installs the global subscriber. `RUST_LOG`, when set, overrides `level`.
///
/// Writes to the systemd journal when stderr is connected to it (see the module docs), otherwise
/// to stderr in `format`.
///
/// Calling it twice is harmless (the second call keeps the first subscriber), which lets tests and
/// the in-process demo call daemon entry points repeatedly.
pub fn init(level: &str, format: LogFormat) -> Result<(), LogInitError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => parse_filter(&env)?,
        _ => parse_filter(level)?,
    };
    let (journal, journal_error) = if systemd_journal_logger::connected_to_journal() {
        match JournalLog::new() {
            Ok(journal) => (Some(JournalLayer::new(journal)), None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let on_stderr = journal.is_none();
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let text = (on_stderr && format == LogFormat::Text)
        .then(|| tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi));
    let json = (on_stderr && format == LogFormat::Json)
        .then(|| tracing_subscriber::fmt::layer().json().flatten_event(true).with_writer(std::io::stderr));
    let (filter, handle) = reload::Layer::new(filter);
    let installed = tracing_subscriber::registry().with(filter).with(journal).with(text).with(json).try_init();
    if installed.is_ok() {
        let _first = RELOAD.set(handle);
    }
    if let Some(e) = journal_error {
        tracing::warn!(error = %e, "stderr is connected to the journal but journald's socket is not usable; logging to stderr");
    }
    Ok(())
}

type ReloadHandle = reload::Handle<EnvFilter, tracing_subscriber::Registry>;

/// The filter of the subscriber [`init`] installed, for [`set_level`].
static RELOAD: std::sync::OnceLock<ReloadHandle> = std::sync::OnceLock::new();

/// Replaces the level filter at run time (configuration reload). An invalid directive is
/// refused and the current filter stays.
pub fn set_level(directive: &str) -> Result<(), LogInitError> {
    let filter = parse_filter(directive)?;
    if let Some(handle) = RELOAD.get() {
        handle.reload(filter).map_err(|e| LogInitError { directive: directive.to_owned(), reason: e.to_string() })?;
    }
    Ok(())
}

/// A tracing layer that writes every event as a `log::Record`, with the event's and its spans'
/// fields as key-values, to a `log::Log` sink: in production `systemd_journal_logger::JournalLog`,
/// which turns key-values into journal fields.
///
/// The sink is called directly, not through the global `log` logger, so the `log` → tracing
/// bridge installed next to this layer cannot loop.
#[derive(Debug)]
pub struct JournalLayer<L = JournalLog> {
    sink: L,
}

impl<L: log::Log> JournalLayer<L> {
    /// A layer writing to `sink`.
    pub fn new(sink: L) -> Self {
        Self { sink }
    }
}

/// Fields recorded on a span, kept in the span's extensions until it closes.
#[derive(Debug)]
struct SpanFields(Vec<(String, String)>);

impl<S, L> Layer<S> for JournalLayer<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: log::Log + 'static,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = FieldCollector::default();
        attrs.record(&mut fields);
        span.extensions_mut().insert(SpanFields(fields.into_pairs()));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut extensions = span.extensions_mut();
        if let Some(SpanFields(pairs)) = extensions.get_mut::<SpanFields>() {
            let mut fields = FieldCollector::default();
            values.record(&mut fields);
            for (key, value) in fields.into_pairs() {
                set_field(pairs, key, value);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut entry = JournalEntry::from_event(event);
        if let Some(scope) = ctx.event_scope(event) {
            let mut names = Vec::new();
            let mut span_fields = Vec::new();
            for span in scope.from_root() {
                names.push(span.name());
                if let Some(SpanFields(pairs)) = span.extensions().get::<SpanFields>() {
                    for (key, value) in pairs {
                        set_field(&mut span_fields, key.clone(), value.clone());
                    }
                }
            }
            entry.add_span_context(&names, span_fields);
        }
        entry.with_record(|record| self.sink.log(record));
    }
}

/// One event, ready to be handed to a `log::Log` as a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    /// The event's level.
    pub level: log::Level,
    /// `MESSAGE`: the event's `message` field, or its other fields as `key=value` when it has none.
    pub message: String,
    /// The target: the event's, or for a bridged `log` record the original target.
    pub target: String,
    /// The module path, when known.
    pub module_path: Option<String>,
    /// The source file, when known.
    pub file: Option<String>,
    /// The source line, when known.
    pub line: Option<u32>,
    /// Journal field names (see [`journal_field_name`]) and values: span fields from the
    /// outermost span in, then the event's own; an inner value replaces an outer one.
    pub fields: Vec<(String, String)>,
}

impl JournalEntry {
    /// Collects an event's metadata and fields (without span context).
    pub fn from_event(event: &Event<'_>) -> Self {
        let meta = event.metadata();
        let mut collector = FieldCollector::default();
        event.record(&mut collector);
        let FieldCollector { message, pairs, plain, log_target, log_module_path, log_file, log_line } = collector;
        Self {
            level: as_log_level(*meta.level()),
            message: message.unwrap_or(plain),
            target: log_target.unwrap_or_else(|| meta.target().to_owned()),
            module_path: log_module_path.or_else(|| meta.module_path().map(str::to_owned)),
            file: log_file.or_else(|| meta.file().map(str::to_owned)),
            line: log_line.or(meta.line()),
            fields: pairs,
        }
    }

    /// Puts the fields of the enclosing spans before the event's own (which win on a clash), and
    /// names the spans, outermost first, in `SPAN` (`connection:chunk`).
    fn add_span_context(&mut self, names: &[&str], span_fields: Vec<(String, String)>) {
        let own = std::mem::replace(&mut self.fields, span_fields);
        for (key, value) in own {
            set_field(&mut self.fields, key, value);
        }
        if !names.is_empty() {
            set_field(&mut self.fields, "SPAN".to_owned(), names.join(":"));
        }
    }

    /// Builds the `log::Record` (fields as key-values) and passes it to `f`.
    pub fn with_record<R>(&self, f: impl FnOnce(&log::Record<'_>) -> R) -> R {
        let fields = KeyValues(&self.fields);
        f(&log::Record::builder()
            .args(format_args!("{}", self.message))
            .level(self.level)
            .target(&self.target)
            .module_path(self.module_path.as_deref())
            .file(self.file.as_deref())
            .line(self.line)
            .key_values(&fields)
            .build())
    }
}

/// The entry's fields as `log` key-values.
struct KeyValues<'a>(&'a [(String, String)]);

impl log::kv::Source for KeyValues<'_> {
    fn visit<'kvs>(&'kvs self, visitor: &mut dyn log::kv::VisitSource<'kvs>) -> Result<(), log::kv::Error> {
        for (key, value) in self.0 {
            visitor.visit_pair(log::kv::Key::from_str(key), log::kv::Value::from(value.as_str()))?;
        }
        Ok(())
    }

    fn count(&self) -> usize {
        self.0.len()
    }
}

/// Fields that `systemd-journal-logger` writes itself (plus our `SPAN`); a tracing field with one
/// of these names is written as `F_<NAME>` so it cannot shadow them.
const RESERVED_FIELDS: &[&str] = &[
    "MESSAGE",
    "PRIORITY",
    "SYSLOG_IDENTIFIER",
    "SYSLOG_PID",
    "CODE_FILE",
    "CODE_LINE",
    "CODE_MODULE",
    "TARGET",
    "SPAN",
];

/// The journal field name for a tracing field name.
///
/// journald accepts only `A-Z`, `0-9` and `_`, starting with a letter, at most 64 bytes. So:
/// uppercase; any other character becomes `_` (`peer.addr` → `PEER_ADDR`); a name that does not
/// start with a letter, or that collides with a field the logger sets itself, gets the prefix `F_`
/// (`priority` → `F_PRIORITY`, `_x` → `F__X`).
pub fn journal_field_name(name: &str) -> String {
    let name = name.strip_prefix("r#").unwrap_or(name);
    let mut out: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect();
    if !out.starts_with(|c: char| c.is_ascii_uppercase()) || RESERVED_FIELDS.contains(&out.as_str()) {
        out.insert_str(0, "F_");
    }
    out.truncate(64);
    out
}

/// Sets `key` to `value`, replacing an earlier value of the same key (journald would keep both,
/// and most readers show only the first).
fn set_field(pairs: &mut Vec<(String, String)>, key: String, value: String) {
    match pairs.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => pairs.push((key, value)),
    }
}

fn as_log_level(level: tracing::Level) -> log::Level {
    match level {
        tracing::Level::ERROR => log::Level::Error,
        tracing::Level::WARN => log::Level::Warn,
        tracing::Level::INFO => log::Level::Info,
        tracing::Level::DEBUG => log::Level::Debug,
        tracing::Level::TRACE => log::Level::Trace,
    }
}

/// Collects the fields of an event or span as journal-named strings. The `log.*` fields that
/// `tracing-log` adds to bridged `log` records are taken as the record's metadata instead.
#[derive(Debug, Default)]
struct FieldCollector {
    message: Option<String>,
    pairs: Vec<(String, String)>,
    /// `name=value ...` of the ordinary fields under their tracing names: the message of an event
    /// that has none.
    plain: String,
    log_target: Option<String>,
    log_module_path: Option<String>,
    log_file: Option<String>,
    log_line: Option<u32>,
}

impl FieldCollector {
    fn into_pairs(self) -> Vec<(String, String)> {
        let mut pairs = self.pairs;
        if let Some(message) = self.message {
            // On a span, `message` is an ordinary field.
            set_field(&mut pairs, journal_field_name("span_message"), message);
        }
        pairs
    }

    fn put(&mut self, field: &Field, value: String) {
        match field.name() {
            "message" => self.message = Some(value),
            "log.target" => self.log_target = Some(value),
            "log.module_path" => self.log_module_path = Some(value),
            "log.file" => self.log_file = Some(value),
            "log.line" => self.log_line = value.parse().ok(),
            name => {
                if !self.plain.is_empty() {
                    self.plain.push(' ');
                }
                let _ = write!(self.plain, "{name}={value}");
                set_field(&mut self.pairs, journal_field_name(name), value);
            }
        }
    }
}

impl Visit for FieldCollector {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.to_owned());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.to_string());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.to_string());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.to_string());
    }

    fn record_i128(&mut self, field: &Field, value: i128) {
        self.put(field, value.to_string());
    }

    fn record_u128(&mut self, field: &Field, value: u128) {
        self.put(field, value.to_string());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.to_string());
    }

    /// An error with its chain of sources (see [`error_chain`]).
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, error_chain(value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, format!("{value:?}"));
    }
}

/// An error and its chain of sources, joined by ": " like anyhow's `{:#}`, without repeating a
/// source whose text the previous message already ends with (many error types print their
/// source in their own message and also return it from `source()`).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !text.ends_with(&part) {
            let _ = write!(text, ": {part}");
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn an_error_chain_names_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        #[derive(Debug, thiserror::Error)]
        #[error("cannot read x.pem: {0}")]
        struct Repeats(#[source] std::io::Error);
        let err = anyhow::Error::new(Repeats(io)).context("loading the CA");
        assert_eq!(error_chain(err.as_ref()), "loading the CA: cannot read x.pem: no such file");
        assert_eq!(format!("{err:#}"), "loading the CA: cannot read x.pem: no such file: no such file");
    }

    #[test]
    fn a_bad_level_directive_is_named_in_the_error() {
        let err = parse_filter("edge=loud").expect_err("not a level");
        assert!(err.to_string().contains("edge=loud"), "{err}");
        assert!(parse_filter("info,edge_uploader=debug").is_ok());
    }

    /// What a `log::Log` saw of one record.
    #[derive(Debug, Clone)]
    struct Seen {
        level: log::Level,
        message: String,
        target: String,
        module_path: Option<String>,
        file: Option<String>,
        line: Option<u32>,
        kvs: Vec<(String, String)>,
    }

    impl Seen {
        fn field(&self, key: &str) -> Option<&str> {
            self.kvs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
        }
    }

    /// A `log::Log` standing in for `JournalLog`: keeps what it is given.
    #[derive(Debug, Clone, Default)]
    struct Capture(Arc<Mutex<Vec<Seen>>>);

    struct KvsToVec<'a>(&'a mut Vec<(String, String)>);

    impl<'kvs> log::kv::VisitSource<'kvs> for KvsToVec<'_> {
        fn visit_pair(&mut self, key: log::kv::Key<'kvs>, value: log::kv::Value<'kvs>) -> Result<(), log::kv::Error> {
            self.0.push((key.as_str().to_owned(), value.to_string()));
            Ok(())
        }
    }

    impl log::Log for Capture {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }

        fn log(&self, record: &log::Record<'_>) {
            let mut kvs = Vec::new();
            record.key_values().visit(&mut KvsToVec(&mut kvs)).expect("visit key-values");
            let seen = Seen {
                level: record.level(),
                message: record.args().to_string(),
                target: record.target().to_owned(),
                module_path: record.module_path().map(str::to_owned),
                file: record.file().map(str::to_owned),
                line: record.line(),
                kvs,
            };
            self.0.lock().expect("capture lock").push(seen);
        }

        fn flush(&self) {}
    }

    /// Runs `f` with a subscriber that sends events through a `JournalLayer` into a capture.
    fn capture(f: impl FnOnce()) -> Vec<Seen> {
        let sink = Capture::default();
        let subscriber = tracing_subscriber::registry().with(JournalLayer::new(sink.clone()));
        tracing::subscriber::with_default(subscriber, f);
        sink.0.lock().expect("capture lock").clone()
    }

    #[derive(Debug)]
    struct Outer;
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("ack lost")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&Inner)
        }
    }
    #[derive(Debug)]
    struct Inner;
    impl std::fmt::Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection reset")
        }
    }
    impl std::error::Error for Inner {}

    #[test]
    fn event_fields_become_uppercase_journal_key_values() {
        let seen = capture(|| {
            let path = std::path::Path::new("/var/lib/edge-ingest/seg-000001");
            let err = Outer;
            tracing::warn!(
                chunk_id = 42u64,
                bytes = -7i64,
                ratio = 0.5f64,
                retry = true,
                path = %path.display(),
                device = "gw-0001",
                peer.addr = ?"10.0.0.1:4433",
                error = &err as &(dyn std::error::Error + 'static),
                "chunk rejected"
            );
        });
        assert_eq!(seen.len(), 1, "{seen:?}");
        let rec = &seen[0];
        assert_eq!(rec.level, log::Level::Warn);
        assert_eq!(rec.message, "chunk rejected");
        assert_eq!(rec.target, module_path!());
        assert_eq!(rec.module_path.as_deref(), Some(module_path!()));
        assert!(rec.file.as_deref().is_some_and(|f| f.ends_with("logging.rs")), "{rec:?}");
        assert!(rec.line.is_some());
        assert_eq!(
            rec.kvs,
            [
                ("CHUNK_ID", "42"),
                ("BYTES", "-7"),
                ("RATIO", "0.5"),
                ("RETRY", "true"),
                ("PATH", "/var/lib/edge-ingest/seg-000001"),
                ("DEVICE", "gw-0001"),
                ("PEER_ADDR", "\"10.0.0.1:4433\""),
                ("ERROR", "ack lost: connection reset"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        // No message among the fields: it is MESSAGE, written by the logger.
        assert!(rec.field("MESSAGE").is_none());
    }

    #[test]
    fn span_fields_are_carried_and_inner_values_win() {
        let seen = capture(|| {
            let conn = tracing::info_span!("connection", device = "gw-0001", stream = "outer");
            let _c = conn.enter();
            let chunk = tracing::debug_span!("chunk", seq = tracing::field::Empty);
            chunk.record("seq", 7u64);
            let _k = chunk.enter();
            tracing::error!(stream = "temperature", "store failed");
        });
        assert_eq!(seen.len(), 1, "{seen:?}");
        let rec = &seen[0];
        assert_eq!(rec.level, log::Level::Error);
        assert_eq!(rec.field("DEVICE"), Some("gw-0001"));
        assert_eq!(rec.field("SEQ"), Some("7"));
        assert_eq!(rec.field("STREAM"), Some("temperature"), "the event's own value wins");
        assert_eq!(rec.kvs.iter().filter(|(k, _)| k == "STREAM").count(), 1);
        assert_eq!(rec.field("SPAN"), Some("connection:chunk"));
    }

    #[test]
    fn bridged_log_records_keep_their_target_and_location() {
        // tracing-log turns a `log` record into an event with these `log.*` fields.
        let seen = capture(|| {
            tracing::info!(
                log.target = "quinn_proto::connection",
                log.module_path = "quinn_proto::connection",
                log.file = "src/connection/mod.rs",
                log.line = 812u64,
                "path validated"
            );
        });
        let rec = &seen[0];
        assert_eq!(rec.level, log::Level::Info);
        assert_eq!(rec.target, "quinn_proto::connection");
        assert_eq!(rec.module_path.as_deref(), Some("quinn_proto::connection"));
        assert_eq!(rec.file.as_deref(), Some("src/connection/mod.rs"));
        assert_eq!(rec.line, Some(812));
        assert!(rec.kvs.is_empty(), "{:?}", rec.kvs);
    }

    #[test]
    fn fields_that_would_shadow_logger_fields_are_prefixed_and_message_falls_back_to_fields() {
        let seen = capture(|| tracing::debug!(priority = 1, target = "x", _private = 2, records = 3));
        let rec = &seen[0];
        assert_eq!(rec.level, log::Level::Debug);
        assert_eq!(rec.field("F_PRIORITY"), Some("1"));
        assert_eq!(rec.field("F_TARGET"), Some("x"));
        assert_eq!(rec.field("F__PRIVATE"), Some("2"));
        assert_eq!(rec.field("RECORDS"), Some("3"));
        assert!(rec.field("PRIORITY").is_none() && rec.field("TARGET").is_none());
        assert_eq!(rec.message, "priority=1 target=x _private=2 records=3");
    }

    #[test]
    fn journal_field_names_follow_journald_rules() {
        assert_eq!(journal_field_name("chunk_id"), "CHUNK_ID");
        assert_eq!(journal_field_name("peer.addr"), "PEER_ADDR");
        assert_eq!(journal_field_name("r#type"), "TYPE");
        assert_eq!(journal_field_name("1st"), "F_1ST");
        assert_eq!(journal_field_name("größe"), "GR__E");
        assert_eq!(journal_field_name("message"), "F_MESSAGE");
        assert_eq!(journal_field_name(""), "F_");
        let long = journal_field_name(&"a".repeat(100));
        assert_eq!(long.len(), 64);
        for name in ["chunk_id", "peer.addr", "1st", "größe", "priority", "x-y"] {
            let out = journal_field_name(name);
            assert!(out.starts_with(|c: char| c.is_ascii_uppercase()), "{out}");
            assert!(out.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'), "{out}");
        }
    }
}

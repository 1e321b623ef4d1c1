//! Log setup: human text or JSON lines on stderr, filtered by a level directive.

use tracing_subscriber::{EnvFilter, fmt};

/// How log lines are written.
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
/// Calling it twice is harmless (the second call keeps the first subscriber), which lets tests and
/// the in-process demo call daemon entry points repeatedly.
pub fn init(level: &str, format: LogFormat) -> Result<(), LogInitError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(env) if !env.is_empty() => parse_filter(&env)?,
        _ => parse_filter(level)?,
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _already_set = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_level_directive_is_named_in_the_error() {
        let err = parse_filter("edge=loud").expect_err("not a level");
        assert!(err.to_string().contains("edge=loud"), "{err}");
        assert!(parse_filter("info,edge_uploader=debug").is_ok());
    }
}

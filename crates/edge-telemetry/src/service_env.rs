//! The environment a daemon's systemd unit gives it, for the operator's commands.
//!
//! Both units read overrides (`EDGE_UPLOADER__SECTION__KEY=...`) from
//! `/etc/default/<daemon>` (`EnvironmentFile=`). The daemon sees them in its environment; an
//! operator's shell does not. A command that looks at the running service (`status`, `push`,
//! the spool tools) has to read the file itself, or it looks for the socket, the metrics
//! listener or the spool where the config file alone puts them, and reports a service that
//! runs elsewhere as not running.
//!
//! The file is read by systemd's rules for `EnvironmentFile=` (its `env-file.c`), so that the
//! command and the service see the same values: `KEY=VALUE` lines; `#` or `;` starts a
//! comment only at the start of a line (`KEY=a # b` is the value `a # b`); whitespace around
//! the key and the value is dropped; a single or double quote at the start of a value (or
//! right after a closing one) quotes what follows up to the closing one, and elsewhere is an
//! ordinary character (a backslash escapes `"`, `\`, `` ` `` and `$` inside double quotes and
//! keeps itself before anything else; outside quotes it escapes any character); a backslash at
//! the end of a line continues the value on the next; no `$VAR` expansion.

use std::collections::HashMap;
use std::path::Path;

/// The overrides with one prefix that the service sees (see [`overrides`]).
#[derive(Debug, Default)]
pub struct Overrides {
    /// Variable name to value: the file's, then this process's own on top.
    pub vars: HashMap<String, String>,
    /// Why the file could not be read, if it exists and could not be (permission denied, say):
    /// then only this process's own overrides are in `vars`, and the caller should say so.
    pub unreadable: Option<String>,
}

/// The overrides with `prefix` (e.g. `EDGE_UPLOADER`) that the service sees: those of
/// `env_file` (when it exists), then this process's own, which win, as a variable set in the
/// operator's shell is one they mean to apply. Other variables are left out.
pub fn overrides(env_file: &Path, prefix: &str) -> Overrides {
    let wanted = |k: &str| is_override(k, prefix);
    let mut out = Overrides::default();
    match std::fs::read(env_file) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            out.vars = parse_env_file(&text).into_iter().filter(|(k, _)| wanted(k)).collect();
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => out.unreadable = Some(format!("cannot read {}: {e}", env_file.display())),
    }
    out.vars.extend(std::env::vars().filter(|(k, _)| wanted(k)));
    out
}

/// Whether the variable `name` is an override of `prefix` (`PREFIX__SECTION__KEY`).
fn is_override(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).is_some_and(|rest| rest.starts_with("__"))
}

/// The names of the overrides with `prefix` a config load applies, sorted: those of `vars` when
/// given (the service's, [`for_packaged_config`]), else this process's own.
pub fn override_names(vars: Option<&HashMap<String, String>>, prefix: &str) -> OverrideNames {
    let mut names: Vec<String> = match vars {
        Some(vars) => vars.keys().filter(|k| is_override(k, prefix)).cloned().collect(),
        None => std::env::vars().map(|(k, _)| k).filter(|k| is_override(k, prefix)).collect(),
    };
    names.sort();
    OverrideNames(names)
}

/// The overrides a config load applied ([`override_names`]).
#[derive(Debug, Clone, Default)]
pub struct OverrideNames(Vec<String>);

impl OverrideNames {
    /// The message for the error `e` of a load that failed once the overrides were put over a
    /// config file that parsed alone (`file`, when there is one): the overrides caused it, and a
    /// message that named the file would send the operator to a file that is fine. Without
    /// overrides, the file is named.
    pub fn blame(&self, file: Option<&Path>, e: impl std::fmt::Display) -> String {
        match (self.0.is_empty(), file) {
            (false, _) => format!("environment overrides ({}): {e}", self.0.join(", ")),
            (true, Some(file)) => format!("{}: {e}", file.display()),
            (true, None) => e.to_string(),
        }
    }
}

/// The service's overrides (see [`overrides`]) for a command given `config`, when that is the
/// packaged config (none given, or `packaged_config`); `None` for another config, to which the
/// unit's file does not apply. An unreadable file is said on stderr, as `program: ...`: these
/// are the operator's commands, the daemon gets the file from systemd.
pub fn for_packaged_config(
    config: Option<&Path>,
    packaged_config: &Path,
    env_file: &Path,
    prefix: &str,
    program: &str,
) -> Option<HashMap<String, String>> {
    if config.is_some_and(|p| p != packaged_config) {
        return None;
    }
    let found = overrides(env_file, prefix);
    if let Some(why) = found.unreadable {
        eprintln!("{program}: {why}; the service's overrides in it are not applied here");
    }
    Some(found.vars)
}

/// The assignments of an `EnvironmentFile=`, in order, by systemd's rules (module doc). A later
/// assignment of a key replaces an earlier one when collected into a map, as in systemd.
pub fn parse_env_file(text: &str) -> Vec<(String, String)> {
    #[derive(Clone, Copy, PartialEq)]
    enum St {
        LineStart,
        Key,
        BeforeValue,
        Value,
        ValueEscape,
        Single,
        Double,
        DoubleEscape,
        Comment,
        CommentEscape,
    }
    let newline = |c: char| c == '\n' || c == '\r';
    let blank = |c: char| c == ' ' || c == '\t' || newline(c);
    let mut out = Vec::new();
    let (mut key, mut value) = (String::new(), String::new());
    // Where trailing whitespace began in the unquoted part of the value, if it runs to its end.
    let mut trailing: Option<usize> = None;
    let mut finish = |key: &mut String, value: &mut String, trailing: &mut Option<usize>, chomp: bool| {
        if chomp && let Some(at) = trailing.take() {
            value.truncate(at);
        }
        out.push((key.trim_end().to_owned(), std::mem::take(value)));
        key.clear();
        *trailing = None;
    };
    let mut st = St::LineStart;
    for c in text.chars() {
        st = match st {
            St::LineStart if c == '#' || c == ';' => St::Comment,
            St::LineStart if blank(c) => St::LineStart,
            St::LineStart => {
                key.push(c);
                St::Key
            }
            St::Key if newline(c) => {
                key.clear();
                St::LineStart
            }
            St::Key if c == '=' => St::BeforeValue,
            St::Key => {
                key.push(c);
                St::Key
            }
            St::BeforeValue if newline(c) => {
                finish(&mut key, &mut value, &mut trailing, false);
                St::LineStart
            }
            St::BeforeValue if c == '\'' => St::Single,
            St::BeforeValue if c == '"' => St::Double,
            St::BeforeValue if c == '\\' => St::ValueEscape,
            St::BeforeValue if blank(c) => St::BeforeValue,
            St::BeforeValue => {
                value.push(c);
                St::Value
            }
            St::Value if newline(c) => {
                finish(&mut key, &mut value, &mut trailing, true);
                St::LineStart
            }
            St::Value if c == '\\' => {
                trailing = None;
                St::ValueEscape
            }
            St::Value => {
                if !blank(c) {
                    trailing = None;
                } else if trailing.is_none() {
                    trailing = Some(value.len());
                }
                value.push(c);
                St::Value
            }
            St::ValueEscape => {
                if !newline(c) {
                    value.push(c);
                }
                St::Value
            }
            St::Single if c == '\'' => St::BeforeValue,
            St::Double if c == '"' => St::BeforeValue,
            St::Double if c == '\\' => St::DoubleEscape,
            St::Single | St::Double => {
                value.push(c);
                st
            }
            St::DoubleEscape => {
                if matches!(c, '"' | '\\' | '`' | '$') {
                    value.push(c);
                } else if c != '\n' {
                    value.push('\\');
                    value.push(c);
                }
                St::Double
            }
            St::Comment if c == '\\' => St::CommentEscape,
            St::Comment if newline(c) => St::LineStart,
            St::Comment => St::Comment,
            St::CommentEscape if newline(c) => St::LineStart,
            St::CommentEscape => St::Comment,
        };
    }
    match st {
        St::Value => finish(&mut key, &mut value, &mut trailing, true),
        St::BeforeValue | St::ValueEscape | St::Single | St::Double | St::DoubleEscape => {
            finish(&mut key, &mut value, &mut trailing, false);
        }
        St::LineStart | St::Key | St::Comment | St::CommentEscape => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Vec<(String, String)> {
        parse_env_file(text)
    }

    fn kv(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn values_are_read_as_systemd_reads_an_environment_file() {
        // Comments only at the start of a line; whitespace around keys and values dropped.
        assert_eq!(
            parsed("# c\n ; c\n  A = /run/x.sock  # note  \nB=\nC\n"),
            kv(&[("A", "/run/x.sock  # note"), ("B", "")])
        );
        // A quote opens quoting at the start of a value or after a closing one, and is an
        // ordinary character inside an unquoted value.
        assert_eq!(
            parsed("A=\"a b\"\nB='it''s'\nC=x'y z'w\nD=it's\nE=a b\n"),
            kv(&[("A", "a b"), ("B", "its"), ("C", "x'y z'w"), ("D", "it's"), ("E", "a b")])
        );
        // A quote opening a value and never closed takes the rest of the file.
        assert_eq!(parsed("A='abc\nB=1\n"), kv(&[("A", "abc\nB=1\n")]));
        // Escapes: in double quotes only "\"\\`$" lose the backslash; outside, any char; a
        // backslash at the end of a line continues the value.
        assert_eq!(
            parsed("A=\"q\\\"\\$x\\n\"\nB=a\\ b\\\nc\nC=$HOME\n"),
            kv(&[("A", "q\"$x\\n"), ("B", "a bc"), ("C", "$HOME")])
        );
        // A comment line ending in a backslash stays one line; lines without '=' are ignored.
        assert_eq!(parsed("# a \\\nA=1\nnot a line\nB=2"), kv(&[("A", "1"), ("B", "2")]));
    }

    #[test]
    fn the_files_overrides_with_the_prefix_are_read_and_an_unreadable_file_is_said() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("edge-test");
        std::fs::write(
            &file,
            "# overrides\nEDGE_TEST_SVC__INTAKE__SOCKET=/run/x/intake.sock\nnot a line\n\
             EDGE_TEST_SVC__METRICS__LISTEN=\"127.0.0.1:9999\"\nOTHER=1\nEDGE_TEST_SVCX__A=2\n",
        )
        .expect("write");
        let o = overrides(&file, "EDGE_TEST_SVC");
        assert_eq!(o.vars.get("EDGE_TEST_SVC__INTAKE__SOCKET").map(String::as_str), Some("/run/x/intake.sock"));
        assert_eq!(o.vars.get("EDGE_TEST_SVC__METRICS__LISTEN").map(String::as_str), Some("127.0.0.1:9999"));
        assert_eq!(o.vars.len(), 2, "{:?}", o.vars);
        assert!(o.unreadable.is_none());
        let missing = overrides(&dir.path().join("missing"), "EDGE_TEST_SVC");
        assert!(missing.vars.is_empty() && missing.unreadable.is_none(), "a missing file is no news");
        // A directory cannot be read as a file: said, not silently taken for an empty file.
        let unreadable = overrides(dir.path(), "EDGE_TEST_SVC");
        assert!(unreadable.unreadable.as_deref().is_some_and(|w| w.contains("cannot read")), "{unreadable:?}");
    }
}

//! The environment a daemon's systemd unit gives it, for the operator's commands.
//!
//! Both units read overrides (`EDGE_UPLOADER__SECTION__KEY=...`) from
//! `/etc/default/<daemon>` (`EnvironmentFile=`). The daemon sees them in its environment; an
//! operator's shell does not. A command that looks at the running service (`status`, `push`,
//! the spool tools) has to read the file itself, or it looks for the socket, the metrics
//! listener or the spool where the config file alone puts them, and reports a service that
//! runs elsewhere as not running.

use std::collections::HashMap;
use std::path::Path;

/// The overrides with `prefix` (e.g. `EDGE_UPLOADER`) that the service sees: those of
/// `env_file` (when it exists), then this process's own, which win, as a variable set in the
/// operator's shell is one they mean to apply. Other variables are left out.
///
/// The file is read with `dotenvy`: `KEY=VALUE` lines, `#` comments, shell quoting. Unlike
/// systemd, `dotenvy` expands `$VAR` in unquoted and double-quoted values; the daemons' keys
/// (paths, addresses, durations, sizes) hold no `$`. A line it cannot parse is skipped, as
/// systemd skips it.
pub fn overrides(env_file: &Path, prefix: &str) -> HashMap<String, String> {
    let wanted = |k: &str| k.strip_prefix(prefix).is_some_and(|rest| rest.starts_with("__"));
    let mut vars: HashMap<String, String> = match dotenvy::from_path_iter(env_file) {
        Ok(iter) => iter.filter_map(Result::ok).filter(|(k, _)| wanted(k)).collect(),
        Err(_) => HashMap::new(),
    };
    vars.extend(std::env::vars().filter(|(k, _)| wanted(k)));
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_overrides_are_read_and_other_variables_and_bad_lines_left_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("edge-test");
        std::fs::write(
            &file,
            "# overrides\nEDGE_TEST_SVC__INTAKE__SOCKET=/run/x/intake.sock\nnot a line\n\
             EDGE_TEST_SVC__METRICS__LISTEN=\"127.0.0.1:9999\"\nOTHER=1\nEDGE_TEST_SVCX__A=2\n",
        )
        .expect("write");
        let vars = overrides(&file, "EDGE_TEST_SVC");
        assert_eq!(vars.get("EDGE_TEST_SVC__INTAKE__SOCKET").map(String::as_str), Some("/run/x/intake.sock"));
        assert_eq!(vars.get("EDGE_TEST_SVC__METRICS__LISTEN").map(String::as_str), Some("127.0.0.1:9999"));
        assert_eq!(vars.len(), 2, "{vars:?}");
        assert!(overrides(&dir.path().join("missing"), "EDGE_TEST_SVC").is_empty());
    }
}

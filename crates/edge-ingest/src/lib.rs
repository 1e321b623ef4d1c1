//! edge-ingest: the server side of edge-uploader.
//!
//! The binary in `main.rs` is a thin CLI over this library so that tests and the agent's `demo`
//! command can run a server in-process.

/// A crash point for the reliability tests: in a build with the `failpoints` feature, a process
/// started with `FAILPOINTS=<name>=return` aborts here (as a power cut or SIGKILL would stop it).
/// Without the feature it compiles to nothing.
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        if fail::eval($name, |_| ()).is_some() {
            eprintln!(concat!("failpoint ", $name, ": crashing the process"));
            std::process::abort();
        }
    };
}
pub(crate) use crash_point;

pub mod config;
pub mod jetstream;
pub mod metrics;
pub mod server;
pub mod sink;
pub mod status;
pub mod store;

/// Exit code for configuration errors (`EX_CONFIG`); systemd is told not to restart on it.
pub const EXIT_CONFIG: i32 = 78;

//! Telemetry shared by both daemons: log setup, the Prometheus `/metrics` server, systemd
//! readiness notifications and the signals a ready daemon obeys.
//!
//! Kept deliberately small: each daemon owns its metric names, handles and collectors; this
//! crate only holds the plumbing both need to be observable and to behave like a well-mannered
//! systemd service.

pub mod logging;
pub mod metrics;
pub mod notify;
pub mod service_env;
pub mod signals;

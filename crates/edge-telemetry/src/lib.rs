//! Telemetry shared by both daemons: log setup and systemd readiness notifications.
//!
//! Kept deliberately small: each daemon owns its own metrics; this crate only holds what both
//! need to behave like a well-mannered systemd service.

pub mod logging;
pub mod notify;

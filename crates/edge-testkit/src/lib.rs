//! Test-only helpers shared by the system tests in `tests/`: building and locating the two
//! daemons, running them as real child processes (ready notification through a `NOTIFY_SOCKET`
//! of the test's own, SIGKILL, SIGTERM), and certificate fixtures on disk.
//!
//! Never shipped: no daemon crate depends on this one.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub mod nats;
pub mod netem;
pub mod tier;
pub mod workload;

pub use tier::{Tier, report};

/// Path of a workspace binary, built once per test process with the same profile as the tests.
pub fn bin(name: &str) -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().map_err(|e| e.to_string())?;
            // target/<profile>/deps/<test-binary>
            let profile_dir =
                exe.parent().and_then(Path::parent).ok_or("unexpected test binary location")?.to_path_buf();
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            // The same selection as `cargo test --workspace`, so features unify the same way and
            // this is a no-op after the test build instead of a rebuild with other features.
            cmd.args(["build", "--quiet", "--workspace", "--all-targets"]);
            if release {
                cmd.arg("--release");
            }
            // Without the variables Cargo sets for the test process itself: build scripts that
            // watch one (ring's watches `CARGO_MANIFEST_DIR`) would otherwise run again and
            // rebuild ring, rustls and quinn here, and again at the next test build, about a
            // minute each time.
            for (key, _) in std::env::vars_os() {
                if key.to_str().is_some_and(set_by_cargo_for_the_crate) {
                    cmd.env_remove(key);
                }
            }
            let status = cmd.status().map_err(|e| format!("running cargo build: {e}"))?;
            if !status.success() {
                return Err(format!("cargo build of the daemons failed: {status}"));
            }
            Ok(profile_dir)
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))?;
    let path = dir.join(name);
    if !path.is_file() {
        bail!("{} was not built", path.display());
    }
    Ok(path)
}

/// Whether Cargo (or nextest, which mirrors it) sets `var` for the crate being built or tested,
/// as opposed to configuring Cargo itself (`CARGO_HOME`, `CARGO_TARGET_DIR`, ...).
fn set_by_cargo_for_the_crate(var: &str) -> bool {
    var.starts_with("CARGO_PKG_")
        || var.starts_with("CARGO_BIN_")
        || matches!(
            var,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_CRATE_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        )
}

/// Certificates for one ingest server and some devices, written under `dir`.
#[derive(Debug, Clone)]
pub struct PkiFixture {
    pub server: edge_transport::ServerTls,
    pub devices: Vec<(String, DeviceFiles)>,
}

/// A device's TLS files.
#[derive(Debug, Clone)]
pub struct DeviceFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl PkiFixture {
    /// Generates a CA, a server certificate for localhost/127.0.0.1 and one certificate per device.
    pub fn generate(dir: &Path, devices: &[&str]) -> anyhow::Result<Self> {
        let pki = edge_transport::pki::InMemoryPki::generate(&["localhost", "127.0.0.1"])?;
        let server = pki.write_server_files(&dir.join("server"))?.server_tls();
        let mut out = Vec::new();
        for d in devices {
            let f = pki.write_device_files(d, &dir.join(d))?;
            out.push(((*d).to_owned(), DeviceFiles { cert: f.cert, key: f.key, ca: f.ca_cert }));
        }
        Ok(Self { server, devices: out })
    }
}

/// A free UDP port on 127.0.0.1 for a daemon to bind (see [`free_port`]).
pub fn free_udp_port() -> anyhow::Result<u16> {
    free_port(|port| std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok())
}

/// A free TCP port on 127.0.0.1 for a daemon to bind (see [`free_port`]).
pub fn free_tcp_port() -> anyhow::Result<u16> {
    free_port(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
}

/// The first port `is_free` accepts, from 10000 up to the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, 32768 to 60999 by default). A port the kernel handed out
/// for a bind to port 0 could be handed out again, as the source port of any outgoing
/// connection, before the daemon binds it: a test's own HTTP request took an agent's metrics
/// port that way in a CI run. Ports below the range are never handed out; only another test
/// choosing the same one could take it, and each process walks its own stretch of the range.
fn free_port(is_free: impl Fn(u16) -> bool) -> anyhow::Result<u16> {
    const FIRST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let end = ephemeral.clamp(FIRST + 1_000, 65_535);
    let span = end - FIRST;
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let port = FIRST + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = u16::try_from(port)?;
        if is_free(port) {
            return Ok(port);
        }
    }
    bail!("no free port from {FIRST} to {end}")
}

/// A daemon running as a child process.
#[derive(Debug)]
pub struct Daemon {
    name: String,
    child: Option<Child>,
    notify: UnixDatagram,
    notify_path: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts `binary args...` with `NOTIFY_SOCKET` pointing at a socket of ours; stderr goes to
    /// `<log_dir>/<name>.log` (appended, so restarts keep history).
    pub fn spawn(
        name: &str,
        binary: &Path,
        args: &[&str],
        log_dir: &Path,
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let notify_path = log_dir.join(format!("{name}.notify"));
        let _stale = std::fs::remove_file(&notify_path);
        let notify = UnixDatagram::bind(&notify_path).with_context(|| format!("binding {}", notify_path.display()))?;
        let log = log_dir.join(format!("{name}.log"));
        let stderr = std::fs::OpenOptions::new().create(true).append(true).open(&log)?;
        let mut cmd = Command::new(binary);
        cmd.args(args)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("RUST_LOG", std::env::var("EDGE_TEST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().with_context(|| format!("starting {}", binary.display()))?;
        Ok(Self { name: name.to_owned(), child: Some(child), notify, notify_path, log })
    }

    /// Waits for the next `READY=1` (or fails if the process exits first).
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        self.wait_notify("READY=1", timeout)
    }

    /// Waits until a notify message containing `needle` arrives.
    pub fn wait_notify(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 4096];
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("{} exited with {status} before {needle}; log: {}", self.name, self.tail_log());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{} did not send {needle} within {timeout:?}; log: {}", self.name, self.tail_log());
            }
            // Short receive timeout so a crashed child is noticed promptly.
            self.notify.set_read_timeout(Some(left.min(Duration::from_millis(200))))?;
            match self.notify.recv(&mut buf) {
                Ok(n) => {
                    if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l.trim() == needle) {
                        return Ok(());
                    }
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Every notify message received so far that was not consumed, in order.
    pub fn drain_notify(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let _ = self.notify.set_nonblocking(true);
        while let Ok(n) = self.notify.recv(&mut buf) {
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        let _ = self.notify.set_nonblocking(false);
        out
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Sends a signal by name (`HUP`, `TERM`, ...) without waiting.
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        let pid = self.child.as_ref().context("not running")?.id();
        let status = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status()?;
        anyhow::ensure!(status.success(), "kill -{name} {pid} failed");
        Ok(())
    }

    /// Waits until the daemon's log contains `needle` (the daemon runs in another process;
    /// its log is the event we can observe).
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if std::fs::read_to_string(&self.log).unwrap_or_default().contains(needle) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} never logged {needle:?}; log: {}",
                self.name,
                self.tail_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the daemon to exit on its own; its exit status. Fails (and kills it) if it
    /// still runs after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        self.reap(timeout, "")
    }

    /// SIGTERM, then wait for the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let pid = self.child.as_ref().context("not running")?.id();
        // Unsafe code is denied in this workspace, so signal through the `kill` command.
        let status = Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
        self.reap(timeout, " after SIGTERM")
    }

    /// The exit status once the daemon is gone; kills it after `timeout` (`after` says what
    /// it was waited for after, in the error).
    fn reap(&mut self, timeout: Duration, after: &str) -> anyhow::Result<std::process::ExitStatus> {
        let mut c = self.child.take().context("not running")?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = c.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                bail!("{} did not exit within {timeout:?}{after}; log: {}", self.name, self.tail_log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last lines of the daemon's log, for failure messages.
    pub fn tail_log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Process id while the child runs (for /proc sampling).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Path of the log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.notify_path);
    }
}

//! The agent's TLS client configuration, kept in step with its files.
//!
//! Device certificates expire, and on ten thousand gateways they are renewed by a provisioning
//! tool that writes new files over the old ones, not by an operator restarting each agent. So
//! the agent does not keep what it read at start for its whole life: before every connection
//! attempt it looks at the three files (`upload.cert`, `upload.key`, `upload.ca`: modification
//! and change times, size, inode, so a file renamed into place counts, and so does a `chmod`
//! or `chown` that makes it readable), and reads them again when one changed. A SIGHUP reads
//! them at once, at the paths of the new configuration. A set of files that does not load (a
//! key written but not its certificate yet, a broken PEM, a key the agent may not read) is
//! logged and the previous configuration stays in use; it is tried again when a file changes,
//! and at the first attempt a minute after it failed.
//!
//! A connection already open keeps the certificate it was made with: the ingest accepts it
//! until that certificate expires, then closes it (`Unauthorized`), and the next attempt
//! picks up the files. After such a close, or a `Revoked` one, the agent also forgets its TLS
//! sessions ([`ClientTls::forget_sessions`]): resuming one would only carry the old
//! certificate again, where a full handshake shows the new one, or gets the server's TLS alert
//! naming what is wrong with the old. Sessions are forgotten even when the files do not load at
//! that moment: the last good identity is used with an empty session store.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use tracing::{error, info, warn};

/// What identifies a file's contents and access without reading it: modification time, change
/// time (owner and mode too), size, inode.
type Stamp = Option<(SystemTime, (i64, i64), u64, u64)>;

/// The stamps of the three files of `tls`.
fn stamps(tls: &edge_transport::ClientTls) -> [Stamp; 3] {
    [stamp(&tls.cert), stamp(&tls.key), stamp(&tls.server_ca)]
}

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, (m.ctime(), m.ctime_nsec()), m.len(), m.ino()))
}

/// After a set of files failed to load, it is tried again at the first attempt this long after,
/// even unchanged (a failure the stamp does not show, such as a directory's permissions).
const RETRY_FAILED: Duration = Duration::from_secs(60);

/// The configuration every connection attempt takes (see the module doc).
#[derive(Debug)]
pub struct ClientTls {
    tuning: edge_transport::Tuning,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The files; `None` for a configuration given in memory (benchmarks, tests).
    files: Option<edge_transport::ClientTls>,
    config: quinn::ClientConfig,
    /// The TLS half of `config` as read from the files, without its sessions' life since: what
    /// [`ClientTls::forget_sessions`] starts again from when the files do not load.
    identity: Option<rustls::ClientConfig>,
    /// The files' stamps when `config` was read, or when they last failed to load (so a broken
    /// set is tried again once it changes, or after [`RETRY_FAILED`]).
    seen: [Stamp; 3],
    /// When the files last failed to load, if they did after the last good read.
    failed_at: Option<Instant>,
    /// Times the files were read into a new configuration after the first.
    reloads: u64,
}

impl State {
    fn stamps(&self) -> [Stamp; 3] {
        self.files.as_ref().map_or([None, None, None], stamps)
    }
}

impl ClientTls {
    /// Reads the files of `tls`.
    ///
    /// # Errors
    /// When they do not load (as [`edge_transport::client_config`]).
    pub fn from_files(
        tls: edge_transport::ClientTls,
        tuning: edge_transport::Tuning,
    ) -> Result<ClientTls, edge_transport::TransportError> {
        // Stamped before the read: a change during it is seen at the next attempt.
        let seen = stamps(&tls);
        let identity = edge_transport::rustls_client_config(&tls)?;
        let config = edge_transport::quic_client_config(identity.clone(), &tuning)?;
        let state = State { files: Some(tls), config, identity: Some(identity), seen, failed_at: None, reloads: 0 };
        Ok(ClientTls { tuning, state: Mutex::new(state) })
    }

    /// A configuration that never changes (no files behind it).
    pub fn fixed(config: quinn::ClientConfig) -> ClientTls {
        let state = State { files: None, config, identity: None, seen: [None; 3], failed_at: None, reloads: 0 };
        ClientTls { tuning: edge_transport::Tuning::default(), state: Mutex::new(state) }
    }

    /// The configuration for the next connection attempt: the files read again first if one
    /// changed since they were last read.
    pub fn for_connect(&self) -> quinn::ClientConfig {
        let mut st = crate::lock(&self.state);
        let now = st.stamps();
        let retry = st.failed_at.is_some_and(|t| t.elapsed() >= RETRY_FAILED);
        if now != st.seen || retry {
            st.seen = now;
            self.read_files(&mut st, true);
        }
        st.config.clone()
    }

    /// Drops the TLS sessions kept for resumption, so the next handshake is a full one: with
    /// the files read again, or, when they do not load, with the identity last read from them.
    pub fn forget_sessions(&self) {
        let mut st = crate::lock(&self.state);
        st.seen = st.stamps();
        if self.read_files(&mut st, false) {
            return;
        }
        let Some(identity) = &st.identity else { return };
        match edge_transport::quic_client_config(edge_transport::without_sessions(identity), &self.tuning) {
            Ok(config) => st.config = config,
            // The same tuning built the config in use, so this does not happen; if it did, the
            // sessions would be kept and the next attempt resume one, as before this call.
            Err(e) => warn!(error = %e, "TLS sessions not forgotten"),
        }
    }

    /// SIGHUP: the files of `tls` (the paths may have changed) are read now, and used from the
    /// next connection attempt.
    ///
    /// # Errors
    /// When they do not load; the previous configuration stays in use.
    pub fn reload(&self, tls: edge_transport::ClientTls) -> Result<(), edge_transport::TransportError> {
        let seen = stamps(&tls);
        let identity = edge_transport::rustls_client_config(&tls)?;
        let config = edge_transport::quic_client_config(identity.clone(), &self.tuning)?;
        let mut st = crate::lock(&self.state);
        st.files = Some(tls);
        st.seen = seen;
        st.config = config;
        st.identity = Some(identity);
        st.failed_at = None;
        st.reloads += 1;
        Ok(())
    }

    /// Times the files were read into a new configuration since the first.
    pub fn reloads(&self) -> u64 {
        crate::lock(&self.state).reloads
    }

    /// The certificate file in use (for logs); `None` for a fixed configuration.
    pub fn cert_path(&self) -> Option<PathBuf> {
        crate::lock(&self.state).files.as_ref().map(|f| f.cert.clone())
    }

    /// Reads the files into a new configuration (a new resumption store); `changed`: because
    /// a file changed, not because the sessions are to be forgotten. Whether they loaded.
    fn read_files(&self, st: &mut State, changed: bool) -> bool {
        let Some(files) = &st.files else { return false };
        let read = edge_transport::rustls_client_config(files)
            .and_then(|identity| Ok((edge_transport::quic_client_config(identity.clone(), &self.tuning)?, identity)));
        match read {
            Ok((config, identity)) => {
                let why = if changed { "a file changed" } else { "sessions forgotten" };
                info!(cert = %files.cert.display(), why, "device TLS files read; the next connection uses them");
                st.config = config;
                st.identity = Some(identity);
                st.failed_at = None;
                st.reloads += 1;
                true
            }
            Err(e) if changed => {
                st.failed_at = Some(Instant::now());
                error!(cert = %files.cert.display(), error = %e, "device TLS files changed and do not load; the previous ones stay in use (tried again when a file changes, or in a minute)");
                false
            }
            Err(e) => {
                st.failed_at = Some(Instant::now());
                warn!(cert = %files.cert.display(), error = %e, "device TLS files do not load; the previous ones stay in use, without their sessions");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edge_transport::pki::InMemoryPki;

    fn files(pki: &InMemoryPki, dir: &Path) -> edge_transport::ClientTls {
        let dev = pki.write_device_files("gw-tls-01", dir).expect("device files");
        edge_transport::ClientTls {
            cert: dev.cert,
            key: dev.key,
            server_ca: dev.ca_cert,
            server_name: "localhost".into(),
        }
    }

    /// Replaces `path` the way provisioning tools do: a new file renamed over the old one.
    fn replace(path: &Path, text: &str) {
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, path).expect("rename");
    }

    #[test]
    fn changed_files_are_read_at_the_next_attempt_and_broken_ones_leave_the_last_good_in_use() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let tls = files(&pki, dir.path());
        let source = ClientTls::from_files(tls.clone(), edge_transport::Tuning::default()).expect("loads");
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 0, "nothing changed");

        // A renewal: certificate and key replaced.
        let (cert, key) = pki.issue_device("gw-tls-01").expect("renewed");
        replace(&tls.cert, &cert);
        replace(&tls.key, &key);
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 1, "read again once");
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 1, "and not again while unchanged");

        // Half a renewal that does not parse: the last good configuration stays, and the
        // broken file is not read at every attempt.
        replace(&tls.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n");
        let _ = source.for_connect();
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 1);
        // Fixed: read.
        replace(&tls.cert, &cert);
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 2);

        // A change of mode alone (a key made readable by `chmod` or `chown`) counts too.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tls.cert, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        let _ = source.for_connect();
        assert_eq!(source.reloads(), 3);

        // Forgetting the sessions reads the files (a new resumption store) even unchanged.
        source.forget_sessions();
        assert_eq!(source.reloads(), 4);

        // SIGHUP with files elsewhere; a set that does not load is refused and changes nothing.
        let other = files(&pki, &dir.path().join("other"));
        source.reload(other.clone()).expect("reload");
        assert_eq!(source.cert_path(), Some(other.cert.clone()));
        let missing = edge_transport::ClientTls { cert: dir.path().join("missing.pem"), ..other.clone() };
        assert!(source.reload(missing).is_err());
        assert_eq!(source.cert_path(), Some(other.cert), "the refused paths are not taken");
        assert_eq!(source.reloads(), 5);
    }

    /// Connects with `config` and makes one round trip (so the session ticket arrives before
    /// the close). Whether the connection could send 0-RTT data, which only a stored session
    /// allows.
    async fn round_trip(server: &quinn::Endpoint, config: quinn::ClientConfig) -> bool {
        let tuning = edge_transport::Tuning::default();
        let client = edge_transport::client_endpoint("127.0.0.1:0".parse().expect("addr"), &tuning).expect("client");
        let connecting = client.connect_with(config, server.local_addr().expect("addr"), "localhost").expect("connect");
        let (conn, resumed) = match connecting.into_0rtt() {
            Ok((conn, _)) => (Ok(conn), true),
            Err(connecting) => (Err(connecting), false),
        };
        let accept = async {
            let conn = server.accept().await.expect("incoming").await.expect("server handshake");
            let (mut send, mut recv) = conn.accept_bi().await.expect("stream");
            let data = recv.read_to_end(16).await.expect("read");
            send.write_all(&data).await.expect("echo");
            send.finish().expect("finish");
            conn.closed().await;
        };
        let connect = async {
            let conn = match conn {
                Ok(conn) => conn,
                Err(connecting) => connecting.await.expect("full handshake"),
            };
            let (mut send, mut recv) = conn.open_bi().await.expect("open");
            send.write_all(b"ping").await.expect("write");
            send.finish().expect("finish");
            assert_eq!(recv.read_to_end(16).await.expect("echo"), b"ping");
            conn.close(0u32.into(), b"done");
        };
        tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(connect, accept) })
            .await
            .expect("round trip within 20 s");
        resumed
    }

    #[tokio::test]
    async fn sessions_are_forgotten_even_when_the_files_do_not_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let tuning = edge_transport::Tuning::default();
        let server_config =
            edge_transport::server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &tuning)
                .expect("server config");
        let server = edge_transport::server_endpoint("127.0.0.1:0".parse().expect("addr"), server_config, &tuning)
            .expect("server endpoint");
        let tls = files(&pki, dir.path());
        let source = ClientTls::from_files(tls.clone(), tuning).expect("loads");

        assert!(!round_trip(&server, source.for_connect()).await, "the first handshake is a full one");
        // The session from it would be resumed (0-RTT is possible only then) ...
        let resumable = source.for_connect();
        // ... but the ingest closed the connection for the certificate while a renewal is half
        // written: the files do not load, and the sessions must go all the same.
        std::fs::write(&tls.key, "-----BEGIN PRIVATE KEY-----\nnot base64\n").expect("break key");
        source.forget_sessions();
        assert!(!round_trip(&server, source.for_connect()).await, "a session was resumed after forget_sessions");
        assert!(round_trip(&server, resumable).await, "the session existed: the test shows nothing otherwise");
        assert_eq!(source.reloads(), 0, "the broken files were not taken");
    }
}

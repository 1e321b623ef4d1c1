//! A small HTTP/1.1 client for the intake Unix socket, used by `edge-uploader push`, the demo's
//! producers and the system tests. One connection is kept and reused between requests.

use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// The answer of the intake to one request.
#[derive(Debug, Clone)]
pub struct IntakeResponse {
    pub status: u16,
    pub body: serde_json::Value,
    pub retry_after: Option<u64>,
}

impl IntakeResponse {
    /// Records the intake accepted (0 unless 200).
    pub fn records(&self) -> u64 {
        if self.status == 200 { self.body.get("records").and_then(serde_json::Value::as_u64).unwrap_or(0) } else { 0 }
    }
}

/// A reusable connection to the intake socket.
#[derive(Debug)]
pub struct IntakeClient {
    path: PathBuf,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl IntakeClient {
    /// A client for the socket at `path`; connects lazily.
    pub fn new(path: impl AsRef<Path>) -> Self {
        Self { path: path.as_ref().to_path_buf(), sender: None }
    }

    /// A client on a connection already made to the intake socket.
    pub async fn on(stream: UnixStream) -> anyhow::Result<Self> {
        let path = stream.peer_addr().ok().and_then(|a| a.as_pathname().map(Path::to_path_buf)).unwrap_or_default();
        let mut client = Self { path, sender: None };
        client.sender = Some(Self::handshake(stream).await?);
        Ok(client)
    }

    /// A client on a TCP connection already made, for one exchange (it does not reconnect):
    /// `GET /v1/status` on the agent's metrics listener.
    pub async fn on_tcp(stream: tokio::net::TcpStream) -> anyhow::Result<Self> {
        Ok(Self { path: PathBuf::new(), sender: Some(Self::handshake(stream).await?) })
    }

    async fn handshake<S>(stream: S) -> anyhow::Result<SendRequest<Full<Bytes>>>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _closed = conn.await;
        });
        Ok(sender)
    }

    async fn connect(&mut self) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        if self.sender.as_ref().is_none_or(SendRequest::is_closed) {
            let stream = UnixStream::connect(&self.path)
                .await
                .with_context(|| format!("connecting to the intake socket {}", self.path.display()))?;
            self.sender = Some(Self::handshake(stream).await?);
        }
        self.sender.as_mut().context("intake connection")
    }

    /// Connects now if not connected: an error here means nothing of the next request was sent.
    ///
    /// # Errors
    /// When the socket cannot be connected to, or the HTTP handshake fails.
    pub async fn connected(&mut self) -> anyhow::Result<()> {
        self.connect().await.map(|_| ())
    }

    /// `GET path`, answer parsed as JSON.
    pub async fn get_json(&mut self, path: &str) -> anyhow::Result<IntakeResponse> {
        let sender = self.connect().await?;
        sender.ready().await?;
        let req = hyper::Request::get(path).header(hyper::header::HOST, "localhost").body(Full::new(Bytes::new()))?;
        self.send(req).await
    }

    /// Posts `body` to `/v1/streams/{stream}`.
    pub async fn post(&mut self, stream: &str, content_type: &str, body: Bytes) -> anyhow::Result<IntakeResponse> {
        let sender = self.connect().await?;
        sender.ready().await?;
        let req = hyper::Request::post(format!("/v1/streams/{stream}"))
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::CONTENT_TYPE, content_type)
            .body(Full::new(body))?;
        self.send(req).await
    }

    async fn send(&mut self, req: hyper::Request<Full<Bytes>>) -> anyhow::Result<IntakeResponse> {
        let sender = self.connect().await?;
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                self.sender = None;
                return Err(e).context("sending the request to the intake");
            }
        };
        let status = resp.status().as_u16();
        let retry_after =
            resp.headers().get(hyper::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let bytes = resp.into_body().collect().await?.to_bytes();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok(IntakeResponse { status, body, retry_after })
    }
}

/// A producer's connection to the record-stream intake (`intake.stream_socket`, wire format in
/// [`edge_proto::intake`]): records are buffered and written in order, answers read as they
/// come. Used by the tests and the bench; a producer in another language needs only the table
/// in that module.
#[derive(Debug)]
pub struct RecordStreamClient<S> {
    io: S,
    wbuf: Vec<u8>,
    rbuf: Vec<u8>,
    stream: Option<edge_proto::StreamName>,
    /// Records written into `wbuf` so far.
    sent: u64,
}

impl RecordStreamClient<UnixStream> {
    /// Connects to the record-stream socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> anyhow::Result<Self> {
        let path = path.as_ref();
        let io = UnixStream::connect(path)
            .await
            .with_context(|| format!("connecting to the record-stream socket {}", path.display()))?;
        Ok(Self::new(io))
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> RecordStreamClient<S> {
    /// A client on an open connection; the preamble is sent with the first records.
    pub fn new(io: S) -> Self {
        Self { io, wbuf: edge_proto::intake::MAGIC.to_vec(), rbuf: Vec::new(), stream: None, sent: 0 }
    }

    /// Queues one record for `stream` (a Stream frame first when the stream changes).
    pub fn record(&mut self, stream: &edge_proto::StreamName, record: &[u8]) {
        if self.stream.as_ref() != Some(stream) {
            edge_proto::intake::put_stream(&mut self.wbuf, stream);
            self.stream = Some(stream.clone());
        }
        edge_proto::intake::put_record(&mut self.wbuf, record);
        self.sent += 1;
    }

    /// Queues raw bytes as they are (for tests of malformed input).
    pub fn raw(&mut self, bytes: &[u8]) {
        self.wbuf.extend_from_slice(bytes);
    }

    /// Records queued so far on this connection.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Writes what is queued.
    pub async fn flush(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        self.io.write_all(&self.wbuf).await?;
        self.wbuf.clear();
        Ok(())
    }

    /// The agent's next answer; `None` when it closed the connection.
    pub async fn reply(&mut self) -> anyhow::Result<Option<edge_proto::intake::Reply>> {
        use tokio::io::AsyncReadExt;
        loop {
            if let Some((reply, used)) = edge_proto::intake::parse_reply(&self.rbuf)? {
                self.rbuf.drain(..used);
                return Ok(Some(reply));
            }
            let mut buf = [0u8; 4096];
            let n = self.io.read(&mut buf).await.context("reading the agent's answer")?;
            if n == 0 {
                anyhow::ensure!(self.rbuf.is_empty(), "the agent closed the connection inside an answer");
                return Ok(None);
            }
            self.rbuf.extend_from_slice(&buf[..n]);
        }
    }

    /// Flushes, ends the sending side and returns the agent's last answer: an Ack for every
    /// record sent, or the Error that ended the connection.
    pub async fn finish(mut self) -> anyhow::Result<edge_proto::intake::Reply> {
        use tokio::io::AsyncWriteExt;
        // A refused connection may be closed before everything is written; its answer tells.
        let _ = self.flush().await;
        let _ = self.io.shutdown().await;
        let mut last = None;
        while let Some(reply) = self.reply().await? {
            last = Some(reply);
        }
        last.context("the agent closed the connection without an answer")
    }
}

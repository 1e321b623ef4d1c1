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

    async fn connect(&mut self) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        if self.sender.as_ref().is_none_or(SendRequest::is_closed) {
            let stream = UnixStream::connect(&self.path)
                .await
                .with_context(|| format!("connecting to the intake socket {}", self.path.display()))?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(async move {
                let _closed = conn.await;
            });
            self.sender = Some(sender);
        }
        self.sender.as_mut().context("intake connection")
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

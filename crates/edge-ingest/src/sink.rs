//! Where verified chunks go: the file store on this machine (the default) or a NATS JetStream
//! stream shared by every ingest server of a tier (`[sink] kind = "jetstream"`). The server
//! sees one interface: persist a chunk and learn whether it is durable, new or not.

use crate::jetstream::JetStreamSink;
use crate::store::{IncomingChunk, PersistOutcome, StoreHandle, StoreStatsView};

/// The sink of a running server. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Sink {
    /// Segment files in a local data directory ([`crate::store`]).
    Files(StoreHandle),
    /// A JetStream stream ([`crate::jetstream`]).
    JetStream(JetStreamSink),
}

impl Sink {
    /// Stores `chunk` (or finds it stored) and says so only once it is durable.
    pub async fn persist(&self, chunk: IncomingChunk) -> PersistOutcome {
        match self {
            Sink::Files(store) => store.persist(chunk).await,
            Sink::JetStream(js) => js.persist(chunk).await,
        }
    }

    /// Applies an agent's floor: no seq of `(device, spool, stream)` below `seq` will come as
    /// new data any more. The file store closes the gaps below it in its dedup index
    /// ([`crate::store::Store::raise_floor`]); JetStream deduplicates by subject (one message
    /// per chunk part) and keeps no gaps to close, so there it does nothing.
    /// Returns once the floor is applied.
    pub async fn raise_floor(&self, device: &str, spool: [u8; 16], stream: &str, seq: u64) {
        match self {
            Sink::Files(store) => store.raise_floor(device, spool, stream, seq).await,
            Sink::JetStream(_) => {}
        }
    }

    /// Statistics for `/metrics` and `/v1/status`.
    pub fn stats_view(&self) -> StoreStatsView {
        match self {
            Sink::Files(store) => store.stats_view(),
            Sink::JetStream(js) => js.stats_view(),
        }
    }

    /// Stops the sink once the server stopped sending it chunks: the file store finishes its
    /// queue and releases its directory lock; the JetStream client flushes and disconnects.
    pub async fn shutdown(self) {
        match self {
            Sink::Files(store) => {
                if let Err(e) = tokio::task::spawn_blocking(move || store.shutdown()).await {
                    tracing::error!(error = %e, "store shutdown task failed");
                }
            }
            Sink::JetStream(js) => js.shutdown().await,
        }
    }
}

impl From<StoreHandle> for Sink {
    fn from(store: StoreHandle) -> Self {
        Sink::Files(store)
    }
}

impl From<JetStreamSink> for Sink {
    fn from(js: JetStreamSink) -> Self {
        Sink::JetStream(js)
    }
}

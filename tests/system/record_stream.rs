//! The record-stream intake of the real agent process under slow commits: the spool's
//! `spool::append::before_commit` point sleeps 20 ms in each commit (`FAILPOINTS`, test builds
//! only), so the records that arrive meanwhile reach the per-connection gathering cap and wait
//! in the agent's receive buffer. Every one of them must still be framed, committed and acked:
//! when the producer then only waits for its acks, and when it ends its side at once.

use std::time::Duration;

use edge_proto::StreamName;
use edge_proto::intake::Reply;
use edge_uploader::client::RecordStreamClient;

use crate::common::{READY_TIMEOUT, World};
use crate::crash_loop::{runtime, spawn_agent};

#[test]
fn records_held_at_the_gathering_cap_during_slow_commits_are_all_acked() -> anyhow::Result<()> {
    let world = World::new("gw-recstream-01", "")?;
    let mut agent = spawn_agent(&world, &[("FAILPOINTS", "spool::append::before_commit=sleep(20)")])?;
    agent.wait_ready(READY_TIMEOUT)?;
    let socket = world.intake_socket().with_file_name(edge_uploader::config::DEFAULT_STREAM_SOCKET);
    let record = vec![b'r'; 10 << 10];
    let n = (4 * edge_uploader::record_stream::PENDING_CAP / record.len()) as u64;
    let rt = runtime()?;
    rt.block_on(async {
        // Written at once, then only waiting: the acks must come without further bytes.
        let mut c = RecordStreamClient::connect(&socket).await?;
        let s = StreamName::new("waits")?;
        for _ in 0..n {
            c.record(&s, &record);
        }
        c.flush().await?;
        let mut acked = 0;
        while acked < n {
            match tokio::time::timeout(Duration::from_secs(30), c.reply()).await {
                Ok(Ok(Some(Reply::Ack { committed }))) => acked = committed,
                other => anyhow::bail!("expected acks up to {n}, got {other:?} after {acked}"),
            }
        }
        anyhow::ensure!(c.finish().await? == Reply::Ack { committed: n });
        // Written and ended at once, four producers side by side: what is left unframed at the
        // end of the stream is complete frames, not a cut-off one.
        for round in 0..8 {
            let mut producers = tokio::task::JoinSet::new();
            for k in 0..4 {
                let mut c = RecordStreamClient::connect(&socket).await?;
                let record = record.clone();
                producers.spawn(async move {
                    let s = StreamName::new(&format!("ends-{k}"))?;
                    // Written in pieces of a few records, as a client with a write buffer does.
                    for i in 0..n {
                        if i % 7 == 6 {
                            c.flush().await?;
                        }
                        c.record(&s, &record);
                    }
                    c.finish().await
                });
            }
            while let Some(reply) = producers.join_next().await {
                let reply = reply??;
                anyhow::ensure!(reply == Reply::Ack { committed: n }, "round {round}: {reply:?}");
            }
        }
        anyhow::Ok(())
    })
    .map_err(|e| e.context(agent.tail_log()))?;
    let status = agent.terminate(Duration::from_secs(30))?;
    assert!(status.success(), "agent exit after SIGTERM: {status}");
    Ok(())
}

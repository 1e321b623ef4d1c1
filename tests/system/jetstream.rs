//! The scale-out sink end to end: the real agent and ingest processes, the ingest writing to the
//! machine's NATS JetStream (a stream of the test's own, deleted afterwards). The ingest server
//! is killed with SIGKILL again and again while producers push and the agent uploads, and each
//! restart is a new server with nothing on its disk: whatever it knows of what is stored, it
//! learns from JetStream. At the end the stream must hold exactly the records acknowledged to
//! the producers, each once, in order per stream.

use std::sync::Arc;
use std::time::{Duration, Instant};

use edge_testkit::workload::Workload;
use edge_testkit::{Tier, nats};
use rand::{Rng, SeedableRng};

use crate::common::World;
use crate::crash_loop::{Producers, chunks_acked, drain, runtime, summary_ms, wait_status};

/// Points the world's ingest server at a JetStream stream.
fn use_jetstream(world: &World, stream: &str, prefix: &str) -> anyhow::Result<()> {
    let mut cfg = std::fs::read_to_string(&world.ingest_config)?;
    cfg.push_str(&format!(
        "\n[sink]\nkind = \"jetstream\"\n\n[sink.jetstream]\nservers = [{:?}]\nstream = {stream:?}\n\
         subject_prefix = {prefix:?}\nack_timeout = \"3s\"\n",
        nats::url()
    ));
    std::fs::write(&world.ingest_config, cfg)?;
    Ok(())
}

#[test]
fn records_reach_jetstream_exactly_once_through_ingest_sigkills() -> anyhow::Result<()> {
    let tier = Tier::current();
    // Each kill leaves the agent on a dead connection until its idle timeout (10 s), while the
    // producers keep filling the spool: small records keep that backlog (and the machine's
    // JetStream store) small.
    let ingest_kills: u32 = tier.pick(2, 20);
    let world = World::new("gw-js-01", "")?;
    let (stream, prefix) = nats::unique("system");
    use_jetstream(&world, &stream, &prefix)?;
    let socket = world.intake_socket();
    let mut ingest = world.start_ingest()?;
    let agent = world.start_agent()?;

    let rt = runtime()?;
    let js = rt.block_on(nats::context(&nats::url()))?;
    let workload = Arc::new(Workload::new(0x15_7E_A4).with_sizes(1, 1024));
    let producers = Producers::start(&rt, &workload, &socket, 5);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x15_7E_A4);
    let mut restart_to_ready = Vec::new();
    let result = (|| -> anyhow::Result<_> {
        for kill in 0..ingest_kills {
            // Upload works with this server: the agent sees chunks acknowledged.
            let before = chunks_acked(&rt.block_on(crate::crash_loop::agent_status(&socket))?);
            rt.block_on(wait_status(&socket, "a chunk acked by this ingest server", Duration::from_secs(60), |s| {
                chunks_acked(s) > before
            }))
            .map_err(|e| e.context(format!("before ingest kill {kill}: {}", ingest.tail_log())))?;
            producers.wait_acked(producers.acked(), rng.random_range(200..2000), Duration::from_secs(60), || {
                agent.tail_log()
            })?;
            std::thread::sleep(Duration::from_millis(rng.random_range(0..100)));
            ingest.kill9()?;
            let t = Instant::now();
            ingest = world.start_ingest()?;
            restart_to_ready.push(t.elapsed());
        }
        let sent = producers.stop(&rt)?;
        rt.block_on(drain(&socket, Duration::from_secs(120))).map_err(|e| e.context(agent.tail_log()))?;
        // The operator sees which sink the server writes to, and its health (the last server
        // took what was left after its predecessor's kill).
        let cfg = world.ingest_config.to_string_lossy().into_owned();
        let (code, doc) = crate::common::json_output("edge-ingest", &["status", "--config", &cfg, "--json"])?;
        anyhow::ensure!(code == 0, "edge-ingest status exit {code}: {doc}");
        let sink = &doc["sink"];
        anyhow::ensure!(sink["kind"] == "jetstream" && sink["stream"] == stream.as_str(), "status: {doc}");
        anyhow::ensure!(sink["healthy"] == true && sink["chunks"].as_u64() > Some(0), "status: {doc}");
        let msgs = rt.block_on(nats::messages(&js, &stream))?;
        Ok((sent, msgs))
    })();
    rt.block_on(nats::delete_stream(&js, &stream));
    let (sent, msgs) = result?;
    let report = nats::check_stream_contents(&workload, &msgs, &sent)?;
    edge_testkit::report(
        "jetstream_ingest_sigkill",
        &serde_json::json!({
            "ingest_sigkill_cycles": ingest_kills,
            "messages": msgs.len(),
            "ingest_restart_to_ready_ms": summary_ms(&restart_to_ready),
            "check": report.to_json(),
        }),
    )?;
    assert!(report.is_exact(), "JetStream differs from what was acknowledged: {report:?}");
    assert_eq!(report.out_of_order, 0, "records out of order: {report:?}");
    assert!(report.acked >= 200 * u64::from(ingest_kills), "too few records acknowledged: {report:?}");
    Ok(())
}

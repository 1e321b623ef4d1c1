//! `edge-ingest stored`: whether one chunk is in the file store, by its key, from the command
//! line, with the exit codes scripts rely on (0 stored, 1 not, 2 usage, 3 could not tell), and
//! through a config as the operator runs it (the JetStream sink's lookup itself is tested in
//! `jetstream.rs`).

use std::path::Path;
use std::process::Command;

use edge_ingest::store::{ChunkKey, ExportFilter, IncomingChunk, Payload, PersistOutcome, Store, StoreOptions, export};
use edge_proto::Codec;
use edge_proto::records::encode_record;

const BIN: &str = env!("CARGO_BIN_EXE_edge-ingest");
const SPOOL: [u8; 16] = [0x5a; 16];

fn chunk(seq: u64, records: usize) -> IncomingChunk {
    chunk_of(SPOOL, seq, records)
}

fn chunk_of(spool: [u8; 16], seq: u64, records: usize) -> IncomingChunk {
    let mut payload = Vec::new();
    for i in 0..records {
        encode_record(&mut payload, format!("{{\"seq\":{seq},\"i\":{i}}}").as_bytes());
    }
    IncomingChunk {
        key: ChunkKey { device: "gw-1".into(), spool, stream: "temp.c".into(), seq },
        records: u32::try_from(records).expect("small"),
        codec: Codec::None,
        raw_len: u32::try_from(payload.len()).expect("small"),
        checksum: edge_proto::crc32c(&payload),
        created_ms: 1_700_000_000_000,
        payload: Payload::from(payload),
    }
}

fn stored(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN).arg("stored").args(args).output().expect("run edge-ingest");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn key_args<'a>(dir: &'a str, spool: &'a str, seq: &'a str) -> Vec<&'a str> {
    vec!["--data-dir", dir, "--device", "gw-1", "--stream", "temp.c", "--spool", spool, "--seq", seq]
}

#[test]
fn a_stored_chunk_a_missing_one_and_a_damaged_one_are_told_apart_by_exit_code() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = Store::open(StoreOptions::new(dir.path())).expect("open").0;
    for seq in 1..=3 {
        assert_eq!(store.persist(vec![chunk(seq, 4)]), vec![PersistOutcome::Stored]);
    }
    drop(store);
    let data = dir.path().to_str().expect("utf-8 path");
    let spool = "5a".repeat(16);

    let (code, out, err) = stored(&key_args(data, &spool, "2"));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("seq 2") && out.contains("stored, 4 records"), "{out}");
    // Upper-case hex names the same spool.
    assert_eq!(stored(&key_args(data, &spool.to_uppercase(), "2")).0, 0);

    let (code, out, err) = stored(&key_args(data, &spool, "9"));
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("seq 9") && out.contains("not stored in"), "{out}");
    let other_spool = "5b".repeat(16);
    assert_eq!(stored(&key_args(data, &other_spool, "2")).0, 1, "another spool's seq 2 is not this one");

    // Without --spool: every spool's chunk of that seq, each named by its spool.
    let mut store = Store::open(StoreOptions::new(dir.path())).expect("reopen").0;
    assert_eq!(store.persist(vec![chunk_of([0x5b; 16], 2, 1)]), vec![PersistOutcome::Stored]);
    drop(store);
    let any = ["--data-dir", data, "--device", "gw-1", "--stream", "temp.c", "--seq", "2"];
    let (code, out, err) = stored(&any);
    // Which of the two is the agent's is not for the store to say.
    assert_eq!(code, 3, "{out}{err}");
    assert!(out.contains(&format!("spool {spool}, seq 2): stored, 4 records")), "{out}");
    assert!(out.contains(&format!("spool {other_spool}, seq 2): stored, 1 records")), "{out}");
    assert!(out.contains("several spools hold this seq"), "{out}");
    let one = ["--data-dir", data, "--device", "gw-1", "--stream", "temp.c", "--seq", "1"];
    assert_eq!(stored(&one).0, 0, "one spool's chunk, whole, nothing damaged");

    // Chunk 3's payload goes bad in the store: its entry is there, its records cannot be had,
    // so the store cannot say it is stored, nor that it is not.
    let (segment, header, payload) = located(dir.path(), 3);
    flip(dir.path(), segment, payload + 2);
    let (code, out, err) = stored(&key_args(data, &spool, "3"));
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("cannot rule it out: 1 entries of it do not read back whole"), "{err}");
    assert!(err.contains("payload checksum mismatch; chunk skipped"), "the entry is logged, with its place: {err}");
    // `export` says what it skipped, in words.
    let out = Command::new(BIN).args(["export", "--data-dir", data, "--format", "raw"]).output().expect("export");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "what was readable is exported, and the exit says not all: {err}");
    let whole = Command::new(BIN).args(["export", "--data-dir", data, "--seq", "2"]).output().expect("export");
    assert_eq!(whole.status.code(), Some(0), "{}", String::from_utf8_lossy(&whole.stderr));
    assert!(err.contains("payload checksum mismatch; chunk skipped"), "{err}");
    assert!(
        err.contains(&format!(
            "exported 9 records of 3 chunks ({} payload bytes) from 1 segment(s) in {data}; skipped, as damaged: 1 \
             entries that do not read back whole (0 of them fail to decode, the rest their checksum)",
            out.stdout.len()
        )),
        "{err}"
    );
    assert_eq!(stored(&key_args(data, &spool, "2")).0, 0, "its neighbour is unharmed");
    // A damaged entry header makes a region that does not parse: whatever was asked for, and
    // was not found, may be in it.
    flip(dir.path(), segment, payload + 2);
    flip(dir.path(), segment, header + 14);
    for seq in ["3", "9"] {
        let (code, out, err) = stored(&key_args(data, &spool, seq));
        assert_eq!(code, 3, "seq {seq}: {out}{err}");
        assert!(err.contains("1 regions of"), "{err}");
    }
    assert_eq!(stored(&key_args(data, &spool, "2")).0, 0, "found where it is whole");
    // Without a spool id, the damage could hide another spool's chunk of seq 1.
    let (code, out, _) = stored(&one);
    assert_eq!(code, 3, "{out}");
    assert!(out.contains("the store has damaged regions"), "{out}");
}

/// Segment, entry offset and payload offset of the chunk of `seq` in the store at `dir`.
fn located(dir: &Path, seq: u64) -> (u64, u64, u64) {
    let mut at = None;
    let filter = ExportFilter { seq: Some(seq), spool: Some(SPOOL), ..ExportFilter::default() };
    export(dir, &filter, |c| {
        at = Some((c.segment, c.offset, c.offset + edge_ingest::store::format::entry_header_len(c.key) as u64));
        Ok(())
    })
    .expect("export");
    at.expect("the chunk is stored")
}

#[test]
fn through_the_operators_config_with_the_file_sink_and_with_jetstream_out_of_reach() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let mut store = Store::open(StoreOptions::new(&data)).expect("open").0;
    assert_eq!(store.persist(vec![chunk(1, 2)]), vec![PersistOutcome::Stored]);
    drop(store);
    // The server's TLS files are not this command's business: a config naming files that are
    // not there (a machine the store was copied to, say) still answers.
    let tls = dir.path().join("no-tls");
    let head = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        tls.join("server.pem"),
        tls.join("server.key"),
        tls.join("client-ca.pem")
    );
    let files = dir.path().join("files.toml");
    std::fs::write(&files, format!("{head}[store]\ndata_dir = {data:?}\n")).expect("write config");
    let spool = "5a".repeat(16);
    let ask = |config: &Path, seq: &str| {
        let config = config.to_str().expect("utf-8").to_owned();
        stored(&["--config", &config, "--device", "gw-1", "--stream", "temp.c", "--spool", &spool, "--seq", seq])
    };
    let (code, out, err) = ask(&files, "1");
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("stored, 2 records"), "{out}");
    assert_eq!(ask(&files, "2").0, 1);

    // NATS where nothing listens: the lookup cannot tell, which is not "not stored".
    let port = std::net::UdpSocket::bind("127.0.0.1:0").expect("a free port").local_addr().expect("addr").port();
    let jetstream = dir.path().join("jetstream.toml");
    let sink = format!(
        "[sink]\nkind = \"jetstream\"\n[sink.jetstream]\nservers = [\"nats://127.0.0.1:{port}\"]\nconnect_timeout = \"1s\"\n"
    );
    std::fs::write(&jetstream, format!("{head}{sink}")).expect("write config");
    let (code, out, err) = ask(&jetstream, "1");
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains(&format!("127.0.0.1:{port}")), "names the server: {err}");
}

#[test]
fn bad_keys_are_usage_errors_and_an_unreadable_store_is_not_a_verdict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().to_str().expect("utf-8 path");
    let (code, _, err) = stored(&key_args(data, "5a5a", "1"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--spool") && err.contains("\"5a5a\""), "names the bad value: {err}");
    let (code, _, err) = stored(&key_args(data, &"zz".repeat(16), "1"));
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = stored(&["--device", "gw-1", "--stream", "s", "--spool", &"00".repeat(16)]);
    assert_eq!(code, 2, "clap's usage error for a missing --seq: {err}");
    let config = dir.path().join("edge-ingest.toml");
    std::fs::write(&config, "[sink]\nkind = \"carrier-pigeon\"\n").expect("write config");
    let args = ["--config", config.to_str().expect("utf-8"), "--device", "gw-1", "--stream", "s"];
    let (code, _, err) = stored(&[&args[..], &["--spool", &"00".repeat(16), "--seq", "1"]].concat());
    assert_eq!(code, 78, "an invalid config: {err}");

    let missing = dir.path().join("no-such-store");
    let (code, out, err) = stored(&key_args(missing.to_str().expect("utf-8"), &"5a".repeat(16), "1"));
    assert_eq!(code, 3, "could not tell, which is not 'not stored': {out}{err}");
    assert!(err.contains("no-such-store"), "names the directory: {err}");
    // A directory that exists but is no store (a wrong data_dir) cannot tell either.
    let (code, out, err) = stored(&key_args(data, &"5a".repeat(16), "1"));
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.contains("is not an ingest store: it has no segments directory"), "{err}");
    // `export` refuses it too, rather than export nothing as if the store were empty.
    let out = Command::new(BIN).args(["export", "--data-dir", data]).output().expect("export");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("is not an ingest store"), "{err}");
}

fn flip(dir: &Path, segment: u64, offset: u64) {
    let path =
        dir.join(edge_ingest::store::format::SEGMENTS_DIR).join(edge_ingest::store::format::segment_file_name(segment));
    let mut bytes = std::fs::read(&path).expect("read segment");
    let at = usize::try_from(offset).expect("small");
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).expect("write segment");
}

/// With the JetStream sink, through a config as the operator runs it: a whole chunk, one stored
/// only in part (as a server that died between the parts leaves it), and both at once when
/// asked without a spool id.
#[tokio::test]
async fn jetstream_chunks_whole_in_part_and_of_two_spools_have_their_exit_codes() {
    use edge_ingest::jetstream::{JetStreamOptions, JetStreamSink};
    use edge_testkit::nats;
    let (name, prefix) = nats::unique("stored");
    let js = nats::context(&nats::url()).await.expect("NATS with JetStream at EDGE_TEST_NATS_URL or 127.0.0.1:4222");
    let opts = JetStreamOptions {
        servers: vec![nats::url()],
        stream: name.clone(),
        subject_prefix: prefix.clone(),
        ..JetStreamOptions::default()
    };
    let sink = JetStreamSink::start(opts).await.expect("sink");
    tokio::time::timeout(std::time::Duration::from_secs(30), sink.ready()).await.expect("stream set up");
    assert_eq!(sink.persist(chunk(5, 3)).await, PersistOutcome::Stored);
    // Another spool's seq 5: part 1 of 2 only.
    let other = "5b".repeat(16);
    let id = format!("gw-1.temp%2Ec.{other}.5.1");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    headers.insert("Edge-Part", "1/2");
    headers.insert("Edge-Records", "2");
    js.publish_with_headers(format!("{prefix}.{id}"), headers, b"part".as_slice().into())
        .await
        .expect("publish")
        .await
        .expect("ack");

    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("pki");
    let tls = pki.write_server_files(&dir.path().join("tls")).expect("server files");
    let config = dir.path().join("edge-ingest.toml");
    let body = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n[sink]\nkind = \"jetstream\"\n[sink.jetstream]\n\
         servers = [{:?}]\nstream = {name:?}\nsubject_prefix = {prefix:?}\n",
        tls.cert,
        tls.key,
        tls.client_ca,
        nats::url()
    );
    std::fs::write(&config, body).expect("write config");
    let config = config.to_str().expect("utf-8").to_owned();
    let ask = move |spool: Option<&str>| {
        let mut args = vec!["--config", &config, "--device", "gw-1", "--stream", "temp.c", "--seq", "5"];
        if let Some(s) = spool {
            args.extend(["--spool", s]);
        }
        stored(&args)
    };
    let mine = "5a".repeat(16);
    let (whole, in_part, both) = tokio::task::spawn_blocking(move || (ask(Some(&mine)), ask(Some(&other)), ask(None)))
        .await
        .expect("the commands ran");
    nats::delete_stream(&js, &name).await;
    let (code, out, err) = whole;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("stored, 3 records in 1 part(s)"), "{out}");
    let (code, out, err) = in_part;
    assert_eq!(code, 4, "{out}{err}");
    assert!(out.contains("only in part") && out.contains("part(s) 1 of 2 (2 records)"), "{out}");
    let (code, out, err) = both;
    assert_eq!(code, 4, "a chunk in part is there: {out}{err}");
    assert_eq!(out.lines().filter(|l| l.contains(", seq 5): ")).count(), 2, "{out}");
}

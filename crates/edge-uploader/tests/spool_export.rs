//! `edge-uploader spool export-quarantined` against a real spool file held open by this process,
//! as the agent would hold it: it prints the records of the quarantined chunks only, every batch
//! whose checksum passes, names what it could not export (a damaged batch, a record NDJSON cannot
//! carry) and says so in its exit code. And `push --framed`, which sends such an export back,
//! refuses an input cut short before it connects.

use std::path::Path;
use std::process::Command;

use edge_proto::records::encode_record;
use edge_spool::{AppendRequest, Batch, ChunkMeta, Spool, SpoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_edge-uploader");

fn export(spool: &Path, args: &[&str]) -> (i32, Vec<u8>, String) {
    let out = Command::new(BIN)
        .args(["spool", "export-quarantined", "--spool"])
        .arg(spool)
        .args(args)
        .output()
        .expect("run edge-uploader");
    (out.status.code().unwrap_or(-1), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// One batch of framed records, as the intake frames them.
fn batch(stream: &str, records: &[&[u8]]) -> Batch {
    let mut data = Vec::new();
    for r in records {
        encode_record(&mut data, r);
    }
    Batch { stream: stream.into(), data, records: records.len() as u32 }
}

/// Appends each batch in a commit of its own, then seals: one chunk per stream.
fn append(spool: &mut Spool, batches: Vec<Batch>, now: u64) {
    for b in batches {
        spool.append(&[AppendRequest { batches: vec![b] }], now).expect("append");
    }
    spool.seal_all(now).expect("seal");
}

/// XORs a byte into the second batch of `chunk`, in its payload segment file.
fn damage_second_batch(db: &Path, chunk: &ChunkMeta) -> i64 {
    let raw = rusqlite::Connection::open(db).expect("raw connection");
    let (batch, segment, offset): (i64, i64, u64) = raw
        .query_row(
            "SELECT b.id, b.segment, b.seg_offset FROM batches b JOIN chunks c
             ON b.stream_id = c.stream_id AND b.id BETWEEN c.first_batch AND c.last_batch
             WHERE c.id = ?1 ORDER BY b.id LIMIT 1 OFFSET 1",
            [chunk.id.0],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("the chunk's second batch, in a segment");
    let seg_path = format!("{}-seg-{segment:010}", db.display());
    let mut seg = std::fs::read(&seg_path).expect("segment file");
    seg[usize::try_from(offset).expect("offset") + 2] ^= 0x40;
    std::fs::write(&seg_path, &seg).expect("flip");
    batch
}

fn raw_records(mut out: &[u8]) -> Vec<Vec<u8>> {
    let mut recs = Vec::new();
    while !out.is_empty() {
        let len = u32::from_le_bytes(out[..4].try_into().expect("length")) as usize;
        recs.push(out[4..4 + len].to_vec());
        out = &out[4 + len..];
    }
    recs
}

#[test]
fn exports_every_intact_batch_of_the_quarantined_chunks_only_and_names_what_it_could_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    // `rejected`: a chunk the ingest refused, intact; one record holds a newline.
    append(&mut spool, vec![batch("rejected", &[b"{\"t\":1}", b"{\"t\":2}"]), batch("rejected", &[b"two\nlines"])], 1);
    // `live`: sealed and waiting, not in quarantine: never exported.
    append(&mut spool, vec![batch("live", &[b"{\"keep\":1}"])], 2);
    // `damaged`: three batches, the second of which a bad byte ruins.
    append(
        &mut spool,
        vec![
            batch("damaged", &[b"{\"d\":1}", b"{\"d\":2}"]),
            batch("damaged", &[b"{\"d\":3}"]),
            batch("damaged", &[b"{\"d\":4}"]),
        ],
        3,
    );
    let sealed = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list");
    let by = |s: &str| sealed.iter().find(|m| m.stream == s).expect("chunk").clone();
    let (rejected, damaged) = (by("rejected"), by("damaged"));
    let bad_batch = damage_second_batch(&path, &damaged);
    spool.quarantine(rejected.id, "rejected by the server: bad records").expect("quarantine");
    spool.quarantine(damaged.id, "corrupt in spool: test").expect("quarantine");

    // Raw: every record of `rejected`, and `damaged` but for its second batch. The spool is held
    // open by this process the whole time, as the agent holds it.
    let (code, out, err) = export(&path, &["--format", "raw"]);
    assert_eq!(code, 1, "{err}");
    let want: Vec<&[u8]> = vec![b"{\"d\":1}", b"{\"d\":2}", b"{\"d\":4}", b"{\"t\":1}", b"{\"t\":2}", b"two\nlines"];
    assert_eq!(raw_records(&out), want, "{err}");
    assert!(err.contains(&format!("chunk {} (stream damaged, seq 1): 3 of 4 records exported", damaged.id.0)), "{err}");
    assert!(err.contains(&format!("batch {bad_batch}: crc32c stored")), "{err}");
    // Its bytes went bad in the spool: the agent may have sent it before, and the report says so.
    assert!(err.contains("(quarantined: corrupt in spool: test); the agent may have sent it before"), "{err}");
    // With the command that asks the ingest, keyed by this spool's id; under --spool there is no
    // certificate to take the device id from, so that is left for the operator to fill in.
    let ask = format!(
        "edge-ingest stored --config /etc/edge-ingest/edge-ingest.toml --device=<the device id: the common name of \
         upload.cert> --stream=damaged --spool={} --seq=1",
        spool.id()
    );
    assert!(err.contains(&format!("ask the ingest with\n    {ask}\n")), "{err}");
    assert_eq!(err.matches("edge-ingest stored --").count(), 1, "only the chunk that may be stored: {err}");
    assert!(err.contains("1 chunk(s) may be stored at the ingest already"), "{err}");
    assert!(!err.contains("(quarantined: rejected by the server: bad records);"), "refused: not stored: {err}");
    assert!(err.contains(&format!("chunk {} (stream rejected, seq 1): 3 records exported", rejected.id.0)), "{err}");
    assert!(err.contains("exported 6 records of 2 quarantined chunk(s); 1 chunk(s) not in full"), "{err}");

    // One chunk alone, by stream and seq; a seq without its stream is a usage error.
    let (code, out, err) = export(&path, &["--stream", "damaged", "--seq", "1", "--format", "raw"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(raw_records(&out), want[..3].to_vec(), "{err}");
    assert!(err.contains("of 1 quarantined chunk(s) of stream \"damaged\", seq 1;"), "{err}");
    let (code, out, err) = export(&path, &["--stream", "damaged", "--seq", "2"]);
    assert_eq!((code, out.len()), (1, 0), "{err}");
    assert!(err.ends_with("no chunk of stream \"damaged\" with seq 2 is in quarantine\n"), "{err}");
    let (code, _, err) = export(&path, &["--seq", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--stream"), "{err}");

    // NDJSON, one stream: the batch holding a newline is named, not written.
    let (code, out, err) = export(&path, &["--stream", "rejected"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(String::from_utf8(out).expect("utf-8"), "{\"t\":1}\n{\"t\":2}\n", "{err}");
    assert!(
        err.contains(
            "2 of 3 records exported; not exported: record 1 of a batch of 1 holds a newline or ends in a carriage"
        ),
        "{err}"
    );

    // A stream whose quarantined chunks are all intact and NDJSON-safe: exit 0.
    spool.quarantine(by("live").id, "rejected by the server: test").expect("quarantine");
    let (code, out, err) = export(&path, &["--stream", "live"]);
    assert_eq!((code, out.as_slice()), (0, &b"{\"keep\":1}\n"[..]), "{err}");
    assert!(err.ends_with("exported 1 records of 1 quarantined chunk(s) of stream \"live\"\n"), "{err}");

    // The export changed nothing: still three chunks in quarantine, nothing else.
    assert_eq!(spool.stats().quarantined_chunks, 3);
    assert_eq!(spool.reader().expect("reader").quarantined().expect("list").len(), 3);
}

#[test]
fn nothing_in_quarantine_exports_nothing_and_a_missing_spool_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    append(&mut spool, vec![batch("a", &[b"{}"])], 1);
    drop(spool);
    let (code, out, err) = export(&path, &[]);
    assert_eq!((code, out.len()), (0, 0), "{err}");
    assert!(err.contains("exported 0 records of 0 quarantined chunk(s)"), "{err}");

    let missing = dir.path().join("nope/spool.db");
    let (code, _, err) = export(&missing, &[]);
    assert_eq!(code, 78, "{err}");
    assert!(err.contains("does not exist") && err.contains(&missing.display().to_string()), "{err}");
    assert!(!dir.path().join("nope").exists(), "nothing was created");
}

#[test]
fn push_framed_reads_the_whole_input_before_it_sends_anything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("records.bin");
    // Two whole records, then a third cut short.
    let mut data = Vec::new();
    encode_record(&mut data, b"one");
    encode_record(&mut data, b"two");
    encode_record(&mut data, b"three");
    data.truncate(data.len() - 2);
    std::fs::write(&input, &data).expect("input");
    // No agent listens there: an input that is refused before anything is sent never finds out.
    let socket = dir.path().join("no-agent.sock");
    let push = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(["push", "--framed", "--stream", "s", "--socket"])
            .arg(&socket)
            .args(extra)
            .arg(&input)
            .output()
            .expect("run edge-uploader");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = push(&[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("the input is not length-prefixed records: record 3 is cut short"), "{err}");
    assert!(!err.contains("no-agent.sock"), "nothing was sent: {err}");

    // Skipping more records than the input holds is refused, before anything is sent.
    data.truncate(0);
    encode_record(&mut data, b"one");
    std::fs::write(&input, &data).expect("input");
    let (code, err) = push(&["--skip", "2"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--skip 2: the input holds 1 records") && !err.contains("no-agent.sock"), "{err}");
}

/// The spool commands read the spool's path from the config, and nothing of the TLS files they
/// do not connect with: a config whose certificate is not there (a gateway not enrolled yet)
/// still names the spool. Without a certificate the printed lookup leaves the device id to fill.
#[test]
fn the_spool_commands_need_the_config_but_not_its_tls_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    append(&mut spool, vec![batch("a", &[b"{}"])], 1);
    drop(spool);
    let tls = dir.path().join("not-enrolled");
    let config = dir.path().join("edge-uploader.toml");
    std::fs::write(
        &config,
        format!(
            "[spool]\npath = {path:?}\n[upload]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
            tls.join("ca.pem"),
            tls.join("device.pem"),
            tls.join("device.key")
        ),
    )
    .expect("write config");
    for args in [&["spool", "export-quarantined"][..], &["spool", "check"]] {
        let out = Command::new(BIN).args(args).arg("--config").arg(&config).output().expect("run edge-uploader");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    }
    // check-config, which vouches for `run`, does ask for them, naming the one missing.
    let out = Command::new(BIN).args(["check-config", "--config"]).arg(&config).output().expect("run edge-uploader");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(err.contains("upload.ca: file") && err.contains("does not exist"), "{err}");
}

/// `push` and `status` with a config named by `--config` that is not there, or does not parse,
/// exit 78 naming it: they must not ask the packaged agent's socket about another agent.
#[test]
fn push_and_status_refuse_a_named_config_they_cannot_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.toml");
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[intake\nsocket = 1\n").expect("write config");
    for config in [&missing, &broken] {
        for args in [&["status"][..], &["push", "--stream", "s", "/dev/null"]] {
            let out = Command::new(BIN).args(args).arg("--config").arg(config).output().expect("run edge-uploader");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(78), "{args:?} {}: {err}", config.display());
            assert!(err.contains(&config.display().to_string()), "names the file: {err}");
        }
    }
}

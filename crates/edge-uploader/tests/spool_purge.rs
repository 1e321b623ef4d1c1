//! `edge-uploader spool purge-quarantined` against a real spool file: refused (exit 1, nothing
//! deleted) while another process has the spool open, then deletes exactly the quarantined
//! chunks, lists them, and leaves every other chunk as it was.

use std::path::Path;
use std::process::Command;

use edge_spool::{AppendRequest, Batch, Spool, SpoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_edge-uploader");

fn purge(spool: &Path, json: bool) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["spool", "purge-quarantined", "--spool"]).arg(spool);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run edge-uploader");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn append(spool: &mut Spool, stream: &str, record: &[u8], now: u64) {
    let req = AppendRequest { batches: vec![Batch { stream: stream.into(), data: record.to_vec(), records: 1 }] };
    spool.append(&[req], now).expect("append");
    spool.seal_all(now).expect("seal");
}

#[test]
fn purge_is_refused_while_the_spool_is_open_then_deletes_only_the_quarantined_chunks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    append(&mut spool, "bad", &[7; 4096], 1);
    append(&mut spool, "good", b"keep me", 2);
    append(&mut spool, "bad", &[8; 4096], 3);
    let sealed = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list");
    let bad: Vec<_> = sealed.iter().filter(|m| m.stream == "bad").map(|m| m.id).collect();
    assert_eq!(bad.len(), 2);
    for id in &bad {
        spool.quarantine(*id, "rejected by the server: test").expect("quarantine");
    }

    // This process holds the spool, as the agent would: refused, nothing deleted.
    let (code, out, err) = purge(&path, false);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains(&format!("in use by process {}", std::process::id())), "{err}");
    assert_eq!(spool.stats().quarantined_chunks, 2);
    drop(spool);

    let (code, out, err) = purge(&path, true);
    assert_eq!(code, 0, "{out}{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(doc["purged"], 2, "{doc}");
    let ids: Vec<_> = doc["chunks"].as_array().expect("chunks").iter().map(|c| c["id"].as_i64()).collect();
    assert_eq!(ids, bad.iter().map(|id| Some(id.0)).collect::<Vec<_>>(), "{doc}");
    assert_eq!(doc["chunks"][0]["reason"], "rejected by the server: test", "{doc}");
    assert_eq!(doc["chunks"][0]["bytes"], 4096, "{doc}");

    let (spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("reopen");
    let stats = spool.stats();
    assert_eq!(stats.quarantined_chunks, 0);
    let left = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list");
    assert_eq!(left.iter().map(|m| m.stream.as_str()).collect::<Vec<_>>(), vec!["good"]);
    assert!(spool.reader().expect("reader").quarantined().expect("list").is_empty());
    drop(spool);

    // Again: nothing left to purge is not an error.
    let (code, out, err) = purge(&path, false);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("purged 0 quarantined chunk(s)"), "{out}");
}

#[test]
fn purge_of_a_spool_that_does_not_exist_is_a_usage_error_and_creates_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nope/spool.db");
    let (code, out, err) = purge(&path, false);
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.contains("does not exist") && err.contains(&path.display().to_string()), "{err}");
    assert!(!dir.path().join("nope").exists(), "nothing was created");
}

#[test]
fn purge_as_another_user_than_the_spools_owner_is_refused_and_deletes_nothing() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    append(&mut spool, "bad", b"x", 1);
    let id = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list")[0].id;
    spool.quarantine(id, "test").expect("quarantine");
    drop(spool);
    let me = std::fs::metadata(&path).expect("spool").uid();
    // Give the file to another owner: only root may (CI runs as root; elsewhere this says so).
    if std::os::unix::fs::chown(&path, Some(me.wrapping_add(4242)), None).is_err() {
        eprintln!("skipped: cannot chown the spool file (not root)");
        return;
    }
    let (code, out, err) = purge(&path, false);
    assert_eq!(code, 78, "{out}{err}");
    assert!(err.contains(&format!("belongs to uid {}", me.wrapping_add(4242))) && err.contains("sudo -u"), "{err}");
    std::os::unix::fs::chown(&path, Some(me), None).expect("chown back");
    let (spool, _) = Spool::open(SpoolOptions::new(path)).expect("reopen");
    assert_eq!(spool.stats().quarantined_chunks, 1, "nothing was purged");
}

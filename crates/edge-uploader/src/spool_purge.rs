//! `edge-uploader spool purge-quarantined`: deletes the chunks held in quarantine.
//!
//! A chunk is quarantined when its bytes fail their checksum or the ingest server rejected it;
//! it is never sent again, and is kept (with its reason) so that an operator can look at it,
//! for as long as the spool file lives: `status` shows it as a note and the
//! `edge_uploader_spool_quarantined_chunks` gauge counts it. Once looked at, this command
//! deletes them and gives their space back. It writes the spool, so it needs the agent stopped:
//! while the agent runs, the spool's lock refuses it and nothing is changed. It runs as the
//! spool file's owner only (the agent's user), so that what it creates the agent can write.
//!
//! Exit codes: 0 done (also when there was nothing to purge), 1 the spool could not be opened
//! or written (the agent is running, say), 78 usage or configuration error (a missing file,
//! another user than the spool's owner).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use edge_spool::{QuarantinedChunk, Spool, SpoolOptions};
use serde_json::json;

/// Exit code when the spool could not be opened or written.
pub const EXIT_FAILED: u8 = 1;

/// What a purge deleted.
#[derive(Debug)]
pub struct Purged {
    /// The chunks, as listed just before they were deleted.
    pub chunks: Vec<QuarantinedChunk>,
    /// Bytes the spool's files took on disk before and after.
    pub disk_bytes: (u64, u64),
}

/// Resolves the spool ([`crate::spool_check::existing_spool`]), purges, prints what was
/// deleted and returns the exit code.
pub fn run(config: Option<&Path>, spool: Option<PathBuf>, json: bool) -> u8 {
    let opts = match crate::spool_check::existing_spool(config, spool) {
        Ok(opts) => opts,
        Err(code) => return code,
    };
    if let Err(why) = same_owner(&opts.path) {
        eprintln!("edge-uploader: {why}");
        return crate::spool_check::config_exit();
    }
    let path = opts.path.clone();
    match purge(opts) {
        Ok(p) => {
            if json {
                println!("{}", to_json(&path, &p));
            } else {
                print!("{}", render(&path, &p));
            }
            0
        }
        Err(e) => {
            eprintln!("edge-uploader: {}", edge_telemetry::logging::error_chain(e.as_ref()));
            EXIT_FAILED
        }
    }
}

/// The purge may create files beside the spool (the disk reserve, a segment, SQLite's WAL); made
/// by another user (root, say) they would be files the agent, running as the spool's owner,
/// cannot open, and it would stop at its next start. So it runs as the spool file's owner only.
fn same_owner(db: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let owner = std::fs::metadata(db).map_err(|e| format!("cannot read {}: {e}", db.display()))?.uid();
    let me = rustix::process::geteuid().as_raw();
    if owner == me {
        return Ok(());
    }
    Err(format!(
        "{} belongs to uid {owner} and this runs as uid {me}: run it as the spool's owner, as the agent runs \
         (e.g. `sudo -u edge-uploader edge-uploader spool purge-quarantined`), so that the files it creates are \
         ones the agent can write",
        db.display()
    ))
}

/// Opens the spool (taking its lock), lists the quarantined chunks and deletes them in one
/// transaction.
///
/// # Errors
/// When the spool cannot be opened (another process has it open: the agent) or written. Then
/// nothing was deleted.
pub fn purge(opts: SpoolOptions) -> anyhow::Result<Purged> {
    let path = opts.path.clone();
    let before = edge_spool::disk_usage(&path).unwrap_or(0);
    let (mut spool, _) = Spool::open(opts).with_context(|| format!("opening spool {}", path.display()))?;
    let chunks = spool
        .reader()
        .and_then(|mut r| r.quarantined())
        .with_context(|| format!("listing the quarantined chunks of {}", path.display()))?;
    let n =
        spool.purge_quarantined().with_context(|| format!("purging the quarantined chunks of {}", path.display()))?;
    anyhow::ensure!(
        n == chunks.len() as u64,
        "{} held {} quarantined chunks when listed and {n} when purged",
        path.display(),
        chunks.len()
    );
    drop(spool);
    let after = edge_spool::disk_usage(&path).unwrap_or(0);
    Ok(Purged { chunks, disk_bytes: (before, after) })
}

fn render(path: &Path, p: &Purged) -> String {
    let mut out = String::new();
    for q in &p.chunks {
        let m = &q.meta;
        let _ = writeln!(
            out,
            "purged chunk {} (stream {}, seq {}, {} records, {} bytes): {}",
            m.id.0, m.stream, m.seq, m.records, m.bytes, q.reason
        );
    }
    let _ = writeln!(
        out,
        "{}: purged {} quarantined chunk(s); the spool's files took {} bytes on disk, now {}",
        path.display(),
        p.chunks.len(),
        p.disk_bytes.0,
        p.disk_bytes.1
    );
    out
}

fn to_json(path: &Path, p: &Purged) -> serde_json::Value {
    let chunks: Vec<_> = p
        .chunks
        .iter()
        .map(|q| {
            let m = &q.meta;
            json!({"id": m.id.0, "stream": m.stream, "seq": m.seq, "records": m.records, "bytes": m.bytes, "reason": q.reason})
        })
        .collect();
    json!({"version": 1, "path": path, "purged": chunks.len(), "chunks": chunks,
        "disk_bytes_before": p.disk_bytes.0, "disk_bytes_after": p.disk_bytes.1})
}

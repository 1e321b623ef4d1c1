//! This machine's identity (`spool.machine_id_file`, by default `/etc/machine-id`), which the
//! spool compares with the machine its file was last opened on: a copy of the file on another
//! machine (a cloned disk image) takes a new spool id, so that its records cannot collide with
//! the original's at the ingest (`edge_spool::HostCheck`).

use std::io::Read;
use std::path::Path;

/// The longest identity taken (a machine id is 32 hex characters).
pub const MAX_BYTES: usize = 255;

/// Reads the identity in `path`, or says why there is none to compare: a missing or
/// unreadable file, an empty one or systemd's `uninitialized` (an image before its first
/// boot), or contents that are not one short line of text.
pub fn read(path: &Path) -> Result<String, String> {
    let mut raw = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_BYTES as u64 + 2).read_to_end(&mut raw))
        .map_err(|e| format!("{} cannot be read: {e}", path.display()))?;
    let text = std::str::from_utf8(&raw).map_err(|_| format!("{} is not text", path.display()))?;
    let id = text.trim();
    if id.is_empty() || id == "uninitialized" {
        return Err(format!("{} holds no machine id yet ({:?}: an image before its first boot)", path.display(), id));
    }
    if id.len() > MAX_BYTES {
        return Err(format!("{} holds more than {MAX_BYTES} bytes, not a machine id", path.display()));
    }
    if id.chars().any(char::is_control) {
        return Err(format!("{} holds more than one line, not a machine id", path.display()));
    }
    Ok(id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_id_is_read_trimmed_and_anything_else_says_why_not() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("machine-id");
        let with = |text: &[u8]| {
            std::fs::write(&file, text).expect("write");
            read(&file)
        };
        assert_eq!(with(b"0123456789abcdef0123456789abcdef\n"), Ok("0123456789abcdef0123456789abcdef".to_owned()));
        for (text, why) in [
            (&b""[..], "no machine id yet"),
            (b"uninitialized\n", "no machine id yet"),
            (b"a\nb\n", "more than one line"),
            (b"\xff\xfe", "not text"),
            (&[b'a'; 300][..], "more than 255 bytes"),
        ] {
            let got = with(text);
            assert!(got.as_ref().is_err_and(|e| e.contains(why) && e.contains("machine-id")), "{text:?}: {got:?}");
        }
        let missing = read(&dir.path().join("nowhere"));
        assert!(missing.as_ref().is_err_and(|e| e.contains("nowhere") && e.contains("cannot be read")), "{missing:?}");
    }
}

//! Process accounting from `/proc` (CPU seconds, peak RSS, bytes written to storage), free
//! ports, and small statistics helpers.
//!
//! Everything is read from `/proc/<pid>/...` rather than `getrusage`, because the parties of a
//! case are long-lived child processes measured while they run, and reading `/proc` needs no
//! `unsafe`.

use std::path::Path;

use anyhow::{Context, bail};

/// Kernel clock ticks per second for `utime`/`stime` in `/proc/<pid>/stat`. Linux reports these
/// in `USER_HZ`, which is 100 on every architecture the project targets (`getconf CLK_TCK`).
const CLK_TCK: f64 = 100.0;

/// User + system CPU seconds of a process (all its threads), so far.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name is in parentheses and may contain spaces; fields are counted after it.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).context("malformed /proc/<pid>/stat")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After ")": field 3 (state) is index 0, so utime (14) is index 11 and stime (15) index 12.
    let utime: f64 = fields.get(11).context("no utime")?.parse()?;
    let stime: f64 = fields.get(12).context("no stime")?.parse()?;
    Ok((utime + stime) / CLK_TCK)
}

/// CPU seconds of this process.
pub fn self_cpu_seconds() -> anyhow::Result<f64> {
    cpu_seconds(std::process::id())
}

/// Peak resident set size (`VmHWM`) in bytes.
pub fn peak_rss_bytes(pid: u32) -> anyhow::Result<u64> {
    status_kib(pid, "VmHWM:").map(|k| k * 1024)
}

/// Resident set size now (`VmRSS`) in bytes.
pub fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    status_kib(pid, "VmRSS:").map(|k| k * 1024)
}

fn status_kib(pid: u32, key: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    for line in status.lines() {
        if let Some(rest) = line.strip_prefix(key) {
            let kib = rest.trim().trim_end_matches("kB").trim();
            return kib.parse().with_context(|| format!("parsing {key} {kib:?}"));
        }
    }
    bail!("{key} not found in /proc/{pid}/status")
}

/// Bytes the process caused to be sent to the storage layer (`write_bytes` of `/proc/<pid>/io`).
pub fn write_bytes(pid: u32) -> anyhow::Result<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).with_context(|| format!("reading /proc/{pid}/io"))?;
    for line in io.lines() {
        if let Some(v) = line.strip_prefix("write_bytes:") {
            return v.trim().parse().context("parsing write_bytes");
        }
    }
    bail!("write_bytes not found in /proc/{pid}/io")
}

/// Bytes written to the block device holding `path`, since boot (sectors written in
/// `/sys/dev/block/<major>:<minor>/stat`, times 512): what reached the disk, from every process.
/// `write_bytes` of `/proc/<pid>/io` counts a whole page-cache folio each time part of it is
/// dirtied, which overstates what a process that overwrites a file in small pieces writes.
pub fn device_write_bytes(path: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?.dev();
    // The Linux encoding of a dev_t (glibc's gnu_dev_major / gnu_dev_minor).
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let stat_path = format!("/sys/dev/block/{major}:{minor}/stat");
    let stat = std::fs::read_to_string(&stat_path).with_context(|| format!("reading {stat_path}"))?;
    let sectors: u64 = stat
        .split_whitespace()
        .nth(6)
        .with_context(|| format!("{stat_path}: no sectors-written field"))?
        .parse()
        .with_context(|| format!("{stat_path}: sectors written"))?;
    Ok(sectors * 512)
}

/// Free ports on 127.0.0.1 for the daemons and peers, below the kernel's ephemeral range (the
/// test kit's, see there).
pub use edge_testkit::{free_tcp_port, free_udp_port};

/// Median and spread of repeated measurements.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    /// `None` when there is no sample.
    pub fn of(samples: &[f64]) -> Option<Stat> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Stat { median, min: v[0], max: v[n - 1], n })
    }

    /// `median [min-max]` with `prec` decimals.
    pub fn show(&self, prec: usize) -> String {
        if self.n == 1 {
            format!("{:.prec$}", self.median)
        } else {
            format!("{:.prec$} [{:.prec$}-{:.prec$}]", self.median, self.min, self.max)
        }
    }
}

/// Fails with a clear message unless `bin` exists and is newer than every source file of the
/// crates it is built from (the bench measures the release binaries as they are on disk).
pub fn check_fresh(bin: &Path, sources: &[&Path]) -> anyhow::Result<()> {
    let meta = std::fs::metadata(bin)
        .with_context(|| format!("{} does not exist: run `cargo build --release --workspace` first", bin.display()))?;
    let built = meta.modified()?;
    let mut newest: Option<(std::time::SystemTime, std::path::PathBuf)> = None;
    for dir in sources {
        walk(dir, &mut |p, t| {
            if newest.as_ref().is_none_or(|(n, _)| t > *n) {
                newest = Some((t, p.to_path_buf()));
            }
        })?;
    }
    if let Some((t, p)) = newest
        && t > built
    {
        bail!(
            "{} is older than {}: run `cargo build --release --workspace` first (or pass --allow-stale)",
            bin.display(),
            p.display()
        );
    }
    Ok(())
}

fn walk(dir: &Path, f: &mut dyn FnMut(&Path, std::time::SystemTime)) -> anyhow::Result<()> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(_) => return Ok(()),
    };
    if meta.is_file() {
        f(dir, meta.modified()?);
        return Ok(());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let p = entry.path();
        let ft = entry.file_type()?;
        if ft.is_dir() {
            walk(&p, f)?;
        } else if p.extension().is_some_and(|e| e == "rs" || e == "toml") {
            f(&p, entry.metadata()?.modified()?);
        }
    }
    Ok(())
}

/// virtio's device id of the memory balloon, and the balloon's feature bit for free page
/// reporting.
const VIRTIO_ID_BALLOON: u32 = 5;
const VIRTIO_BALLOON_F_REPORTING: usize = 5;

/// Whether this machine is a virtual machine whose memory balloon reports the guest's free
/// memory to its host (virtio-balloon free page reporting), read from `root`
/// (`/sys/bus/virtio/devices`); `None` when no balloon device is there. Memory the guest has
/// left free for a moment goes back to the host, and the first write to it afterwards costs a
/// fault in the host: the daemons pay it whenever their page cache or heap grows into new
/// memory (BENCHMARKS.md, "Done and tried since the `a54f6d1` run", 32), a cost a gateway on
/// bare metal does not have.
pub fn balloon_free_page_reporting(root: &Path) -> Option<bool> {
    let devices = std::fs::read_dir(root).ok()?;
    devices.filter_map(Result::ok).find_map(|d| {
        let id = std::fs::read_to_string(d.path().join("device")).ok()?;
        let id = u32::from_str_radix(id.trim().trim_start_matches("0x"), 16).ok()?;
        if id != VIRTIO_ID_BALLOON {
            return None;
        }
        // One character per feature bit, bit 0 first.
        let bits = std::fs::read_to_string(d.path().join("features")).ok()?;
        Some(bits.trim().as_bytes().get(VIRTIO_BALLOON_F_REPORTING) == Some(&b'1'))
    })
}

/// The pid of a process whose command line (arguments joined by spaces) satisfies `pred`.
pub fn find_process(pred: impl Fn(&str) -> bool) -> Option<u32> {
    let entries = std::fs::read_dir("/proc").ok()?;
    entries.filter_map(Result::ok).find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        pred(&cmd).then_some(pid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_median_and_spread() {
        let s = Stat::of(&[3.0, 1.0, 2.0]).expect("samples");
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        let s = Stat::of(&[4.0, 1.0]).expect("samples");
        assert_eq!(s.median, 2.5);
        assert!(Stat::of(&[]).is_none());
    }

    /// A fake `/sys/bus/virtio/devices` with a block device and, if `balloon` is given, a
    /// balloon with those feature bits.
    fn virtio_devices(balloon: Option<&str>) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("tempdir");
        let dev = |name: &str, id: &str, features: &str| {
            let d = root.path().join(name);
            std::fs::create_dir(&d).expect("device dir");
            std::fs::write(d.join("device"), format!("{id}\n")).expect("device");
            std::fs::write(d.join("features"), format!("{features}\n")).expect("features");
        };
        // A block device with bit 5 set, which must not be taken for the balloon's.
        dev("virtio0", "0x0002", "0010011001100100");
        if let Some(features) = balloon {
            dev("virtio1", "0x0005", features);
        }
        root
    }

    #[test]
    fn balloon_free_page_reporting_reads_the_balloons_bit_five_only() {
        let on = virtio_devices(Some("0110010100000000"));
        assert_eq!(balloon_free_page_reporting(on.path()), Some(true));
        let off = virtio_devices(Some("0110100000000000"));
        assert_eq!(balloon_free_page_reporting(off.path()), Some(false));
        let short = virtio_devices(Some("011"));
        assert_eq!(balloon_free_page_reporting(short.path()), Some(false));
        let none = virtio_devices(None);
        assert_eq!(balloon_free_page_reporting(none.path()), None);
        assert_eq!(balloon_free_page_reporting(&none.path().join("missing")), None);
    }

    #[test]
    fn own_process_accounting_reads() {
        let pid = std::process::id();
        assert!(cpu_seconds(pid).expect("cpu") >= 0.0);
        assert!(peak_rss_bytes(pid).expect("rss") > 0);
        assert!(write_bytes(pid).is_ok());
    }
}

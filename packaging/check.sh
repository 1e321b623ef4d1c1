#!/usr/bin/env bash
# Packaging checks for edge-uploader and edge-ingest, run by .ci/run (as root, on Debian).
#
#   1. tools: installs what is missing (apt: systemd, dpkg-dev, binutils, passwd,
#      init-system-helpers, python3; promtool from Debian's prometheus package, unpacked, not
#      installed; cargo-deb with cargo install --debug).
#   2. alert rules: promtool check rules + promtool test rules; dashboard: valid JSON, only the
#      agreed metric names, every query parses as PromQL.
#   3. builds both binaries once (release) and both .deb packages with cargo deb --no-build.
#   4. package contents: binary, unit (no ExecStartPre=), default config, conffiles, maintainer
#      scripts, Depends (libc6, passwd, procps).
#   5. systemd-analyze verify on both units as packaged (binaries in place), with no diagnostics.
#   6. installs both packages with dpkg --root into a scratch root (chrootless scripts): the
#      postinst creates the accounts and directories, the unit is enabled, the config is in /etc;
#      check-config refuses the fresh config (no TLS files yet, exit 78), then accepts it, run as
#      the service account inside the scratch root, once test certificates from
#      `edge-ingest pki` are in place, each key <name>:root 0400: readable by its service account,
#      not by another member of its group (the agent's producers); a reinstall keeps the accounts
#      and takes a group-readable device.key back to edge-uploader:root 0400; a purge removes the
#      state but keeps the accounts and the operator's TLS files.
#
# Idempotent: everything it makes lives in target/packaging/ and a scratch root under /tmp that
# is removed on exit. Any failed check stops it with "PACKAGING CHECK FAILED: ...".
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=$REPO/target/packaging
PKGS=(edge-uploader edge-ingest)
export CARGO_TERM_COLOR=never

step() { printf '\n--- packaging: %s\n' "$*"; }
ok() { printf '  ok: %s\n' "$*"; }
die() {
    printf '\nPACKAGING CHECK FAILED: %s\n' "$*" >&2
    exit 1
}
trap 'die "command failed at packaging/check.sh line $LINENO: $BASH_COMMAND"' ERR

SCRATCH=""
cleanup() { if [ -n "$SCRATCH" ]; then rm -rf "$SCRATCH"; fi; }
trap cleanup EXIT

# ---------------------------------------------------------------------------------------------
step "tools"
[ "$(id -u)" = 0 ] || die "run as root (dpkg --root, chroot and file ownership need it)"
APT_UPDATED=""
apt_install() {
    if [ -z "$APT_UPDATED" ]; then
        apt-get update -q >/dev/null || die "apt-get update failed"
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null ||
        die "apt-get install $* failed"
}
need=()
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v dpkg-shlibdeps >/dev/null || need+=(dpkg-dev)
command -v objcopy >/dev/null || need+=(binutils)
command -v useradd >/dev/null || need+=(passwd)
command -v deb-systemd-helper >/dev/null || need+=(init-system-helpers)
command -v python3 >/dev/null || need+=(python3)
command -v setpriv >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    echo "  installing ${need[*]}"
    apt_install "${need[@]}"
fi

# promtool ships in Debian's prometheus package; take only the binary (no service, no account).
mkdir -p "$OUT/tools"
if command -v promtool >/dev/null; then
    PROMTOOL=$(command -v promtool)
else
    PROMTOOL=$OUT/tools/prometheus/usr/bin/promtool
    if [ ! -x "$PROMTOOL" ]; then
        echo "  fetching promtool (Debian package prometheus)"
        if [ -z "$APT_UPDATED" ]; then
            apt-get update -q >/dev/null || die "apt-get update failed"
            APT_UPDATED=1
        fi
        rm -rf "$OUT/tools/prometheus" "$OUT"/tools/prometheus_*.deb
        (cd "$OUT/tools" && apt-get download -q prometheus >/dev/null 2>&1) || die "apt-get download prometheus failed"
        dpkg-deb -x "$OUT"/tools/prometheus_*.deb "$OUT/tools/prometheus"
    fi
fi
version=$("$PROMTOOL" --version 2>&1) || die "$PROMTOOL does not run"
echo "  ${version%%$'\n'*}"

if ! cargo deb --version >/dev/null 2>&1; then
    echo "  installing cargo-deb"
    # --debug: an unoptimised cargo-deb builds in about a minute instead of seven on 2 cores,
    # and packaging two binaries is no work worth optimising.
    cargo install --locked --debug cargo-deb --version '^3.8' >/dev/null 2>&1 || die "cargo install cargo-deb failed"
fi
version=$(cargo deb --version 2>&1) || die "cargo deb does not run"
echo "  ${version%%$'\n'*}"
version=$(systemd-analyze --version)
echo "  ${version%%$'\n'*}"

# ---------------------------------------------------------------------------------------------
step "alert rules (packaging/prometheus)"
"$PROMTOOL" check rules packaging/prometheus/edge-uploader.rules.yml ||
    die "promtool check rules packaging/prometheus/edge-uploader.rules.yml"
(cd packaging/prometheus && "$PROMTOOL" test rules edge-uploader.rules.test.yml) ||
    die "promtool test rules packaging/prometheus/edge-uploader.rules.test.yml"
ok "promtool check rules and test rules pass"

step "dashboard (packaging/grafana)"
# Every query must use only the metrics the daemons export and parse as PromQL: the queries,
# with Grafana's variables replaced, go into a scratch rule file for promtool.
python3 - packaging/grafana/edge-uploader.json "$OUT/dashboard-queries.rules.yml" <<'PY' ||
import json, re, sys
AGENT = """intake_records_total intake_bytes_total spool_bytes spool_disk_bytes spool_chunks
spool_oldest_unacked_age_seconds upload_bytes_total upload_chunks_total
chunk_upload_latency_seconds_bucket end_to_end_latency_seconds_bucket chunks_in_flight connected
reconnects_total dropped_records_total intake_stream_buffer_bytes intake_request_buffer_bytes
spool_commit_seconds_bucket connections_superseded_total""".split()
INGEST = """connections chunks_total bytes_total persist_latency_seconds_bucket
auth_failures_total connections_superseded_total""".split()
known = {"edge_uploader_" + m for m in AGENT} | {"edge_ingest_" + m for m in INGEST}
dash = json.load(open(sys.argv[1]))
assert dash.get("uid") and dash.get("title"), "dashboard needs a uid and a title"
exprs, used = [], set()
def walk(panels):
    for p in panels:
        walk(p.get("panels", []))
        for t in p.get("targets", []):
            exprs.append((p["title"], t["expr"]))
walk(dash["panels"])
assert exprs, "no queries in the dashboard"
for title, expr in exprs:
    for name in re.findall(r"\bedge_(?:uploader|ingest)_[a-z_]+", expr):
        if name not in known:
            sys.exit(f"panel {title!r} uses {name}, which no daemon exports")
        used.add(name)
for var in dash["templating"]["list"]:
    q = var.get("definition", "")
    for name in re.findall(r"\bedge_(?:uploader|ingest)_[a-z_]+", q):
        if name not in known:
            sys.exit(f"variable {var['name']} uses {name}, which no daemon exports")
subst = {"$__rate_interval": "5m", "$__range": "1h", "$instance": ".*", "$ingest": ".*"}
with open(sys.argv[2], "w") as f:
    f.write("groups:\n  - name: dashboard-queries\n    rules:\n")
    for i, (title, expr) in enumerate(exprs):
        for k, v in subst.items():
            expr = expr.replace(k, v)
        assert "$" not in expr, f"unsubstituted variable in {title!r}: {expr}"
        f.write(f"      - record: dashboard:q{i}\n        expr: {json.dumps(expr)}\n")
missing = known - used
if missing:
    sys.exit(f"dashboard shows none of: {sorted(missing)}")
print(f"  {len(exprs)} queries over {len(used)} metrics")
PY
    die "packaging/grafana/edge-uploader.json: bad metric name or structure (see above)"
"$PROMTOOL" check rules "$OUT/dashboard-queries.rules.yml" >/dev/null ||
    die "a dashboard query is not valid PromQL: $PROMTOOL check rules $OUT/dashboard-queries.rules.yml"
ok "dashboard JSON valid, metric names known, every query parses"

# ---------------------------------------------------------------------------------------------
step "build (release) and .deb packages"
cargo build --release --locked -p edge-uploader -p edge-ingest || die "cargo build --release failed"
rm -rf "$OUT/deb"
mkdir -p "$OUT/deb"
for p in "${PKGS[@]}"; do
    cargo deb -p "$p" --no-build --locked --output "$OUT/deb/" >"$OUT/cargo-deb-$p.log" 2>&1 ||
        { cat "$OUT/cargo-deb-$p.log"; die "cargo deb -p $p failed"; }
    if grep -i "warning" "$OUT/cargo-deb-$p.log"; then
        die "cargo deb -p $p printed warnings (above)"
    fi
done
declare -A DEB
for p in "${PKGS[@]}"; do
    DEB[$p]=$(ls "$OUT"/deb/"$p"_*.deb)
    ok "built ${DEB[$p]#"$REPO"/} ($(($(stat -c %s "${DEB[$p]}") / 1048576)) MiB)"
done

# ---------------------------------------------------------------------------------------------
step "package contents"
for p in "${PKGS[@]}"; do
    deb=${DEB[$p]}
    ctrl=$OUT/control-$p
    rm -rf "$ctrl"
    dpkg-deb -e "$deb" "$ctrl"
    info=$(dpkg-deb -I "$deb")
    contents=$(dpkg-deb -c "$deb")
    grep -q "^ Package: $p$" <<<"$info" || die "$p: wrong Package field"
    depends=$(dpkg-deb -f "$deb" Depends)
    # procps: /bin/kill, which the units' ExecReload= runs.
    for d in libc6 passwd procps; do
        grep -qw "$d" <<<"$depends" || die "$p: Depends ($depends) lacks $d"
    done
    own='(root/root|0/0)'
    grep -qE "^-rwxr-xr-x $own .* \./usr/bin/$p$" <<<"$contents" || die "$p: /usr/bin/$p missing or not 0755 root"
    grep -qE "^-rw-r--r-- $own .* \./usr/lib/systemd/system/$p\.service$" <<<"$contents" ||
        die "$p: /usr/lib/systemd/system/$p.service missing"
    grep -qE "^-rw-r--r-- $own .* \./etc/$p/$p\.toml$" <<<"$contents" || die "$p: /etc/$p/$p.toml missing"
    grep -qx "/etc/$p/$p.toml" "$ctrl/conffiles" || die "$p: /etc/$p/$p.toml is not listed in conffiles"
    for s in postinst postrm prerm; do
        [ -x "$ctrl/$s" ] || die "$p: maintainer script $s missing"
        ! grep -q '#DEBHELPER#' "$ctrl/$s" || die "$p: #DEBHELPER# left unreplaced in $s"
        sh -n "$ctrl/$s" || die "$p: $s is not valid sh"
    done
    grep -q "deb-systemd-helper enable $p.service" "$ctrl/postinst" || die "$p: postinst does not enable the unit"
    grep -q "useradd --system" "$ctrl/postinst" || die "$p: postinst does not create the account"
    # Shipped files are the repository's.
    x=$OUT/extract-$p
    rm -rf "$x"
    dpkg-deb -x "$deb" "$x"
    cmp -s "$x/usr/lib/systemd/system/$p.service" "systemd/$p.service" || die "$p: packaged unit differs from systemd/$p.service"
    # RestartPreventExitStatus=78 applies to the main process only: a check-config in
    # ExecStartPre= that exits 78 would be restarted forever. `run` makes the same checks.
    ! grep -q '^[[:space:]]*ExecStartPre=' "systemd/$p.service" ||
        die "$p: systemd/$p.service has an ExecStartPre= (its exit 78 would not stop the restarts)"
    grep -q '^RestartPreventExitStatus=78$' "systemd/$p.service" || die "$p: systemd/$p.service lacks RestartPreventExitStatus=78"
    cmp -s "$x/etc/$p/$p.toml" "config/$p.toml" || die "$p: packaged config differs from config/$p.toml"
    "$x/usr/bin/$p" --version >/dev/null || die "$p: packaged binary does not run"
    sections=$(readelf -S "$x/usr/bin/$p")
    ! grep -qE '\.debug_(info|line)' <<<"$sections" || die "$p: /usr/bin/$p still carries debug sections"
    ls "$OUT"/deb/"$p"-dbgsym_*.ddeb >/dev/null 2>&1 || die "$p: no $p-dbgsym package with the debug symbols"
    ok "$p: $(dpkg-deb -f "$deb" Version), Depends: $depends"
    ok "$p: /usr/bin/$p (0755, stripped, $(($(stat -c %s "$x/usr/bin/$p") / 1048576)) MiB; symbols in $p-dbgsym), /usr/lib/systemd/system/$p.service, conffile /etc/$p/$p.toml, postinst/prerm/postrm with deb-systemd-helper"
done

# ---------------------------------------------------------------------------------------------
step "systemd-analyze verify (units as packaged)"
SCRATCH=$(mktemp -d /tmp/edge-packaging.XXXXXX)
chmod 0755 "$SCRATCH"
VROOT=$SCRATCH/verify
mkdir -p "$VROOT/usr/lib/systemd"
# The targets the units name (multi-user.target, network-online.target...) come from the host;
# the units and the binaries they start come from the packages.
cp -a /usr/lib/systemd/system "$VROOT/usr/lib/systemd/"
for p in "${PKGS[@]}"; do dpkg-deb -x "${DEB[$p]}" "$VROOT"; done
for p in "${PKGS[@]}"; do
    # verify exits 0 on an unknown key or an unparsable value ("..., ignoring"): any output fails.
    if ! diag=$(cd / && systemd-analyze verify --root="$VROOT" "$p.service" 2>&1) || [ -n "$diag" ]; then
        printf '%s\n' "$diag" >&2
        die "systemd-analyze verify $p.service"
    fi
    ok "systemd-analyze verify $p.service: no diagnostics"
done

# ---------------------------------------------------------------------------------------------
step "install into a scratch root (dpkg --root, chrootless maintainer scripts)"
R=$SCRATCH/root
mkdir -p "$R/etc" "$R/var/lib/dpkg/info" "$R/var/lib/dpkg/updates" "$R/var/lib/dpkg/triggers" "$R/var/log" "$R/usr/sbin"
touch "$R/var/lib/dpkg/status" "$R/var/lib/dpkg/available"
# A minimal system: root's account, and a policy that starts no service.
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$R/etc/passwd"
printf 'root:x:0:\n' >"$R/etc/group"
printf 'root:*:19000:0:99999:7:::\n' >"$R/etc/shadow"
printf 'root:*::\n' >"$R/etc/gshadow"
chmod 0640 "$R/etc/shadow" "$R/etc/gshadow"
printf '#!/bin/sh\nexit 101\n' >"$R/usr/sbin/policy-rc.d"
chmod 0755 "$R/usr/sbin/policy-rc.d"
DPKG=(dpkg --root="$R" --force-script-chrootless --force-depends --force-unsafe-io --log="$SCRATCH/dpkg.log")
"${DPKG[@]}" -i "${DEB[edge-uploader]}" "${DEB[edge-ingest]}" >"$SCRATCH/dpkg-install.out" 2>&1 ||
    { cat "$SCRATCH/dpkg-install.out"; die "dpkg --root -i failed"; }
sed 's/^/  | /' "$SCRATCH/dpkg-install.out" | grep -E '^  \| edge-(uploader|ingest): ' || true

declare -A UID_OF GID_OF
for p in "${PKGS[@]}"; do
    status=$(dpkg-query --root="$R" -W -f='${Status}' "$p")
    [ "$status" = "install ok installed" ] || die "$p: dpkg status is '$status'"
    pw=$(grep "^$p:" "$R/etc/passwd") || die "$p: postinst did not create the user $p"
    gr=$(grep "^$p:" "$R/etc/group") || die "$p: postinst did not create the group $p"
    IFS=: read -r _ _ uid gid _ home shell <<<"$pw"
    [ "$gid" = "$(cut -d: -f3 <<<"$gr")" ] || die "$p: user's primary group is not $p"
    [ "$uid" -lt 1000 ] || die "$p: uid $uid is not a system uid"
    [ "$home" = "/var/lib/$p" ] && [ "$shell" = /usr/sbin/nologin ] || die "$p: home $home / shell $shell"
    UID_OF[$p]=$uid
    GID_OF[$p]=$gid
    [ "$(stat -c '%u:%g %a' "$R/var/lib/$p")" = "$uid:$gid 700" ] ||
        die "$p: /var/lib/$p is $(stat -c '%u:%g %a' "$R/var/lib/$p"), want $uid:$gid 700"
    [ "$(stat -c '%u:%g %a' "$R/etc/$p/tls")" = "0:$gid 750" ] || die "$p: /etc/$p/tls ownership or mode"
    [ -f "$R/usr/lib/systemd/system/$p.service" ] || die "$p: unit not installed"
    [ "$(readlink "$R/etc/systemd/system/multi-user.target.wants/$p.service")" = "/usr/lib/systemd/system/$p.service" ] ||
        die "$p: unit not enabled (no multi-user.target.wants symlink)"
    [ -f "$R/etc/$p/$p.toml" ] || die "$p: config not installed"
    grep -qx "/etc/$p/$p.toml [0-9a-f]*" <(dpkg-query --root="$R" -W -f='${Conffiles}\n' "$p" | sed 's/^ //') ||
        die "$p: dpkg does not record /etc/$p/$p.toml as a conffile"
    ok "$p: user $p (uid $uid, group $gid, home /var/lib/$p, nologin), /var/lib/$p $uid:$gid 0700, /etc/$p/tls root:$p 0750"
    ok "$p: unit installed and enabled (multi-user.target.wants), conffile /etc/$p/$p.toml"
done

# check-config runs inside the scratch root as the service account, loading the config as the
# unit's ExecReload= and `run` would: its absolute paths (/etc/<name>/tls/...) then resolve
# there. The binaries' libraries are copied in so they run under chroot.
for lib in $(ldd "$R/usr/bin/edge-uploader" "$R/usr/bin/edge-ingest" | grep -oE '/[^ ]+\.so[^ ]*' | sort -u); do
    cp -L --parents "$lib" "$R/"
done
check_config() { # package -> prints output, returns the exit code
    local p=$1
    chroot --userspec="${UID_OF[$p]}:${GID_OF[$p]}" "$R" "/usr/bin/$p" check-config --config "/etc/$p/$p.toml" 2>&1
}
for p in "${PKGS[@]}"; do
    rc=0
    out=$(check_config "$p") || rc=$?
    [ "$rc" = 78 ] || die "$p: check-config on the fresh install exited $rc, want 78 (no TLS files yet): $out"
    ok "$p: check-config refuses the fresh install (exit 78): ${out#*: }"
done

# The operator's step (README.md, packaging/README.md): certificates from `edge-ingest pki`,
# each key <name>:root 0400.
BIN=$REPO/target/release
"$BIN/edge-ingest" pki init --dir "$R/etc/edge-ingest/tls" --server-name localhost >/dev/null
"$BIN/edge-ingest" pki issue --dir "$R/etc/edge-ingest/tls" --device gw-0001 --out "$SCRATCH/gw-0001" >/dev/null
install -m 0644 -o 0 -g 0 "$SCRATCH/gw-0001/device.pem" "$SCRATCH/gw-0001/ca.pem" "$R/etc/edge-uploader/tls/"
install -m 0400 -o "${UID_OF[edge-uploader]}" -g 0 "$SCRATCH/gw-0001/device.key" "$R/etc/edge-uploader/tls/"
chown "${UID_OF[edge-ingest]}:0" "$R/etc/edge-ingest/tls/server.key"
chmod 0400 "$R/etc/edge-ingest/tls/server.key"
for p in "${PKGS[@]}"; do
    out=$(check_config "$p") || die "$p: check-config refused the installed config with test certificates: $out"
    ok "$p: as user $p in the scratch root: $out"
done
setpriv --reuid="${UID_OF[edge-uploader]}" --regid="${GID_OF[edge-uploader]}" --clear-groups \
    test -r "$R/etc/edge-uploader/tls/device.key" || die "edge-uploader cannot read its device key"
setpriv --reuid="${UID_OF[edge-ingest]}" --regid="${GID_OF[edge-ingest]}" --clear-groups \
    test -r "$R/etc/edge-ingest/tls/server.key" || die "edge-ingest cannot read its server key"
# A producer: another account in the group edge-uploader (for the intake socket) reaches the
# directory and the certificates but not the key. Likewise any other member of edge-ingest.
PRODUCER_UID=64999
for p in "${PKGS[@]}"; do
    case $p in edge-uploader) key=$R/etc/$p/tls/device.key ;; *) key=$R/etc/$p/tls/server.key ;; esac
    setpriv --reuid="$PRODUCER_UID" --regid="$PRODUCER_UID" --groups="${GID_OF[$p]}" \
        test -r "$R/etc/$p/tls/ca.pem" || die "a member of the group $p cannot read /etc/$p/tls/ca.pem (test setup)"
    ! setpriv --reuid="$PRODUCER_UID" --regid="$PRODUCER_UID" --groups="${GID_OF[$p]}" \
        test -r "$key" || die "another member of the group $p can read ${key#"$R"}"
done
ok "each service account can read its private key (<name>:root 0400); other members of its group cannot"

step "reinstall and purge (scratch root)"
"${DPKG[@]}" -i "${DEB[edge-uploader]}" >"$SCRATCH/dpkg-reinstall.out" 2>&1 ||
    { cat "$SCRATCH/dpkg-reinstall.out"; die "dpkg --root reinstall failed"; }
[ "$(grep -c '^edge-uploader:' "$R/etc/passwd")" = 1 ] || die "reinstall duplicated the account"
[ "$(stat -c '%u' "$R/var/lib/edge-uploader")" = "${UID_OF[edge-uploader]}" ] || die "reinstall changed /var/lib/edge-uploader"
[ "$(stat -c '%u:%g %a' "$R/etc/edge-uploader/tls/device.key")" = "${UID_OF[edge-uploader]}:0 400" ] ||
    die "reinstall changed device.key: $(stat -c '%u:%g %a' "$R/etc/edge-uploader/tls/device.key")"
ok "reinstall (postinst configure with the old version) keeps the account, the state and the key"
# A key in the layout earlier versions documented (root:edge-uploader 0640, readable by every
# producer) is taken to edge-uploader:root 0400 by the next configure.
chown "0:${GID_OF[edge-uploader]}" "$R/etc/edge-uploader/tls/device.key"
chmod 0640 "$R/etc/edge-uploader/tls/device.key"
"${DPKG[@]}" -i "${DEB[edge-uploader]}" >"$SCRATCH/dpkg-reinstall.out" 2>&1 ||
    { cat "$SCRATCH/dpkg-reinstall.out"; die "dpkg --root reinstall failed"; }
[ "$(stat -c '%u:%g %a' "$R/etc/edge-uploader/tls/device.key")" = "${UID_OF[edge-uploader]}:0 400" ] ||
    die "reinstall left a group-readable device.key at $(stat -c '%u:%g %a' "$R/etc/edge-uploader/tls/device.key")"
out=$(check_config edge-uploader) || die "edge-uploader: check-config refused the config after the key's migration: $out"
ok "reinstall takes a root:edge-uploader 0640 device.key to edge-uploader:root 0400"
touch "$R/var/lib/edge-uploader/spool.db"
"${DPKG[@]}" --purge edge-uploader >"$SCRATCH/dpkg-purge.out" 2>&1 ||
    { cat "$SCRATCH/dpkg-purge.out"; die "dpkg --root --purge failed"; }
[ ! -e "$R/var/lib/edge-uploader" ] || die "purge left /var/lib/edge-uploader"
[ ! -e "$R/usr/lib/systemd/system/edge-uploader.service" ] || die "purge left the unit"
[ ! -e "$R/etc/systemd/system/multi-user.target.wants/edge-uploader.service" ] || die "purge left the enable symlink"
[ ! -e "$R/etc/edge-uploader/edge-uploader.toml" ] || die "purge left the conffile"
[ -f "$R/etc/edge-uploader/tls/device.key" ] || die "purge removed the operator's TLS files"
grep -q '^edge-uploader:' "$R/etc/passwd" || die "purge removed the account"
ok "purge removes state, unit, enable link and conffile; keeps the account and the operator's TLS files"

step "all packaging checks passed"

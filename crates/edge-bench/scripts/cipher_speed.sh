#!/usr/bin/env bash
# The TLS 1.3 AEADs' speed on this CPU, with and without its AES instructions, as a stand-in
# for a gateway without them (edge-transport orders the cipher suites by whether the CPU has
# AES and carry-less multiply instructions). OpenSSL, not ring: ring has no switch to turn its
# use of AES-NI off, OpenSSL has OPENSSL_ia32cap. The "without" rows mask AES-NI (bit 57 of
# the first word) and PCLMULQDQ (bit 33) on x86; elsewhere they equal the "with" rows.
# Prints MB/s (10^6 bytes) per AEAD at 1,200-byte messages, about one QUIC packet.
#
#   crates/edge-bench/scripts/cipher_speed.sh [SECONDS]
set -euo pipefail
seconds=${1:-3}
command -v openssl >/dev/null || { echo "cipher_speed.sh: needs openssl" >&2; exit 2; }
echo "| AEAD | with AES instructions, MB/s | without, MB/s |"
echo "|---|---|---|"
for aead in aes-128-gcm aes-256-gcm chacha20-poly1305; do
    speed() {
        # The last line is "<name> <rate>k" in 1000s of bytes per second.
        env "$@" openssl speed -seconds "$seconds" -bytes 1200 -evp "$aead" 2>/dev/null |
            awk 'END { v = $NF; sub(/k$/, "", v); printf "%.0f", v / 1000 }'
    }
    with=$(speed X=1)
    without=$(speed OPENSSL_ia32cap='~0x200000200000000:~0x0')
    echo "| $aead | $with | $without |"
done

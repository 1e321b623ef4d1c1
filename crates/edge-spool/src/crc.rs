//! CRC-32C of a concatenation from the CRCs of its parts, without reading the bytes again.
//!
//! The reader checks every batch against its own CRC and also needs the CRC of the whole
//! payload for the wire. Hashing the payload a second time was a tenth of the reader's work in
//! a drain profile; `crc32c::crc32c_combine` avoids the pass but squares 32×32 GF(2) matrices
//! about log2(len) times per call, which cost more than the pass for 10 KiB batches. Here the
//! shift by `len` bytes is a product of precomputed powers x^(2^k) mod P, one per set bit of
//! the length: a few hundred shifts and XORs per batch.
//!
//! Polynomials are bit-reflected, as CRC-32C computes them: bit 31 holds x^0.

/// CRC-32C of `data` (with `crc-fast`, as `edge_proto::crc32c`; this crate does not depend on
/// the protocol's).
#[inline]
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// CRC-32C of `A ‖ data`, given `crc` = CRC-32C(A).
#[inline]
pub(crate) fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The register holds the CRC before its final inversion; a 32-bit CRC's upper half is zero.
    let mut digest = crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

/// The CRC-32C polynomial, reflected.
const POLY: u32 = 0x82F6_3B78;

/// a(x)·b(x) mod P.
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `X2N[k]` = x^(2^k) mod P.
const X2N: [u32; 32] = {
    let mut t = [0u32; 32];
    let mut p = 1u32 << 30; // x^1
    t[0] = p;
    let mut k = 1;
    while k < 32 {
        p = mul_mod_p(p, p);
        t[k] = p;
        k += 1;
    }
    t
};

/// x^(8·len) mod P: the shift of a CRC past `len` bytes.
fn x8n_mod_p(mut len: u64) -> u32 {
    let mut p = 1u32 << 31; // x^0
    // Bit j of `len` stands for x^(8·2^j) = x^(2^(j+3)): from the table up to k = 31 (lengths
    // below 512 MiB), squared on the fly beyond.
    let mut k = 3usize;
    let mut sq = X2N[3];
    while len != 0 {
        if len & 1 != 0 {
            p = mul_mod_p(sq, p);
        }
        len >>= 1;
        k += 1;
        sq = if k < 32 { X2N[k] } else { mul_mod_p(sq, sq) };
    }
    p
}

/// The CRC-32C of `A ‖ B` from `crc_a` = CRC-32C(A), `crc_b` = CRC-32C(B) and `len_b` = |B|.
pub(crate) fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    mul_mod_p(x8n_mod_p(len_b), crc_a) ^ crc_b
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn combining_two_parts_gives_the_crc_of_the_whole(data in proptest::collection::vec(any::<u8>(), 0..4096), cut in any::<prop::sample::Index>()) {
            let cut = cut.index(data.len() + 1);
            let (a, b) = data.split_at(cut);
            let whole = crc32c::crc32c(&data);
            prop_assert_eq!(combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64), whole);
        }

        #[test]
        fn agrees_with_the_crate_for_any_length(a in any::<u32>(), b in any::<u32>(), len in 0u64..(1 << 40)) {
            prop_assert_eq!(combine(a, b, len), crc32c::crc32c_combine(a, b, usize::try_from(len).unwrap_or(usize::MAX)));
        }
    }

    proptest! {
        #[test]
        fn crc_fast_agrees_with_the_crc32c_crate(data in proptest::collection::vec(any::<u8>(), 0..70_000), cut in any::<prop::sample::Index>()) {
            let whole = crc32c::crc32c(&data);
            prop_assert_eq!(super::crc32c(&data), whole);
            let (a, b) = data.split_at(cut.index(data.len() + 1));
            prop_assert_eq!(crc32c_append(super::crc32c(a), b), whole);
        }
    }

    #[test]
    fn many_parts_fold_into_the_payload_crc() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let mut crc = 0;
        for part in data.chunks(10_240) {
            crc = combine(crc, crc32c::crc32c(part), part.len() as u64);
        }
        assert_eq!(crc, crc32c::crc32c(&data));
    }
}

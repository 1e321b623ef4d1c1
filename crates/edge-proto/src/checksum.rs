//! CRC-32C (Castagnoli), the checksum of chunk payloads on the wire and of what both ends store.
//!
//! Computed with `crc-fast`, which folds 64 bytes at a time with carry-less multiplies where
//! the CPU has them (VPCLMULQDQ on x86-64, PMULL on AArch64) and picks the path at run time.

/// CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// CRC-32C of `A ‖ data`, given `crc` = CRC-32C(A): continues a checksum over more bytes.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The register holds the CRC before its final inversion.
    let mut digest = crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    // A 32-bit CRC: the upper half is zero.
    digest.finalize() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_check_value_of_the_catalogue() {
        // CRC-32/ISCSI's check value in the CRC catalogue (reveng).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c_append(0, b"123456789"), 0xe306_9283);
    }

    proptest! {
        #[test]
        fn agrees_with_the_crc32c_crate(data in proptest::collection::vec(any::<u8>(), 0..70_000), cut in any::<prop::sample::Index>()) {
            let whole = crc32c::crc32c(&data);
            prop_assert_eq!(super::crc32c(&data), whole);
            let (a, b) = data.split_at(cut.index(data.len() + 1));
            prop_assert_eq!(crc32c_append(super::crc32c(a), b), whole);
        }
    }
}

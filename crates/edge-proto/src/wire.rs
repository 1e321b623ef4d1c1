//! Little-endian primitives shared by the frame and chunk header codecs.
//!
//! [`Reader`] walks a complete, already length-checked body and turns every shortfall into
//! [`ProtoError::Truncated`] naming the field; nothing here allocates more than the bytes it was
//! given. The `put_*` functions append to a `Vec<u8>`. Strings are `len: u8` + UTF-8 bytes.

use crate::error::ProtoError;

/// A cursor over one frame or header body.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(crate) fn bytes(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtoError> {
        let Some((head, rest)) = self.buf.split_at_checked(n) else {
            return Err(ProtoError::Truncated { field });
        };
        self.buf = rest;
        Ok(head)
    }

    pub(crate) fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ProtoError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N, field)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A `len: u8` prefixed byte string of at most `max` bytes.
    pub(crate) fn short_bytes(&mut self, field: &'static str, max: usize) -> Result<&'a [u8], ProtoError> {
        let len = usize::from(self.u8(field)?);
        if len > max {
            return Err(ProtoError::StringTooLong { field, len, max });
        }
        self.bytes(len, field)
    }

    /// A `len: u8` prefixed UTF-8 string of at most `max` bytes.
    pub(crate) fn short_str(&mut self, field: &'static str, max: usize) -> Result<&'a str, ProtoError> {
        let bytes = self.short_bytes(field, max)?;
        std::str::from_utf8(bytes).map_err(|_| ProtoError::InvalidUtf8 { field })
    }

    /// Ends the body: every byte must have been read.
    pub(crate) fn finish(self, frame: &'static str) -> Result<(), ProtoError> {
        if self.buf.is_empty() { Ok(()) } else { Err(ProtoError::TrailingBytes { frame, extra: self.buf.len() }) }
    }
}

pub(crate) fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Writes `s` as `len: u8` + bytes, cut to at most `max` bytes (at most 255) on a char boundary.
pub(crate) fn put_short_str(out: &mut Vec<u8>, s: &str, max: usize) {
    let s = truncate_str(s, max.min(usize::from(u8::MAX)));
    // `truncate_str` returned at most 255 bytes.
    out.push(u8::try_from(s.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(s.as_bytes());
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
pub(crate) fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_names_the_field_it_ran_out_in() {
        let mut r = Reader::new(&[1, 0, 7]);
        assert_eq!(r.u16("version"), Ok(1));
        assert_eq!(r.u32("limit"), Err(ProtoError::Truncated { field: "limit" }));
    }

    #[test]
    fn reader_refuses_trailing_bytes() {
        let mut r = Reader::new(&[1, 2]);
        assert_eq!(r.u8("a"), Ok(1));
        assert_eq!(r.finish("Test"), Err(ProtoError::TrailingBytes { frame: "Test", extra: 1 }));
    }

    #[test]
    fn strings_are_cut_on_a_char_boundary() {
        assert_eq!(truncate_str("héllo", 2), "h");
        assert_eq!(truncate_str("héllo", 3), "hé");
        assert_eq!(truncate_str("abc", 10), "abc");
        let mut out = Vec::new();
        put_short_str(&mut out, &"é".repeat(200), 300);
        assert_eq!(out[0], 254);
        assert_eq!(out.len(), 255);
    }
}

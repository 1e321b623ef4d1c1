//! Validated stream names.
//!
//! A stream name is 1 to [`MAX_STREAM_NAME_LEN`] bytes of `[A-Za-z0-9_.-]`, and is neither `.`
//! nor `..` (sinks may use names as path components). On the wire it is `len: u8` followed by the
//! ASCII bytes; decoding re-validates it, so a [`StreamName`] always holds a valid name.

use std::borrow::Borrow;
use std::fmt;
use std::str::FromStr;

/// Longest stream name, in bytes.
pub const MAX_STREAM_NAME_LEN: usize = 64;

/// The name of a record stream: `[A-Za-z0-9_.-]{1,64}`, except `.` and `..`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamName(String);

/// Why a string is not a valid [`StreamName`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name is empty.
    #[error("stream name is empty")]
    Empty,
    /// The name is longer than [`MAX_STREAM_NAME_LEN`] bytes.
    #[error("stream name is {len} bytes, the limit is {MAX_STREAM_NAME_LEN}")]
    TooLong { len: usize },
    /// The name contains a byte outside `[A-Za-z0-9_.-]`.
    #[error("stream name has a forbidden byte {byte:#04x} at offset {offset}")]
    InvalidByte { byte: u8, offset: usize },
    /// The name is `.` or `..`.
    #[error("stream name cannot be `.` or `..`")]
    DotName,
}

impl StreamName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, NameError> {
        validate(name.as_bytes())?;
        Ok(Self(name.to_owned()))
    }

    /// Validates raw wire bytes, without allocating for invalid input.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Self, NameError> {
        validate(bytes)?;
        // Validation admits ASCII only, so the bytes are UTF-8.
        Ok(Self(bytes.iter().map(|&b| char::from(b)).collect()))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name's length in bytes (1 to 64).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always `false`: a stream name is never empty. Present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Consumes the name, returning the inner `String`.
    pub fn into_string(self) -> String {
        self.0
    }
}

fn validate(bytes: &[u8]) -> Result<(), NameError> {
    if bytes.is_empty() {
        return Err(NameError::Empty);
    }
    if bytes.len() > MAX_STREAM_NAME_LEN {
        return Err(NameError::TooLong { len: bytes.len() });
    }
    if let Some(offset) = bytes.iter().position(|&b| !is_name_byte(b)) {
        return Err(NameError::InvalidByte { byte: bytes[offset], offset });
    }
    if bytes == b"." || bytes == b".." {
        return Err(NameError::DotName);
    }
    Ok(())
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')
}

impl fmt::Display for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl AsRef<str> for StreamName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for StreamName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl FromStr for StreamName {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<&str> for StreamName {
    type Error = NameError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl TryFrom<String> for StreamName {
    type Error = NameError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        validate(s.as_bytes())?;
        Ok(Self(s))
    }
}

impl From<StreamName> for String {
    fn from(name: StreamName) -> Self {
        name.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_the_allowed_alphabet_are_accepted() {
        for ok in ["a", "sensor-1", "temp_c.v2", "A.B-c_9", ".hidden", &"x".repeat(64)] {
            let name = StreamName::new(ok).expect(ok);
            assert_eq!(name.as_str(), ok);
            assert_eq!(name.to_string(), ok);
        }
    }

    #[test]
    fn empty_long_dot_and_foreign_names_are_refused() {
        assert_eq!(StreamName::new(""), Err(NameError::Empty));
        assert_eq!(StreamName::new(&"x".repeat(65)), Err(NameError::TooLong { len: 65 }));
        assert_eq!(StreamName::new("a/b"), Err(NameError::InvalidByte { byte: b'/', offset: 1 }));
        assert_eq!(StreamName::new("a b"), Err(NameError::InvalidByte { byte: b' ', offset: 1 }));
        assert!(matches!(StreamName::new("é"), Err(NameError::InvalidByte { offset: 0, .. })));
        assert_eq!(StreamName::new("."), Err(NameError::DotName));
        assert_eq!(StreamName::new(".."), Err(NameError::DotName));
        assert!(StreamName::new("...").is_ok());
    }

    #[test]
    fn wire_bytes_are_validated_like_strings() {
        assert_eq!(StreamName::from_bytes(b"ok"), StreamName::new("ok"));
        assert_eq!(StreamName::from_bytes(&[0xff]), Err(NameError::InvalidByte { byte: 0xff, offset: 0 }));
    }
}

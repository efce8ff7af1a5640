//! Shared secrets kept in files: what the peer port's HMAC handshake is keyed by
//! (`--peer-secret-file`), and what the tier daemon's network ports ask of their clients (the
//! metrics endpoint's bearer token, the KV event socket's ZMTP PLAIN password).
//!
//! One reading for all of them: the file's bytes with trailing ASCII whitespace (a newline) cut, at
//! least [`MIN_SECRET_BYTES`]; like ssh with a private key, a file its group or others may read or
//! write is refused. Secrets are compared in constant time ([`secrets_equal`]).

use std::path::{Path, PathBuf};

/// Fewest bytes a secret may have (after a trailing newline is cut).
pub const MIN_SECRET_BYTES: usize = 16;

/// Why a secret file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {why}", path.display())]
#[non_exhaustive]
pub struct SecretFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it (it cannot be read, is not a regular file, is open to its group or
    /// others, or holds too short a secret), with the fix where there is one.
    pub why: String,
}

/// Reads the secret of `path`: its bytes with trailing ASCII whitespace cut.
///
/// # Errors
/// [`SecretFileError`] naming the path: it cannot be read, is not a regular file, has any of the
/// mode bits `0o077` (`chmod 600` it), or holds fewer than [`MIN_SECRET_BYTES`] bytes.
pub fn read_secret_file(path: impl AsRef<Path>) -> Result<Vec<u8>, SecretFileError> {
    use std::os::unix::fs::PermissionsExt;
    let path = path.as_ref();
    let bad = |why: String| SecretFileError { path: path.to_path_buf(), why };
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(bad(format!("its mode {mode:04o} lets its group or others at it: chmod 600 it")));
    }
    let mut bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
        bytes.pop();
    }
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(bad(format!(
            "a secret of {} B is too short: at least {MIN_SECRET_BYTES} B (e.g. `head -c 32 /dev/urandom | base64 > \
             FILE`)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Whether `a` and `b` are the same bytes, in time that depends on their lengths only.
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    // An optimiser may not see through the fold to stop early: the result is read once, here.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_secret_file_is_private_long_enough_and_cut_of_its_newline() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, b"0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_secret_file(&p).unwrap_err().why.contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret_file(&p).unwrap(), b"0123456789abcdef");
        std::fs::write(&p, b"short\n").unwrap();
        assert!(read_secret_file(&p).unwrap_err().why.contains("too short"));
        assert!(read_secret_file(dir.path()).unwrap_err().why.contains("not a regular file"));
        assert!(secrets_equal(b"abc", b"abc") && !secrets_equal(b"abc", b"abd") && !secrets_equal(b"abc", b"ab"));
    }
}

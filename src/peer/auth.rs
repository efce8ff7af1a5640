//! The peer port's trust: a shared secret ([`PeerSecret`]) that both sides of a control connection
//! prove before anything else is answered (see `docs/design.md`, "Trust model: the peer port").
//!
//! The handshake, in the hello (protocol version 2):
//!
//! ```text
//!   reader                                         owner
//!   Hello {magic, version, nonce_r}             -> Challenge {nonce_o}
//!   Auth {mac_r, namespace_r, descriptor_r}     -> Welcome {mac_o, namespace_o, block bytes, descriptor_o, limits}
//!                                                  | Refused(Auth)   (nothing about the owner)
//! ```
//!
//! `mac_r = HMAC-SHA-256(secret, "kvtier-peer reader" | nonce_r | nonce_o | namespace_r |
//! descriptor_r)`, `mac_o` the same with `"kvtier-peer owner"` over the owner's namespace, block
//! bytes and descriptor. Each side's nonce is 32 random bytes drawn for this connection, so a MAC
//! recorded from one connection proves nothing in another (no replay, either way); the role label
//! keeps a reader's MAC from being reflected as an owner's. MACs are compared in constant time.
//! The owner loads the reader's descriptor and sends its own (NIXL metadata, the pool's registered
//! range) only after `mac_r` checked; the reader loads the owner's only after `mac_o` checked.

use super::PeerError;
use crate::key::Namespace;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::Path;
use std::sync::Arc;

/// Bytes of a handshake nonce and of a MAC.
pub const NONCE_BYTES: usize = 32;

use crate::secret::MIN_SECRET_BYTES;

/// The shared secret of a group of peers (`kvtierd --peer-secret-file`): every instance that serves
/// or reads peers with it proves it in the hello. Cheap to clone. Its bytes are never printed
/// (`Debug` shows only its length).
#[derive(Clone)]
pub struct PeerSecret(Arc<[u8]>);

impl std::fmt::Debug for PeerSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerSecret({} B)", self.0.len())
    }
}

impl PeerSecret {
    /// A secret of these bytes.
    ///
    /// # Errors
    /// [`PeerError::Secret`] if it has fewer than 16 bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<PeerSecret, PeerError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(PeerError::Secret(format!(
                "a peer secret of {} B is too short: at least {MIN_SECRET_BYTES} B (e.g. `head -c 32 /dev/urandom \
                 | base64 > FILE`)",
                bytes.len()
            )));
        }
        Ok(PeerSecret(bytes.into()))
    }

    /// Reads the secret from `path`: its bytes with trailing ASCII whitespace (a newline) cut, at
    /// least 16 of them. Like ssh with a private key, a file that its group
    /// or others may read or write (any of the mode bits `0o077`) is refused: `chmod 600 FILE`.
    ///
    /// # Errors
    /// [`PeerError::Secret`] naming the path: it cannot be read, is not a regular file, is open to
    /// its group or others, or holds too short a secret.
    pub fn from_file(path: impl AsRef<Path>) -> Result<PeerSecret, PeerError> {
        crate::secret::read_secret_file(path)
            .map_err(|e| PeerError::Secret(format!("peer secret file {e}")))
            .and_then(PeerSecret::new)
    }

    /// The key of the handshake's MACs: this secret's bytes, or none (the empty key) for an
    /// instance without a secret, whose proofs then only a peer without one accepts.
    fn key(secret: Option<&PeerSecret>) -> &[u8] {
        secret.map_or(&[][..], |s| &s.0[..])
    }
}

/// Which side a MAC is from (its label, so one side's MAC never passes as the other's).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// The reader's proof (`Auth`).
    Reader,
    /// The owner's proof (`Welcome`).
    Owner,
}

/// 32 fresh random bytes (the OS's generator).
///
/// # Errors
/// [`PeerError::Network`] if the OS has no randomness to give (never on Linux once booted).
pub fn nonce() -> Result<[u8; NONCE_BYTES], PeerError> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| PeerError::Network(std::io::Error::other(format!("no random nonce: {e}"))))?;
    Ok(n)
}

/// The MAC of `role` over both nonces and what that side states (`namespace`, `extra`: the
/// owner's block bytes, `descriptor`).
pub fn mac(
    secret: Option<&PeerSecret>,
    role: Role,
    reader_nonce: &[u8; NONCE_BYTES],
    owner_nonce: &[u8; NONCE_BYTES],
    namespace: &Namespace,
    extra: u64,
    descriptor: &[u8],
) -> [u8; NONCE_BYTES] {
    let m = hasher(secret, role, reader_nonce, owner_nonce, namespace, extra, descriptor);
    m.finalize().into_bytes().into()
}

/// True if `given` is the MAC [`mac`] computes for these inputs; compared in constant time.
#[allow(clippy::too_many_arguments)]
pub(crate) fn verify(
    secret: Option<&PeerSecret>,
    role: Role,
    reader_nonce: &[u8; NONCE_BYTES],
    owner_nonce: &[u8; NONCE_BYTES],
    namespace: &Namespace,
    extra: u64,
    descriptor: &[u8],
    given: &[u8; NONCE_BYTES],
) -> bool {
    // Seeded bug (tests only): `peer-auth-unchecked` takes any MAC.
    if crate::seeded::seeded("peer-auth-unchecked") {
        return true;
    }
    hasher(secret, role, reader_nonce, owner_nonce, namespace, extra, descriptor).verify_slice(given).is_ok()
}

fn hasher(
    secret: Option<&PeerSecret>,
    role: Role,
    reader_nonce: &[u8; NONCE_BYTES],
    owner_nonce: &[u8; NONCE_BYTES],
    namespace: &Namespace,
    extra: u64,
    descriptor: &[u8],
) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(PeerSecret::key(secret)).expect("HMAC takes a key of any length");
    m.update(match role {
        Role::Reader => b"kvtier-peer reader\0",
        Role::Owner => b"kvtier-peer owner\0\0",
    });
    m.update(reader_nonce);
    m.update(owner_nonce);
    m.update(&namespace.0);
    m.update(&extra.to_le_bytes());
    m.update(&(descriptor.len() as u64).to_le_bytes());
    m.update(descriptor);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_checks_only_with_its_secret_nonces_role_and_statement() {
        let s = PeerSecret::new(*b"0123456789abcdef").unwrap();
        let other = PeerSecret::new(*b"0123456789abcdeF").unwrap();
        let (r, o, ns) = ([1u8; 32], [2u8; 32], Namespace([3u8; 16]));
        let m = mac(Some(&s), Role::Reader, &r, &o, &ns, 0, b"d");
        assert!(verify(Some(&s), Role::Reader, &r, &o, &ns, 0, b"d", &m));
        assert!(!verify(Some(&other), Role::Reader, &r, &o, &ns, 0, b"d", &m), "another secret");
        assert!(!verify(None, Role::Reader, &r, &o, &ns, 0, b"d", &m), "no secret");
        assert!(!verify(Some(&s), Role::Owner, &r, &o, &ns, 0, b"d", &m), "the other role");
        assert!(!verify(Some(&s), Role::Reader, &o, &r, &ns, 0, b"d", &m), "other nonces");
        assert!(!verify(Some(&s), Role::Reader, &r, &o, &Namespace([4u8; 16]), 0, b"d", &m), "another namespace");
        assert!(!verify(Some(&s), Role::Reader, &r, &o, &ns, 1, b"d", &m), "another statement");
        assert!(!verify(Some(&s), Role::Reader, &r, &o, &ns, 0, b"e", &m), "another descriptor");
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn a_secret_file_open_to_others_or_too_short_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret");
        std::fs::write(&p, "a secret of some length\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = PeerSecret::from_file(&p).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = PeerSecret::from_file(&p).unwrap();
        assert_eq!(&s.0[..], b"a secret of some length", "the trailing newline is cut");
        assert!(!format!("{s:?}").contains("secret of"), "Debug never shows the bytes");
        std::fs::write(&p, "short\n").unwrap();
        assert!(PeerSecret::from_file(&p).unwrap_err().to_string().contains("too short"));
        assert!(PeerSecret::from_file(dir.path()).unwrap_err().to_string().contains("not a regular file"));
    }
}

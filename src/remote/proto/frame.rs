//! Frames: a 4-byte little-endian length and a `postcard` payload, written ([`encode`],
//! [`write_frame`]) and read without allocating a length prefix's worth up front ([`read_frame`],
//! [`read_request`]), and [`NoSigPipe`], a socket writer that never raises `SIGPIPE`.

use super::{Request, MAX_FRAME, READ_CHUNK};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// Encodes `msg` as one frame (length prefix and payload) into `buf` (cleared first).
///
/// # Errors
/// The encoder's error, or a payload larger than [`MAX_FRAME`].
pub fn encode<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    let mut buf2 = postcard::to_extend(msg, std::mem::take(buf)).map_err(invalid)?;
    let len = buf2.len() - 4;
    if len > MAX_FRAME {
        return Err(invalid(format!("a {len} B frame is larger than {MAX_FRAME} B")));
    }
    buf2[..4].copy_from_slice(&(len as u32).to_le_bytes());
    *buf = buf2;
    Ok(())
}

/// Writes `msg` as one frame with a single `write_all` (`buf` is scratch space).
///
/// # Errors
/// Encoding or I/O errors.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T, buf: &mut Vec<u8>) -> std::io::Result<()> {
    encode(msg, buf)?;
    w.write_all(buf)
}

/// Reads one frame and decodes it (`buf` is scratch space). End of stream before the first byte
/// is [`std::io::ErrorKind::UnexpectedEof`].
///
/// # Errors
/// I/O errors, a frame larger than [`MAX_FRAME`], or a payload that does not decode.
pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<T> {
    let len = read_len(r)?;
    if len > MAX_FRAME {
        return Err(invalid(format!("a {len} B frame is larger than {MAX_FRAME} B")));
    }
    read_payload(r, len, buf)?;
    decode(buf)
}

/// Reads a frame's 4-byte length prefix: the payload's length, bytes.
///
/// # Errors
/// I/O errors ([`std::io::ErrorKind::UnexpectedEof`] at end of stream).
pub fn read_len(r: &mut impl Read) -> std::io::Result<usize> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    Ok(u32::from_le_bytes(len) as usize)
}

/// Reads a payload of `len` bytes into `buf` (cleared first), growing it by at most [`READ_CHUNK`]
/// bytes ahead of what has arrived: a peer that announces 4 GiB and sends 10 bytes makes this
/// hold about 64 KiB, not 4 GiB.
///
/// # Errors
/// I/O errors; [`std::io::ErrorKind::UnexpectedEof`] if the stream ends first.
pub fn read_payload(r: &mut impl Read, len: usize, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    if crate::seeded::seeded("frame-prealloc") {
        buf.resize(len, 0);
        buf.clear();
    }
    while buf.len() < len {
        let at = buf.len();
        buf.resize(at + (len - at).min(READ_CHUNK), 0);
        match r.read(&mut buf[at..]) {
            Ok(0) => {
                buf.truncate(at);
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(n) => buf.truncate(at + n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => buf.truncate(at),
            Err(e) => {
                buf.truncate(at);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Reads and discards a payload of `len` bytes, [`READ_CHUNK`] at a time (an oversized frame the
/// reader answers without keeping).
///
/// # Errors
/// I/O errors; [`std::io::ErrorKind::UnexpectedEof`] if the stream ends first.
pub fn skip_payload(r: &mut impl Read, mut len: usize) -> std::io::Result<()> {
    let mut scratch = [0u8; 4096];
    while len > 0 {
        let want = len.min(scratch.len());
        match r.read(&mut scratch[..want]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => len -= n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One frame a daemon read from a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A request.
    Request(Request),
    /// A frame over the reader's bound, `len` payload bytes: read and discarded.
    Oversized {
        /// Its payload's length, bytes.
        len: u64,
    },
    /// A frame within the bound whose payload is no request (the reason).
    Undecodable(String),
}

/// Reads the next frame of a connection: a request, or an oversized or undecodable frame that was
/// read whole, so the connection stays in step. Memory: at most `max_frame` bytes (plus
/// [`READ_CHUNK`]) in `buf`, whatever the length prefix says.
///
/// # Errors
/// I/O errors ([`std::io::ErrorKind::UnexpectedEof`] at end of stream, also mid-frame).
pub fn read_request(r: &mut impl Read, buf: &mut Vec<u8>, max_frame: usize) -> std::io::Result<Incoming> {
    let len = read_len(r)?;
    if len > max_frame {
        skip_payload(r, len)?;
        return Ok(Incoming::Oversized { len: len as u64 });
    }
    read_payload(r, len, buf)?;
    Ok(match decode(buf) {
        Ok(req) => Incoming::Request(req),
        Err(e) => Incoming::Undecodable(e.to_string()),
    })
}

/// Decodes one payload. postcard never allocates more than the payload can hold: a sequence's
/// length prefix only bounds how many elements are read from the payload's bytes (serde caps the
/// up-front reservation at 1 MiB), so a huge prefix on a short payload is an error, not an
/// allocation.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidData`] for a payload that does not decode.
pub fn decode<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> std::io::Result<T> {
    postcard::from_bytes(payload).map_err(invalid)
}

/// Writes to a socket with `MSG_NOSIGNAL`: a peer that is gone is an `EPIPE` error, never a
/// `SIGPIPE` that would kill the process (an engine may not ignore it).
#[derive(Debug)]
pub struct NoSigPipe<'a>(pub &'a std::os::unix::net::UnixStream);

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        nix::sys::socket::send(self.0.as_raw_fd(), buf, nix::sys::socket::MsgFlags::MSG_NOSIGNAL)
            .map_err(std::io::Error::from)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Polls `stream` without sleeping, for at most `spin`, until it has bytes to read, has been
/// closed or has failed; reads nothing (the caller's read then finds the bytes, the end of stream
/// or the error at once). A reply or request that arrives within `spin` is so read without the
/// wake-up of a thread asleep in `read` (5-15 us each on a server's cores: a round trip has two).
/// Returns at once for a zero `spin`; after `spin` the caller's blocking read waits as before.
pub fn spin_until_readable(stream: &std::os::unix::net::UnixStream, spin: std::time::Duration) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    if spin.is_zero() {
        return;
    }
    let start = std::time::Instant::now();
    loop {
        let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => {}
            // Readable, hung up or failed: the read sees which.
            _ => return,
        }
        if start.elapsed() >= spin {
            return;
        }
        std::hint::spin_loop();
    }
}

fn invalid(e: impl ToString) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

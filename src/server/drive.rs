//! [`drive_session`]: one session of a daemon run from encoded requests, without a socket (the fuzz
//! target `wire_session` and tests).

use super::limits::Limits;
use super::session::Session;
use super::shared::Shared;
use crate::remote::proto::{Reply, Request, WireError};
use crate::tier::HostTier;
use std::sync::Arc;

/// Fuzzing and tests: runs the requests encoded back to back in `bytes` (postcard, no length
/// prefixes; decoding stops at the first that does not decode) through one session of a daemon
/// serving `tier`, with `limits`, as a connection that said hello would; then ends the session as
/// if its process had exited, so whatever it held goes back. A lease id below 16 names the
/// session's own leases in the order it got them (a real client learns the random ids from the
/// replies). Returns the replies.
///
/// # Errors
/// A request that panicked (no request may panic the daemon), named with its message.
#[doc(hidden)]
pub fn drive_session(tier: HostTier, limits: Limits, mut bytes: &[u8]) -> Result<Vec<Reply>, String> {
    let shared = Arc::new(Shared::new(tier, limits));
    let mut session = Session::new(shared.clone(), None, None);
    session.gone_at_end = true;
    let mut ids: Vec<u64> = Vec::new();
    let mut replies = Vec::new();
    while let Ok((mut req, rest)) = postcard::take_from_bytes::<Request>(bytes) {
        bytes = rest;
        let lease_of = |n: u64| if n < 16 { ids.get(n as usize).copied().unwrap_or(n) } else { n };
        match &mut req {
            Request::OpenLease { instance, lease } => {
                if *instance < 2 {
                    *instance = shared.welcome.instance;
                }
                *lease = lease_of(*lease);
            }
            Request::LeaseInfo { lease }
            | Request::ReleaseLease { lease }
            | Request::DropLease { lease }
            | Request::ConsumeUse { lease }
            | Request::Restore { lease, .. } => *lease = lease_of(*lease),
            _ => {}
        }
        let reply = session.run(req);
        if let Reply::Error(WireError::Panicked { request, message }) = &reply {
            return Err(format!("request {request} panicked: {message}"));
        }
        if let Reply::Leased { lease, .. } = &reply {
            if *lease != 0 && !ids.contains(lease) {
                ids.push(*lease);
            }
        }
        replies.push(reply);
    }
    drop(session);
    Ok(replies)
}

//! A [`TierError`] on the wire ([`WireError`]) and the conversions both ways.

use crate::error::TierError;
use serde::{Deserialize, Serialize};

/// A [`TierError`] the daemon returns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum WireError {
    CannotFit {
        needed: u64,
        available: u64,
        capacity: u64,
    },
    PoolExhausted {
        needed: u64,
        got: u64,
    },
    LeaseSettled,
    LeaseExpired,
    LeaseTooShort {
        asked: u64,
        held: u64,
    },
    ForeignLease,
    ShuttingDown,
    TooManyPins {
        slot: u32,
    },
    GeometryMismatch {
        backend: String,
        tier: String,
    },
    ProtocolMismatch {
        daemon: u32,
        client: u32,
    },
    LimitExceeded {
        limit: crate::error::Limit,
        asked: u64,
        max: u64,
    },
    Protocol(String),
    Panicked {
        request: String,
        message: String,
    },
    /// A request the daemon could not serve (an unknown id, a malformed message), as text; a
    /// client reports it as [`TierError::Protocol`] (the connection stays usable).
    Other(String),
}

impl From<&TierError> for WireError {
    fn from(e: &TierError) -> Self {
        use TierError as T;
        match e {
            T::CannotFit { needed, available, capacity } => WireError::CannotFit {
                needed: *needed as u64,
                available: *available as u64,
                capacity: *capacity as u64,
            },
            T::PoolExhausted { needed, got } => WireError::PoolExhausted { needed: *needed as u64, got: *got as u64 },
            T::LeaseSettled => WireError::LeaseSettled,
            T::LeaseExpired => WireError::LeaseExpired,
            T::LeaseTooShort { asked, held } => WireError::LeaseTooShort { asked: *asked as u64, held: *held as u64 },
            T::ForeignLease => WireError::ForeignLease,
            T::ShuttingDown => WireError::ShuttingDown,
            T::TooManyPins { slot } => WireError::TooManyPins { slot: *slot },
            T::GeometryMismatch { backend, tier } => {
                WireError::GeometryMismatch { backend: backend.clone(), tier: tier.clone() }
            }
            T::ProtocolMismatch { daemon, client } => WireError::ProtocolMismatch { daemon: *daemon, client: *client },
            T::LimitExceeded { limit, asked, max } => {
                WireError::LimitExceeded { limit: *limit, asked: *asked, max: *max }
            }
            T::Protocol { reason } => WireError::Protocol(reason.clone()),
            T::Panicked { request, message } => {
                WireError::Panicked { request: request.clone(), message: message.clone() }
            }
            e => WireError::Other(e.to_string()),
        }
    }
}

impl From<WireError> for TierError {
    fn from(w: WireError) -> Self {
        match w {
            WireError::CannotFit { needed, available, capacity } => TierError::CannotFit {
                needed: needed as usize,
                available: available as usize,
                capacity: capacity as usize,
            },
            WireError::PoolExhausted { needed, got } => {
                TierError::PoolExhausted { needed: needed as usize, got: got as usize }
            }
            WireError::LeaseSettled => TierError::LeaseSettled,
            WireError::LeaseExpired => TierError::LeaseExpired,
            WireError::LeaseTooShort { asked, held } => {
                TierError::LeaseTooShort { asked: asked as usize, held: held as usize }
            }
            WireError::ForeignLease => TierError::ForeignLease,
            WireError::ShuttingDown => TierError::ShuttingDown,
            WireError::TooManyPins { slot } => TierError::TooManyPins { slot },
            WireError::GeometryMismatch { backend, tier } => TierError::GeometryMismatch { backend, tier },
            WireError::ProtocolMismatch { daemon, client } => TierError::ProtocolMismatch { daemon, client },
            WireError::LimitExceeded { limit, asked, max } => TierError::LimitExceeded { limit, asked, max },
            WireError::Protocol(reason) => TierError::Protocol { reason },
            WireError::Panicked { request, message } => TierError::Panicked { request, message },
            // Answered on a working connection: the connection stays usable, so never Disconnected.
            WireError::Other(m) => TierError::Protocol { reason: format!("the daemon refused the request: {m}") },
        }
    }
}

//! The bounds every connection is held to ([`Limits`]), how the daemon is set up besides its tier
//! ([`ServerConfig`]), and the typed refusal of a request over a bound ([`limit`]).

use crate::error::{Error, Limit, LimitsError, TierError};
use crate::remote::proto::{self, WireLimits};
use std::time::{Duration, Instant};

/// Every bound the daemon holds a connection to. A request over one is answered
/// `WireError::LimitExceeded` (the [`Limit`] named) and does
/// nothing. The welcome sends them (`WireLimits`) so a client can check before sending. Defaults
/// in parentheses; `kvtierd`'s flag for each in the field's docs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (256, `--max-connections`); one more is refused with
    /// [`Limit::Connections`] and closed, the daemon goes on.
    pub connections: usize,
    /// Connections one process (its pid from `SO_PEERCRED`) has open at once (16,
    /// `--max-connections-per-process`); one more is refused with
    /// [`Limit::ConnectionsPerProcess`] and closed. Connections may idle between frames, so
    /// without this one process opening [`Limits::connections`] connections would lock every
    /// other engine out. A connection counts from accept until its thread ends, however it ends.
    pub connections_per_process: usize,
    /// Time from accept to a complete hello (5 s, `--hello-timeout`); past it the connection is
    /// closed.
    pub hello_timeout: Duration,
    /// Time a frame may take to arrive once its length prefix has begun (30 s, `--frame-timeout`);
    /// past it the connection is closed. Between frames a connection may idle for ever.
    pub frame_timeout: Duration,
    /// Time a reply may wait for the client to take it (30 s, `--write-timeout`); past it the
    /// connection is closed (a client that never reads its replies).
    pub write_timeout: Duration,
    /// Largest request frame payload, bytes (24 MiB = 25,165,824 B, `--max-frame-bytes`; at most
    /// `proto::MAX_FRAME`). A larger frame is read and discarded in 4 KiB pieces and answered
    /// [`Limit::FrameBytes`].
    pub frame_bytes: usize,
    /// Keys one query, save, hint or audit may name (2^20 = 1,048,576, `--max-keys-per-request`).
    pub keys_per_request: usize,
    /// Hints one connection holds at once (1,024, `--max-hints`).
    pub hints_per_connection: usize,
    /// Distinct keys over one connection's live hints (2^20, `--max-hint-keys`).
    pub hint_keys_per_connection: usize,
    /// Lease handles one connection holds at once (2,048, `--max-leases`).
    pub leases_per_connection: usize,
    /// Blocks over the lease handles one connection holds, each handle (a query's or an
    /// `OpenLease`'s) counting its lease's blocks (262,144 = 2^18, `--max-leased-blocks`); a query
    /// naming more distinct keys than are left, or an `OpenLease` of a larger lease, is refused with
    /// [`Limit::LeasedBlocksPerConnection`]. A lease pins each of its slots once, so leases hold at
    /// most `connections × min(leases_per_connection, leased_blocks_per_connection)` pins of one
    /// slot; binding refuses limits whose product exceeds half of
    /// `crate::slab::slot::SlotWord::LEASE_PINS`, so no number of leases makes a block unleasable.
    pub leased_blocks_per_connection: usize,
    /// Saves and restores one connection has in flight, or withheld after an unknown outcome, at
    /// once (4,096, `--max-copies`).
    pub copies_per_connection: usize,
    /// Uses one lease may have (1,024, `--max-lease-uses`).
    pub lease_uses: u32,
    /// Slots one process (its pid from `SO_PEERCRED`) holds `WRITING` for saves in flight or
    /// withheld after a save's unknown outcome, over all its connections at once (0: half the
    /// pool's capacity, at least 1; `--max-slots-per-process`). A save naming more keys than the
    /// process has left is refused with [`Limit::SlotsPerProcess`] before anything is reserved, so
    /// one process cannot take every slot, and a process that parks slots connection after
    /// connection stops at this bound (its parked slots share one pidfd).
    pub slots_per_process: usize,
    /// Slots held `WRITING` for saves in flight or withheld, over every process at once (0: the
    /// pool's capacity; `--max-writing-slots`), and each process's **fair share** of them: this
    /// bound divided by the processes connected now or holding such slots (at least 1 slot). A
    /// process may take slots past its fair share only from what the others leave: a save is
    /// refused with [`Limit::WritingSlots`] (its reservation dropped, as a failed save's) if the
    /// slots it reserved (keys already resident take none) take the slots held past this bound,
    /// or take its process past its fair share while that leaves another connected process less
    /// than its own share unheld. So every connected process can
    /// always have its fair share being written, however many slots the others keep `WRITING`
    /// (two processes that never finish their copies leave a third at least a third); a process
    /// that connects while others hold more than their new shares gets its share as their saves
    /// finish (or their processes exit).
    pub writing_slots: usize,
    /// Bytes the daemon's hint tables may be charged over every connection's hints (256 MiB,
    /// `--max-hint-bytes`): 256 B a hint and `kvtier::HINTED_KEY_BYTES` (114 B) a key it names,
    /// about 2.3 million hinted keys. A hint past it is refused with [`Limit::HintBytes`]; the
    /// tables shrink and their memory goes back to the system as hints go.
    pub hint_bytes: usize,
    /// Stack size of a connection's thread, bytes (256 KiB, `--thread-stack`).
    pub thread_stack_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections: 256,
            connections_per_process: 16,
            hello_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            frame_bytes: 24 << 20,
            keys_per_request: 1 << 20,
            hints_per_connection: 1024,
            hint_keys_per_connection: 1 << 20,
            leases_per_connection: 2048,
            leased_blocks_per_connection: 1 << 18,
            copies_per_connection: 4096,
            lease_uses: 1024,
            slots_per_process: 0,
            writing_slots: 0,
            hint_bytes: 256 << 20,
            thread_stack_bytes: 256 << 10,
        }
    }
}

impl Limits {
    /// The limits as the welcome sends them.
    pub fn wire(&self) -> WireLimits {
        let ms = |d: Duration| d.as_millis().min(u64::MAX as u128) as u64;
        WireLimits {
            frame_bytes: self.frame_bytes as u64,
            keys_per_request: self.keys_per_request as u64,
            hints_per_connection: self.hints_per_connection as u64,
            hint_keys_per_connection: self.hint_keys_per_connection as u64,
            leases_per_connection: self.leases_per_connection as u64,
            copies_per_connection: self.copies_per_connection as u64,
            lease_uses: self.lease_uses as u64,
            connections: self.connections as u64,
            frame_timeout_ms: ms(self.frame_timeout),
            write_timeout_ms: ms(self.write_timeout),
        }
    }

    pub(super) fn check(&self) -> Result<(), Error> {
        let zero = |d: Duration| d.is_zero();
        if self.connections == 0
            || self.connections_per_process == 0
            || zero(self.hello_timeout)
            || zero(self.frame_timeout)
            || zero(self.write_timeout)
        {
            return Err(LimitsError::Zero.into());
        }
        let now = Instant::now();
        for (name, t) in [("hello", self.hello_timeout), ("frame", self.frame_timeout), ("write", self.write_timeout)] {
            // Each connection computes `now + t`: a timeout the clock cannot add is refused here.
            if now.checked_add(t).and_then(|x| x.checked_add(Duration::from_secs(365 * 86_400))).is_none() {
                return Err(LimitsError::TimeoutTooLarge { which: name, timeout: t }.into());
            }
        }
        let per_slot =
            (self.connections as u128) * (self.leases_per_connection.min(self.leased_blocks_per_connection) as u128);
        let pins = crate::slab::slot::SlotWord::LEASE_PINS as u128 / 2;
        if per_slot > pins && !crate::seeded::seeded("leased-blocks-unbounded") {
            return Err(LimitsError::LeasePins {
                connections: self.connections,
                leases: self.leases_per_connection,
                leased_blocks: self.leased_blocks_per_connection,
                pins_per_slot: per_slot,
                max: pins,
            }
            .into());
        }
        if self.frame_bytes > proto::MAX_FRAME {
            return Err(LimitsError::FrameTooLarge { bytes: self.frame_bytes, max: proto::MAX_FRAME }.into());
        }
        Ok(())
    }
}

/// How the daemon is set up besides its tier: its [`Limits`] and who may connect.
#[derive(Clone, Debug, Default)]
pub struct ServerConfig {
    /// The bounds every connection is held to.
    pub limits: Limits,
    /// `None`: the socket is `0600`, only the daemon's uid may connect. `Some(gid)`: the socket is
    /// `0660` and belongs to group `gid`, whose members may connect too (`kvtierd --group NAME`);
    /// the socket's directory must let them reach it (one
    /// [`Server::bind_with`](super::Server::bind_with) creates is `0750` and of that group).
    pub group: Option<u32>,
}

/// The typed refusal of a request that asked `asked` of a bound of `max`.
pub(super) fn limit(limit: Limit, asked: usize, max: usize) -> TierError {
    TierError::LimitExceeded { limit, asked: asked as u64, max: max as u64 }
}

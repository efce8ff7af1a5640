//! `--kv-events ADDR`: the pool's KV events for routers (Dynamo's KV router, Mooncake's Conductor,
//! any vLLM KV-event subscriber), on a ZeroMQ PUB socket in vLLM's own format.
//!
//! **What is sent.** Every block the pool stores (a save's commit, a promotion from the SSD tier or a
//! peer) and every block it evicts, on the host (`medium` `CPU`) and on the SSD tier (`STORAGE`),
//! read from the tier's event log ([`kvtier::HostTier::take_events`]) every
//! [`EventLimits::interval`]. One ZeroMQ message per batch, three frames as vLLM's
//! `ZmqEventPublisher` sends them: the topic, a sequence number (8 bytes, big-endian, from 0), and
//! a MessagePack `KVEventBatch` (`[ts, [events]]`; each event a map tagged `"type"`:
//! `BlockStored` with `block_hashes`, `parent_block_hash` (nil), `token_ids` (empty: the pool does
//! not know them), `block_size` (tokens), `lora_id`, `medium`, `lora_name`; `BlockRemoved` with
//! `block_hashes` and `medium`). A block's hash is its 16-byte kvtier content key (`bytes`): the key
//! an engine's connector saved it under (`kvtier.vllm` announces its stores under vLLM's own hashes
//! too, with the tokens). Consecutive events of one kind and medium share one event.
//!
//! **The socket.** ZMTP 3.0 with the NULL mechanism (what `zmq.SUB` speaks, libzmq and pyzmq
//! included), written here with a bound on everything a subscriber holds, which no ZeroMQ library
//! offers: at most [`EventLimits::subscribers`] connections at once (one more is closed at once), a
//! handshake within [`EventLimits::handshake`], at most [`EventLimits::queue_bytes`] of unsent
//! messages a subscriber (past it the subscriber misses messages: the sequence numbers show the
//! gap), and a subscriber that has missed messages for [`EventLimits::stalled`] is disconnected.
//! The daemon therefore holds at most `subscribers x queue_bytes` for its subscribers, whatever they
//! do. Subscriptions (topic prefixes, ZMTP 3.0 messages or 3.1 `SUBSCRIBE` commands) filter on the
//! publishing side. vLLM's replay socket (a ROUTER that resends missed batches) is not served.
//!
//! **Who may listen.** A subscriber learns which blocks the pool holds and when (content keys, not
//! tokens): the same membership a client of the daemon's socket can test. With
//! `--kv-events-secret-file` every subscriber proves the secret as its ZMTP PLAIN password (any
//! user name; compared in constant time; a wrong one gets an `ERROR` command and the connection
//! closes, before anything is sent); without it the socket speaks the NULL mechanism, which
//! authenticates no one, and listens on loopback only. PLAIN sends the password as it is: across
//! hosts, run it inside a private network or a tunnel. All of it runs on one thread (a tokio
//! current-thread runtime).

use crate::seeded::seeded;
use kvtier::{EventMedium, HostTier, TierEvent};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// The lock's guard, also after a panic elsewhere (every value under these locks stays valid).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The bounds of the event socket (see the module docs).
#[derive(Copy, Clone, Debug)]
pub(crate) struct EventLimits {
    /// Subscribers connected at once (a connection still in its handshake counts).
    pub subscribers: usize,
    /// Unsent bytes a subscriber may have queued.
    pub queue_bytes: usize,
    /// Time a new connection has to finish the ZMTP handshake.
    pub handshake: Duration,
    /// Time a subscriber may miss messages (its queue full), or take no byte of a message being
    /// written, before it is disconnected.
    pub stalled: Duration,
    /// How often the tier's event log is read and published.
    pub interval: Duration,
}

impl Default for EventLimits {
    fn default() -> Self {
        EventLimits {
            subscribers: 16,
            queue_bytes: 8 << 20,
            handshake: Duration::from_secs(5),
            stalled: Duration::from_secs(30),
            interval: Duration::from_millis(10),
        }
    }
}

/// Events a `KVEventBatch` carries at most (a batch of a busy interval is split).
pub(crate) const EVENTS_PER_BATCH: usize = 512;

/// The tier's event log's capacity the daemon asks for: room for the blocks a busy pool stores and
/// evicts between two reads (at 10 ms, a million a second), past which events are dropped.
pub(crate) const EVENT_LOG_CAPACITY: usize = 1 << 16;

/// The listening address of `--kv-events ENDPOINT`: `tcp://HOST:PORT` (vLLM's form; `*` is every
/// address) or `HOST:PORT`. A non-loopback address needs a secret (`secret`).
///
/// # Errors
/// A message for an endpoint that is not TCP, does not parse, or is not loopback without a secret.
pub(crate) fn parse_endpoint(endpoint: &str, secret: bool) -> Result<SocketAddr, String> {
    let rest = match endpoint.split_once("://") {
        Some(("tcp", rest)) => rest,
        Some((scheme, _)) => return Err(format!("{scheme}:// endpoints are not served: give tcp://HOST:PORT")),
        None => endpoint,
    };
    let rest = rest.strip_prefix("*:").map(|p| format!("0.0.0.0:{p}")).unwrap_or_else(|| rest.to_string());
    let mut addrs =
        std::net::ToSocketAddrs::to_socket_addrs(&rest).map_err(|e| format!("not a HOST:PORT address ({e})"))?;
    let addr = addrs.next().ok_or("the address resolves to nothing")?;
    if !addr.ip().is_loopback() && !secret {
        return Err(format!(
            "{addr} is not a loopback address: subscribers learn which blocks the pool holds, and without a \
             secret they prove nothing; give --kv-events-secret-file (subscribers send it as their ZeroMQ PLAIN \
             password)"
        ));
    }
    Ok(addr)
}

/// The greeting of ZMTP 3.0 (RFC 23), the NULL mechanism or (`plain`) PLAIN as its server.
fn greeting(plain: bool) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3; // version 3.0
    if plain {
        g[12..17].copy_from_slice(b"PLAIN");
        g[32] = 1; // as-server
    } else {
        g[12..16].copy_from_slice(b"NULL");
    }
    g
}

/// A command frame of `name` and `body` (RFC 23: flags 0x04, a short size).
fn command(name: &[u8], body: &[u8]) -> Vec<u8> {
    let len = 1 + name.len() + body.len();
    let mut f = vec![0x04, len as u8, name.len() as u8];
    f.extend_from_slice(name);
    f.extend_from_slice(body);
    f
}

/// The password of a PLAIN `HELLO` command's body (after its name): a user name and a password,
/// each a length byte and its bytes; None for a malformed one.
fn plain_password(hello: &[u8]) -> Option<&[u8]> {
    let (&ulen, rest) = hello.split_first()?;
    let rest = rest.get(ulen as usize..)?;
    let (&plen, rest) = rest.split_first()?;
    (rest.len() == plen as usize).then_some(rest)
}

/// `READY` with `Socket-Type` `PUB`, as a command frame.
fn ready() -> Vec<u8> {
    command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x03PUB")
}

/// Appends one ZMTP frame of `body` (`more`: another frame of the message follows).
fn frame(out: &mut Vec<u8>, body: &[u8], more: bool) {
    let more = u8::from(more);
    if body.len() <= 255 {
        out.extend_from_slice(&[more, body.len() as u8]);
    } else {
        out.push(more | 0x02);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    out.extend_from_slice(body);
}

/// The three frames of one published message: topic, sequence number, payload.
pub(crate) fn message(topic: &[u8], seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(payload.len() + topic.len() + 32);
    frame(&mut m, topic, true);
    frame(&mut m, &seq.to_be_bytes(), true);
    frame(&mut m, payload, false);
    m
}

/// `events` as one MessagePack `KVEventBatch` at `ts` (seconds since the epoch); `block_size` is
/// the pool's tokens a block. Consecutive events of one kind and medium become one event.
pub(crate) fn encode_batch(ts: f64, events: &[TierEvent], block_size: u32) -> Vec<u8> {
    use rmp::encode::*;
    let mut runs: Vec<(bool, EventMedium, Vec<&[u8; 16]>)> = Vec::new();
    for e in events {
        let (stored, key, medium) = match e {
            TierEvent::Stored { key, medium } => (true, key, *medium),
            TierEvent::Removed { key, medium } => (false, key, *medium),
            _ => continue,
        };
        match runs.last_mut() {
            Some((s, m, keys)) if *s == stored && *m == medium => keys.push(key.as_bytes()),
            _ => runs.push((stored, medium, vec![key.as_bytes()])),
        }
    }
    let mut out = Vec::with_capacity(64 + events.len() * 24);
    // Writes to a Vec cannot fail.
    let w = &mut out;
    write_array_len(w, 2).expect("a Vec");
    write_f64(w, ts).expect("a Vec");
    write_array_len(w, runs.len() as u32).expect("a Vec");
    for (stored, medium, keys) in runs {
        let str = |w: &mut Vec<u8>, s: &str| write_str(w, s).expect("a Vec");
        write_map_len(w, if stored { 8 } else { 3 }).expect("a Vec");
        str(w, "type");
        str(w, if stored { "BlockStored" } else { "BlockRemoved" });
        str(w, "block_hashes");
        write_array_len(w, keys.len() as u32).expect("a Vec");
        for k in keys {
            write_bin(w, k).expect("a Vec");
        }
        if stored {
            str(w, "parent_block_hash");
            write_nil(w).expect("a Vec");
            str(w, "token_ids");
            write_array_len(w, 0).expect("a Vec");
            str(w, "block_size");
            write_uint(w, u64::from(block_size)).expect("a Vec");
            str(w, "lora_id");
            write_nil(w).expect("a Vec");
        }
        str(w, "medium");
        str(w, medium.vllm_name());
        if stored {
            str(w, "lora_name");
            write_nil(w).expect("a Vec");
        }
    }
    out
}

/// One subscriber's side of the publisher: its queue and what it subscribed to.
struct Subscriber {
    queue: Mutex<Outbox>,
    subscriptions: Mutex<Vec<Vec<u8>>>,
    wake: Notify,
    closed: AtomicBool,
}

#[derive(Default)]
struct Outbox {
    messages: VecDeque<Arc<[u8]>>,
    bytes: usize,
    /// Since when messages have been missed (the queue full), if they are now.
    missing_since: Option<Instant>,
}

impl Subscriber {
    fn wants(&self, topic: &[u8]) -> bool {
        lock(&self.subscriptions).iter().any(|s| topic.starts_with(s))
    }

    /// Queues `m` if it fits; true if the subscriber has missed messages for longer than `stalled`.
    fn offer(&self, m: &Arc<[u8]>, limits: &EventLimits, now: Instant, missed: &AtomicU64) -> bool {
        let mut q = lock(&self.queue);
        let unbounded = seeded("events-queue-unbounded");
        if q.bytes + m.len() <= limits.queue_bytes || unbounded {
            q.bytes += m.len();
            q.messages.push_back(m.clone());
            q.missing_since = None;
            drop(q);
            self.wake.notify_one();
            false
        } else {
            missed.fetch_add(1, Ordering::Relaxed);
            let since = *q.missing_since.get_or_insert(now);
            now.duration_since(since) > limits.stalled
        }
    }
}

/// What the publisher has done, logged every [`SUMMARY_EVERY`] while it changes.
#[derive(Default)]
struct Counts {
    published: AtomicU64,
    refused: AtomicU64,
    missed: AtomicU64,
    dropped_by_log: AtomicU64,
}

/// How often the publisher's counts are logged (when they changed).
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

impl Counts {
    fn summary(&self) -> [u64; 4] {
        [&self.published, &self.refused, &self.missed, &self.dropped_by_log].map(|c| c.load(Ordering::Relaxed))
    }
}

/// Binds `addr` (before the daemon prints its start line, so a port 0 is known).
///
/// # Errors
/// The bind's error.
pub(crate) fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves subscribers on `listener` and publishes `tier`'s events under `topic` until the process
/// ends. Runs on the calling thread.
pub(crate) fn run(
    listener: std::net::TcpListener,
    tier: HostTier,
    topic: String,
    secret: Option<Arc<[u8]>>,
    limits: EventLimits,
) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("the KV event publisher cannot start its runtime: {e}; no events are published");
            return;
        }
    };
    rt.block_on(async move {
        let listener = match TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("the KV event socket: {e}; no events are published");
                return;
            }
        };
        let subs: Arc<Mutex<Vec<Arc<Subscriber>>>> = Arc::default();
        let counts = Arc::new(Counts::default());
        let connected = Arc::new(AtomicU64::new(0));
        tokio::spawn(publish(tier, topic.into_bytes(), subs.clone(), counts.clone(), limits));
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!("KV event socket accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            // (Seeded bug, tests only: `events-subscribers-unbounded` takes every connection.)
            if connected.load(Ordering::Relaxed) >= limits.subscribers as u64 && !seeded("events-subscribers-unbounded")
            {
                counts.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%peer, "KV event subscriber refused: {} connected already", limits.subscribers);
                drop(stream);
                continue;
            }
            connected.fetch_add(1, Ordering::Relaxed);
            let (subs, connected, secret) = (subs.clone(), connected.clone(), secret.clone());
            tokio::spawn(async move {
                if let Err(e) = serve(stream, &subs, secret.as_deref(), limits).await {
                    tracing::debug!(%peer, "KV event subscriber gone: {e}");
                }
                connected.fetch_sub(1, Ordering::Relaxed);
            });
        }
    });
}

/// Reads the tier's event log every `limits.interval` and queues each batch for the subscribers.
async fn publish(
    tier: HostTier,
    topic: Vec<u8>,
    subs: Arc<Mutex<Vec<Arc<Subscriber>>>>,
    counts: Arc<Counts>,
    limits: EventLimits,
) {
    let block_size = tier.geometry().page_tokens();
    let mut events = Vec::new();
    let mut seq = 0u64;
    let mut lost_seen = 0;
    let mut tick = tokio::time::interval(limits.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut logged, mut logged_at) = (counts.summary(), Instant::now());
    loop {
        tick.tick().await;
        if logged_at.elapsed() >= SUMMARY_EVERY && counts.summary() != logged {
            let [published, refused, missed, dropped] = counts.summary();
            tracing::info!(
                "KV events so far: {published} batches published, {refused} subscribers refused (over \
                 --kv-events-subscribers), {missed} batches missed by slow subscribers, {dropped} events dropped by \
                 the pool's log"
            );
            (logged, logged_at) = (counts.summary(), Instant::now());
        }
        events.clear();
        let lost = tier.take_events(&mut events);
        if lost > lost_seen {
            tracing::warn!("the pool's event log dropped {} events (a burst larger than it holds)", lost - lost_seen);
            counts.dropped_by_log.store(lost, Ordering::Relaxed);
            lost_seen = lost;
        }
        if events.is_empty() {
            continue;
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let now = Instant::now();
        let subscribers: Vec<Arc<Subscriber>> = lock(&subs).clone();
        for chunk in events.chunks(EVENTS_PER_BATCH) {
            let m: Arc<[u8]> = message(&topic, seq, &encode_batch(ts, chunk, block_size)).into();
            seq += 1;
            counts.published.fetch_add(1, Ordering::Relaxed);
            for s in &subscribers {
                if s.wants(&topic) && s.offer(&m, &limits, now, &counts.missed) {
                    tracing::info!("a KV event subscriber missed messages for {:?}: disconnected", limits.stalled);
                    s.closed.store(true, Ordering::Relaxed);
                    s.wake.notify_one();
                }
            }
        }
    }
}

/// One subscriber's connection: the handshake, then its queue written out while its
/// subscriptions are read.
async fn serve(
    stream: TcpStream,
    subs: &Arc<Mutex<Vec<Arc<Subscriber>>>>,
    secret: Option<&[u8]>,
    limits: EventLimits,
) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "the ZMTP handshake took too long");
    let invalid = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    tokio::time::timeout(limits.handshake, async {
        wr.write_all(&greeting(secret.is_some())).await?;
        let mut peer = [0u8; 64];
        rd.read_exact(&mut peer).await?;
        let mechanism: &[u8] = if secret.is_some() { b"PLAIN\0" } else { b"NULL\0" };
        if peer[0] != 0xFF || peer[9] != 0x7F || peer[10] < 3 || &peer[12..12 + mechanism.len()] != mechanism {
            return Err(invalid("not a ZMTP 3 greeting of this socket's mechanism"));
        }
        if let Some(secret) = secret {
            // PLAIN (RFC 24): HELLO (user name, password) -> WELCOME; then INITIATE -> READY.
            let (flags, body) = read_frame(&mut rd).await?;
            let password = body.strip_prefix(b"\x05HELLO").filter(|_| flags & 0x04 != 0).and_then(plain_password);
            // (Seeded bug, tests only: `events-password-unchecked` takes any password.)
            if !password.is_some_and(|p| kvtier::secrets_equal(p, secret) || seeded("events-password-unchecked")) {
                let why = b"the KV event socket's secret (--kv-events-secret-file) was not given";
                let mut body = vec![why.len() as u8];
                body.extend_from_slice(why);
                wr.write_all(&command(b"ERROR", &body)).await?;
                return Err(invalid("a subscriber without the secret"));
            }
            wr.write_all(&command(b"WELCOME", b"")).await?;
            let (flags, body) = read_frame(&mut rd).await?;
            if flags & 0x04 == 0 || !body.starts_with(b"\x08INITIATE") {
                return Err(invalid("no INITIATE command"));
            }
            wr.write_all(&ready()).await?;
        } else {
            wr.write_all(&ready()).await?;
            let (flags, body) = read_frame(&mut rd).await?;
            if flags & 0x04 == 0 || !body.starts_with(b"\x05READY") {
                return Err(invalid("no READY command"));
            }
        }
        Ok(())
    })
    .await
    .map_err(|_| timed_out())??;
    let sub = Arc::new(Subscriber {
        queue: Mutex::default(),
        subscriptions: Mutex::default(),
        wake: Notify::new(),
        closed: AtomicBool::new(false),
    });
    lock(subs).push(sub.clone());
    let reader = tokio::spawn(read_subscriptions(rd, sub.clone()));
    let result = async {
        loop {
            if sub.closed.load(Ordering::Relaxed) {
                return Ok(());
            }
            let next = {
                let mut q = lock(&sub.queue);
                let m = q.messages.pop_front();
                if let Some(m) = &m {
                    q.bytes -= m.len();
                }
                m
            };
            match next {
                // A subscriber that takes no byte for `stalled` is gone (its queue is full by then).
                Some(m) => tokio::time::timeout(limits.stalled, wr.write_all(&m))
                    .await
                    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the subscriber reads nothing"))??,
                None => sub.wake.notified().await,
            }
        }
    }
    .await;
    reader.abort();
    lock(subs).retain(|s| !Arc::ptr_eq(s, &sub));
    result
}

/// Reads the subscriber's frames until it goes: subscriptions and unsubscriptions (ZMTP 3.0
/// messages `\x01TOPIC` / `\x00TOPIC`, or 3.1 commands `SUBSCRIBE` / `CANCEL`); anything else is
/// ignored. Ends the connection (through `closed`) on end of stream or a bad frame.
async fn read_subscriptions(mut rd: OwnedReadHalf, sub: Arc<Subscriber>) {
    while let Ok((flags, body)) = read_frame(&mut rd).await {
        let (on, topic) = if flags & 0x04 != 0 {
            if let Some(t) = body.strip_prefix(b"\x09SUBSCRIBE") {
                (true, t)
            } else if let Some(t) = body.strip_prefix(b"\x06CANCEL") {
                (false, t)
            } else {
                continue;
            }
        } else {
            match body.split_first() {
                Some((1, t)) => (true, t),
                Some((0, t)) => (false, t),
                _ => continue,
            }
        };
        let mut s = lock(&sub.subscriptions);
        if on {
            if s.len() < MAX_SUBSCRIPTIONS {
                s.push(topic.to_vec());
            }
        } else if let Some(i) = s.iter().position(|x| x == topic) {
            s.remove(i);
        }
    }
    sub.closed.store(true, Ordering::Relaxed);
    sub.wake.notify_one();
}

/// Subscriptions one subscriber may hold (more are ignored).
const MAX_SUBSCRIPTIONS: usize = 64;
/// The largest frame a subscriber may send (a subscription's topic).
const MAX_FRAME: u64 = 4096;

/// One frame from the subscriber: (flags, body).
async fn read_frame(rd: &mut OwnedReadHalf) -> std::io::Result<(u8, Vec<u8>)> {
    let flags = rd.read_u8().await?;
    let len = if flags & 0x02 != 0 { rd.read_u64().await? } else { u64::from(rd.read_u8().await?) };
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a {len}-byte frame")));
    }
    let mut body = vec![0; len as usize];
    rd.read_exact(&mut body).await?;
    Ok((flags, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_tcp_and_loopback_unless_public() {
        assert_eq!(parse_endpoint("tcp://127.0.0.1:5557", false).unwrap(), "127.0.0.1:5557".parse().unwrap());
        assert_eq!(parse_endpoint("127.0.0.1:0", false).unwrap().port(), 0);
        assert!(parse_endpoint("tcp://*:5557", false).unwrap_err().contains("--kv-events-secret-file"));
        assert_eq!(parse_endpoint("tcp://*:5557", true).unwrap(), "0.0.0.0:5557".parse().unwrap());
        assert!(parse_endpoint("ipc:///tmp/x", false).unwrap_err().contains("tcp://HOST:PORT"));
        assert!(parse_endpoint("tcp://nowhere", false).is_err());
    }

    #[test]
    fn a_batch_groups_runs_of_one_kind_and_medium() {
        let k = |b| kvtier::ContentKey::from_bytes([b; 16]);
        let events = [
            TierEvent::Stored { key: k(1), medium: EventMedium::Host },
            TierEvent::Stored { key: k(2), medium: EventMedium::Host },
            TierEvent::Removed { key: k(1), medium: EventMedium::Host },
            TierEvent::Stored { key: k(2), medium: EventMedium::Disk },
        ];
        let b = encode_batch(1.5, &events, 16);
        let mut r = &b[..];
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 2);
        assert_eq!(rmp::decode::read_f64(&mut r).unwrap(), 1.5);
        assert_eq!(rmp::decode::read_array_len(&mut r).unwrap(), 3, "three runs");
        assert_eq!(rmp::decode::read_map_len(&mut r).unwrap(), 8);
    }

    #[test]
    fn a_subscriber_queues_up_to_its_bound_then_misses_and_is_dropped_once_stalled() {
        let limits = EventLimits { queue_bytes: 100, stalled: Duration::from_secs(30), ..EventLimits::default() };
        let sub = Subscriber {
            queue: Mutex::default(),
            subscriptions: Mutex::default(),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
        };
        let missed = AtomicU64::new(0);
        let m: Arc<[u8]> = vec![0u8; 40].into();
        let t0 = Instant::now();
        assert!(!sub.offer(&m, &limits, t0, &missed) && !sub.offer(&m, &limits, t0, &missed));
        assert!(!sub.offer(&m, &limits, t0, &missed), "a third message misses, not yet stalled");
        let q = lock(&sub.queue);
        assert_eq!((q.messages.len(), q.bytes, missed.load(Ordering::Relaxed)), (2, 80, 1), "the queue is bounded");
        drop(q);
        assert!(!sub.offer(&m, &limits, t0 + Duration::from_secs(30), &missed));
        assert!(sub.offer(&m, &limits, t0 + Duration::from_secs(31), &missed), "missing for longer than stalled");
        // Room again: the subscriber catches up and is no longer missing.
        lock(&sub.queue).messages.clear();
        lock(&sub.queue).bytes = 0;
        assert!(!sub.offer(&m, &limits, t0 + Duration::from_secs(90), &missed));
        assert_eq!(lock(&sub.queue).missing_since, None);
    }

    #[test]
    fn frames_longer_than_255_bytes_take_the_long_form() {
        let m = message(b"t", 7, &[9u8; 300]);
        assert_eq!(&m[..2], &[1, 1]);
        assert_eq!(&m[3..5], &[1, 8]);
        assert_eq!(&m[5..13], &7u64.to_be_bytes());
        assert_eq!(m[13], 0x02);
        assert_eq!(&m[14..22], &300u64.to_be_bytes());
        assert_eq!(m.len(), 22 + 300);
    }
}

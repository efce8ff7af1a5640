//! `kvtierd`: the kvtier tier daemon. One host pool in shared memory, served to every engine process
//! that connects to its Unix socket (`kvtier::HostTier::connect`). See `docs/design.md` ("The tier
//! daemon") for the protocol and what happens when an engine dies.

mod events;
mod http;
mod seeded;

use clap::Parser;
use kvtier::prometheus_client::registry::Registry;
use kvtier::{ArenaSpec, BackingChoice, Geometry, HostTier, PolicyKind, PoolConfig, SsdConfig, TierConfig};
use kvtier::{Limits, PoolHealth, Server, ServerConfig};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The kvtier tier daemon: one host-memory KV-cache pool in shared memory for every engine process.
#[derive(Parser, Debug)]
#[command(name = "kvtierd", version)]
struct Args {
    /// Unix socket to listen on [default: $XDG_RUNTIME_DIR/kvtierd.sock; as root
    /// /run/kvtierd/kvtierd.sock; else /tmp/kvtierd-$UID/kvtierd.sock]. Its directory is created
    /// (0700) if missing; a stale socket there is replaced, anything else is left alone (an error).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Let members of group NAME connect too: the socket becomes 0660 of that group (default: 0600,
    /// the daemon's own uid only). The socket's directory must let the group reach it.
    #[arg(long, value_name = "NAME")]
    group: Option<String>,
    /// Connections served at once; one more is refused with a typed error.
    #[arg(long, default_value_t = Limits::default().connections)]
    max_connections: usize,
    /// Connections one process (its pid) has open at once; one more is refused with a typed error,
    /// so one process cannot lock other engines out.
    #[arg(long, default_value_t = Limits::default().connections_per_process)]
    max_connections_per_process: usize,
    /// Seconds from accept to a complete hello.
    #[arg(long, default_value_t = Limits::default().hello_timeout.as_secs_f64())]
    hello_timeout: f64,
    /// Seconds a request frame may take to arrive once it has begun.
    #[arg(long, default_value_t = Limits::default().frame_timeout.as_secs_f64())]
    frame_timeout: f64,
    /// Seconds a reply may wait for its client to read it; past it the connection is closed.
    #[arg(long, default_value_t = Limits::default().write_timeout.as_secs_f64())]
    write_timeout: f64,
    /// Largest request frame, bytes (at most 64 MiB).
    #[arg(long, default_value_t = Limits::default().frame_bytes)]
    max_frame_bytes: usize,
    /// Keys one query, save, hint or audit may name.
    #[arg(long, default_value_t = Limits::default().keys_per_request)]
    max_keys_per_request: usize,
    /// Hints one connection holds at once.
    #[arg(long, default_value_t = Limits::default().hints_per_connection)]
    max_hints: usize,
    /// Distinct keys over one connection's hints.
    #[arg(long, default_value_t = Limits::default().hint_keys_per_connection)]
    max_hint_keys: usize,
    /// Lease handles one connection holds at once.
    #[arg(long, default_value_t = Limits::default().leases_per_connection)]
    max_leases: usize,
    /// Blocks over the lease handles one connection holds.
    #[arg(long, default_value_t = Limits::default().leased_blocks_per_connection)]
    max_leased_blocks: usize,
    /// Saves and restores one connection has in flight at once.
    #[arg(long, default_value_t = Limits::default().copies_per_connection)]
    max_copies: usize,
    /// Slots one process holds being written or withheld over all its connections (0: half the
    /// pool's capacity).
    #[arg(long, default_value_t = Limits::default().slots_per_process)]
    max_slots_per_process: usize,
    /// Slots being written or withheld over every process at once (0: the pool's capacity). Each
    /// process's fair share is this divided by the processes connected (or holding such slots);
    /// a save past its share is served only from what the other connected processes' unheld
    /// shares leave, so processes that never finish their copies cannot take the others' shares
    /// (slots taken before a process connected come back as those saves end).
    #[arg(long, default_value_t = Limits::default().writing_slots)]
    max_writing_slots: usize,
    /// Bytes the hint tables may take over every connection's hints (256 B a hint, 114 B a key it
    /// names; the default holds about 2.3 million hinted keys); a hint past it is refused typed.
    #[arg(long, default_value_t = Limits::default().hint_bytes)]
    max_hint_bytes: usize,
    /// Uses one lease may have.
    #[arg(long, default_value_t = Limits::default().lease_uses)]
    max_lease_uses: u32,
    /// Stack size of a connection's thread, bytes.
    #[arg(long, default_value_t = Limits::default().thread_stack_bytes)]
    thread_stack: usize,
    /// Block layout preset: glm52, qwen3-4b, deepseek-v3, deepseek-v3-bf16, llama3-8b.
    #[arg(long, conflicts_with_all = ["model", "arena"])]
    geometry: Option<String>,
    /// Model name of a custom layout (with --page-tokens and --arena).
    #[arg(long, requires = "arena")]
    model: Option<String>,
    /// Tokens per page of a custom layout.
    #[arg(long, default_value_t = 16)]
    page_tokens: u32,
    /// One arena of a custom layout, NAME:BYTES_PER_PAGE, in order (repeat).
    #[arg(long)]
    arena: Vec<String>,
    /// Tensor-parallel shard INDEX/COUNT the blocks belong to.
    #[arg(long)]
    shard: Option<String>,
    /// Host memory for block slots: bytes, or a number with a unit: GB, MB (10^9, 10^6 B) or GiB,
    /// MiB (2^30, 2^20 B); units are case-sensitive (4gb is refused). Capacity = floor(pool / slot
    /// size) slots; the start-up line says the bytes chosen.
    #[arg(long, default_value = "4GiB")]
    pool: String,
    /// Eviction policy: lru, clock, sieve, s3fifo, 2q, prefix-lfu, prefix-tinylfu, adaptive-lfu.
    #[arg(long, default_value_t = PolicyKind::default().name().to_string())]
    policy: String,
    /// Pages behind the pool: auto (hugetlb if reserved, else 4 KiB), hugetlb, thp, plain.
    #[arg(long, default_value = "auto")]
    backing: String,
    /// Settle leases older than this many seconds (an engine that forgets one pins at most this
    /// long) [default: never].
    #[arg(long)]
    lease_ttl: Option<f64>,
    /// Touch every page at start (no page faults on first saves). Refused unless MemAvailable
    /// less the pool stays at least max(1 GiB, 5% of MemTotal) (see --overcommit).
    #[arg(long)]
    prefault: bool,
    /// Lock the pool in memory (refused if the pool exceeds RLIMIT_MEMLOCK, unless the daemon has
    /// CAP_IPC_LOCK).
    #[arg(long)]
    mlock: bool,
    /// Map a pool larger than memory can back, on purpose. Without it a pool larger than physical
    /// memory (MemTotal less the hugetlb pool), or with --prefault or --mlock one that would leave
    /// less than max(1 GiB, 5% of MemTotal) of MemAvailable (the headroom kept for the engines and
    /// the kernel), is refused at start (hugetlb pools are checked against the free 2 MiB pages).
    #[arg(long)]
    overcommit: bool,
    /// Bind the pool to this NUMA node.
    #[arg(long)]
    numa_node: Option<u32>,
    /// An SSD tier under the pool: a file of disk slots at PATH taking SIZE bytes (a size as for
    /// --pool, e.g. /mnt/nvme0/kvtier.ssd:2TiB), one --ssd per drive. Its directory must exist; a
    /// missing file is created and preallocated (4096 B + slots of the block and its trailer,
    /// rounded up to 4 KiB), an existing one is reopened and its blocks served again after a
    /// restart. Evicted blocks the drive holds come back into the pool when a query reaches them.
    #[arg(long, value_name = "PATH:SIZE")]
    ssd: Vec<String>,
    /// How blocks are admitted to the SSD tier: `N` uses (its save is the first, each query that
    /// leases it one more; 1 writes every saved block to the drive), or `auto` (after 1 or 2 uses,
    /// decided online from the drive's ghost hits; the default).
    #[arg(long, value_name = "N|auto", default_value = "auto")]
    ssd_admit: String,
    /// Serve Prometheus metrics at http://ADDR/metrics (OpenMetrics text) and health at
    /// http://ADDR/healthz (e.g. 127.0.0.1:9464; port 0 picks a free one, printed at start).
    /// On a non-loopback address /metrics needs --metrics-token-file. One thread serves every
    /// connection (HTTP/1.1, hyper), with --metrics-connections open at most and --metrics-timeout
    /// on every read and write; no connection lives past 60 s, so no client holds a thread or
    /// delays another's answer.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
    /// A file (mode 0600, at least 16 bytes) whose contents /metrics asks of every scrape as
    /// `Authorization: Bearer CONTENTS` (Prometheus: `authorization: {credentials_file: PATH}`);
    /// /healthz stays open (it tells healthy or not, nothing else). Needed with --metrics on an
    /// address other than loopback.
    #[arg(long, value_name = "PATH", requires = "metrics")]
    metrics_token_file: Option<PathBuf>,
    /// Seconds the pool may have no free or evictable slot (every slot pinned, being written or
    /// quarantined) before /healthz answers 503.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0, requires = "metrics")]
    healthz_bound: f64,
    /// HTTP connections the metrics endpoint keeps open at once; one more closes the oldest. All of
    /// them are served by one thread, whatever their clients do.
    #[arg(long, value_name = "N", default_value_t = http::HttpLimits::default().connections, requires = "metrics")]
    metrics_connections: usize,
    /// Seconds the metrics endpoint waits for a request's head, for a byte to read or for the
    /// client to take a byte written; past it the connection is closed. No connection lives past
    /// 60 s.
    #[arg(long, value_name = "SECONDS", default_value_t = http::HttpLimits::default().timeout.as_secs_f64(),
          requires = "metrics")]
    metrics_timeout: f64,
    /// Publish the pool's KV events (every block stored and evicted, host and SSD tier) to routers
    /// on a ZeroMQ PUB socket at ENDPOINT (tcp://HOST:PORT or HOST:PORT; port 0 picks a free one,
    /// printed at start), in vLLM's KVEventBatch format: what vLLM's --kv-events-config
    /// subscribers read. On an address other than loopback it needs --kv-events-secret-file.
    #[arg(long, value_name = "ENDPOINT")]
    kv_events: Option<String>,
    /// The topic of every KV event message (subscribers filter on its prefix; vLLM's default is
    /// empty).
    #[arg(long, value_name = "TOPIC", default_value = "", requires = "kv_events")]
    kv_events_topic: String,
    /// Subscribers the KV event socket serves at once; one more is closed at once. Each holds at
    /// most 8 MiB of unsent events (past it, it misses batches; missing them for 30 s
    /// disconnects it).
    #[arg(long, value_name = "N", default_value_t = events::EventLimits::default().subscribers, requires = "kv_events")]
    kv_events_subscribers: usize,
    /// A file (mode 0600, at least 16 bytes) whose contents every KV event subscriber must give as
    /// its ZeroMQ PLAIN password (pyzmq: `sock.plain_username = b"kvtier"`, `sock.plain_password =
    /// CONTENTS`); without it the socket speaks ZeroMQ's NULL mechanism, which authenticates no
    /// one, and listens on loopback only.
    #[arg(long, value_name = "PATH", requires = "kv_events")]
    kv_events_secret_file: Option<PathBuf>,
    /// Serve this pool's blocks to other kvtier instances (peers, e.g. decode engines fetching a
    /// prefill's blocks) at ADDR (host:port; port 0 picks a free one, printed at start): the peer
    /// control protocol over TCP, the bytes read one-sided from the pool through NIXL, whose
    /// runtime (libnixl_capi.so and its UCX plugin) must be on LD_LIBRARY_PATH and
    /// NIXL_PLUGIN_DIR. Peers must prove the secret of --peer-secret-file before anything is
    /// answered; an address that is not loopback needs it. An authenticated peer can read any
    /// block of the pool (NIXL's reads are one-sided, over the whole registered pool): share the
    /// secret only with instances trusted with the pool, on a private network. Needs a build
    /// with feature `nixl` (without it, refused at start).
    #[arg(long, value_name = "ADDR")]
    peer_listen: Option<String>,
    /// The peers' shared secret: a file of at least 16 bytes (a trailing newline is cut) that
    /// its group and others cannot read (mode 0600), the same on every instance of the group.
    /// Proven both ways in each peer connection's hello (HMAC-SHA-256 over fresh nonces), by
    /// --peer-listen's peers and to --peer's owners. Needs a build with feature `nixl`
    /// (without it, refused at start).
    #[arg(long, value_name = "PATH")]
    peer_secret_file: Option<std::path::PathBuf>,
    /// Blocks peers may keep pinned at once over all their connections [default: all but an
    /// eighth of the pool's slots], so the engines' own saves keep victims.
    #[arg(long, value_name = "N", requires = "peer_listen")]
    peer_pinned_blocks: Option<usize>,
    /// Read from the peer at ADDR (host:port of another instance's `--peer-listen`; repeat for
    /// several, asked in order): a client's query whose prefix ends short here asks the peers for
    /// the keys after it, and the blocks they hold are read through NIXL into this pool (the next
    /// query hits here) and leased to the client, marked as from a peer. The peers must serve the
    /// same model (namespace) and block size. Needs a build with feature `nixl`
    /// (without it, refused at start).
    #[arg(long = "peer", value_name = "ADDR")]
    peers: Vec<String>,
    /// Milliseconds a query may spend on its peers (connecting, the owner's lease, the read, the
    /// generation check); past it the client gets the prefix held so far.
    #[arg(long, value_name = "MS", default_value_t = 2000, requires = "peers")]
    peer_timeout_ms: u64,
}

/// The refusal of a peer flag by a build without the `nixl` feature.
#[cfg(not(feature = "nixl"))]
const NO_NIXL: &str =
    "kvtierd was built without the `nixl` feature: rebuild with `cargo build --release -p kvtierd --features nixl`";

/// The first peer flag given, in a build without the `nixl` feature (the flags exist in every
/// build so that such a build says why it cannot serve them, not "unexpected argument").
#[cfg(not(feature = "nixl"))]
fn peer_flag_without_nixl(a: &Args) -> Option<&'static str> {
    let _ = a.peer_timeout_ms; // Only with --peer (clap `requires`), refused with it.
    if a.peer_listen.is_some() {
        Some("--peer-listen")
    } else if !a.peers.is_empty() {
        Some("--peer")
    } else if a.peer_secret_file.is_some() {
        Some("--peer-secret-file")
    } else if a.peer_pinned_blocks.is_some() {
        Some("--peer-pinned-blocks")
    } else {
        None
    }
}

/// What `--peer-listen` and `--peer` give: the peer server in front of the pool, and the peers
/// this daemon reads from.
#[cfg(feature = "nixl")]
struct PeerRoles {
    server: Option<kvtier::PeerServer>,
    readers: Option<std::sync::Arc<kvtier::PeerSet>>,
}

/// With `--peer-listen` or `--peer`: one NIXL transport over the daemon's pool (registered once),
/// a peer server in front of it and the configured peers to read from (each only with its flag).
///
/// # Errors
/// A message naming the flag: a secret file that cannot be used, a listen address that is not
/// loopback without a secret, the NIXL runtime missing, an address that cannot be bound, a pin
/// budget of 0, a peer address empty or given twice.
#[cfg(feature = "nixl")]
fn peer_roles(a: &Args, tier: &HostTier) -> Result<PeerRoles, String> {
    let flag = match (&a.peer_listen, a.peers.first()) {
        (None, None) if a.peer_secret_file.is_some() => {
            return Err("--peer-secret-file: needs --peer-listen or --peer".into())
        }
        (None, None) => return Ok(PeerRoles { server: None, readers: None }),
        (Some(addr), _) => format!("--peer-listen {addr}"),
        (None, Some(addr)) => format!("--peer {addr}"),
    };
    let secret = match &a.peer_secret_file {
        Some(p) => Some(kvtier::PeerSecret::from_file(p).map_err(|e| format!("--peer-secret-file: {e}"))?),
        None => None,
    };
    // Checked before NIXL starts (PeerServer::bind checks it too): an open port without a secret
    // lets anybody who reaches it read the pool.
    if let (Some(addr), None) = (&a.peer_listen, &secret) {
        use std::net::ToSocketAddrs;
        let open =
            addr.to_socket_addrs().map_err(|e| format!("--peer-listen {addr}: {e}"))?.any(|s| !s.ip().is_loopback());
        if open {
            return Err(format!(
                "--peer-listen {addr}: not a loopback address, so it needs --peer-secret-file (without a secret \
                 anybody who reaches the port reads the pool)"
            ));
        }
    }
    let transport: std::sync::Arc<dyn kvtier::PeerTransport> = std::sync::Arc::new(
        kvtier::NixlTransport::new(&kvtier::unique_agent_name("kvtierd"), tier.pool())
            .map_err(|e| format!("{flag}: {e}"))?,
    );
    let server = match &a.peer_listen {
        None => None,
        Some(addr) => {
            let limits = kvtier::PeerLimits { pinned_blocks: a.peer_pinned_blocks, ..kvtier::PeerLimits::default() };
            Some(
                kvtier::PeerServer::bind_with_secret(tier, addr.as_str(), transport.clone(), limits, secret.clone())
                    .map_err(|e| format!("--peer-listen {addr}: {e}"))?,
            )
        }
    };
    let readers = if a.peers.is_empty() {
        None
    } else {
        let set = kvtier::PeerSet::new(tier, transport, a.peers.iter().cloned())
            .map_err(|e| format!("--peer {}: {e}", a.peers.join(",")))?
            .with_secret(secret);
        Some(std::sync::Arc::new(set))
    };
    Ok(PeerRoles { server, readers })
}

fn geometry(a: &Args) -> Result<Geometry, String> {
    let g = match (&a.geometry, &a.model) {
        (Some(p), _) => Geometry::preset(p, 1).map_err(|e| e.to_string())?,
        (None, Some(model)) => {
            let arenas = a
                .arena
                .iter()
                .map(|s| {
                    let (name, bytes) = s.split_once(':').ok_or_else(|| format!("--arena {s}: expected NAME:BYTES"))?;
                    let bytes = bytes.parse::<u64>().map_err(|e| format!("--arena {s}: {e}"))?;
                    Ok(ArenaSpec::packed(name, bytes, 1))
                })
                .collect::<Result<Vec<_>, String>>()?;
            Geometry::new(model, a.page_tokens, arenas).map_err(|e| e.to_string())?
        }
        (None, None) => return Err("give --geometry PRESET, or --model with --arena NAME:BYTES".into()),
    };
    match &a.shard {
        None => Ok(g),
        Some(s) => {
            let (i, n) = s.split_once('/').ok_or_else(|| format!("--shard {s}: expected INDEX/COUNT"))?;
            let (i, n) = (i.parse::<u32>().map_err(|e| e.to_string())?, n.parse::<u32>().map_err(|e| e.to_string())?);
            g.with_shard(i, n).map_err(|e| e.to_string())
        }
    }
}

fn config(a: &Args) -> Result<TierConfig, String> {
    let g = geometry(a)?;
    let bytes = kvtier::parse_bytes(&a.pool).map_err(|e| format!("--pool {e}"))?;
    let backing = match a.backing.as_str() {
        "auto" => BackingChoice::Auto,
        "hugetlb" => BackingChoice::HugeTlb,
        "thp" => BackingChoice::TransparentHuge,
        "plain" => BackingChoice::Plain,
        b => return Err(format!("--backing {b}: expected auto, hugetlb, thp or plain")),
    };
    let mut pool = PoolConfig::new(bytes)
        .with_backing(backing)
        .with_prefault(a.prefault)
        .with_mlock(a.mlock)
        .with_overcommit(a.overcommit);
    if let Some(n) = a.numa_node {
        pool = pool.with_numa_node(n);
    }
    let policy = a.policy.parse::<PolicyKind>().map_err(|e| e.to_string())?;
    let ssd = ssd_config(a, &g)?;
    let mut cfg = TierConfig::new(g, bytes).with_pool(pool).with_policy(policy);
    if let Some(ssd) = ssd {
        cfg = cfg.with_ssd(ssd);
    }
    if let Some(ttl) = a.lease_ttl {
        let ttl =
            Duration::try_from_secs_f64(ttl).map_err(|_| format!("--lease-ttl {ttl}: not a number of seconds"))?;
        cfg = cfg.with_lease_ttl(ttl);
    }
    if let Some(endpoint) = &a.kv_events {
        events::parse_endpoint(endpoint, a.kv_events_secret_file.is_some())
            .map_err(|e| format!("--kv-events {endpoint}: {e}"))?;
        if a.kv_events_subscribers == 0 {
            return Err("--kv-events-subscribers must be above zero".into());
        }
        cfg = cfg.with_events(events::EVENT_LOG_CAPACITY);
    }
    Ok(cfg)
}

/// The SSD tier of `--ssd` and `--ssd-admit` for blocks of `g` (none without `--ssd`), every file
/// checked to hold at least one block before any is created.
fn ssd_config(a: &Args, g: &Geometry) -> Result<Option<SsdConfig>, String> {
    if a.ssd_admit.trim() == "0" {
        return Err("--ssd-admit 0: a block needs at least one use (its save) to be admitted".into());
    }
    let admit: kvtier::SsdAdmit = a.ssd_admit.parse().map_err(|e: kvtier::BadSsdAdmit| format!("--ssd-admit: {e}"))?;
    let mut config: Option<SsdConfig> = None;
    for s in &a.ssd {
        let f = kvtier::parse_ssd_file(s).map_err(|e| format!("--ssd {s}: {e}"))?;
        if g.disk_slots(f.bytes) == 0 {
            return Err(format!(
                "--ssd {s}: {} B hold no block of {} B (a 4096 B header, then disk slots of {} B)",
                f.bytes,
                g.slot_bytes(),
                g.disk_slot_bytes()
            ));
        }
        config = Some(match config {
            None => SsdConfig::new(f.path, f.bytes),
            Some(c) => c.with_file(f.path, f.bytes),
        });
    }
    Ok(config.map(|c| c.with_admit(admit)))
}

fn seconds(flag: &str, s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("--{flag} {s}: not a number of seconds"))
}

fn server_config(a: &Args) -> Result<ServerConfig, String> {
    let limits = Limits {
        connections: a.max_connections,
        connections_per_process: a.max_connections_per_process,
        hello_timeout: seconds("hello-timeout", a.hello_timeout)?,
        frame_timeout: seconds("frame-timeout", a.frame_timeout)?,
        write_timeout: seconds("write-timeout", a.write_timeout)?,
        frame_bytes: a.max_frame_bytes,
        keys_per_request: a.max_keys_per_request,
        hints_per_connection: a.max_hints,
        hint_keys_per_connection: a.max_hint_keys,
        leases_per_connection: a.max_leases,
        leased_blocks_per_connection: a.max_leased_blocks,
        copies_per_connection: a.max_copies,
        lease_uses: a.max_lease_uses,
        slots_per_process: a.max_slots_per_process,
        writing_slots: a.max_writing_slots,
        hint_bytes: a.max_hint_bytes,
        thread_stack_bytes: a.thread_stack,
    };
    let group = match &a.group {
        None => None,
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => Some(g.gid.as_raw()),
            Ok(None) => return Err(format!("--group {name}: no such group")),
            Err(e) => return Err(format!("--group {name}: {e}")),
        },
    };
    Ok(ServerConfig { limits, group })
}

/// Raises the soft limit on open files to the hard limit: each connection holds its socket and a
/// pidfd of its process, so the default soft limit (often 1,024) would bound connections below
/// `--max-connections`.
fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        tracing::warn!("getrlimit(RLIMIT_NOFILE): {}", std::io::Error::last_os_error());
        return;
    }
    if r.rlim_cur < r.rlim_max {
        let want = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
        // SAFETY: setrlimit reads one rlimit from `want`, which lives for the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
            tracing::warn!("setrlimit(RLIMIT_NOFILE, {}): {}", r.rlim_max, std::io::Error::last_os_error());
        }
    }
}

/// The `--metrics` endpoint: its listening socket, what it answers from and its bounds.
struct MetricsEndpoint {
    listener: std::net::TcpListener,
    addr: std::net::SocketAddr,
    endpoint: http::Endpoint,
    limits: http::HttpLimits,
}

/// `more` adds further families (the peer server's) to the registry.
fn metrics_endpoint(
    addr: &str,
    a: &Args,
    server: &Server,
    more: impl FnOnce(&mut Registry),
) -> Result<MetricsEndpoint, String> {
    let bound = seconds("healthz-bound", a.healthz_bound)?;
    let timeout = seconds("metrics-timeout", a.metrics_timeout)?;
    if timeout.is_zero() || a.metrics_connections == 0 {
        return Err("--metrics-timeout and --metrics-connections must be above zero".into());
    }
    let token = match &a.metrics_token_file {
        Some(path) => Some(kvtier::read_secret_file(path).map_err(|e| format!("--metrics-token-file {e}"))?),
        None => None,
    };
    let listener = std::net::TcpListener::bind(addr).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    if !addr.ip().is_loopback() && token.is_none() {
        return Err(format!(
            "{addr} is not a loopback address: /metrics tells the pool's traffic to whoever asks; give \
             --metrics-token-file (scrapes send it as `Authorization: Bearer TOKEN`)"
        ));
    }
    let mut registry = Registry::default();
    server.register_metrics(&mut registry);
    more(&mut registry);
    Ok(MetricsEndpoint {
        listener,
        addr,
        endpoint: http::Endpoint { registry, health: PoolHealth::new(server.tier(), bound), token },
        limits: http::HttpLimits { connections: a.metrics_connections, timeout },
    })
}

/// Colour in the log only on a terminal, and never with `NO_COLOR` set to anything non-empty
/// (<https://no-color.org>).
fn log_colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

const GIB: f64 = (1u64 << 30) as f64;

/// `RLIMIT_MEMLOCK` as a person reads it.
fn memlock_text() -> String {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return format!("unknown ({})", std::io::Error::last_os_error());
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} B", r.rlim_cur)
    }
}

/// Logs, before the pool is mapped, what was asked for and what the machine offers.
fn log_pool_request(a: &Args, cfg: &TierConfig) {
    let g = &cfg.geometry;
    let bytes = cfg.pool.bytes;
    tracing::info!(
        "pool asked: --pool {} = {} B ({:.2} GiB) = {} slots of {} B, backing {}, prefault {}, mlock {}, overcommit {}, \
         numa node {}",
        a.pool,
        bytes,
        bytes as f64 / GIB,
        cfg.pool.slots(g.slot_bytes()).map_or_else(|e| e.to_string(), |n| n.to_string()),
        g.slot_bytes(),
        a.backing,
        a.prefault,
        a.mlock,
        a.overcommit,
        a.numa_node.map_or("any".to_string(), |n| n.to_string()),
    );
    tracing::info!(
        "memory: {} total, {} available; 2 MiB hugepages free: {}; RLIMIT_MEMLOCK {}",
        meminfo_text("MemTotal"),
        meminfo_text("MemAvailable"),
        kvtier::hugetlb_free_pages(a.numa_node),
        memlock_text(),
    );
}

/// A `/proc/meminfo` field in GiB, or `unknown`.
fn meminfo_text(field: &str) -> String {
    let kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.split_whitespace().next()?.parse::<u64>().ok())
    });
    kib.map_or("unknown".into(), |k| format!("{:.2} GiB", (k * 1024) as f64 / GIB))
}

fn log_limits(l: &Limits) {
    tracing::info!(
        "limits: {} connections ({} per process), frames up to {} B, {} keys per request, {} hints ({} keys), \
         {} leases ({} blocks), {} copies in flight per connection, {} uses per lease, {} slots per process \
         (0: half the pool), {} slots being written over all processes (0: the pool), {} B of hints; timeouts \
         hello {:?}, frame {:?}, write {:?}",
        l.connections,
        l.connections_per_process,
        l.frame_bytes,
        l.keys_per_request,
        l.hints_per_connection,
        l.hint_keys_per_connection,
        l.leases_per_connection,
        l.leased_blocks_per_connection,
        l.copies_per_connection,
        l.lease_uses,
        l.slots_per_process,
        l.writing_slots,
        l.hint_bytes,
        l.hello_timeout,
        l.frame_timeout,
        l.write_timeout,
    );
}

/// Large allocations go straight to the system and come straight back: glibc's allocator otherwise
/// raises its thresholds after the first large free (up to 32 MiB mapped, 64 MiB trimmed), after
/// which the temporaries of a large request (a hint of 2^20 keys, its decoded keys and their
/// de-duplication) stay resident in the connection threads' arenas once freed. The daemon's pool
/// is mapped by itself, so only requests' buffers and the tables of hints and leases pass here.
fn return_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets two of the allocator's parameters (under its own lock); called before
    // any other thread of this process starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

fn main() {
    return_large_frees();
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(log_colour())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "kvtier=info,kvtierd=info".into()),
        )
        .init();
    #[cfg(not(feature = "nixl"))]
    if let Some(flag) = peer_flag_without_nixl(&args) {
        eprintln!("kvtierd: {flag}: {NO_NIXL}");
        std::process::exit(2);
    }
    let socket = args.socket.clone().unwrap_or_else(kvtier::default_socket_path);
    let (cfg, server_cfg) = match config(&args).and_then(|c| Ok((c, server_config(&args)?))) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvtierd: {e}");
            std::process::exit(2);
        }
    };
    // Block the stop signals in every thread; the main thread waits for them below.
    let mut stop = nix::sys::signal::SigSet::empty();
    stop.add(nix::sys::signal::Signal::SIGTERM);
    stop.add(nix::sys::signal::Signal::SIGINT);
    if let Err(e) = stop.thread_block() {
        eprintln!("kvtierd: blocking SIGTERM/SIGINT: {e}");
        std::process::exit(1);
    }
    log_pool_request(&args, &cfg);
    log_limits(&server_cfg.limits);
    let cfg_pool_bytes = cfg.pool.bytes;
    let t0 = Instant::now();
    let tier = match HostTier::new_shared(cfg) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvtierd: {e}");
            std::process::exit(1);
        }
    };
    let setup = t0.elapsed();
    raise_fd_limit();
    // Before the socket is bound: a peer server that cannot start leaves nothing behind.
    #[cfg(feature = "nixl")]
    let PeerRoles { server: peers, readers } = match peer_roles(&args, &tier) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvtierd: {e}");
            std::process::exit(1);
        }
    };
    let server = match Server::bind_with(&socket, tier, server_cfg) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtierd: {e}");
            std::process::exit(1);
        }
    };
    #[cfg(feature = "nixl")]
    if let Some(r) = &readers {
        let timeout = Duration::from_millis(args.peer_timeout_ms);
        if let Err(e) = server.fetch_from_peers(r.clone(), timeout) {
            eprintln!("kvtierd: --peer-timeout-ms {}: {e}", args.peer_timeout_ms);
            std::process::exit(1);
        }
        tracing::info!(
            "reading misses from peers {} (NIXL), {} ms per query",
            args.peers.join(", "),
            args.peer_timeout_ms
        );
    }
    let kv_events = match &args.kv_events {
        None => None,
        Some(endpoint) => {
            // The endpoint was checked with the configuration already.
            let secret = match &args.kv_events_secret_file {
                Some(path) => match kvtier::read_secret_file(path) {
                    Ok(s) => Some(std::sync::Arc::<[u8]>::from(s)),
                    Err(e) => {
                        eprintln!("kvtierd: --kv-events-secret-file {e}");
                        std::process::exit(2);
                    }
                },
                None => None,
            };
            let bound = events::parse_endpoint(endpoint, secret.is_some())
                .and_then(|addr| events::bind(addr).map_err(|e| format!("binding {addr}: {e}")));
            match bound.and_then(|l| Ok((l.local_addr().map_err(|e| e.to_string())?, l, secret))) {
                Ok(l) => Some(l),
                Err(e) => {
                    eprintln!("kvtierd: --kv-events {endpoint}: {e}");
                    std::process::exit(1);
                }
            }
        }
    };
    let metrics = match &args.metrics {
        None => None,
        Some(addr) => match metrics_endpoint(addr, &args, &server, |_registry| {
            #[cfg(feature = "nixl")]
            if let Some(p) = &peers {
                p.register_metrics(_registry);
            }
        }) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("kvtierd: --metrics {addr}: {e}");
                std::process::exit(1);
            }
        },
    };
    let t = server.tier();
    let g = t.geometry();
    tracing::info!(
        "pool mapped: {:.2} GiB, {} slots of {} B, backing {}, numa node {}, locked {}, set up in {:.1} ms",
        t.pool().mapped_bytes() as f64 / GIB,
        t.capacity(),
        g.slot_bytes(),
        t.pool().backing().name(),
        t.pool().numa_node().map_or("any".to_string(), |n| n.to_string()),
        t.pool().is_locked(),
        setup.as_secs_f64() * 1e3,
    );
    tracing::info!(
        "listening at {} ({}), policy {}",
        socket.display(),
        match &args.group {
            Some(g) => format!("mode 0660, group {g}"),
            None => "mode 0600, this uid only".into(),
        },
        t.policy_name()
    );
    let mut at = match &metrics {
        Some(m) => {
            // In the log too, not only on stdout: a daemon run by a service manager logs stderr.
            tracing::info!("serving metrics at http://{}/metrics (health at /healthz)", m.addr);
            format!(", metrics at http://{}/metrics", m.addr)
        }
        None => String::new(),
    };
    if let Some((addr, _, secret)) = &kv_events {
        tracing::info!(
            "publishing KV events at tcp://{addr} (topic {:?}, {})",
            args.kv_events_topic,
            if secret.is_some() { "subscribers prove the secret (ZMTP PLAIN)" } else { "loopback, no authentication" }
        );
        at.push_str(&format!(", KV events at tcp://{addr}"));
    }
    #[cfg(feature = "nixl")]
    if let Some(p) = &peers {
        tracing::info!("serving peers at {} (NIXL)", p.local_addr());
        at.push_str(&format!(", peers at {}", p.local_addr()));
    }
    #[cfg(feature = "nixl")]
    if readers.is_some() {
        at.push_str(&format!(", reading from peers {}", args.peers.join(" ")));
    }
    let ssd = match t.ssd_stats() {
        Some(s) => {
            tracing::info!(
                "SSD tier: {} files, {} disk slots of {} B, admitted after {} uses; {} blocks found again ({} torn, \
                 {} foreign slots freed)",
                args.ssd.len(),
                s.capacity,
                g.disk_slot_bytes(),
                args.ssd_admit,
                s.recovered_blocks,
                s.recovered_torn,
                s.recovered_foreign,
            );
            format!(
                ", SSD tier {} disk slots of {} B, {} blocks recovered",
                s.capacity,
                g.disk_slot_bytes(),
                s.recovered_blocks
            )
        }
        None => String::new(),
    };
    println!(
        "kvtierd: serving {} (namespace {:?}) at {}: --pool {} = {} B, {} slots of {} B ({:.2} GiB mapped, {} \
         pages), policy {}, pool set up in {:.1} ms{ssd}, pid {}{at}",
        g.model(),
        g.namespace(),
        socket.display(),
        args.pool.trim(),
        cfg_pool_bytes,
        t.capacity(),
        g.slot_bytes(),
        t.pool().mapped_bytes() as f64 / GIB,
        t.pool().backing().name(),
        t.policy_name(),
        setup.as_secs_f64() * 1e3,
        std::process::id()
    );
    let path = server.path().to_path_buf();
    // The tier outlives the accept thread's server for the shutdown's flush.
    let tier = server.tier().clone();
    std::thread::Builder::new()
        .name("kvtierd-accept".into())
        .spawn(move || {
            if let Err(e) = server.run() {
                eprintln!("kvtierd: {e}");
                std::process::exit(1);
            }
        })
        .expect("spawning the accept thread");
    if let Some(m) = metrics {
        std::thread::Builder::new()
            .name("kvtierd-metrics".into())
            .spawn(move || http::run(m.listener, m.endpoint, m.limits))
            .expect("spawning the metrics thread");
    }
    if let Some((_, listener, secret)) = kv_events {
        let (tier, topic) = (tier.clone(), args.kv_events_topic.clone());
        let limits = events::EventLimits { subscribers: args.kv_events_subscribers, ..Default::default() };
        std::thread::Builder::new()
            .name("kvtierd-events".into())
            .spawn(move || events::run(listener, tier, topic, secret, limits))
            .expect("spawning the KV event thread");
    }
    let sig = stop.wait();
    let _ = std::fs::remove_file(&path);
    // The bind lock's file too, unless a daemon is binding the path right now.
    Server::remove_lock_file(&path);
    // Peers' connections close and their leases settle before the flush.
    #[cfg(feature = "nixl")]
    if let Some(p) = peers {
        p.shutdown();
    }

    if let Some(s) = tier.ssd_stats() {
        // What is queued for the drive is written before the process ends: it is served again
        // after the restart.
        let t0 = Instant::now();
        tier.flush_demotions();
        tracing::info!(
            "SSD tier: {} demotions written at shutdown in {:.1} ms; {} blocks on the drive",
            s.demotions_pending,
            t0.elapsed().as_secs_f64() * 1e3,
            tier.ssd_stats().map_or(0, |s| s.blocks)
        );
    }
    match sig {
        Ok(s) => tracing::info!("{}: stopped", s.as_str()),
        Err(e) => tracing::warn!("waiting for SIGTERM/SIGINT: {e}; stopped"),
    }
}

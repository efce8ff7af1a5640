//! The `--metrics` endpoint: `/metrics` (OpenMetrics text) and `/healthz` over HTTP/1.1, served by
//! hyper on one thread (a tokio current-thread runtime), bounded whatever its clients do:
//!
//! - **one thread** however many connections are open: each connection is a task on that thread,
//!   so a client that idles, sends half a request or never reads its answers holds a task and a
//!   socket, never a thread, and never delays another connection's answer;
//! - **connections**: at most [`HttpLimits::connections`] open at once; one more closes the oldest
//!   (whatever it is doing), so a flood of idle connections cannot keep a probe out, and the
//!   daemon's sockets and memory stay bounded;
//! - **timeouts**: a request's head must arrive within [`HttpLimits::timeout`] of the connection's
//!   first byte or the previous answer (hyper's header read timeout); a read that waits longer than
//!   that for a byte, or a write that waits longer than that for the client to take one, closes
//!   the connection; and no connection lives longer than [`CONNECTION_LIFETIME`];
//! - **memory**: a connection buffers at most [`READ_BUFFER`] bytes of requests (pipelined
//!   requests past that wait in the client's socket) and the answers it has not yet written.
//!
//! The engines' Unix socket is served by other threads (`kvtier::Server`), which share nothing with
//! this one but the tier's counters, read at scrape time.

use crate::seeded::seeded;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use kvtier::prometheus_client::registry::Registry;
use kvtier::PoolHealth;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// No connection lives longer than this (a scraper reconnects; nothing else needs longer).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Bytes of requests one connection buffers (hyper's smallest allowed buffer is 8 KiB).
pub const READ_BUFFER: usize = 16 << 10;

/// The endpoint's bounds (`kvtierd --metrics-connections`, `--metrics-timeout`).
#[derive(Copy, Clone, Debug)]
pub struct HttpLimits {
    /// Connections open at once (64); one more closes the oldest.
    pub connections: usize,
    /// Longest wait for a request's head, a byte to read or the client to take a byte written (5 s).
    pub timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits { connections: 64, timeout: Duration::from_secs(5) }
    }
}

/// What the endpoint answers from: the daemon's metrics and the pool's health.
pub struct Endpoint {
    /// The families `/metrics` encodes (read at each scrape).
    pub registry: Registry,
    /// What `/healthz` answers (sampled between requests too).
    pub health: PoolHealth,
    /// The bearer token `/metrics` asks of every request (`--metrics-token-file`), or none.
    pub token: Option<Vec<u8>>,
}

impl Endpoint {
    /// Whether `req` may read `/metrics`: no token is asked, or its `Authorization` is `Bearer`
    /// and the token (compared in constant time).
    fn authorized<B>(&self, req: &Request<B>) -> bool {
        let Some(token) = &self.token else { return true };
        // (Seeded bug, tests only: `metrics-token-unchecked` lets every scrape in.)
        if seeded("metrics-token-unchecked") {
            return true;
        }
        let given = req.headers().get(hyper::header::AUTHORIZATION).map(|v| v.as_bytes());
        given.and_then(|v| v.strip_prefix(b"Bearer ")).is_some_and(|t| kvtier::secrets_equal(t, token))
    }

    /// The answer to one request (a panic while encoding is a 500, never the server's end).
    fn answer<B>(&self, req: &Request<B>) -> Response<Full<Bytes>> {
        let text = |status: u16, body: String, kind: &'static str| {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(kind));
            r
        };
        let plain = "text/plain; charset=utf-8";
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return text(405, "only GET and HEAD\n".into(), plain);
        }
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match req.uri().path() {
            "/metrics" if !self.authorized(req) => {
                let mut r =
                    text(401, "/metrics needs the daemon's bearer token (--metrics-token-file)\n".into(), plain);
                r.headers_mut()
                    .insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
                r
            }
            "/metrics" => {
                let mut body = String::new();
                match kvtier::prometheus_client::encoding::text::encode(&mut body, &self.registry) {
                    Ok(()) => text(200, body, "application/openmetrics-text; version=1.0.0; charset=utf-8"),
                    Err(e) => text(500, format!("encoding the metrics: {e}\n"), plain),
                }
            }
            "/healthz" => {
                let h = self.health.check();
                text(if h.is_healthy() { 200 } else { 503 }, format!("{h}\n"), plain)
            }
            _ => text(404, "not found: /metrics and /healthz are served here\n".into(), plain),
        }));
        run.unwrap_or_else(|_| text(500, "answering panicked (see the daemon's log)\n".into(), plain))
    }
}

/// Serves `listener` on the calling thread for as long as the process lives: should serving ever
/// end (the runtime failing to start, a panic outside a request's answer), its connections are
/// closed and it starts again on the same socket after 100 ms, so no fault leaves `/metrics` and
/// `/healthz` unanswered for good.
pub fn run(listener: std::net::TcpListener, endpoint: Endpoint, limits: HttpLimits) {
    let endpoint = Rc::new(endpoint);
    loop {
        let outcome = listener
            .try_clone()
            .map(|l| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(l, endpoint.clone(), limits))));
        match outcome {
            Err(e) => tracing::error!("metrics endpoint: cloning its socket: {e}; trying again"),
            Ok(Ok(Err(e))) => tracing::error!("metrics endpoint: {e}; starting again"),
            Ok(Ok(Ok(()))) => tracing::error!("metrics endpoint: stopped serving; starting again"),
            Ok(Err(_)) => tracing::error!("metrics endpoint: panicked (logged above); starting again"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Serves `listener` on the calling thread until an error, sampling the pool's health every
/// quarter of its bound (at most every second) in between, so an exhaustion is timed from when it
/// began rather than from the first probe.
///
/// # Errors
/// The runtime or the listener could not be set up (nothing was served).
fn serve(listener: std::net::TcpListener, endpoint: Rc<Endpoint>, limits: HttpLimits) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let tick = (endpoint.health.bound() / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let sampler = endpoint.clone();
        tokio::task::spawn_local(async move {
            let mut every = tokio::time::interval(tick);
            loop {
                every.tick().await;
                let _ = sampler.health.check();
            }
        });
        let open = Rc::new(RefCell::new(Open::default()));
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and the like: the next accept may succeed.
                    tracing::warn!("metrics endpoint: accepting: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let conn = connection(stream, endpoint.clone(), limits);
            // Seeded bug (tests only): `metrics-serial` answers one connection at a time, so a
            // client that never reads holds every other one up.
            if seeded("metrics-serial") {
                conn.await;
                continue;
            }
            let id = open.borrow_mut().begin(limits.connections);
            let done = open.clone();
            let task = tokio::task::spawn_local(async move {
                conn.await;
                done.borrow_mut().end(id);
            });
            open.borrow_mut().started(id, task.abort_handle());
        }
    })
}

/// The connections open now, oldest first.
#[derive(Default)]
struct Open {
    next: u64,
    tasks: VecDeque<(u64, Option<tokio::task::AbortHandle>)>,
}

impl Open {
    /// A new connection's id; the oldest connections are closed until fewer than `max` remain.
    fn begin(&mut self, max: usize) -> u64 {
        // Seeded bug (tests only): `metrics-unbounded-connections` keeps every connection open.
        while self.tasks.len() >= max.max(1) && !seeded("metrics-unbounded-connections") {
            if let Some((_, Some(h))) = self.tasks.pop_front() {
                h.abort();
            }
        }
        self.next += 1;
        self.tasks.push_back((self.next, None));
        self.next
    }

    fn started(&mut self, id: u64, h: tokio::task::AbortHandle) {
        if let Some(t) = self.tasks.iter_mut().find(|(i, _)| *i == id) {
            t.1 = Some(h);
        }
    }

    fn end(&mut self, id: u64) {
        if let Some(i) = self.tasks.iter().position(|(i, _)| *i == id) {
            self.tasks.remove(i);
        }
    }
}

/// One connection served until it closes, times out or reaches [`CONNECTION_LIFETIME`].
async fn connection(stream: TcpStream, endpoint: Rc<Endpoint>, limits: HttpLimits) {
    // Seeded bug (tests only): `metrics-no-timeouts` waits for ever for reads and writes.
    let timeout = if seeded("metrics-no-timeouts") { Duration::from_secs(86_400) } else { limits.timeout };
    let io = TokioIo::new(Deadlined::new(stream, timeout));
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let r = endpoint.answer(&req);
        async move { Ok::<_, Infallible>(r) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(timeout).max_buf_size(READ_BUFFER).keep_alive(true);
    let lifetime = if seeded("metrics-no-timeouts") { Duration::from_secs(86_400) } else { CONNECTION_LIFETIME };
    match tokio::time::timeout(lifetime, http.serve_connection(io, service)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!("metrics endpoint: a connection ended: {e}"),
        Err(_) => tracing::debug!("metrics endpoint: a connection closed after {lifetime:?}"),
    }
}

/// A socket whose reads and writes fail with `TimedOut` once one has waited `timeout` without
/// progress (a client that neither sends nor takes bytes).
struct Deadlined {
    s: TcpStream,
    timeout: Duration,
    read_stall: Option<Pin<Box<Sleep>>>,
    write_stall: Option<Pin<Box<Sleep>>>,
}

impl Deadlined {
    fn new(s: TcpStream, timeout: Duration) -> Self {
        Deadlined { s, timeout, read_stall: None, write_stall: None }
    }
}

/// The outcome of an I/O call that returned `r`: progress clears `stall`; a wait starts it (once)
/// and fails with `TimedOut` when it runs out.
fn deadline<T>(
    r: Poll<io::Result<T>>,
    stall: &mut Option<Pin<Box<Sleep>>>,
    timeout: Duration,
    what: &str,
    cx: &mut Context<'_>,
) -> Poll<io::Result<T>> {
    match r {
        Poll::Ready(r) => {
            *stall = None;
            Poll::Ready(r)
        }
        Poll::Pending => {
            let t = stall.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
            match t.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client {what} nothing for {timeout:?}"),
                ))),
                Poll::Pending => Poll::Pending,
            }
        }
    }
}

impl AsyncRead for Deadlined {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.s).poll_read(cx, buf);
        deadline(r, &mut this.read_stall, this.timeout, "sent", cx)
    }
}

impl AsyncWrite for Deadlined {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.s).poll_write(cx, buf);
        deadline(r, &mut this.write_stall, this.timeout, "took", cx)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.s).poll_flush(cx);
        deadline(r, &mut this.write_stall, this.timeout, "took", cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.s).poll_shutdown(cx);
        deadline(r, &mut this.write_stall, this.timeout, "took", cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.s).poll_write_vectored(cx, bufs);
        deadline(r, &mut this.write_stall, this.timeout, "took", cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.s.is_write_vectored()
    }
}

//! Running `kvtierd` and client processes from tests: finding the binaries at run time (so the test
//! binaries also run where they were copied without the source tree), bounded waits everywhere.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest wait for anything a test waits for (a process, a line, a condition). Generous: the
/// tests must pass on a loaded 2-core machine; a hang fails the test at this deadline instead.
pub const DEADLINE: Duration = Duration::from_secs(120);

/// The directory of the running test executable (`target/<profile>/deps`).
fn exe_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}

/// The `kvtierd` binary: `$KVTIERD_BIN` if set, else `kvtierd` in the parent of the test
/// executable's directory (`target/<profile>/`), else the path Cargo compiled in.
///
/// Panics, naming every place it looked, if none of them holds a file.
pub fn kvtierd_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIERD_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "KVTIERD_BIN={} is not a file", p.display());
        return p;
    }
    let mut tried = Vec::new();
    if let Some(dir) = exe_dir() {
        if let Some(profile) = dir.parent() {
            tried.push(profile.join("kvtierd"));
        }
    }
    tried.push(PathBuf::from(env!("CARGO_BIN_EXE_kvtierd")));
    match tried.iter().find(|p| p.is_file()) {
        Some(p) => p.clone(),
        None => panic!("kvtierd is not in any of {tried:?}; build it (cargo build -p kvtierd) or set KVTIERD_BIN"),
    }
}

/// Waits for `child` to exit, at most `timeout`; kills it and panics past that.
pub fn wait_exit(child: &mut Child, what: &str, timeout: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Polls `cond` until it holds, at most [`DEADLINE`]; panics with `what` past that.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < DEADLINE, "{what}: not true within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The geometry every test daemon serves: two arenas of 4,096 B and 1,024 B per page (5,120 B
/// slots), 16-token pages.
pub const ARENAS: [(&str, u64); 2] = [("big", 4096), ("small", 1024)];
/// Bytes per slot of that geometry.
pub const SLOT_BYTES: u64 = 5120;

/// A `kvtierd` process on a socket in its own temporary directory; killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
    pub slots: u64,
    pub policy: String,
    /// The line the daemon printed once it listened.
    pub line: String,
}

impl Daemon {
    /// Starts `kvtierd` with `slots` slots of the test geometry (plain pages), LRU.
    pub fn start(slots: u64) -> Daemon {
        Self::start_with(slots, "lru", None)
    }

    /// Starts `kvtierd` with `slots` slots, `policy`, at `socket` (default: a new temporary
    /// directory's `kvtierd.sock`), and waits until it accepts connections.
    pub fn start_with(slots: u64, policy: &str, socket: Option<PathBuf>) -> Daemon {
        Self::start_args(slots, policy, socket, &[])
    }

    /// [`Daemon::start_with`] with extra command-line arguments (limits: `--max-connections 4`).
    pub fn start_args(slots: u64, policy: &str, socket: Option<PathBuf>, extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = socket.unwrap_or_else(|| dir.path().join("kvtierd.sock"));
        let mut cmd = Command::new(kvtierd_bin());
        cmd.arg("--socket").arg(&socket).args(["--model", "test-model", "--page-tokens", "16"]);
        for (name, bytes) in ARENAS {
            cmd.arg("--arena").arg(format!("{name}:{bytes}"));
        }
        cmd.args(["--pool", &(slots * SLOT_BYTES).to_string(), "--backing", "plain", "--policy", policy]);
        // The tests' engines may each use most of the pool; a test of the per-process bound sets it.
        if !extra.contains(&"--max-slots-per-process") {
            cmd.args(["--max-slots-per-process", &slots.to_string()]);
        }
        cmd.args(extra);
        cmd.env("RUST_LOG", "kvtier=warn").stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawning kvtierd");
        // The daemon prints one line once it listens.
        let out = child.stdout.take().expect("stdout");
        let line = read_line_within(BufReader::new(out), DEADLINE).unwrap_or_else(|| {
            let _ = child.kill();
            panic!("kvtierd printed nothing within {DEADLINE:?}")
        });
        assert!(line.starts_with("kvtierd: serving test-model"), "{line}");
        Daemon { child, socket, dir, slots, policy: policy.into(), line }
    }

    /// The daemon's resident set, bytes (`VmRSS` of `/proc/PID/status`).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("the daemon's status");
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
        let kib: u64 = line.split_whitespace().nth(1).expect("a number").parse().expect("a number");
        kib * 1024
    }

    /// `kill -9` and wait.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = wait_exit(&mut self.child, "kvtierd after SIGKILL", DEADLINE);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one line on another thread, at most `timeout` (None past it or at end of stream).
pub fn read_line_within<R: BufRead + Send + 'static>(mut r: R, timeout: Duration) -> Option<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let n = r.read_line(&mut s).unwrap_or(0);
        let _ = tx.send((n > 0).then_some(s));
    });
    rx.recv_timeout(timeout).ok().flatten().map(|s| s.trim_end().to_string())
}

/// What a client process's report lines start with.
pub const ROLE_MARK: &str = "KVTIER-ROLE ";

/// A client process: this test binary re-run with only the test `client_role`, which runs `role`
/// against the daemon at `socket`. It reports lines holding [`ROLE_MARK`] on stdout and reads
/// commands from stdin.
pub struct Client {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    pub role: String,
}

impl Client {
    /// Starts `role` with extra environment `env`.
    pub fn start(socket: &Path, role: &str, env: &[(&str, String)]) -> Client {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", "client_role", "--nocapture", "--test-threads", "1"])
            .env("KVTIER_CLIENT_ROLE", role)
            .env("KVTIER_SOCKET", socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawning a client process");
        let stdout: ChildStdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness prints `test client_role ... ` before the test's first line.
                if let Some(at) = line.find(ROLE_MARK) {
                    if tx.send(line[at + ROLE_MARK.len()..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        Client { stdin: child.stdin.take(), child, lines, role: role.into() }
    }

    /// The next `ROLE` line, within [`DEADLINE`].
    pub fn line(&mut self) -> String {
        match self.lines.recv_timeout(DEADLINE) {
            Ok(l) => l,
            Err(_) => {
                let _ = self.child.kill();
                panic!("client `{}` reported nothing within {DEADLINE:?}", self.role)
            }
        }
    }

    /// The next `ROLE` line, which must start with `prefix`; returns the rest.
    pub fn expect(&mut self, prefix: &str) -> String {
        let l = self.line();
        match l.strip_prefix(prefix) {
            Some(rest) => rest.trim().to_string(),
            None => panic!("client `{}` said `{l}`, expected `{prefix}...`", self.role),
        }
    }

    /// Sends one line to the client's stdin.
    pub fn tell(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("writing to a client");
        stdin.flush().expect("flushing a client's stdin");
    }

    /// Waits for a successful exit (closing stdin first).
    pub fn finish(mut self) {
        drop(self.stdin.take());
        let s = wait_exit(&mut self.child, &format!("client `{}`", self.role), DEADLINE);
        assert!(s.success(), "client `{}` failed: {s}", self.role);
    }

    /// `kill -9` and wait.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = wait_exit(&mut self.child, &format!("client `{}` after SIGKILL", self.role), DEADLINE);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

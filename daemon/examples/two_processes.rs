//! Two engine processes sharing one pool through `kvtierd`: this process saves a prompt's blocks
//! and shares a lease; a second process (this program re-run with `restore TOKEN`) opens the lease
//! and restores the blocks into its own arenas, checking every byte.
//!
//! ```sh
//! cargo run --release -p kvtierd -- --geometry llama3-8b --pool 1GiB &    # default_socket_path()
//! cargo run --release -p kvtierd --example two_processes
//! ```
//! Host arenas stand in for GPU memory, so it runs anywhere; with `kvtier::CudaArenas` (or an
//! engine's own tensors) the copies run on each process's GPU.

use kvtier::MemcpyArenas;
use kvtier::{EngineArenas, HostTier, LeaseToken, WaitFor};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let socket = std::env::var_os("KVTIERD_SOCKET").map_or_else(kvtier::default_socket_path, std::path::PathBuf::from);
    let args: Vec<String> = std::env::args().collect();
    let tier = HostTier::connect(&socket)?;
    let geometry = tier.geometry().with_pages(64)?; // this process's pages per arena
    let arenas = Arc::new(MemcpyArenas::new(&geometry)?);
    let rank = tier.attach(arenas.backend()?)?;
    let keys: Vec<_> = (0..4).map(|i| tier.namespace().trace_page_key(42, i)).collect();

    if args.get(1).map(String::as_str) == Some("restore") {
        // Process B: open the lease A shared and restore from it.
        let token = LeaseToken::from_bytes(&hex_decode(&args[2]))?;
        let lease = tier.open_lease(&token)?;
        rank.restore(&lease, &[20, 21, 22, 23], WaitFor::Nothing)?.wait()?;
        arenas.verify(&[20, 21, 22, 23], &keys)?; // the bytes process A saved
        println!(
            "process {} (rank {}): restored {} blocks, bytes verified",
            std::process::id(),
            rank.id(),
            lease.len()
        );
        return Ok(());
    }

    // Process A: "prefill" 4 pages, save them, and lease them for 2 ranks (this one and B).
    arenas.fill(&[0, 1, 2, 3], &keys)?;
    rank.save(&keys, &[0, 1, 2, 3], WaitFor::Nothing)?.handle.wait()?;
    let lease = tier.query_shared(&keys, 2);
    let token: String = lease.token().ok_or("nothing leased")?.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    rank.restore(&lease, &[10, 11, 12, 13], WaitFor::Nothing)?.wait()?;
    arenas.verify(&[10, 11, 12, 13], &keys)?;
    println!("process {} (rank {}): saved and restored 4 blocks; lease token {token}", std::process::id(), rank.id());
    let mut child = Command::new(std::env::current_exe()?).args(["restore", &token]).stdout(Stdio::piped()).spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let out = BufReader::new(stdout).lines().next().ok_or("process B said nothing")??;
    println!("{out}");
    if !child.wait()?.success() {
        return Err("process B failed".into());
    }
    println!("lease settled once both ranks restored: {}", lease.is_settled());
    let s = tier.stats();
    println!(
        "daemon: {} blocks saved, {} restored, {} hit and {} missed, {} of {} slots ready, {} live leases \
         (kvtier stats shows the rest)",
        s.saved_blocks, s.restored_blocks, s.hit_blocks, s.miss_blocks, s.ready_slots, s.capacity, s.live_leases
    );
    Ok(())
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).filter_map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

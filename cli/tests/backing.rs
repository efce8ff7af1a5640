//! `--backing thp` for a shared pool (kvtierd's; `HostPool::new_shared`): where the kernel's shmem
//! THP setting keeps transparent hugepages off the pool, the pool is plain and a warning says so
//! and why. The pool is made in a child process (this test binary re-run with only
//! `shared_thp_pool_role`), whose log goes to its stderr.

use kvtier::{Backing, BackingChoice, PoolConfig};
use std::process::Command;

const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// Run only as a child (`KVTIER_THP_ROLE` set): makes a 4 MiB shared pool asking for THP, logging
/// warnings to stderr, and prints the backing it got.
#[test]
fn shared_thp_pool_role() {
    if std::env::var_os("KVTIER_THP_ROLE").is_none() {
        return;
    }
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter("warn").init();
    let cfg = PoolConfig::new(4 << 20).with_backing(BackingChoice::TransparentHuge);
    let pool = kvtier::HostPool::new_shared(1 << 20, &cfg).unwrap();
    println!("BACKING {}", pool.backing().name());
}

#[test]
fn a_thp_shared_pool_that_gets_plain_pages_says_so_and_why() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shared_thp_pool_role", "--nocapture", "--test-threads", "1"])
        .env("KVTIER_THP_ROLE", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let setting = std::fs::read_to_string(SHMEM_ENABLED).unwrap_or_default();
    let allowed = ["[always]", "[within_size]", "[advise]", "[force]"].iter().any(|s| setting.contains(s));
    if allowed {
        assert!(stdout.contains(&format!("BACKING {}", Backing::TransparentHuge.name())), "{stdout}\n{stderr}");
        assert!(!stderr.contains("plain 4 KiB pages"), "{stderr}");
    } else {
        assert!(stdout.contains(&format!("BACKING {}", Backing::Plain.name())), "{stdout}\n{stderr}");
        assert!(stderr.contains("WARN"), "{stderr}");
        assert!(
            stderr.contains("backing thp asked for the shared pool, but it is backed by plain 4 KiB pages"),
            "{stderr}"
        );
        assert!(stderr.contains(SHMEM_ENABLED), "the warning names the setting's file: {stderr}");
    }
}

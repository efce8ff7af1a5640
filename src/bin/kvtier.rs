//! The `kvtier` command line.
//!
//! `kvtier simulate TRACE` compares eviction policies' hit ratios on a trace (no bytes moved).
//! `kvtier replay [TRACE]` replays a Mooncake-format trace (default: the bundled sample) through the
//! host tier and prints a report (a table, or JSON with `--json`). Logs go to stderr, filtered by
//! `RUST_LOG` (default `warn`). Any error exits with status 1 and its message on stderr.

use clap::{Parser, Subcommand, ValueEnum};
use kvtier::copy::BackendKind;
use kvtier::evict::PolicyKind;
use kvtier::replay::{self, ReplayConfig};
use kvtier::trace::{self, TraceRequest};
use kvtier::{BackingChoice, Error, Geometry, TraceError};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;

#[derive(Parser)]
#[command(name = "kvtier", version, about = "A host-memory tier for LLM KV caches")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a Mooncake-format trace through the host tier and report hits, bytes moved and speed.
    Replay(ReplayArgs),
    /// Page hit ratio of every eviction policy (and the offline optimum) against pool size on a trace,
    /// through the real index, slab and policy code, moving no bytes.
    Simulate(kvtier::simulate::SimulateArgs),
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Trace file (JSON Lines, Mooncake format). Default: the bundled sample of the conversation trace.
    trace: Option<PathBuf>,
    /// Block layout preset: glm52, qwen3-4b, deepseek-v3, deepseek-v3-bf16, llama3-8b.
    #[arg(long, default_value = "glm52")]
    geometry: String,
    /// Host pool size, with units (e.g. 4GiB, 512MiB, 32GB; GB = 10^9 B, GiB = 2^30 B).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pool: u64,
    /// GPU pages for the replay. Default: the largest request's pages x concurrency.
    #[arg(long)]
    gpu_pages: Option<u64>,
    /// Eviction policy: lru, clock, sieve, s3fifo, prefix-lfu, prefix-tinylfu.
    #[arg(long, default_value = "lru", value_parser = PolicyKind::from_str)]
    policy: PolicyKind,
    /// Copy backend: auto = cuda if built with feature `cuda` and a GPU is present, else host.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    backend: BackendKind,
    /// Pool backing: auto = hugetlb if enough 2 MiB pages are reserved, else THP, else plain pages.
    #[arg(long, value_enum, default_value_t = BackingArg::Auto)]
    backing: BackingArg,
    /// Replay only the first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Requests in flight (1 = one at a time in file order, deterministic hits).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    concurrency: u64,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(Copy, Clone, ValueEnum)]
enum BackingArg {
    Auto,
    Hugetlb,
    Thp,
    Plain,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| format!("`{s}` is not a byte size (e.g. 4GiB, 512MiB, 32GB): {e}"))
}

fn replay(args: ReplayArgs) -> Result<(), Error> {
    let requests: Vec<TraceRequest> = match &args.trace {
        Some(p) => trace::load(p)?,
        None => {
            let r = trace::sample()?;
            if r.is_empty() {
                return Err(TraceError::Empty { path: trace::SAMPLE_NAME.into() }.into());
            }
            r
        }
    };
    let requests = &requests[..args.requests.unwrap_or(usize::MAX).min(requests.len())];
    let concurrency = args.concurrency as usize;
    // Page size first (presets differ), then the arenas sized for the replay.
    let probe = Geometry::preset(&args.geometry, 1)?;
    let gpu_pages = match args.gpu_pages {
        Some(0) => return Err(Error::Config("--gpu-pages must be at least 1".into())),
        Some(n) => n,
        None => replay::gpu_pages_needed(requests, probe.page_tokens(), concurrency)?,
    };
    let geometry = probe.with_pages(gpu_pages)?;
    let arenas = args.backend.arenas(0, &geometry)?;
    let config = ReplayConfig {
        policy: args.policy,
        pool_bytes: args.pool,
        backing: match args.backing {
            BackingArg::Auto => BackingChoice::Auto,
            BackingArg::Hugetlb => BackingChoice::HugeTlb,
            BackingArg::Thp => BackingChoice::TransparentHuge,
            BackingArg::Plain => BackingChoice::Plain,
        },
        gpu_pages: Some(gpu_pages),
        requests: None,
        concurrency,
    };
    tracing::info!(
        requests = requests.len(),
        gpu_pages,
        pool_bytes = args.pool,
        geometry = %args.geometry,
        "starting replay"
    );
    let bar = if std::io::stderr().is_terminal() {
        let b = indicatif::ProgressBar::new(requests.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests ({eta} left)")
                .expect("static template")
                .progress_chars("=> "),
        );
        Some(b)
    } else {
        None
    };
    let progress = |n: u64| {
        if let Some(b) = &bar {
            b.inc(n);
        }
    };
    let result = replay::run(requests, &config, arenas.as_ref(), &progress);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("report serialises"));
    } else {
        print!("{report}");
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay(args),
        Command::Simulate(args) => kvtier::simulate::cli(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

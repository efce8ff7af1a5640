//! The `kvtier` command line.
//!
//! `kvtier simulate TRACE` compares eviction policies' hit ratios on a trace (no bytes moved).
//! `kvtier replay [TRACE]` replays a Mooncake-format trace (default: the bundled sample) through the
//! host tier and prints a report (a table, or JSON with `--json`). Traces may be zstd-compressed.
//! Logs go to stderr, filtered by `RUST_LOG` (default `warn`). Any error exits with status 1 and its
//! message on stderr; a bad argument exits with status 2 (clap's usage error).

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier::copy::BackendKind;
use kvtier::evict::PolicyKind;
use kvtier::{BackingChoice, Geometry};
use kvtier_cli::replay::{self, ReplayConfig};
use kvtier_cli::simulate::{self, SimConfig};
use kvtier_cli::size::parse_bytes;
use kvtier_cli::trace::{self, TraceRequest};
use kvtier_cli::{Error, TraceError};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

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
    Simulate(SimulateArgs),
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Trace file (JSON Lines, Mooncake format; plain or zstd-compressed). Default: the bundled
    /// sample of the conversation trace (its first 80 requests).
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
    #[arg(long, default_value = "lru", value_parser = str::parse::<PolicyKind>)]
    policy: PolicyKind,
    /// Copy backend: auto = cuda if built with feature `cuda` and a GPU is present, else host.
    #[arg(long, default_value = "auto", value_parser = str::parse::<BackendKind>)]
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

#[derive(clap::Args)]
struct SimulateArgs {
    /// Trace file (JSON Lines, Mooncake format; plain or zstd-compressed), e.g. the whole
    /// conversation trace, data/mooncake_conversation_trace.jsonl.zst.
    trace: PathBuf,
    /// Geometry preset whose slot size turns byte sizes into slots and whose namespace keys pages.
    #[arg(long, default_value = "glm52")]
    geometry: String,
    /// Pool sizes, comma-separated: bytes with a unit (`8GiB`, `500MB`) or slots (`9952slots`).
    #[arg(long, default_value = "8GiB,16GiB,32GiB,64GiB", value_delimiter = ',')]
    pool: Vec<String>,
    /// Policies to run, comma-separated (default: all of lru, clock, sieve, s3fifo, prefix-lfu,
    /// prefix-tinylfu).
    #[arg(long, value_delimiter = ',', value_parser = |s: &str| s.trim().parse::<PolicyKind>())]
    policies: Vec<PolicyKind>,
    /// Use only the first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Skip the offline optimum.
    #[arg(long)]
    no_optimum: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of hit ratio against pool size here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Copy, Clone, ValueEnum)]
enum BackingArg {
    Auto,
    Hugetlb,
    Thp,
    Plain,
}

/// The requests of `path`, or of the bundled sample, cut to the first `limit`.
fn requests(path: Option<&PathBuf>, limit: Option<usize>) -> Result<(String, Vec<TraceRequest>), Error> {
    let (name, mut reqs) = match path {
        Some(p) => (p.display().to_string(), trace::load(p)?),
        None => {
            let r = trace::sample()?;
            if r.is_empty() {
                return Err(TraceError::Empty { path: trace::SAMPLE_NAME.into() }.into());
            }
            (trace::SAMPLE_NAME.to_string(), r)
        }
    };
    reqs.truncate(limit.unwrap_or(usize::MAX));
    Ok((name, reqs))
}

/// A progress bar of `len` steps on stderr, or `None` when stderr is not a terminal or the report
/// goes out as JSON.
fn progress_bar(len: u64, what: &str, json: bool) -> Option<ProgressBar> {
    if json || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {what} ({{eta}} left)"
        ))
        .expect("static template")
        .progress_chars("=> "),
    );
    Some(bar)
}

fn replay(args: ReplayArgs) -> Result<(), Error> {
    let (_, requests) = requests(args.trace.as_ref(), args.requests)?;
    let concurrency = args.concurrency as usize;
    // Page size first (presets differ), then the arenas sized for the replay.
    let probe = Geometry::preset(&args.geometry, 1)?;
    let gpu_pages = match args.gpu_pages {
        Some(0) => return Err(Error::Config("--gpu-pages must be at least 1".into())),
        Some(n) => n,
        None => replay::gpu_pages_needed(&requests, probe.page_tokens(), concurrency)?,
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
    let bar = progress_bar(requests.len() as u64, "requests", args.json);
    let progress = |n: u64| {
        if let Some(b) = &bar {
            b.inc(n);
        }
    };
    let result = replay::run(&requests, &config, arenas.as_ref(), &progress);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("a report serialises"));
    } else {
        print!("{report}");
    }
    Ok(())
}

fn simulate(args: SimulateArgs) -> Result<(), Error> {
    let (name, requests) = requests(Some(&args.trace), args.requests)?;
    let config = SimConfig {
        geometry: args.geometry,
        pools: args.pool,
        policies: if args.policies.is_empty() { PolicyKind::ALL.to_vec() } else { args.policies },
        optimum: !args.no_optimum,
    };
    let bar = progress_bar(config.steps(requests.len()), "requests over all runs", args.json);
    let progress = |n: u64| {
        if let Some(b) = &bar {
            b.inc(n);
        }
    };
    let result = simulate::run(&name, &requests, &config, &progress);
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("a report serialises"));
    } else {
        print!("{}", report.table());
    }
    if let Some(p) = &args.plot {
        std::fs::write(p, report.svg()?).map_err(|source| Error::Output { path: p.clone(), source })?;
        if !args.json {
            println!("plot written to {}", p.display());
        }
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
        Command::Simulate(args) => simulate(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

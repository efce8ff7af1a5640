//! The `kvtier` command line.
//!
//! `kvtier simulate TRACE` compares eviction policies' hit ratios on a trace (no bytes moved).
//! `kvtier synth TRACE` writes a synthetic trace whose parameters are measured on TRACE.
//! `kvtier replay [TRACE]` replays a Mooncake-format trace (default: the bundled sample) through the
//! host tier and prints a report (a table, or JSON with `--json`). Traces may be zstd-compressed.
//! `kvtier stats --socket PATH` shows a running `kvtierd`'s tier (`--json` once, `--watch SECONDS`).
//! Logs go to stderr, filtered by `RUST_LOG` (default `warn`). Any error exits with status 1 and its
//! message on stderr; a bad argument exits with status 2 (clap's usage error).

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier::BackendKind;
use kvtier::PolicyKind;
use kvtier::{BackingChoice, Geometry};
use kvtier_cli::replay::{self, ReplayConfig};
use kvtier_cli::simulate::{self, SimConfig};
use kvtier_cli::size::{parse_bytes, parse_ssd_file};
use kvtier_cli::synth::{self, SynthOptions};
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
    /// When stderr is not a terminal (a pipe, a log file), write a progress line there at most
    /// every SECONDS during replay and simulate (0: at every step); on a terminal a bar shows
    /// instead.
    #[arg(long, global = true, value_name = "SECONDS", default_value_t = 5.0)]
    progress_every: f64,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a Mooncake-format trace through the host tier and report hits, bytes moved and speed.
    Replay(ReplayArgs),
    /// Page hit ratio of every eviction policy (and the offline optimum) against pool size on a trace,
    /// through the real index, slab and policy code, moving no bytes.
    Simulate(SimulateArgs),
    /// Write a synthetic conversation trace whose parameters (conversation return times, shared
    /// system prefixes, lengths) are measured on a real trace.
    Synth(SynthArgs),
    /// A running kvtierd's tier: hit ratio, blocks and bytes saved and restored, slots by state,
    /// leases, evictions, and its top client processes (a table, refreshed with --watch, or JSON
    /// once).
    Stats(StatsArgs),
}

#[derive(clap::Args)]
struct StatsArgs {
    /// The daemon's socket [default: kvtier's default socket path, as kvtierd's].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Print the statistics once as one line of JSON (TierStats' fields, plus hit_ratio and
    /// clients: one object per client process, ClientStats' fields).
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Refresh every SECONDS, with the GB/s (10^9 B/s) saved and restored since the last refresh;
    /// stop with Ctrl-C.
    #[arg(long, value_name = "SECONDS")]
    watch: Option<f64>,
}

#[derive(clap::Args)]
struct SynthArgs {
    /// The trace to measure (JSON Lines, Mooncake format; plain or zstd-compressed). Not with
    /// --shape.
    #[arg(required_unless_present = "shape", conflicts_with = "shape")]
    trace: Option<PathBuf>,
    /// Write a trace of a stated workload shape instead of one fitted to a trace: agentic (long
    /// coding-agent sessions, prompts of 40 k-200 k tokens), short (many independent short
    /// requests), shared-prompt (every session behind one 10 k-token system prompt) or bursty
    /// (bursts of requests over one long document, over background conversations). Takes --seed
    /// and --requests.
    #[arg(long, value_parser = |s: &str| s.parse::<kvtier_cli::shapes::Shape>(),
          conflicts_with_all = ["half", "gap_scale", "system_prompts", "describe"])]
    shape: Option<kvtier_cli::shapes::Shape>,
    /// Measure only one half of the trace, split at the middle of its time span.
    #[arg(long, value_enum)]
    half: Option<HalfArg>,
    /// Seed of the random numbers (same seed, same trace).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Requests to generate.
    #[arg(long, default_value_t = 12_000)]
    requests: usize,
    /// Multiply every conversation return time by this.
    #[arg(long, default_value_t = 1.0)]
    gap_scale: f64,
    /// Use N system prefixes (lengths drawn from the measured ones, Zipf popularity) instead of the
    /// measured ones.
    #[arg(long)]
    system_prompts: Option<usize>,
    /// Print what was measured on stderr.
    #[arg(long)]
    describe: bool,
    /// Write the trace here instead of stdout.
    #[arg(long, short = 'o')]
    output: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// Trace file (JSON Lines, Mooncake format; plain or zstd-compressed). Default: the bundled
    /// sample of the conversation trace (its first 80 requests).
    trace: Option<PathBuf>,
    /// Block layout preset: glm52, qwen3-4b, deepseek-v3, deepseek-v3-bf16, llama3-8b.
    #[arg(long, default_value = "glm52")]
    geometry: String,
    /// Host pool size: bytes, or with a unit (e.g. 4GiB, 512MiB, 32GB; GB = 10^9 B, GiB = 2^30 B;
    /// units are case-sensitive, so 4gb is refused with both readings).
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pool: u64,
    /// GPU pages for the replay. Default: the largest request's pages x concurrency.
    #[arg(long)]
    gpu_pages: Option<u64>,
    /// Eviction policy: lru, clock, sieve, s3fifo, 2q, prefix-lfu, prefix-tinylfu, adaptive-lfu
    /// (default: the crate's default policy).
    #[arg(long, default_value_t = PolicyKind::default(), value_parser = str::parse::<PolicyKind>)]
    policy: PolicyKind,
    /// Chain-aware victims (orphaned chain blocks first, chains from their tail).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    chain: OnOff,
    /// Also replay with scheduler hints for an engine queue of the next N requests (trace order),
    /// and report both runs: without hints, then with them.
    #[arg(long, default_value_t = 0)]
    lookahead: usize,
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
    /// Put an SSD tier under the pool: a file of disk slots at PATH taking SIZE bytes (a size as
    /// for --pool, e.g. /mnt/nvme0/kvtier.ssd:2TiB), one --ssd per drive. A missing file is
    /// created; an existing one is reopened and the blocks it holds are served again. The report
    /// adds the SSD tier's figures and splits the hits into host and promoted pages.
    #[arg(long, value_name = "PATH:SIZE", value_parser = parse_ssd_file, conflicts_with = "lookahead")]
    ssd: Vec<kvtier::SsdFile>,
    /// How blocks are admitted to the SSD tier: `N` uses (its save is the first, each query that
    /// leases it one more; 1 writes every saved block to the drive), or `auto` (after 1 or 2
    /// uses, decided online from the drive's ghost hits; the default).
    #[arg(long, value_name = "N|auto", default_value = "auto", value_parser = |s: &str| s.parse::<kvtier::SsdAdmit>())]
    ssd_admit: kvtier::SsdAdmit,
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
    /// Policies to run, comma-separated (default: all of lru, clock, sieve, s3fifo, 2q, prefix-lfu,
    /// prefix-tinylfu, adaptive-lfu).
    #[arg(long, value_delimiter = ',', value_parser = |s: &str| s.trim().parse::<PolicyKind>())]
    policies: Vec<PolicyKind>,
    /// Chain-aware victims: off (the classic policies), on (orphans, then chain leaves, then the
    /// rest, in each policy's order), or both (each policy twice).
    #[arg(long, value_enum, default_value_t = ChainArg::Both)]
    chain: ChainArg,
    /// Also run each policy with scheduler hints for an engine queue of the next N requests (trace
    /// order): each queued request's keys are hinted until it is admitted.
    #[arg(long, default_value_t = 0)]
    lookahead: usize,
    /// With --lookahead, also run each policy with queue-protecting admission (a save never evicts
    /// a block a queued request will look up; the rows labelled `+protect`).
    #[arg(long, requires = "lookahead")]
    protect: bool,
    /// Use only the requests of one half of the trace, split at the middle of its time span.
    #[arg(long, value_enum)]
    half: Option<HalfArg>,
    /// Use only the first N requests (of the half, with --half).
    #[arg(long)]
    requests: Option<usize>,
    /// Skip the offline optimum.
    #[arg(long)]
    no_optimum: bool,
    /// Also compute the foresight reference at each pool size for these horizons, comma-separated
    /// numbers of requests (rows `foresight-R`): a policy that knows the page uses of the next R
    /// requests exactly and none beyond, LRU for the rest (R = 0: plain LRU; R at least the
    /// trace's length: the optimum). A reference, not a bound.
    #[arg(long, value_delimiter = ',')]
    foresight: Vec<u32>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of hit ratio against pool size here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Also simulate an SSD tier under each host pool, comma-separated sizes: bytes with a unit
    /// (`512GiB`, `2TB`: the size of its slot file) or disk slots (`636857slots`). The report adds
    /// the two-level page hit ratios (host share + SSD share) and an unbounded cache's.
    #[arg(long, value_delimiter = ',')]
    ssd: Vec<String>,
    /// SSD admissions to run, comma-separated: `N` uses (a block used fewer times while on the
    /// host is never written to the drive) or `auto` (1 or 2, decided online from the drive's
    /// ghost hits; the default). Each variant runs over each SSD size with each.
    #[arg(long, value_name = "N|auto", default_value = "auto", value_delimiter = ',', value_parser = |s: &str| s.parse::<kvtier::SsdAdmit>())]
    ssd_admit: Vec<kvtier::SsdAdmit>,
}

#[derive(Copy, Clone, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Copy, Clone, ValueEnum)]
enum ChainArg {
    Off,
    On,
    Both,
}

#[derive(Copy, Clone, ValueEnum)]
enum HalfArg {
    First,
    Second,
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

/// Progress of a long run on stderr: a bar on a terminal (none when the report goes out as JSON);
/// otherwise a line at most every `every` (`what`: the unit counted), so a piped run is not silent.
enum Progress {
    Bar(ProgressBar),
    Lines {
        what: String,
        len: u64,
        every: std::time::Duration,
        state: std::sync::Mutex<(u64, std::time::Instant)>,
        t0: std::time::Instant,
    },
    Quiet,
}

impl Progress {
    fn new(len: u64, what: &str, json: bool, every: std::time::Duration) -> Progress {
        if !std::io::stderr().is_terminal() {
            let t0 = std::time::Instant::now();
            return Progress::Lines { what: what.into(), len, every, state: std::sync::Mutex::new((0, t0)), t0 };
        }
        if json {
            return Progress::Quiet;
        }
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {what} ({{eta}} left)"
            ))
            .expect("static template")
            .progress_chars("=> "),
        );
        Progress::Bar(bar)
    }

    fn inc(&self, n: u64) {
        match self {
            Progress::Bar(b) => b.inc(n),
            Progress::Lines { what, len, every, state, t0 } => {
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                st.0 += n;
                let now = std::time::Instant::now();
                if now.duration_since(st.1) >= *every {
                    let done = st.0;
                    let pct = if *len == 0 { 100.0 } else { 100.0 * done as f64 / *len as f64 };
                    eprintln!(
                        "progress: {done}/{len} {what} ({pct:.1}%), {:.0} s",
                        now.duration_since(*t0).as_secs_f64()
                    );
                    st.1 = now;
                }
            }
            Progress::Quiet => {}
        }
    }

    fn finish(&self) {
        if let Progress::Bar(b) = self {
            b.finish_and_clear();
        }
    }
}

/// `--progress-every` as a duration.
fn progress_every(secs: f64) -> Result<std::time::Duration, Error> {
    std::time::Duration::try_from_secs_f64(secs)
        .map_err(|_| Error::Config(format!("--progress-every {secs}: not a number of seconds")))
}

/// The SSD tier of `--ssd` files and `--ssd-admit` (none without a file).
fn ssd_config(files: &[kvtier::SsdFile], admit: kvtier::SsdAdmit) -> Option<kvtier::SsdConfig> {
    let (first, rest) = files.split_first()?;
    let config =
        rest.iter().fold(kvtier::SsdConfig::new(&first.path, first.bytes), |c, f| c.with_file(&f.path, f.bytes));
    Some(config.with_admit(admit))
}

fn replay(args: ReplayArgs, every: std::time::Duration) -> Result<(), Error> {
    let began = std::time::Instant::now();
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
        chain_aware: matches!(args.chain, OnOff::On),
        lookahead: 0,
        ssd: ssd_config(&args.ssd, args.ssd_admit),
    };
    tracing::info!(
        requests = requests.len(),
        gpu_pages,
        pool_bytes = args.pool,
        geometry = %args.geometry,
        "starting replay"
    );
    let runs: Vec<ReplayConfig> = if args.lookahead > 0 {
        vec![config.clone(), ReplayConfig { lookahead: args.lookahead, ..config }]
    } else {
        vec![config]
    };
    let bar = Progress::new(runs.len() as u64 * requests.len() as u64, "requests", args.json, every);
    let progress = |n: u64| bar.inc(n);
    let mut reports = Vec::new();
    for c in &runs {
        match replay::run(&requests, c, arenas.as_ref(), &progress) {
            Ok(r) => reports.push(r),
            Err(e) => {
                bar.finish();
                return Err(e);
            }
        }
    }
    bar.finish();
    // The whole command: the trace read, the GPU arenas made, and every run.
    let command_s = began.elapsed().as_secs_f64();
    if args.json {
        let v = match reports.as_slice() {
            [one] => serde_json::to_value(one),
            [without, with] => {
                serde_json::to_value(serde_json::json!({ "without_hints": without, "with_hints": with }))
            }
            _ => unreachable!("one or two runs"),
        };
        let v = v.map(|mut v| {
            v["command_s"] = serde_json::json!(command_s);
            v
        });
        println!("{}", serde_json::to_string_pretty(&v.expect("a report serialises")).expect("a report serialises"));
    } else if let [without, with] = reports.as_slice() {
        println!("without hints:");
        print!("{without}");
        println!("\nwith hints for the next {} requests:", args.lookahead);
        print!("{with}");
        println!(
            "\npage hit ratio {:.4} without hints, {:.4} with ({:+.1}%)",
            without.page_hit_ratio,
            with.page_hit_ratio,
            100.0 * (with.page_hit_ratio / without.page_hit_ratio.max(f64::MIN_POSITIVE) - 1.0)
        );
    } else {
        print!("{}", reports[0]);
    }
    if !args.json {
        println!("command time: {command_s:.3} s in all (trace read, GPU arenas made, set-up and replay)");
    }
    Ok(())
}

fn simulate(args: SimulateArgs, every: std::time::Duration) -> Result<(), Error> {
    // The plot's file is opened before the work, so a path that cannot be written fails now, not
    // after the whole run; a file this run created is removed again if the run fails.
    let plot = match &args.plot {
        None => None,
        Some(p) => {
            let existed = p.exists();
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .map_err(|source| Error::Output { path: p.clone(), source })?;
            Some(PlotFile { path: p.clone(), file: Some(f), remove: !existed })
        }
    };
    let (mut name, mut requests) = requests(Some(&args.trace), None)?;
    if let Some(half) = args.half {
        let (first, second) = trace::split_by_time(&requests);
        let (which, part) = match half {
            HalfArg::First => ("first", first),
            HalfArg::Second => ("second", second),
        };
        requests = part;
        name = format!("{name} ({which} half by time)");
    }
    requests.truncate(args.requests.unwrap_or(usize::MAX));
    if requests.is_empty() {
        return Err(TraceError::Empty { path: args.trace.clone() }.into());
    }
    let config = SimConfig {
        geometry: args.geometry,
        pools: args.pool,
        policies: if args.policies.is_empty() { PolicyKind::ALL.to_vec() } else { args.policies },
        chain: match args.chain {
            ChainArg::Off => vec![false],
            ChainArg::On => vec![true],
            ChainArg::Both => vec![false, true],
        },
        lookahead: args.lookahead,
        protect: args.protect,
        optimum: !args.no_optimum,
        foresight: args.foresight,
        ssd: args.ssd,
        ssd_admit: args.ssd_admit,
    };
    let bar = Progress::new(config.steps(requests.len()), "requests over all runs", args.json, every);
    let progress = |n: u64| bar.inc(n);
    let result = simulate::run(&name, &requests, &config, &progress);
    bar.finish();
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).expect("a report serialises"));
    } else {
        print!("{}", report.table());
    }
    if let Some(mut plot) = plot {
        plot.write(report.svg()?.as_bytes())?;
        if !args.json {
            println!("plot written to {}", plot.path.display());
        }
    }
    Ok(())
}

/// An output file opened before the work; removed on drop if this run created it and never wrote
/// it (the run failed).
struct PlotFile {
    path: PathBuf,
    file: Option<std::fs::File>,
    remove: bool,
}

impl PlotFile {
    fn write(&mut self, bytes: &[u8]) -> Result<(), Error> {
        use std::io::Write;
        let err = |source| Error::Output { path: self.path.clone(), source };
        let mut f = self.file.take().expect("written once");
        f.set_len(0).map_err(err)?;
        f.write_all(bytes).map_err(err)?;
        self.remove = false;
        Ok(())
    }
}

impl Drop for PlotFile {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn synth(args: SynthArgs) -> Result<(), Error> {
    let out = match (args.shape, &args.trace) {
        (Some(shape), _) => kvtier_cli::shapes::generate(shape, args.seed, args.requests),
        (None, Some(trace)) => fitted(&args, trace)?,
        (None, None) => unreachable!("clap requires a trace or a shape"),
    };
    if out.is_empty() {
        return Err(Error::Config("--requests 0: no request to write".into()));
    }
    match &args.output {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|source| Error::Output { path: p.clone(), source })?;
            synth::write_jsonl(&out, std::io::BufWriter::new(f))
                .map_err(|source| Error::Output { path: p.clone(), source })?;
        }
        None => {
            let stdout = std::io::stdout();
            synth::write_jsonl(&out, std::io::BufWriter::new(stdout.lock()))
                .map_err(|source| Error::Output { path: "<stdout>".into(), source })?;
        }
    }
    Ok(())
}

/// `kvtier synth TRACE`: a trace fitted to `trace`'s measured statistics.
fn fitted(args: &SynthArgs, trace: &PathBuf) -> Result<Vec<kvtier_cli::trace::TraceRequest>, Error> {
    let (_, mut requests) = requests(Some(trace), None)?;
    if let Some(half) = args.half {
        let (first, second) = trace::split_by_time(&requests);
        requests = match half {
            HalfArg::First => first,
            HalfArg::Second => second,
        };
    }
    if !(args.gap_scale > 0.0 && args.gap_scale.is_finite()) {
        return Err(Error::Config(format!("--gap-scale must be a positive number, not {}", args.gap_scale)));
    }
    let params = synth::fit(&requests);
    if args.describe {
        eprintln!("{}", params.describe());
    }
    let opts = SynthOptions {
        seed: args.seed,
        requests: args.requests,
        gap_scale: args.gap_scale,
        system_prompts: args.system_prompts,
    };
    let out = synth::generate(&params, &opts);
    if out.is_empty() {
        return Err(TraceError::Empty { path: trace.clone() }.into());
    }
    Ok(out)
}

fn stats(args: StatsArgs) -> Result<(), Error> {
    use kvtier_cli::stats;
    let socket = args.socket.unwrap_or_else(kvtier::default_socket_path);
    let tier = kvtier::HostTier::connect(&socket)?;
    let read = || tier.try_stats().map_err(Error::from);
    let clients = || tier.clients().map_err(Error::from);
    let ssd = || tier.try_ssd_stats().map_err(Error::from);
    if args.json {
        println!("{}", stats::json(&read()?, &clients()?, ssd()?.as_ref()));
        return Ok(());
    }
    let Some(every) = args.watch else {
        let (now, clients, ssd) = (read()?, clients()?, ssd()?);
        print!(
            "kvtierd at {}\n{}{}{}",
            socket.display(),
            stats::table(&now, None),
            stats::ssd_table(ssd.as_ref()),
            stats::clients_table(&clients)
        );
        return Ok(());
    };
    let every = std::time::Duration::try_from_secs_f64(every)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Error::Config(format!("--watch {every}: expected a positive number of seconds")))?;
    let terminal = std::io::stdout().is_terminal();
    let mut tier = tier;
    let mut prev: Option<(kvtier::TierStats, std::time::Instant)> = None;
    loop {
        let (now, clients) = match tier.try_stats().and_then(|s| Ok((s, tier.clients()?))) {
            Ok(reading) => reading,
            // The daemon stopped or restarts: say so once, then wait for it and go on.
            Err(e @ kvtier::TierError::Disconnected { .. }) => {
                println!(
                    "kvtierd at {} is gone ({e}); waiting for it to come back (trying every {:.1} s)",
                    socket.display(),
                    every.as_secs_f64()
                );
                tier = reconnect(&socket, every)?;
                println!("kvtierd at {} is back", socket.display());
                // A new daemon run counts from zero: no rates against the old one's counters.
                prev = None;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let at = std::time::Instant::now();
        let since = prev.as_ref().map(|(s, t)| (s, at - *t));
        if terminal {
            // Clear the screen and go home, so the table refreshes in place.
            print!("\x1b[2J\x1b[H");
        }
        print!(
            "kvtierd at {} (every {:.1} s)\n{}{}",
            socket.display(),
            every.as_secs_f64(),
            stats::table(&now, since),
            stats::clients_table(&clients)
        );
        if !terminal {
            println!();
        }
        prev = Some((now, at));
        std::thread::sleep(every);
    }
}

/// Connects to the daemon at `socket` again, trying every `every` for as long as nothing listens
/// there (`kvtier stats --watch` across a daemon restart); any other error ends the wait.
fn reconnect(socket: &std::path::Path, every: std::time::Duration) -> Result<kvtier::HostTier, Error> {
    loop {
        std::thread::sleep(every);
        match kvtier::HostTier::connect(socket) {
            Err(kvtier::Error::Tier(kvtier::TierError::Disconnected { .. })) => {}
            r => return Ok(r?),
        }
    }
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
    let every = progress_every(cli.progress_every);
    let result = match cli.command {
        Command::Replay(args) => every.and_then(|e| replay(args, e)),
        Command::Simulate(args) => every.and_then(|e| simulate(args, e)),
        Command::Synth(args) => synth(args),
        Command::Stats(args) => stats(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

//! `kvtier simulate` as a stand-alone program until the subcommand is wired into `src/bin/kvtier.rs`:
//! `cargo run --release --example simulate -- TRACE [--pool 8GiB,16GiB] [--json] [--plot out.svg]`.

use clap::Parser;

/// Eviction policies on a trace (see `kvtier::simulate`).
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvtier::simulate::SimulateArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = kvtier::simulate::cli(&cli.args) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

//! `rollout-recovery`: the command line. Today it offers the offline `digest` tool; `serve` and
//! the other subcommands arrive with the HTTP service issue.

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use std::io::Read as _;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "rollout-recovery",
    version,
    about = "Resume authority for LLM evaluation and RL rollout collectors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the CPython-identical canonical digest of a JSON document, or with `--jsonl` the
    /// materialized digest of JSONL rows (blank lines skipped).
    Digest {
        /// File to read (`-` or absent: standard input).
        path: Option<PathBuf>,
        /// Treat the input as JSONL rows and print the materialized digest.
        #[arg(long)]
        jsonl: bool,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Digest { path, jsonl } => {
            let reader: Box<dyn std::io::Read + Send> = match path.as_deref() {
                None => Box::new(std::io::stdin()),
                Some(p) if p.as_os_str() == "-" => Box::new(std::io::stdin()),
                Some(p) => Box::new(
                    std::fs::File::open(p)
                        .with_context(|| format!("cannot open {}", p.display()))?,
                ),
            };
            if jsonl {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let result = recovery_core::materialized::materialized_digest(reader, threads)?;
                println!("{}", result.sha256);
            } else {
                let mut text = Vec::new();
                let mut reader = reader;
                reader.read_to_end(&mut text)?;
                println!("{}", recovery_core::canonical::digest_text(&text)?);
            }
        }
    }
    Ok(())
}

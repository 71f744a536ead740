//! The `voxkernel` command. Thin: parsing and printing only; the work lives in voxkernel-core
//! and voxkernel-cuda.

mod backends;
mod bench;
mod serve;
mod synth;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "voxkernel",
    version,
    about = "Fast Qwen3-TTS serving: CPU reference and CUDA megakernel"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a JSON summary of a checkpoint: variant, sizes, speakers, languages, tensor counts.
    Inspect {
        /// Checkpoint directory or hub id (e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice).
        model: String,
    },
    /// Print the text token ids the talker sees for a text, as JSON `{"text_ids": [...]}`.
    Tokenize {
        /// A directory holding vocab.json, merges.txt and tokenizer_config.json.
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        text: String,
    },
    /// Synthesise speech to a 24 kHz mono WAV file.
    Synth(Box<synth::SynthArgs>),
    /// Benchmarks; prints JSON lines.
    Bench(Box<bench::BenchArgs>),
    /// Serve the model: OpenAI-compatible HTTP speech and the WebSocket context protocol.
    Serve(Box<serve::ServeArgs>),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // symphonia logs a failed format probe as an error; to us that is a client's
                // unreadable upload, answered with a 400 that says so.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("info,symphonia_core::formats::probe=off")
                }),
        )
        .with_writer(std::io::stderr)
        // Plain text into log files and pipes (a server's usual stderr).
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Inspect { model } => {
            let dir = voxkernel_core::hub::resolve_model(&model)?;
            let checkpoint = voxkernel_core::checkpoint::Checkpoint::open(&dir)?;
            let summary = voxkernel_core::checkpoint::ModelSummary::new(&checkpoint);
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        Command::Tokenize { model, text } => {
            let tokenizer = voxkernel_core::tokenizer::TextTokenizer::from_dir(&model)?;
            let text_ids = tokenizer.target_text_ids(&text)?;
            println!("{}", serde_json::json!({ "text_ids": text_ids }));
        }
        Command::Synth(args) => synth::run(*args)?,
        Command::Bench(args) => bench::run(*args)?,
        Command::Serve(args) => serve::run(*args)?,
    }
    Ok(())
}

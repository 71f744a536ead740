//! `voxkernel serve`: the engine behind the HTTP and WebSocket server.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::{Engine, EngineOptions, Model};
use voxkernel_core::prompt::PlanLimits;
use voxkernel_server::{Server, ServerOptions};

use crate::backends::{self, BackendChoice, CodecPrecision};

#[derive(Args)]
pub struct ServeArgs {
    /// Checkpoint directory or hub id.
    #[arg(long)]
    model: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// The CUDA codec's arithmetic for the decoder's big convolutions: f32, or tf32 (tensor
    /// cores; faster, with the error docs/codec.md states).
    #[arg(long, value_enum, default_value = "f32")]
    codec_precision: CodecPrecision,
    /// Address to bind; the default takes connections from this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 picks a free one; the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /healthz and /readyz.
    #[arg(long, env = "VOXKERNEL_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Sessions synthesising at once (each holds a sequence slot).
    #[arg(long, default_value_t = 16)]
    max_sessions: usize,
    /// Sessions that may wait for a slot; past that, requests get 503 (WebSocket: overloaded).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Give every audio packet the schedule's frame count (1, 2, 4, then 8), even when the
    /// engine is so loaded that a listener would run out of audio waiting for it; by default,
    /// with the CUDA codec, such a packet goes early with the frames it has (docs/engine.md).
    #[arg(long)]
    fixed_packets: bool,
    /// Most 80 ms frames one utterance may have (2048: 164 s).
    #[arg(long, default_value_t = 2048)]
    max_frames: usize,
    /// Most characters of text per utterance (HTTP input, WebSocket context) or instruction.
    #[arg(long, default_value_t = 4096)]
    max_text_chars: usize,
    /// Base models: registered voices held at once (POST /v1/voices past it gets 409).
    #[arg(long, default_value_t = 100)]
    max_voices: usize,
    /// Base models: most bytes in a POST /v1/voices upload (16 MiB).
    #[arg(long, default_value_t = 16 * 1024 * 1024)]
    max_upload_bytes: usize,
    /// Base models: save registered voices in this directory (one JSON file each) and load
    /// them from it at start; without it they live in memory until the server stops.
    #[arg(long)]
    voices_dir: Option<PathBuf>,
    /// After SIGTERM or Ctrl-C, how long in-flight streams may take to finish before they are
    /// cut (a second signal cuts them at once).
    #[arg(long, default_value_t = 30)]
    shutdown_timeout_secs: u64,
}

pub fn run(args: ServeArgs) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let dir = voxkernel_core::hub::resolve_model(&args.model)?;
    let model = Arc::new(Model::load(&dir)?);
    let options = EngineOptions {
        max_active: args.max_sessions,
        max_queue: args.max_queue,
        max_frames_cap: args.max_frames,
        pacing: !args.fixed_packets,
        // Text tokens rarely outnumber characters, so clients meet the character limit; a
        // text past this one is refused by the engine, which names it.
        limits: PlanLimits {
            max_text_tokens: args.max_text_chars,
        },
        ..EngineOptions::default()
    };
    // Each slot holds a whole prompt (text, instruction and fixed rows) plus every frame.
    let max_len = options.max_frames_cap + 2 * options.limits.max_text_tokens + 64;
    let frames = backends::frame_backend(args.backend, &model, options.max_active, max_len)?;
    let codec = backends::codec_backend(
        args.backend,
        &model,
        options.max_active,
        args.codec_precision,
    )?;
    tracing::info!(frames = %frames.name(), codec = %codec.name(), "backends ready");
    let voice_encoder = match model.checkpoint.config.model_type {
        ModelType::Base => {
            let encoder = backends::voice_encoder(args.backend, &model)?;
            tracing::info!(encoder = %encoder.name(), "voice encoder ready (POST /v1/voices)");
            Some(encoder)
        }
        _ => None,
    };
    let engine = Arc::new(Engine::start(Arc::clone(&model), frames, codec, options)?);

    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    let server = Server::new(
        engine,
        ServerOptions {
            api_key: args.api_key,
            max_text_chars: args.max_text_chars,
            max_upload_bytes: args.max_upload_bytes,
            max_voices: args.max_voices,
            voices_dir: args.voices_dir,
            ..ServerOptions::new(model_id(&args.model))
        },
        voice_encoder,
    )?;
    let handle = server.shutdown_handle();
    let timeout = Duration::from_secs(args.shutdown_timeout_secs);
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!(
            "draining: no new sessions; open streams may finish within {timeout:?} (a second \
             signal ends them now)"
        );
        handle.drain();
        tokio::select! {
            _ = shutdown_signal() => {}
            _ = tokio::time::sleep(timeout) => {}
        }
        tracing::warn!("stopping: ending every open stream");
        handle.stop();
    });
    server.serve(listener).await?;
    tracing::info!("drained; exiting");
    Ok(())
}

/// The name `/v1/models` lists: a directory's name, or the hub id as given.
fn model_id(model: &str) -> String {
    let path = Path::new(model);
    match path.file_name() {
        Some(name) if path.is_dir() => name.to_string_lossy().into_owned(),
        _ => model.to_string(),
    }
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

//! What every handler shares: the engine, the options, the metrics, and the server's phase
//! (serving, draining after SIGTERM, stopping).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use tokio::sync::watch;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::Engine;
use voxkernel_core::voice_clone::CloneEncoder;

use crate::error::FieldError;
use crate::metrics::Metrics;
use crate::request::DESIGN_VOICE;
use crate::voices::VoiceRegistry;

#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The name `GET /v1/models` lists and `model` may give.
    pub model_id: String,
    /// With a key, every endpoint but `/healthz` and `/readyz` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Characters in an HTTP `input`, in one WebSocket context's text, and in an instruction.
    pub max_text_chars: usize,
    /// Bytes in an HTTP request body.
    pub max_body_bytes: usize,
    /// Bytes in one WebSocket message.
    pub max_ws_message_bytes: usize,
    /// Bytes in a `POST /v1/voices` body (the reference clip and the other fields).
    pub max_upload_bytes: usize,
    /// Registered voices held at once (Base models).
    pub max_voices: usize,
    /// Where registered voices are saved, one JSON file each, and loaded from at start;
    /// `None` keeps them in memory only.
    pub voices_dir: Option<PathBuf>,
}

impl ServerOptions {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            api_key: None,
            // OpenAI's limit on `input`.
            max_text_chars: 4096,
            // The longest text as JSON escapes (6 bytes a character) plus the other fields.
            max_body_bytes: 64 * 1024,
            max_ws_message_bytes: 64 * 1024,
            // 30 s (the longest reference) of 48 kHz stereo float WAV is 11.5 MB.
            max_upload_bytes: 16 * 1024 * 1024,
            max_voices: 100,
            voices_dir: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// No new sessions; running ones finish.
    Draining,
    /// Every stream ends now.
    Stopping,
}

pub struct AppState {
    pub engine: Arc<Engine>,
    pub options: ServerOptions,
    pub metrics: Metrics,
    pub voices: VoiceRegistry,
    phase: watch::Sender<Phase>,
    /// Open WebSocket connections, which axum's graceful shutdown does not wait for.
    ws_open: watch::Sender<usize>,
}

impl AppState {
    /// Fails on a voice encoder that does not fit the model, or saved voices that cannot be
    /// loaded ([`VoiceRegistry::new`]).
    pub fn new(
        engine: Arc<Engine>,
        options: ServerOptions,
        voice_encoder: Option<Box<dyn CloneEncoder>>,
    ) -> Result<Self> {
        let voices = VoiceRegistry::new(
            engine.model(),
            voice_encoder,
            options.voices_dir.clone(),
            options.max_voices,
        )?;
        let metrics = Metrics::new();
        metrics.registered_voices.set(voices.len() as i64);
        Ok(Self {
            engine,
            options,
            metrics,
            voices,
            phase: watch::channel(Phase::Serving).0,
            ws_open: watch::channel(0).0,
        })
    }

    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    pub fn watch_phase(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Moves to a later phase (never back).
    pub fn advance(&self, to: Phase) {
        self.phase.send_if_modified(|phase| {
            let later = matches!(
                (*phase, to),
                (Phase::Serving, Phase::Draining | Phase::Stopping)
                    | (Phase::Draining, Phase::Stopping)
            );
            if later {
                *phase = to;
            }
            later
        });
    }

    /// Counts a WebSocket connection until the guard drops.
    pub fn ws_connection(self: &Arc<Self>) -> WsConnectionGuard {
        self.ws_open.send_modify(|n| *n += 1);
        WsConnectionGuard(Arc::clone(self))
    }

    pub async fn ws_closed(&self) {
        let mut open = self.ws_open.subscribe();
        let _ = open.wait_for(|&n| n == 0).await;
    }

    /// The names a request may give as its voice: the preset speakers, or the registered
    /// voices' ids for a Base model.
    pub fn voice_names(&self) -> Vec<String> {
        let config = &self.engine.model().checkpoint.config;
        match config.model_type {
            ModelType::CustomVoice => config.talker.spk_id.keys().cloned().collect(),
            ModelType::VoiceDesign => vec![DESIGN_VOICE.to_string()],
            ModelType::Base => self.voices.list().iter().map(|v| v.id.clone()).collect(),
        }
    }

    pub fn check_text_length(&self, field: &str, text: &str) -> Result<(), FieldError> {
        let limit = self.options.max_text_chars;
        let n = text.chars().count();
        if n > limit {
            return Err(FieldError::new(
                field,
                format!("{n} characters is over the limit of {limit}"),
            ));
        }
        Ok(())
    }
}

pub struct WsConnectionGuard(Arc<AppState>);

impl Drop for WsConnectionGuard {
    fn drop(&mut self) {
        self.0.ws_open.send_modify(|n| *n -= 1);
    }
}

//! The backend-agnostic synthesis flow: request -> prompt plan -> frames -> PCM.
//!
//! - [`Model`], [`SpeechRequest`], [`generate`]: one request run to its end (the CLI's `synth`);
//! - [`Engine`]: many streaming sessions sharing the backends, frame by frame ([`scheduler`]),
//!   steered through [`Session`]s ([`session`]), with text that may arrive piece by piece
//!   ([`text`]).

mod scheduler;
mod session;
mod text;

pub use scheduler::{Engine, EngineOptions, OpenError};
pub use session::{
    AudioChunk, ChunkSchedule, EndReason, EngineStats, RunawayGuard, Session, SessionEvent,
    SessionEvents, SessionHandle, SessionRequest, Usage,
};
pub use text::IncrementalText;

use std::path::Path;

use anyhow::Result;

use crate::backend::{FinishReason, Frame, FrameBackend, FrameEvent, SequenceSpec};
use crate::checkpoint::Checkpoint;
use crate::config::GenerationConfig;
use crate::prompt::{self, PromptPlan, PromptRequest, TextIds, TextMode, Voice};
use crate::sampling::{SamplerParams, SamplingConfig};
use crate::tokenizer::TextTokenizer;

/// A loaded checkpoint with its text tokenizer.
pub struct Model {
    pub checkpoint: Checkpoint,
    pub tokenizer: TextTokenizer,
}

/// What a user asks for, before tokenization.
#[derive(Debug, Clone)]
pub struct SpeechRequest {
    pub text: String,
    pub voice: Voice,
    pub language: String,
    pub instruct: Option<String>,
    /// `None` picks the official default for the voice.
    pub text_mode: Option<TextMode>,
}

impl Model {
    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Self {
            checkpoint: Checkpoint::open(dir)?,
            tokenizer: TextTokenizer::from_dir(dir)?,
        })
    }

    /// The ids of an in-context voice's transcript (`TextIds::reference`), `None` for every
    /// other voice.
    pub fn reference_text_ids(&self, voice: &Voice) -> Result<Option<Vec<u32>>> {
        match voice {
            Voice::Clone { reference_text, .. } => {
                Ok(Some(self.tokenizer.reference_text_ids(reference_text)?))
            }
            _ => Ok(None),
        }
    }

    pub fn plan(&self, request: &SpeechRequest) -> Result<PromptPlan> {
        let instruct = request
            .instruct
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| self.tokenizer.instruct_ids(s))
            .transpose()?;
        let ids = TextIds {
            target: self.tokenizer.target_text_ids(&request.text)?,
            target_role: Some(self.tokenizer.target_role_ids(&request.text)?),
            instruct,
            reference: self.reference_text_ids(&request.voice)?,
        };
        let prompt_request = PromptRequest {
            voice: request.voice.clone(),
            language: request.language.clone(),
            text_mode: request
                .text_mode
                .unwrap_or_else(|| prompt::default_text_mode(&request.voice)),
        };
        prompt::build_plan(&self.checkpoint.config, &prompt_request, &ids)
    }
}

/// User overrides of the checkpoint's `generation_config.json`; `None` keeps its value.
#[derive(Debug, Clone, Default)]
pub struct SamplerOverrides {
    pub greedy: bool,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplerOverrides {
    fn apply(&self, params: &mut SamplerParams) {
        params.do_sample &= !self.greedy;
        params.temperature = self.temperature.unwrap_or(params.temperature);
        params.top_k = self.top_k.unwrap_or(params.top_k);
        params.top_p = self.top_p.unwrap_or(params.top_p);
        params.repetition_penalty = self.repetition_penalty.unwrap_or(params.repetition_penalty);
    }
}

/// The checkpoint's `generation_config.json` with user overrides on top (the wrapper's
/// priority: user value, then the file), validated. Errors name the CLI flag.
pub fn sampling_config(
    generation: &GenerationConfig,
    talker: &SamplerOverrides,
    subtalker: &SamplerOverrides,
    seed: u64,
) -> Result<SamplingConfig> {
    sampling_config_named(generation, talker, subtalker, seed, |field, sub| {
        let flag = field.replace('_', "-");
        if sub {
            format!("--subtalker-{flag}")
        } else {
            format!("--{flag}")
        }
    })
}

/// [`sampling_config`] for another interface (a JSON API): `name(field, is_subtalker)` renders
/// a parameter's user-facing name for the error.
pub fn sampling_config_named(
    generation: &GenerationConfig,
    talker: &SamplerOverrides,
    subtalker: &SamplerOverrides,
    seed: u64,
    name: impl Fn(&str, bool) -> String,
) -> Result<SamplingConfig> {
    let mut config = SamplingConfig::from_generation(generation, seed);
    talker.apply(&mut config.talker);
    subtalker.apply(&mut config.subtalker);
    config.talker.validate(|f| name(f, false))?;
    config.subtalker.validate(|f| name(f, true))?;
    Ok(config)
}

/// Run one sequence to its end on a backend, returning every frame and why it stopped.
pub fn generate(
    backend: &mut dyn FrameBackend,
    spec: &SequenceSpec,
) -> Result<(Vec<Frame>, FinishReason)> {
    let slot = backend.start_one(spec)?;
    let mut frames = Vec::new();
    let result = loop {
        match backend.step(&[slot]) {
            Ok(events) => match events[0] {
                FrameEvent::Frame(frame) => frames.push(frame),
                FrameEvent::Finished(reason) => break Ok(reason),
            },
            Err(e) => break Err(e),
        }
    };
    backend.release(slot);
    Ok((frames, result?))
}

//! The backend-agnostic synthesis flow: request -> prompt plan -> frames -> PCM.

use std::path::Path;

use anyhow::{Result, bail};

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
            reference: None,
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

/// Merge overrides onto the generation config (user value, then the file) and validate.
/// `prefix` names the flag family in errors ("" or "subtalker-").
pub fn sampler_params(
    defaults: SamplerParams,
    overrides: &SamplerOverrides,
    prefix: &str,
) -> Result<SamplerParams> {
    let params = SamplerParams {
        do_sample: defaults.do_sample && !overrides.greedy,
        temperature: overrides.temperature.unwrap_or(defaults.temperature),
        top_k: overrides.top_k.unwrap_or(defaults.top_k),
        top_p: overrides.top_p.unwrap_or(defaults.top_p),
        repetition_penalty: overrides
            .repetition_penalty
            .unwrap_or(defaults.repetition_penalty),
    };
    if params.do_sample && !(params.temperature > 0.0 && params.temperature.is_finite()) {
        bail!(
            "--{prefix}temperature must be > 0 when sampling (got {}); use --greedy for argmax",
            params.temperature
        );
    }
    if params.top_k < 1 {
        bail!("--{prefix}top-k must be at least 1 (got {})", params.top_k);
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        bail!("--{prefix}top-p must be in (0, 1] (got {})", params.top_p);
    }
    if !(params.repetition_penalty > 0.0 && params.repetition_penalty.is_finite()) {
        bail!(
            "--{prefix}repetition-penalty must be > 0 (got {})",
            params.repetition_penalty
        );
    }
    Ok(params)
}

/// The sampling configuration from `generation_config.json` plus user overrides.
pub fn sampling_config(
    generation: &GenerationConfig,
    talker: &SamplerOverrides,
    subtalker: &SamplerOverrides,
    seed: u64,
) -> Result<SamplingConfig> {
    let talker_defaults = SamplerParams {
        do_sample: generation.do_sample,
        temperature: generation.temperature,
        top_k: generation.top_k,
        top_p: generation.top_p,
        repetition_penalty: generation.repetition_penalty,
    };
    let subtalker_defaults = SamplerParams {
        do_sample: generation.subtalker_dosample,
        temperature: generation.subtalker_temperature,
        top_k: generation.subtalker_top_k,
        top_p: generation.subtalker_top_p,
        repetition_penalty: 1.0,
    };
    Ok(SamplingConfig {
        talker: sampler_params(talker_defaults, talker, "")?,
        subtalker: sampler_params(subtalker_defaults, subtalker, "subtalker-")?,
        seed,
    })
}

/// Run one sequence to its end on a backend, returning every frame and why it stopped.
pub fn generate(
    backend: &mut dyn FrameBackend,
    spec: &SequenceSpec,
) -> Result<(Vec<Frame>, FinishReason)> {
    let slot = backend.start(spec)?;
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

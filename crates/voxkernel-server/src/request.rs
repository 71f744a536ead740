//! The settings both APIs share (voice, language, instruct, sampling, seed), checked against the
//! loaded model with errors that name the client's field and list the valid values, then turned
//! into an engine request.

use serde::Deserialize;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::{SamplerOverrides, SessionRequest, sampling_config_named};
use voxkernel_core::prompt::{TextMode, Voice};

use crate::error::FieldError;
use crate::state::AppState;
use crate::voices::ID_PREFIX;

/// Talker sampling; each field falls back to the checkpoint's `generation_config.json`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Argmax for the talker and the sub-talker alike.
    pub greedy: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TextModeField {
    Whole,
    Streaming,
}

/// What a client may set for one utterance, named as its API names the fields.
pub struct Settings<'a> {
    pub voice: Option<&'a str>,
    pub voice_field: &'a str,
    pub language: Option<&'a str>,
    pub instruct: Option<&'a str>,
    pub instruct_field: &'a str,
    pub text_mode: Option<TextModeField>,
    pub seed: Option<u64>,
    pub sampling: Option<&'a SamplingFields>,
}

impl Settings<'_> {
    /// The engine request for these settings and the text known so far.
    pub fn session_request(
        &self,
        state: &AppState,
        text: String,
        text_complete: bool,
    ) -> Result<SessionRequest, FieldError> {
        let model = state.engine.model();
        let config = &model.checkpoint.config;
        let voice = self.voice(state)?;
        let language = self.language.unwrap_or("auto").to_lowercase();
        let languages = config.languages();
        if !languages.contains(&language) {
            return Err(FieldError::new(
                "language",
                format!(
                    "unknown language {:?}; valid: {}",
                    self.language.unwrap_or_default(),
                    languages.join(", ")
                ),
            ));
        }
        let instruct = self.instruct.filter(|s| !s.trim().is_empty());
        if let Some(instruct) = instruct {
            if config.model_type == ModelType::Base {
                return Err(FieldError::new(
                    self.instruct_field,
                    "a base model takes no instruction (its voice comes from the reference \
                     audio); omit it",
                ));
            }
            state.check_text_length(self.instruct_field, instruct)?;
        } else if config.model_type == ModelType::VoiceDesign {
            return Err(FieldError::new(
                self.instruct_field,
                "required for a voice_design model: describe the voice to design",
            ));
        }
        let sampling = self.sampling.cloned().unwrap_or_default();
        let greedy = sampling.greedy.unwrap_or(false);
        let talker = SamplerOverrides {
            greedy,
            temperature: sampling.temperature,
            top_k: sampling.top_k,
            top_p: sampling.top_p,
            repetition_penalty: sampling.repetition_penalty,
        };
        let subtalker = SamplerOverrides {
            greedy,
            ..SamplerOverrides::default()
        };
        let seed = self.seed.unwrap_or_else(random_u64);
        let sampling = sampling_config_named(
            &model.checkpoint.generation,
            &talker,
            &subtalker,
            seed,
            |field, sub| {
                // The sub-talker's values come from the checkpoint alone.
                if sub {
                    format!("the checkpoint's subtalker_{field}")
                } else {
                    format!("sampling.{field}")
                }
            },
        )
        .map_err(|e| {
            // "sampling.top_p must be in (0, 1], got 0": the field is the first word
            let message = format!("{e:#}");
            match message.split_once(' ') {
                Some((field, rest)) if field.starts_with("sampling.") => {
                    FieldError::new(field, rest)
                }
                _ => FieldError::new("sampling", message),
            }
        })?;
        Ok(SessionRequest {
            voice,
            language,
            instruct: instruct.map(str::to_string),
            text_mode: self.text_mode.map(|m| match m {
                TextModeField::Whole => TextMode::Whole,
                TextModeField::Streaming => TextMode::Streaming,
            }),
            sampling,
            text,
            text_complete,
            max_frames: None,
            schedule: None,
        })
    }

    fn voice(&self, state: &AppState) -> Result<Voice, FieldError> {
        let config = &state.engine.model().checkpoint.config;
        let field = self.voice_field;
        let valid = || {
            let names = state.voice_names();
            if names.is_empty() {
                "none yet; register one with POST /v1/voices".to_string()
            } else {
                names.join(", ")
            }
        };
        // An id of a registered voice given to a model that cannot clone.
        let clone_hint = |name: &str| {
            if name.starts_with(ID_PREFIX) {
                format!(
                    "; registered (cloned) voices need a base model, and this is a {} model",
                    config.model_type.as_str()
                )
            } else {
                String::new()
            }
        };
        match (config.model_type, self.voice) {
            (ModelType::CustomVoice, Some(name)) => {
                if config.talker.spk_id.contains_key(&name.to_lowercase()) {
                    Ok(Voice::Speaker(name.to_string()))
                } else {
                    Err(FieldError::new(
                        field,
                        format!(
                            "unknown speaker {name:?}{}; valid: {}",
                            clone_hint(name),
                            valid()
                        ),
                    ))
                }
            }
            (ModelType::CustomVoice, None) => Err(FieldError::new(
                field,
                format!("required for this custom_voice model; valid: {}", valid()),
            )),
            (ModelType::VoiceDesign, None | Some(DESIGN_VOICE)) => Ok(Voice::Design),
            (ModelType::VoiceDesign, Some(name)) => Err(FieldError::new(
                field,
                format!(
                    "{name:?}{}: a voice_design model has no preset speakers; omit the voice (or \
                     give \"{DESIGN_VOICE}\") and describe it in the instruction",
                    clone_hint(name)
                ),
            )),
            (ModelType::Base, Some(id)) => match state.voices.get(id) {
                Some(registered) => Ok(registered.voice.voice()),
                None => Err(FieldError::new(
                    field,
                    format!(
                        "{id:?} is not a registered voice; a base model speaks in the voices \
                         registered with POST /v1/voices; valid: {}",
                        valid()
                    ),
                )),
            },
            (ModelType::Base, None) => Err(FieldError::new(
                field,
                format!(
                    "required for this base model: the id of a voice registered with POST \
                     /v1/voices; valid: {}",
                    valid()
                ),
            )),
        }
    }
}

/// The one voice of a VoiceDesign model, for clients (like OpenAI's) that must name a voice.
pub const DESIGN_VOICE: &str = "design";

/// A seed for a request that gave none, or a request id: different each call, not
/// reproducible, not secret.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded from the OS once per thread and advanced per instance.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

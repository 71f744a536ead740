//! The prompt plan: a typed description of exactly what the official implementation feeds the
//! talker for a request (qwen3-tts-spec.md §3.3). A backend turns each row into a vector by
//! summing a text-track vector and a codec-track vector; nothing here knows about tensors.
//!
//! `build_plan` takes a `PromptRequest` (voice, language, text mode) and `TextIds` (text the
//! caller has already tokenized and sliced like qwen-tts, see `tokenizer.rs`), validates them
//! against the model's config, and returns the plan. It needs no tokenizer and no weights.

use anyhow::{Result, anyhow, bail};
use serde::Serialize;

use crate::backend::Frame;
use crate::config::{ModelConfig, ModelType};

/// How the target text reaches the talker (`non_streaming_mode` in qwen-tts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TextMode {
    /// The whole text sits in the prefill (`non_streaming_mode=True`).
    Whole,
    /// The first text token sits in the prefill; the rest is fed one token per decode step
    /// (`non_streaming_mode=False`).
    Streaming,
}

/// The codec-track vector summed onto a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum CodecSource {
    /// Text-only row: nothing is added.
    None,
    /// `talker.model.codec_embedding[id]`.
    Id(u32),
    /// The request's speaker vector (a Base model's x-vector).
    SpeakerVector,
    /// The summed code embeddings of reference frame `k` (ICL voice clone).
    ReferenceFrame(usize),
}

/// One prefill row: `text_projection(text_embedding[text_id]) + codec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PrefillRow {
    pub text_id: u32,
    pub codec: CodecSource,
}

impl PrefillRow {
    pub fn is_text_only(&self) -> bool {
        self.codec == CodecSource::None
    }
}

/// Everything the talker is fed for one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptPlan {
    pub prefill: Vec<PrefillRow>,
    /// Text-track ids added one per decode step: step `g` adds
    /// `text_projection(text_embedding[trailing[g]])`, or of `tts_pad_id` once they run out.
    pub trailing: Vec<u32>,
    pub tts_pad_id: u32,
    /// Summed onto `CodecSource::SpeakerVector` rows; talker width.
    #[serde(skip)]
    pub speaker_vector: Option<Vec<f32>>,
    /// The reference frames `CodecSource::ReferenceFrame(k)` rows point into (ICL).
    #[serde(skip)]
    pub reference_codes: Vec<Frame>,
}

/// Longest tokenized text a request may carry, so one request cannot claim an unbounded
/// prefill or KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Applies separately to the target text, the instruct and the ICL reference text.
    pub max_text_tokens: usize,
}

impl Default for PlanLimits {
    fn default() -> Self {
        Self {
            max_text_tokens: 4096,
        }
    }
}

/// The id of `"\n"`, the last token of the usual role prefix `<|im_start|>assistant\n`. It is
/// not in config.json, which names only the two special tokens of the prefix.
pub const NEWLINE_TOKEN_ID: u32 = 198;

/// Text already tokenized the way qwen-tts slices it (spec §3.1). Keeping tokenization out of
/// the planner lets the plan be built and tested without a tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TextIds {
    /// `ids[3:-5]` of `"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"`.
    pub target: Vec<u32>,
    /// `ids[0:3]` of that same string. `None` means `[im_start, assistant, "\n"]`, which is
    /// what it is unless the text starts with a line break: BPE then merges that break into
    /// the role's `"\n"` (e.g. `"\n\n"` is one token), and the official prefill carries the
    /// merged token, so pass the real ids for exact parity.
    pub target_role: Option<[u32; 3]>,
    /// All ids of `"<|im_start|>user\n{instruct}<|im_end|>\n"`; `None` for no instruct
    /// (official: an empty instruct string is no instruct).
    pub instruct: Option<Vec<u32>>,
    /// ICL only: `ids[3:-2]` of `"<|im_start|>assistant\n{ref_text}<|im_end|>\n"`.
    pub reference: Option<Vec<u32>>,
}

/// Whose voice speaks. Each model type accepts exactly one family of voices.
#[derive(Debug, Clone, PartialEq)]
pub enum Voice {
    /// A preset speaker of a CustomVoice model, matched case-insensitively.
    Speaker(String),
    /// VoiceDesign: the voice comes from the instruct alone.
    Design,
    /// Base, x-vector only (`x_vector_only_mode=True`): a speaker-encoder vector of talker width.
    XVector(Vec<f32>),
    /// Base, in-context cloning (`icl_mode`): the reference audio's x-vector, codes and
    /// transcript. The planner reads the transcript's ids from `TextIds::reference`; the
    /// text is here so that every request path carrying the voice can tokenize it
    /// (`engine::Model::reference_text_ids`).
    Clone {
        x_vector: Vec<f32>,
        reference_codes: Vec<Frame>,
        reference_text: String,
    },
}

impl Voice {
    fn kind(&self) -> &'static str {
        match self {
            Voice::Speaker(_) => "speaker",
            Voice::Design => "design",
            Voice::XVector(_) => "x_vector",
            Voice::Clone { .. } => "clone",
        }
    }
}

/// One synthesis request, minus its text (see `TextIds`). Whether an instruct is given is
/// `TextIds::instruct.is_some()`; there is no second flag that could disagree with it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRequest {
    pub voice: Voice,
    /// "auto" or a language name, case-insensitive (`ModelConfig::languages()`).
    pub language: String,
    pub text_mode: TextMode,
}

/// The official default per entry point (`non_streaming_mode`): `generate_custom_voice` and
/// `generate_voice_design` default to `True`, `generate_voice_clone` (x-vector and ICL) to
/// `False`.
pub fn default_text_mode(voice: &Voice) -> TextMode {
    match voice {
        Voice::Speaker(_) | Voice::Design => TextMode::Whole,
        Voice::XVector(_) | Voice::Clone { .. } => TextMode::Streaming,
    }
}

/// `build_plan_with_limits` with `PlanLimits::default()`.
pub fn build_plan(
    config: &ModelConfig,
    request: &PromptRequest,
    ids: &TextIds,
) -> Result<PromptPlan> {
    build_plan_with_limits(config, request, ids, PlanLimits::default())
}

/// Checks the voice, language and instruct of a request against the model without any text,
/// so a server can reject a bad request before the text arrives. `build_plan_with_limits` runs
/// the same checks.
pub fn check_request(
    config: &ModelConfig,
    request: &PromptRequest,
    instruct: Option<&[u32]>,
    limits: PlanLimits,
) -> Result<()> {
    resolve_speaker(config, &request.voice)?;
    resolve_language(config, &request.language, &request.voice)?;
    resolve_instruct(config, &request.voice, instruct, limits)?;
    Ok(())
}

/// Lays out the talker input exactly as `Qwen3TTSForConditionalGeneration.generate` does
/// (modeling_qwen3_tts.py:2022-2241, ICL in `generate_icl_prompt`), after validating the
/// request against the model.
///
/// An instruct given to a model without instruct support (the 0.6B CustomVoice) is dropped
/// with a warning, as the official wrapper silently does (qwen3_tts_model.py:799), so that the
/// same request works across model sizes. A Base model has no instruct input at all, so an
/// instruct there is an error.
pub fn build_plan_with_limits(
    config: &ModelConfig,
    request: &PromptRequest,
    ids: &TextIds,
    limits: PlanLimits,
) -> Result<PromptPlan> {
    let speaker = resolve_speaker(config, &request.voice)?;
    let language = resolve_language(config, &request.language, &request.voice)?;
    let instruct = resolve_instruct(config, &request.voice, ids.instruct.as_deref(), limits)?;
    let target = checked_text(config, "text.target", &ids.target, limits)?;
    let role = resolve_role(config, ids.target_role)?;
    let clone = resolve_clone(config, &request.voice, ids.reference.as_deref(), limits)?;

    let talker = &config.talker;
    let tts_pad = config.tts_pad_token_id;
    let mut prefill: Vec<PrefillRow> = Vec::new();
    let text_only = |text_id| PrefillRow {
        text_id,
        codec: CodecSource::None,
    };
    prefill.extend(instruct.into_iter().flatten().copied().map(text_only));
    prefill.extend(role.into_iter().map(text_only));

    // Control rows: every codec entry but the last two is summed with tts_pad; codec_pad
    // carries tts_bos; codec_bos is placed by the body.
    let mut control = match language {
        None => vec![
            CodecSource::Id(talker.codec_nothink_id),
            CodecSource::Id(talker.codec_think_bos_id),
            CodecSource::Id(talker.codec_think_eos_id),
        ],
        Some(language_id) => vec![
            CodecSource::Id(talker.codec_think_id),
            CodecSource::Id(talker.codec_think_bos_id),
            CodecSource::Id(language_id),
            CodecSource::Id(talker.codec_think_eos_id),
        ],
    };
    control.extend(speaker);
    prefill.extend(control.into_iter().map(|codec| PrefillRow {
        text_id: tts_pad,
        codec,
    }));
    prefill.push(PrefillRow {
        text_id: config.tts_bos_token_id,
        codec: CodecSource::Id(talker.codec_pad_id),
    });

    let (body, trailing) = match clone {
        Some((reference_text, frames)) => {
            icl_body(config, reference_text, target, frames, request.text_mode)
        }
        None => plain_body(config, target, request.text_mode),
    };
    prefill.extend(body);

    let (speaker_vector, reference_codes) = match &request.voice {
        Voice::XVector(x_vector) => (Some(x_vector.clone()), Vec::new()),
        Voice::Clone {
            x_vector,
            reference_codes,
            ..
        } => (Some(x_vector.clone()), reference_codes.clone()),
        Voice::Speaker(_) | Voice::Design => (None, Vec::new()),
    };
    Ok(PromptPlan {
        prefill,
        trailing,
        tts_pad_id: tts_pad,
        speaker_vector,
        reference_codes,
    })
}

/// Body and trailing ids without a reference (spec §3.3 (a), (b)).
fn plain_body(
    config: &ModelConfig,
    target: &[u32],
    text_mode: TextMode,
) -> (Vec<PrefillRow>, Vec<u32>) {
    let codec_pad = CodecSource::Id(config.talker.codec_pad_id);
    let codec_bos = CodecSource::Id(config.talker.codec_bos_id);
    match text_mode {
        TextMode::Whole => {
            let mut body: Vec<PrefillRow> = target
                .iter()
                .chain([&config.tts_eos_token_id])
                .map(|&text_id| PrefillRow {
                    text_id,
                    codec: codec_pad,
                })
                .collect();
            body.push(PrefillRow {
                text_id: config.tts_pad_token_id,
                codec: codec_bos,
            });
            (body, Vec::new())
        }
        TextMode::Streaming => {
            let body = vec![PrefillRow {
                text_id: target[0],
                codec: codec_bos,
            }];
            let trailing = target[1..]
                .iter()
                .copied()
                .chain([config.tts_eos_token_id])
                .collect();
            (body, trailing)
        }
    }
}

/// Body and trailing ids of in-context cloning (spec §3.3 (c), `generate_icl_prompt`): the
/// text block `R ++ T ++ [tts_eos]` meets the codec block `[codec_bos, frame 0, ...]`.
fn icl_body(
    config: &ModelConfig,
    reference_text: &[u32],
    target: &[u32],
    frames: usize,
    text_mode: TextMode,
) -> (Vec<PrefillRow>, Vec<u32>) {
    let text_block: Vec<u32> = reference_text
        .iter()
        .chain(target)
        .chain([&config.tts_eos_token_id])
        .copied()
        .collect();
    let codec_block: Vec<CodecSource> =
        std::iter::once(CodecSource::Id(config.talker.codec_bos_id))
            .chain((0..frames).map(CodecSource::ReferenceFrame))
            .collect();
    let tts_pad = config.tts_pad_token_id;
    match text_mode {
        TextMode::Whole => {
            let codec_pad = CodecSource::Id(config.talker.codec_pad_id);
            let text_rows = text_block.iter().map(|&text_id| PrefillRow {
                text_id,
                codec: codec_pad,
            });
            let codec_rows = codec_block.iter().map(|&codec| PrefillRow {
                text_id: tts_pad,
                codec,
            });
            (text_rows.chain(codec_rows).collect(), Vec::new())
        }
        TextMode::Streaming => {
            // Text longer than the codec block spills into trailing; a shorter text is padded
            // with tts_pad up to the codec block's length.
            let body = codec_block
                .iter()
                .enumerate()
                .map(|(i, &codec)| PrefillRow {
                    text_id: text_block.get(i).copied().unwrap_or(tts_pad),
                    codec,
                })
                .collect();
            let trailing = text_block
                .get(codec_block.len()..)
                .unwrap_or_default()
                .to_vec();
            (body, trailing)
        }
    }
}

/// The speaker-slot codec entry, after checking the voice fits the model type.
fn resolve_speaker(config: &ModelConfig, voice: &Voice) -> Result<Option<CodecSource>> {
    let model_type = config.model_type;
    let valid = valid_voices(model_type);
    let wrong_voice = || {
        anyhow!(
            "voice: {:?} is not valid for a {} model; valid voices: {valid}",
            voice.kind(),
            model_type_name(model_type)
        )
    };
    match (model_type, voice) {
        (ModelType::CustomVoice, Voice::Speaker(name)) => {
            let id = config
                .talker
                .spk_id
                .get(&name.to_lowercase())
                .ok_or_else(|| {
                    anyhow!(
                        "voice.speaker: unknown speaker {name:?}; this model's speakers: {}",
                        speaker_names(config)
                    )
                })?;
            Ok(Some(CodecSource::Id(*id)))
        }
        (ModelType::CustomVoice, _) => Err(anyhow!(
            "voice: {:?} is not valid for a custom_voice model, which needs a speaker; valid \
             voices: speaker ({})",
            voice.kind(),
            speaker_names(config)
        )),
        (ModelType::VoiceDesign, Voice::Design) => Ok(None),
        (ModelType::Base, Voice::XVector(x_vector) | Voice::Clone { x_vector, .. }) => {
            let width = config.talker.hidden_size;
            if x_vector.len() != width {
                bail!(
                    "voice.x_vector: {} values, but this model's speaker vector has talker \
                     width {width}",
                    x_vector.len()
                );
            }
            Ok(Some(CodecSource::SpeakerVector))
        }
        _ => Err(wrong_voice()),
    }
}

fn valid_voices(model_type: ModelType) -> &'static str {
    match model_type {
        ModelType::CustomVoice => "speaker",
        ModelType::VoiceDesign => "design",
        ModelType::Base => "x_vector, clone",
    }
}

fn model_type_name(model_type: ModelType) -> &'static str {
    match model_type {
        ModelType::Base => "base",
        ModelType::CustomVoice => "custom_voice",
        ModelType::VoiceDesign => "voice_design",
    }
}

fn speaker_names(config: &ModelConfig) -> String {
    let names: Vec<&str> = config.talker.spk_id.keys().map(String::as_str).collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// The language codec id, `None` for "auto" (the nothink block). A dialect speaker asked for
/// Chinese or "auto" switches to its dialect's id, as the official code does.
fn resolve_language(config: &ModelConfig, language: &str, voice: &Voice) -> Result<Option<u32>> {
    let language = language.to_lowercase();
    let valid = config.languages();
    if !valid.contains(&language) {
        bail!(
            "language: unknown language {language:?}; valid languages: {}",
            valid.join(", ")
        );
    }
    let ids = &config.talker.codec_language_id;
    let mut id = (language != "auto").then(|| ids[&language]);
    if let Voice::Speaker(name) = voice
        && (language == "chinese" || language == "auto")
        && let Some(dialect) = config.talker.spk_is_dialect.get(&name.to_lowercase())
    {
        let dialect_id = ids.get(dialect).ok_or_else(|| {
            anyhow!(
                "config.json: speaker {name:?} has dialect {dialect:?}, which is not in \
                 talker_config.codec_language_id"
            )
        })?;
        id = Some(*dialect_id);
    }
    Ok(id)
}

/// The instruct ids to place at the very start, if any.
fn resolve_instruct<'a>(
    config: &ModelConfig,
    voice: &Voice,
    instruct: Option<&'a [u32]>,
    limits: PlanLimits,
) -> Result<Option<&'a [u32]>> {
    if instruct.is_some_and(<[u32]>::is_empty) {
        bail!("text.instruct: no ids; pass None for no instruct");
    }
    match config.model_type {
        ModelType::VoiceDesign if instruct.is_none() => {
            bail!("text.instruct: a voice_design model needs an instruct describing the voice")
        }
        ModelType::Base if instruct.is_some() => bail!(
            "text.instruct: base models take no instruct (valid for custom_voice 1.7B and \
             voice_design)"
        ),
        ModelType::CustomVoice if instruct.is_some() && !config.supports_instruct() => {
            tracing::warn!(
                model_size = %config.model_size,
                voice = voice.kind(),
                "this custom_voice model ignores instruct; dropping it like the official wrapper"
            );
            Ok(None)
        }
        _ => instruct
            .map(|ids| checked_text(config, "text.instruct", ids, limits))
            .transpose(),
    }
}

fn resolve_role(config: &ModelConfig, role: Option<[u32; 3]>) -> Result<[u32; 3]> {
    let expected = [config.im_start_token_id, config.assistant_token_id];
    match role {
        None => Ok([expected[0], expected[1], NEWLINE_TOKEN_ID]),
        Some(role) if role[..2] == expected => Ok(role),
        Some(role) => bail!(
            "text.target_role: {role:?} must start with <|im_start|> assistant ({expected:?})"
        ),
    }
}

/// The reference text and frame count of an ICL request; `None` for every other voice,
/// which must not carry a reference text.
fn resolve_clone<'a>(
    config: &ModelConfig,
    voice: &Voice,
    reference_text: Option<&'a [u32]>,
    limits: PlanLimits,
) -> Result<Option<(&'a [u32], usize)>> {
    match voice {
        Voice::Clone {
            reference_codes, ..
        } => resolve_reference(config, reference_text, reference_codes, limits).map(Some),
        _ if reference_text.is_some() => bail!(
            "text.reference: a reference text is only used by voice \"clone\" (ICL); this \
             request's voice is {:?}",
            voice.kind()
        ),
        _ => Ok(None),
    }
}

/// The reference text and frame count of an ICL request, validated.
fn resolve_reference<'a>(
    config: &ModelConfig,
    reference_text: Option<&'a [u32]>,
    reference_codes: &[Frame],
    limits: PlanLimits,
) -> Result<(&'a [u32], usize)> {
    let reference_text = reference_text.ok_or_else(|| {
        anyhow!("text.reference: voice \"clone\" (ICL) needs the reference audio's transcript")
    })?;
    let reference_text = checked_text(config, "text.reference", reference_text, limits)?;
    if reference_codes.is_empty() {
        bail!("voice.reference_codes: voice \"clone\" (ICL) needs at least one reference frame");
    }
    let codebook_size = config.talker.code_predictor_config.vocab_size;
    for (k, frame) in reference_codes.iter().enumerate() {
        if let Some((group, code)) = frame
            .iter()
            .enumerate()
            .find(|(_, c)| **c as usize >= codebook_size)
        {
            bail!(
                "voice.reference_codes[{k}][{group}]: code {code} is outside the codebook \
                 (valid: 0..{codebook_size})"
            );
        }
    }
    Ok((reference_text, reference_codes.len()))
}

/// Rejects empty, over-long or out-of-vocabulary text.
fn checked_text<'a>(
    config: &ModelConfig,
    field: &str,
    ids: &'a [u32],
    limits: PlanLimits,
) -> Result<&'a [u32]> {
    if ids.is_empty() {
        bail!("{field}: empty (zero tokens)");
    }
    if ids.len() > limits.max_text_tokens {
        bail!(
            "{field}: {} tokens, over the limit of {} (PlanLimits::max_text_tokens)",
            ids.len(),
            limits.max_text_tokens
        );
    }
    let vocab = config.talker.text_vocab_size;
    if let Some(bad) = ids.iter().find(|id| **id as usize >= vocab) {
        bail!("{field}: token id {bad} is outside the text vocabulary (valid: 0..{vocab})");
    }
    Ok(ids)
}

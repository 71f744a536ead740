//! The prompt plan: a typed description of exactly what the official implementation feeds the
//! talker for a request (qwen3-tts-spec.md §3.3). A backend turns each row into a vector by
//! summing a text-track vector and a codec-track vector; nothing here knows about tensors.

use serde::Serialize;

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
    pub reference_codes: Vec<crate::backend::Frame>,
}

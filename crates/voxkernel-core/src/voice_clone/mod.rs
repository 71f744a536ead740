//! Voice cloning for the Base models (`create_voice_clone_prompt` and the output trimming of
//! `generate_voice_clone` in qwen-tts 0.1.1):
//!
//! 1. [`ReferenceAudio`]: a clip decoded, mixed to mono and resampled to 24 kHz;
//! 2. [`CloneEncoder::encode`]: the clip's x-vector (speaker encoder) and, for in-context
//!    cloning, its codes (speech tokenizer encoder), giving a [`ClonedVoice`]. [`VoiceEncoder`]
//!    is the CPU reference; voxkernel-cuda's `CudaVoiceEncoder` runs the same on the GPU;
//! 3. [`ClonedVoice::voice`]: the prompt voice of a request ([`Voice::XVector`] or
//!    [`Voice::Clone`]); `engine::Model::plan` tokenizes its transcript;
//! 4. [`decode_with_reference`]: in-context output decoded after the reference codes and cut
//!    where the official code cuts it.
//!
//! A [`ClonedVoice`] is everything a later request needs, so a server encodes a voice once,
//! keeps it (it is serde-serializable) and pays no encoder cost per request.

mod audio;

use std::sync::Arc;

use anyhow::{Result, bail};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

pub use self::audio::{MAX_SECONDS, MIN_SECONDS, ReferenceAudio, ReferenceAudioError, SAMPLE_RATE};
use crate::backend::Frame;
use crate::checkpoint::Checkpoint;
use crate::prompt::Voice;
use crate::reference::codec_decoder::CodecDecoder;
use crate::reference::codec_encoder::CodecEncoder;
use crate::reference::mel::MelSpectrogram;
use crate::reference::speaker_encoder::SpeakerEncoder;

/// Which of the two official clone prompts to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneMode<'a> {
    /// In-context learning (`x_vector_only_mode=False`): the x-vector, the reference codes and
    /// the transcript of the reference audio.
    Icl { transcript: &'a str },
    /// `x_vector_only_mode=True`: the speaker embedding alone.
    XVectorOnly,
}

/// A request the caller must fix (a 4xx): the audio itself is checked by [`ReferenceAudio`].
#[derive(Debug, thiserror::Error)]
pub enum CloneRequestError {
    #[error(
        "in-context cloning needs the transcript of the reference audio (or use x-vector-only mode)"
    )]
    MissingTranscript,
}

/// An encoded voice: what the official `VoiceClonePromptItem` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClonedVoice {
    /// The speaker encoder's output, talker width (`ref_spk_embedding`).
    pub x_vector: Vec<f32>,
    /// In-context cloning only.
    pub reference: Option<IclReference>,
}

/// The in-context half of a cloned voice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IclReference {
    /// The reference audio's codes, 12.5 frames per second (`ref_code`).
    pub codes: Vec<Frame>,
    /// What is said in the reference audio (`ref_text`).
    pub transcript: String,
}

impl ClonedVoice {
    /// The prompt voice for a request in this voice.
    pub fn voice(&self) -> Voice {
        match &self.reference {
            Some(reference) => Voice::Clone {
                x_vector: self.x_vector.clone(),
                reference_codes: reference.codes.clone(),
                reference_text: reference.transcript.clone(),
            },
            None => Voice::XVector(self.x_vector.clone()),
        }
    }
}

/// What turns reference audio into a voice: [`VoiceEncoder`] on the CPU, or a GPU encoder
/// (voxkernel-cuda's `CudaVoiceEncoder`). Shared between threads (a server encodes uploads on
/// blocking threads); implementations serialize their own device work.
pub trait CloneEncoder: Send + Sync {
    /// Where it runs, for logs.
    fn name(&self) -> String;

    /// The speaker embedding (`extract_speaker_embedding`), talker width.
    fn x_vector(&self, audio: &ReferenceAudio) -> Result<Vec<f32>>;

    /// The clip's codes (`speech_tokenizer.encode(...).audio_codes`): `ceil(samples / 1920)`
    /// frames.
    fn reference_codes(&self, audio: &ReferenceAudio) -> Result<Vec<Frame>>;

    /// Encodes a voice. ICL runs both encoders; x-vector-only skips the codec encoder (the
    /// official code computes the codes anyway and drops them).
    fn encode(&self, audio: &ReferenceAudio, mode: CloneMode<'_>) -> Result<ClonedVoice> {
        let reference = match mode {
            CloneMode::Icl { transcript } => {
                if transcript.trim().is_empty() {
                    return Err(CloneRequestError::MissingTranscript.into());
                }
                Some(IclReference {
                    codes: self.reference_codes(audio)?,
                    transcript: transcript.to_string(),
                })
            }
            CloneMode::XVectorOnly => None,
        };
        Ok(ClonedVoice {
            x_vector: self.x_vector(audio)?,
            reference,
        })
    }
}

/// The CPU reference: the speaker encoder with its mel front end, and the speech tokenizer's
/// encoder.
pub struct VoiceEncoder {
    mel: MelSpectrogram,
    speaker: SpeakerEncoder,
    codec: CodecEncoder,
}

impl VoiceEncoder {
    /// Loads both encoders (f32) from a Base checkpoint.
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        Ok(Self {
            mel: MelSpectrogram::new()?,
            speaker: SpeakerEncoder::from_checkpoint(checkpoint)?,
            codec: CodecEncoder::from_checkpoint(checkpoint)?,
        })
    }

    /// [`CloneEncoder::encode`], callable without the trait in scope.
    pub fn encode(&self, audio: &ReferenceAudio, mode: CloneMode<'_>) -> Result<ClonedVoice> {
        CloneEncoder::encode(self, audio, mode)
    }

    /// Log-mel frames of the clip, `[frames][128]` (what the speaker encoder sees).
    pub fn mel(&self, audio: &ReferenceAudio) -> Result<Vec<Vec<f32>>> {
        Ok(self.mel.forward(audio.samples())?.to_vec2()?)
    }

    /// The speaker embedding (`extract_speaker_embedding`), talker width.
    pub fn x_vector(&self, audio: &ReferenceAudio) -> Result<Vec<f32>> {
        let mel: Tensor = self.mel.forward(audio.samples())?;
        Ok(self.speaker.forward(&mel)?.to_vec1()?)
    }

    /// The clip's codes (`speech_tokenizer.encode(...).audio_codes`): `ceil(samples / 1920)`
    /// frames.
    pub fn reference_codes(&self, audio: &ReferenceAudio) -> Result<Vec<Frame>> {
        self.codec.encode(audio.samples())
    }
}

impl CloneEncoder for VoiceEncoder {
    fn name(&self) -> String {
        "cpu reference (f32)".to_string()
    }

    fn x_vector(&self, audio: &ReferenceAudio) -> Result<Vec<f32>> {
        VoiceEncoder::x_vector(self, audio)
    }

    fn reference_codes(&self, audio: &ReferenceAudio) -> Result<Vec<Frame>> {
        VoiceEncoder::reference_codes(self, audio)
    }
}

/// Samples the official `generate_voice_clone` drops from the front of an in-context output:
/// `int(ref_len / max(total_len, 1) * wav_len)`, in f64 as Python computes it. It is
/// `reference_frames * 1920` up to float rounding, which can make it one sample short.
pub fn reference_cut(reference_frames: usize, total_frames: usize, wav_len: usize) -> usize {
    (reference_frames as f64 / total_frames.max(1) as f64 * wav_len as f64) as usize
}

/// The waveform of an in-context request as the official code makes it: the reference codes
/// and the generated codes decoded in one pass (official chunk schedule), so the generated
/// part starts with the reference as left context, then the reference part cut off.
pub fn decode_with_reference(
    codec: &Arc<CodecDecoder>,
    reference: &[Frame],
    generated: &[Frame],
) -> Result<Vec<f32>> {
    if reference.is_empty() {
        bail!("decode_with_reference: no reference frames");
    }
    let all: Vec<Frame> = reference.iter().chain(generated).copied().collect();
    let wav = codec.decode_official(&all)?;
    let cut = reference_cut(reference.len(), all.len(), wav.len());
    Ok(wav[cut..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::reference_cut;

    #[test]
    fn the_cut_is_the_official_float_expression() {
        assert_eq!(reference_cut(40, 60, 60 * 1920), 40 * 1920);
        // 15 / 22 * 42240 is just under 28800 in f64: Python's int() gives 28799.
        assert_eq!(reference_cut(15, 22, 22 * 1920), 28_799);
        assert_eq!(reference_cut(0, 0, 0), 0);
    }
}

//! Typed mirrors of the released `config.json`, `speech_tokenizer/config.json` and
//! `generation_config.json`. Every value is read from the JSON: the Python class defaults in
//! qwen-tts 0.1.1 are stale for the released checkpoints, so no field here has a default
//! unless the released files omit it.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// Which of the released model families a checkpoint belongs to (`tts_model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelType {
    Base,
    CustomVoice,
    VoiceDesign,
}

impl ModelType {
    pub const ALL: [&'static str; 3] = ["base", "custom_voice", "voice_design"];

    /// The `tts_model_type` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Base => "base",
            Self::CustomVoice => "custom_voice",
            Self::VoiceDesign => "voice_design",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        match s {
            "base" => Ok(Self::Base),
            "custom_voice" => Ok(Self::CustomVoice),
            "voice_design" => Ok(Self::VoiceDesign),
            other => bail!(
                "config.json: unknown tts_model_type {other:?}; supported: {}",
                Self::ALL.join(", ")
            ),
        }
    }
}

/// Top-level `config.json` (model_type `qwen3_tts`).
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub model_type: ModelType,
    /// `tts_model_size`: "0b6" or "1b7". The 0.6B CustomVoice model ignores `instruct`.
    pub model_size: String,
    pub im_start_token_id: u32,
    pub im_end_token_id: u32,
    pub assistant_token_id: u32,
    pub tts_pad_token_id: u32,
    pub tts_bos_token_id: u32,
    pub tts_eos_token_id: u32,
    pub speaker_encoder: SpeakerEncoderConfig,
    pub talker: TalkerConfig,
}

/// `speaker_encoder_config` (ECAPA-TDNN, Base models). The released configs set only `enc_dim`
/// and `sample_rate`; the geometry falls back to `Qwen3TTSSpeakerEncoderConfig`'s defaults
/// (configuration_qwen3_tts.py:47-58), which the released tensor shapes confirm.
#[derive(Debug, Clone, Deserialize)]
pub struct SpeakerEncoderConfig {
    pub enc_dim: usize,
    pub sample_rate: u32,
    #[serde(default = "speaker_defaults::mel_dim")]
    pub mel_dim: usize,
    #[serde(default = "speaker_defaults::channels")]
    pub enc_channels: Vec<usize>,
    #[serde(default = "speaker_defaults::kernel_sizes")]
    pub enc_kernel_sizes: Vec<usize>,
    #[serde(default = "speaker_defaults::dilations")]
    pub enc_dilations: Vec<usize>,
    #[serde(default = "speaker_defaults::attention_channels")]
    pub enc_attention_channels: usize,
    #[serde(default = "speaker_defaults::res2net_scale")]
    pub enc_res2net_scale: usize,
    #[serde(default = "speaker_defaults::se_channels")]
    pub enc_se_channels: usize,
}

mod speaker_defaults {
    pub fn mel_dim() -> usize {
        128
    }
    pub fn channels() -> Vec<usize> {
        vec![512, 512, 512, 512, 1536]
    }
    pub fn kernel_sizes() -> Vec<usize> {
        vec![5, 3, 3, 3, 1]
    }
    pub fn dilations() -> Vec<usize> {
        vec![1, 2, 3, 4, 1]
    }
    pub fn attention_channels() -> usize {
        128
    }
    pub fn res2net_scale() -> usize {
        8
    }
    pub fn se_channels() -> usize {
        128
    }
}

/// `talker_config` (model_type `qwen3_tts_talker`).
#[derive(Debug, Clone, Deserialize)]
pub struct TalkerConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Codec vocabulary: 2048 audio codes, then control, language and speaker rows.
    pub vocab_size: usize,
    pub text_vocab_size: usize,
    pub text_hidden_size: usize,
    pub num_code_groups: usize,
    pub max_position_embeddings: usize,
    pub codec_pad_id: u32,
    pub codec_bos_id: u32,
    pub codec_eos_token_id: u32,
    pub codec_think_id: u32,
    pub codec_nothink_id: u32,
    pub codec_think_bos_id: u32,
    pub codec_think_eos_id: u32,
    pub codec_language_id: BTreeMap<String, u32>,
    /// Preset speakers of CustomVoice checkpoints; some releases store 1-element lists.
    #[serde(default, deserialize_with = "de_speaker_ids")]
    pub spk_id: BTreeMap<String, u32>,
    /// Speaker name -> dialect language key, or `false`.
    #[serde(default, deserialize_with = "de_dialects")]
    pub spk_is_dialect: BTreeMap<String, String>,
    pub code_predictor_config: CodePredictorConfig,
}

/// `talker_config.code_predictor_config` (model_type `qwen3_tts_talker_code_predictor`).
#[derive(Debug, Clone, Deserialize)]
pub struct CodePredictorConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
    pub num_code_groups: usize,
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading model config {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct Raw {
            tts_model_type: String,
            tts_model_size: String,
            tokenizer_type: String,
            im_start_token_id: u32,
            im_end_token_id: u32,
            assistant_token_id: u32,
            tts_pad_token_id: u32,
            tts_bos_token_id: u32,
            tts_eos_token_id: u32,
            speaker_encoder_config: SpeakerEncoderConfig,
            talker_config: TalkerConfig,
        }
        let raw: Raw = serde_json::from_str(text)?;
        if raw.tokenizer_type != SUPPORTED_TOKENIZER_TYPE {
            bail!(
                "config.json: unknown tokenizer_type {:?}; supported: {SUPPORTED_TOKENIZER_TYPE}",
                raw.tokenizer_type
            );
        }
        Ok(Self {
            model_type: ModelType::parse(&raw.tts_model_type)?,
            model_size: raw.tts_model_size,
            im_start_token_id: raw.im_start_token_id,
            im_end_token_id: raw.im_end_token_id,
            assistant_token_id: raw.assistant_token_id,
            tts_pad_token_id: raw.tts_pad_token_id,
            tts_bos_token_id: raw.tts_bos_token_id,
            tts_eos_token_id: raw.tts_eos_token_id,
            speaker_encoder: raw.speaker_encoder_config,
            talker: raw.talker_config,
        })
    }

    /// The 0.6B CustomVoice model ignores `instruct` (qwen3_tts_model.py:799).
    pub fn supports_instruct(&self) -> bool {
        match self.model_type {
            ModelType::VoiceDesign => true,
            ModelType::CustomVoice => !self.model_size.contains("0b6"),
            ModelType::Base => false,
        }
    }

    /// Languages a request may name: "auto" plus every non-dialect language key
    /// (modeling_qwen3_tts.py:1831-1835).
    pub fn languages(&self) -> Vec<String> {
        std::iter::once("auto".to_string())
            .chain(
                self.talker
                    .codec_language_id
                    .keys()
                    .filter(|k| !k.contains("dialect"))
                    .cloned(),
            )
            .collect()
    }
}

/// The only speech tokenizer the released 12 Hz models use.
pub const SUPPORTED_TOKENIZER_TYPE: &str = "qwen3_tts_tokenizer_12hz";

fn de_speaker_ids<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Id {
        One(u32),
        List(Vec<u32>),
    }
    let raw: BTreeMap<String, Id> = BTreeMap::deserialize(d)?;
    raw.into_iter()
        .map(|(name, id)| match id {
            Id::One(v) => Ok((name, v)),
            Id::List(v) if v.len() == 1 => Ok((name, v[0])),
            Id::List(v) => Err(serde::de::Error::custom(format!(
                "spk_id[{name:?}] must be one id, got {v:?}"
            ))),
        })
        .collect()
}

fn de_dialects<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, String>, D::Error> {
    let raw: BTreeMap<String, serde_json::Value> = BTreeMap::deserialize(d)?;
    Ok(raw
        .into_iter()
        .filter_map(|(name, v)| v.as_str().map(|s| (name, s.to_string())))
        .collect())
}

/// `speech_tokenizer/config.json` (model_type `qwen3_tts_tokenizer_12hz`).
#[derive(Debug, Clone, Deserialize)]
pub struct SpeechTokenizerConfig {
    pub model_type: String,
    pub encoder_valid_num_quantizers: usize,
    pub input_sample_rate: u32,
    pub output_sample_rate: u32,
    pub decode_upsample_rate: usize,
    pub encode_downsample_rate: usize,
    pub decoder_config: CodecDecoderConfig,
    pub encoder_config: CodecEncoderConfig,
}

/// `speech_tokenizer/config.json` → `decoder_config`.
#[derive(Debug, Clone, Deserialize)]
pub struct CodecDecoderConfig {
    pub latent_dim: usize,
    pub codebook_dim: usize,
    pub codebook_size: usize,
    pub decoder_dim: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub sliding_window: usize,
    pub num_quantizers: usize,
    pub num_semantic_quantizers: usize,
    pub vector_quantization_hidden_dimension: usize,
    pub upsample_rates: Vec<usize>,
    pub upsampling_ratios: Vec<usize>,
}

/// `speech_tokenizer/config.json` → `encoder_config`: a transformers `MimiConfig` whose decoder
/// half the checkpoint does not carry. Fields the encoder does not read are left out.
#[derive(Debug, Clone, Deserialize)]
pub struct CodecEncoderConfig {
    /// Codes per second after the downsample (12.5); `None` derives it as transformers does.
    #[serde(rename = "_frame_rate")]
    pub frame_rate: Option<f64>,
    pub sampling_rate: usize,
    pub audio_channels: usize,
    pub hidden_size: usize,
    pub num_filters: usize,
    /// SEANet strides in decoder order; the encoder applies them reversed.
    pub upsampling_ratios: Vec<usize>,
    pub kernel_size: usize,
    pub last_kernel_size: usize,
    pub residual_kernel_size: usize,
    pub dilation_growth_rate: usize,
    pub compress: usize,
    pub num_residual_layers: usize,
    pub use_causal_conv: bool,
    pub pad_mode: String,
    pub use_conv_shortcut: bool,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub hidden_act: String,
    pub norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub attention_bias: bool,
    pub codebook_size: usize,
    pub codebook_dim: usize,
    pub num_quantizers: usize,
    pub num_semantic_quantizers: usize,
    pub vector_quantization_hidden_dimension: usize,
}

impl CodecEncoderConfig {
    /// Samples per SEANet output step (960 as released).
    pub fn seanet_hop(&self) -> usize {
        self.upsampling_ratios.iter().product()
    }

    /// The SEANet rate, `MimiConfig.encodec_frame_rate` (ceil(24000 / 960) = 25).
    pub fn encodec_frame_rate(&self) -> f64 {
        self.sampling_rate.div_ceil(self.seanet_hop()) as f64
    }

    /// `MimiConfig.frame_rate`: `_frame_rate`, or half the SEANet rate when absent.
    pub fn frame_rate(&self) -> f64 {
        self.frame_rate
            .unwrap_or(self.sampling_rate as f64 / (self.seanet_hop() * 2) as f64)
    }

    /// Kernel of the stride-2 downsample conv `MimiModel` adds when the two rates differ
    /// (`2 * encodec_frame_rate / frame_rate` = 4), or `None` when they do not.
    pub fn downsample_kernel(&self) -> Option<usize> {
        let ratio = self.encodec_frame_rate() / self.frame_rate();
        (ratio != 1.0).then(|| 2 * ratio as usize)
    }
}

impl SpeechTokenizerConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading speech tokenizer config {}", path.display()))?;
        let cfg: Self =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if cfg.model_type != SUPPORTED_TOKENIZER_TYPE {
            bail!(
                "{}: unknown model_type {:?}; supported: {SUPPORTED_TOKENIZER_TYPE}",
                path.display(),
                cfg.model_type
            );
        }
        Ok(cfg)
    }

    /// Output samples per codec frame (1920 = 80 ms at 24 kHz).
    pub fn samples_per_frame(&self) -> usize {
        self.decode_upsample_rate
    }
}

/// `generation_config.json`: the wrapper's sampling defaults (read as a plain dict, not a HF
/// GenerationConfig).
#[derive(Debug, Clone, Deserialize)]
pub struct GenerationConfig {
    pub do_sample: bool,
    pub repetition_penalty: f32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub subtalker_dosample: bool,
    pub subtalker_temperature: f32,
    pub subtalker_top_p: f32,
    pub subtalker_top_k: usize,
    pub max_new_tokens: usize,
}

impl GenerationConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading generation config {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

//! `voxkernel synth`: one request, start to finish, to a WAV file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use voxkernel_core::backend::SequenceSpec;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::{self, Model, RunawayGuard, SamplerOverrides, SpeechRequest};
use voxkernel_core::prompt::{TextMode, Voice};
use voxkernel_core::reference::codec_decoder::CodecDecoder;
use voxkernel_core::voice_clone::{self, CloneMode, ClonedVoice, ReferenceAudio};

use crate::backends::{self, BackendChoice};

#[derive(Clone, Copy, ValueEnum)]
pub enum TextModeArg {
    /// The whole text in the prefill (official non_streaming_mode=True).
    Whole,
    /// One text token per decode step (official non_streaming_mode=False).
    Streaming,
}

#[derive(Args)]
pub struct SynthArgs {
    /// Checkpoint directory or hub id.
    #[arg(long)]
    model: String,
    /// The text to speak.
    #[arg(long)]
    text: String,
    /// Preset speaker (CustomVoice models).
    #[arg(long)]
    speaker: Option<String>,
    /// Language name, or "auto".
    #[arg(long, default_value = "auto")]
    language: String,
    /// Style (1.7B CustomVoice) or voice description (VoiceDesign).
    #[arg(long)]
    instruct: Option<String>,
    /// Base models: the voice to clone, a WAV, FLAC, MP3 or Ogg Vorbis file of 1 to 30 s.
    #[arg(long)]
    ref_audio: Option<PathBuf>,
    /// Base models: the transcript of --ref-audio, for in-context cloning.
    #[arg(long)]
    ref_text: Option<String>,
    /// Base models: clone from the speaker embedding of --ref-audio alone (no transcript).
    #[arg(long)]
    x_vector_only: bool,
    /// Seeds the sampling: the same seed, text and settings give the same audio.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Argmax decoding for both the talker and the sub-talker.
    #[arg(long)]
    greedy: bool,
    /// Talker (codebook 0) temperature, > 0. Default: generation_config.json's.
    #[arg(long)]
    temperature: Option<f32>,
    /// Talker top-k (0 keeps every code). Default: generation_config.json's.
    #[arg(long)]
    top_k: Option<usize>,
    /// Talker top-p, in (0, 1]. Default: generation_config.json's.
    #[arg(long)]
    top_p: Option<f32>,
    /// Talker repetition penalty, > 0. Default: generation_config.json's.
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Sub-talker (codebooks 1-15) temperature, > 0. Default: generation_config.json's.
    #[arg(long)]
    subtalker_temperature: Option<f32>,
    /// Sub-talker top-k (0 keeps every code). Default: generation_config.json's.
    #[arg(long)]
    subtalker_top_k: Option<usize>,
    /// Sub-talker top-p, in (0, 1]. Default: generation_config.json's.
    #[arg(long)]
    subtalker_top_p: Option<f32>,
    /// Default: the official one for the voice (whole for preset and designed voices,
    /// streaming for cloned ones).
    #[arg(long, value_enum)]
    text_mode: Option<TextModeArg>,
    /// At most this many 80 ms frames of audio (official max_new_tokens = N + 1). Default: the
    /// runaway guard, 50 + 20 per text token, at most generation_config.json's limit.
    #[arg(long)]
    max_frames: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// Also write the generated codes as JSON `{"codes": [[16 ints] per frame]}`.
    #[arg(long)]
    codes_out: Option<PathBuf>,
    /// Output WAV path (24 kHz mono, 16-bit).
    #[arg(short, long)]
    output: PathBuf,
}

pub fn run(args: SynthArgs) -> Result<()> {
    // Before the download, the load and the synthesis, not after them.
    check_output("--output", &args.output)?;
    if let Some(path) = &args.codes_out {
        check_output("--codes-out", path)?;
    }
    let dir = voxkernel_core::hub::resolve_model(&args.model)?;
    let model = Model::load(&dir)?;
    let config = &model.checkpoint.config;
    if config.model_type != ModelType::Base
        && (args.ref_audio.is_some() || args.ref_text.is_some() || args.x_vector_only)
    {
        bail!(
            "--ref-audio, --ref-text and --x-vector-only apply only to Base models (voice cloning)"
        );
    }
    let voice = match (config.model_type, &args.speaker) {
        (ModelType::CustomVoice, Some(name)) => Voice::Speaker(name.clone()),
        (ModelType::CustomVoice, None) => bail!(
            "--speaker is required for this CustomVoice model; valid speakers: {}",
            config
                .talker
                .spk_id
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ),
        (ModelType::VoiceDesign, None) => Voice::Design,
        (ModelType::Base, None) => clone_voice(&model, &args)?.voice(),
        (_, Some(_)) => {
            bail!("--speaker applies only to CustomVoice models; this model has no preset speakers")
        }
    };
    let request = SpeechRequest {
        text: args.text.clone(),
        voice,
        language: args.language.clone(),
        instruct: args.instruct.clone(),
        text_mode: args.text_mode.map(|m| match m {
            TextModeArg::Whole => TextMode::Whole,
            TextModeArg::Streaming => TextMode::Streaming,
        }),
    };
    let plan = model.plan(&request).map_err(with_flag_names)?;
    let talker = SamplerOverrides {
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
    };
    let subtalker = SamplerOverrides {
        greedy: args.greedy,
        temperature: args.subtalker_temperature,
        top_k: args.subtalker_top_k,
        top_p: args.subtalker_top_p,
        repetition_penalty: None,
    };
    let sampling =
        engine::sampling_config(&model.checkpoint.generation, &talker, &subtalker, args.seed)?;
    // Without --max-frames, the engine's runaway guard bounds a model that never emits EOS
    // (random test checkpoints, or a sampled run gone wrong) instead of the 8191 frames (11
    // minutes) of generation_config.json.
    let max_frames = args.max_frames.unwrap_or_else(|| {
        let tokens = model
            .tokenizer
            .target_text_ids(&args.text)
            .map_or(0, |ids| ids.len());
        RunawayGuard::default()
            .limit(tokens)
            .min(model.checkpoint.generation.max_new_tokens.saturating_sub(1))
    });
    if max_frames == 0 {
        bail!("--max-frames must be at least 1");
    }
    let spec = SequenceSpec {
        plan,
        sampling,
        max_frames,
    };

    // One request: size the KV cache to exactly what it can use.
    let max_len = spec.plan.prefill.len() + spec.max_frames + 1;
    let mut backend = backends::frame_backend(args.backend, &model, 1, max_len)?;
    tracing::info!(backend = %backend.name(), "synthesising");
    let started = Instant::now();
    let (frames, finish) = engine::generate(backend.as_mut(), &spec)?;
    let generate_s = started.elapsed().as_secs_f64();
    // The official schedule (300-frame chunks, 25 frames of context) so a synthesised WAV
    // matches qwen-tts; streaming sessions decode exactly causally instead (docs/codec.md).
    let codec = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint)?);
    let started = Instant::now();
    let pcm = match &request.voice {
        // In-context cloning decodes after the reference codes and cuts them off, as qwen-tts.
        Voice::Clone {
            reference_codes, ..
        } => voice_clone::decode_with_reference(&codec, reference_codes, &frames)?,
        _ => codec.decode_official(&frames)?,
    };
    let codec_s = started.elapsed().as_secs_f64();
    write_wav(&args.output, &pcm)?;
    if let Some(path) = &args.codes_out {
        let json = serde_json::json!({ "codes": frames });
        std::fs::write(path, json.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    tracing::info!(
        frames = frames.len(),
        seconds = pcm.len() as f64 / 24_000.0,
        finished_by = ?finish,
        // Prefill included: a whole-request figure, not the per-frame kernel time.
        decode_ms_per_frame = format!("{:.1}", 1e3 * generate_s / frames.len().max(1) as f64),
        codec_ms_per_frame = format!("{:.1}", 1e3 * codec_s / frames.len().max(1) as f64),
        "wrote {}",
        args.output.display()
    );
    Ok(())
}

/// The voice of --ref-audio, encoded for in-context cloning (with --ref-text) or from its
/// x-vector alone (--x-vector-only). Every input problem names its flag.
fn clone_voice(model: &Model, args: &SynthArgs) -> Result<ClonedVoice> {
    let Some(path) = &args.ref_audio else {
        bail!(
            "--ref-audio is required for Base models: they clone the voice of a reference clip \
             (with --ref-text for in-context cloning, or --x-vector-only)"
        );
    };
    let mode = match (&args.ref_text, args.x_vector_only) {
        (Some(_), true) => bail!("--ref-text is not used with --x-vector-only; pass one of them"),
        (Some(text), false) if !text.trim().is_empty() => CloneMode::Icl { transcript: text },
        (_, false) => bail!(
            "--ref-text is required for in-context cloning: pass the transcript of --ref-audio, \
             or use --x-vector-only"
        ),
        (None, true) => CloneMode::XVectorOnly,
    };
    let audio = ReferenceAudio::load(path)
        .map_err(|e| anyhow::anyhow!("--ref-audio {}: {e}", path.display()))?;
    let started = Instant::now();
    let encoder = backends::voice_encoder(args.backend, model)?;
    let loaded_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let voice = encoder.encode(&audio, mode)?;
    tracing::info!(
        encoder = %encoder.name(),
        seconds = format!("{:.2}", audio.seconds()),
        source_rate = audio.source_rate(),
        reference_frames = voice.reference.as_ref().map_or(0, |r| r.codes.len()),
        load_ms = format!("{:.0}", 1e3 * loaded_s),
        encode_ms = format!("{:.0}", 1e3 * started.elapsed().as_secs_f64()),
        "encoded the reference voice"
    );
    Ok(voice)
}

/// A file path that can be created: not a directory, in a directory that exists.
fn check_output(flag: &str, path: &Path) -> Result<()> {
    if path.is_dir() {
        bail!(
            "{flag} {}: is a directory; give a file path",
            path.display()
        );
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        bail!(
            "{flag} {}: the directory {} does not exist",
            path.display(),
            parent.display()
        );
    }
    Ok(())
}

/// The request's errors name its fields (`voice.speaker: ...`); the user typed the flags.
fn with_flag_names(error: anyhow::Error) -> anyhow::Error {
    let message = format!("{error:#}");
    for (field, flag) in [
        ("voice.speaker:", "--speaker:"),
        ("text.target:", "--text:"),
        ("language:", "--language:"),
        ("instruct:", "--instruct:"),
    ] {
        if let Some(rest) = message.strip_prefix(field) {
            return anyhow::anyhow!("{flag}{rest}");
        }
    }
    error
}

fn write_wav(path: &Path, pcm: &[f32]) -> Result<()> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut writer = hound::WavWriter::create(path, spec)
        .with_context(|| format!("creating {}", path.display()))?;
    for &s in pcm {
        writer.write_sample((s.clamp(-1.0, 1.0) * 32767.0).round() as i16)?;
    }
    writer.finalize()?;
    Ok(())
}

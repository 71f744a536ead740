//! Reference audio for voice cloning: any WAV, FLAC, MP3 or Ogg Vorbis file decoded with
//! symphonia, mixed down to mono (the channel mean, as librosa's `mono=True`) and resampled to
//! 24 kHz with rubato's FFT resampler (the official code uses librosa's `soxr_hq`; see
//! docs/voice_clone.md for how the two differ and what that does to the codes).

use std::io::Cursor;
use std::path::Path;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};
use symphonia::core::codecs::CodecParameters;
use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::{MediaSourceStream, MediaSourceStreamOptions};
use symphonia::core::meta::MetadataOptions;

/// The rate both encoders take (the codec's `input_sample_rate`, the speaker encoder's mel).
pub const SAMPLE_RATE: u32 = 24_000;
/// Shortest reference accepted: the official code takes anything, but under a second there is
/// too little voice for the x-vector, and the codes of a shorter clip are a handful of frames.
pub const MIN_SECONDS: f64 = 1.0;
/// Longest reference accepted. The encoders' cost and memory grow with the clip (about 0.1 s of
/// CPU per second of audio at 0.6B size), and the ICL prompt carries 12.5 rows per second.
pub const MAX_SECONDS: f64 = 30.0;
/// Frames per resampler call; any size gives the same output up to f32 rounding.
const RESAMPLER_CHUNK: usize = 1024;

/// Why a reference clip was refused: all of these are the caller's input, not a server fault.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceAudioError {
    #[error("cannot read the file: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a decodable audio file (WAV, FLAC, MP3 or Ogg Vorbis): {0}")]
    Unreadable(String),
    #[error("the audio holds no samples")]
    Empty,
    #[error("the audio has NaN or infinite samples")]
    NonFinite,
    #[error("the audio is {seconds:.2} s long; a voice reference needs at least {min} s")]
    TooShort { seconds: f64, min: f64 },
    #[error("the audio is over {max} s long (at least {seconds:.1} s); trim it to at most {max} s")]
    TooLong { seconds: f64, max: f64 },
}

/// A voice reference clip, mono at 24 kHz, within [`MIN_SECONDS`, `MAX_SECONDS`].
#[derive(Debug, Clone)]
pub struct ReferenceAudio {
    samples: Vec<f32>,
    source_rate: u32,
    source_channels: usize,
}

impl ReferenceAudio {
    /// Decodes an audio file; the extension only speeds up the format probe.
    pub fn load(path: &Path) -> Result<Self, ReferenceAudioError> {
        let file = std::fs::File::open(path)?;
        let extension = path.extension().and_then(|e| e.to_str());
        Self::decode(
            MediaSourceStream::new(Box::new(file), MediaSourceStreamOptions::default()),
            extension,
        )
    }

    /// Decodes an audio file held in memory (an upload), e.g. with the file name's extension
    /// as `extension`.
    pub fn from_bytes(
        bytes: Vec<u8>,
        extension: Option<&str>,
    ) -> Result<Self, ReferenceAudioError> {
        Self::decode(
            MediaSourceStream::new(
                Box::new(Cursor::new(bytes)),
                MediaSourceStreamOptions::default(),
            ),
            extension,
        )
    }

    /// Mono samples at `rate`, resampled to 24 kHz.
    pub fn from_samples(samples: Vec<f32>, rate: u32) -> Result<Self, ReferenceAudioError> {
        Self::from_mono(samples, rate, 1)
    }

    /// The 24 kHz mono samples the encoders take.
    pub fn samples(&self) -> &[f32] {
        &self.samples
    }

    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / f64::from(SAMPLE_RATE)
    }

    /// Sample rate of the decoded file, before resampling.
    pub fn source_rate(&self) -> u32 {
        self.source_rate
    }

    pub fn source_channels(&self) -> usize {
        self.source_channels
    }

    fn decode(
        stream: MediaSourceStream<'_>,
        extension: Option<&str>,
    ) -> Result<Self, ReferenceAudioError> {
        let unreadable = |e: SymphoniaError| ReferenceAudioError::Unreadable(e.to_string());
        let mut hint = Hint::new();
        if let Some(extension) = extension {
            hint.with_extension(extension);
        }
        let mut format = symphonia::default::get_probe()
            .probe(
                &hint,
                stream,
                FormatOptions::default(),
                MetadataOptions::default(),
            )
            .map_err(unreadable)?;
        let track = format
            .default_track(TrackType::Audio)
            .ok_or_else(|| ReferenceAudioError::Unreadable("no audio track".into()))?;
        let track_id = track.id;
        let Some(CodecParameters::Audio(params)) = &track.codec_params else {
            return Err(ReferenceAudioError::Unreadable(
                "the audio track has no codec parameters".into(),
            ));
        };
        let mut decoder = symphonia::default::get_codecs()
            .make_audio_decoder(params, &AudioDecoderOptions::default())
            .map_err(unreadable)?;

        let mut interleaved: Vec<f32> = Vec::new();
        let mut packet_samples: Vec<f32> = Vec::new();
        let mut spec: Option<(u32, usize)> = None;
        loop {
            let packet = match format.next_packet() {
                Ok(Some(packet)) => packet,
                Ok(None) => break,
                // Some encoders leave a truncated last packet; what came before is usable.
                Err(SymphoniaError::IoError(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    break;
                }
                Err(e) => return Err(unreadable(e)),
            };
            if packet.track_id != track_id {
                continue;
            }
            let buffer = match decoder.decode(&packet) {
                Ok(buffer) => buffer,
                // A corrupt packet is skipped, as players do; an undecodable file ends up Empty.
                Err(SymphoniaError::DecodeError(_)) => continue,
                Err(e) => return Err(unreadable(e)),
            };
            let (rate, channels) = (buffer.spec().rate(), buffer.spec().channels().count());
            match spec {
                None => spec = Some((rate, channels)),
                Some(known) if known != (rate, channels) => {
                    return Err(ReferenceAudioError::Unreadable(format!(
                        "the stream changes from {} Hz x {} to {rate} Hz x {channels} channels",
                        known.0, known.1
                    )));
                }
                Some(_) => {}
            }
            buffer.copy_to_vec_interleaved(&mut packet_samples);
            interleaved.extend_from_slice(&packet_samples);
            // Stop early on a long upload rather than decoding all of it.
            let seconds =
                interleaved.len() as f64 / (channels.max(1) as f64 * f64::from(rate.max(1)));
            if seconds > MAX_SECONDS + 1.0 {
                return Err(ReferenceAudioError::TooLong {
                    seconds,
                    max: MAX_SECONDS,
                });
            }
        }
        let Some((rate, channels)) = spec else {
            return Err(ReferenceAudioError::Empty);
        };
        if channels == 0 || rate == 0 {
            return Err(ReferenceAudioError::Unreadable(format!(
                "{channels} channels at {rate} Hz"
            )));
        }
        Self::from_mono(mix_to_mono(&interleaved, channels), rate, channels)
    }

    fn from_mono(mono: Vec<f32>, rate: u32, channels: usize) -> Result<Self, ReferenceAudioError> {
        if mono.is_empty() {
            return Err(ReferenceAudioError::Empty);
        }
        if rate == 0 {
            return Err(ReferenceAudioError::Unreadable("sample rate 0".into()));
        }
        if mono.iter().any(|s| !s.is_finite()) {
            return Err(ReferenceAudioError::NonFinite);
        }
        let seconds = mono.len() as f64 / f64::from(rate);
        if seconds < MIN_SECONDS {
            return Err(ReferenceAudioError::TooShort {
                seconds,
                min: MIN_SECONDS,
            });
        }
        if seconds > MAX_SECONDS {
            return Err(ReferenceAudioError::TooLong {
                seconds,
                max: MAX_SECONDS,
            });
        }
        Ok(Self {
            samples: resample(&mono, rate, SAMPLE_RATE)?,
            source_rate: rate,
            source_channels: channels,
        })
    }
}

/// The mean over channels of interleaved samples (librosa's `to_mono`: sum, then divide).
fn mix_to_mono(interleaved: &[f32], channels: usize) -> Vec<f32> {
    if channels == 1 {
        return interleaved.to_vec();
    }
    interleaved
        .chunks_exact(channels)
        .map(|frame| frame.iter().sum::<f32>() / channels as f32)
        .collect()
}

/// Band-limited resampling of a whole clip with rubato's synchronous FFT resampler, computed in
/// f64: `ceil(len * to / from)` samples, the resampler's delay trimmed.
fn resample(mono: &[f32], from: u32, to: u32) -> Result<Vec<f32>, ReferenceAudioError> {
    if from == to {
        return Ok(mono.to_vec());
    }
    let failed = |what: String| {
        ReferenceAudioError::Unreadable(format!("resampling {from} Hz to {to} Hz: {what}"))
    };
    let input: Vec<f64> = mono.iter().map(|&s| f64::from(s)).collect();
    // rubato 5.0.1 trims `fft_size_out / 2` output frames of delay, but its filter is centred at
    // `(fft_size_in - 1) / 2` input frames: an odd input size (e.g. 44.1 -> 24 kHz with 1024-frame
    // chunks: 1029 in, 560 out) leaves the output 0.27 samples early, a 1.6e-2 error on a 440 Hz
    // tone. An even number of minimal blocks keeps the FFT input size even and the delay exact.
    let block_in = (from / gcd(from, to)) as usize;
    let chunk = 2 * block_in * RESAMPLER_CHUNK.div_ceil(2 * block_in);
    let mut resampler = Fft::<f64>::new(from as usize, to as usize, chunk, 1, FixedSync::Both)
        .map_err(|e| failed(e.to_string()))?;
    let adapter =
        InterleavedSlice::new(&input, 1, input.len()).map_err(|e| failed(e.to_string()))?;
    let output = resampler
        .process_all(&adapter, input.len(), None)
        .map_err(|e| failed(e.to_string()))?;
    Ok(output.take_data().into_iter().map(|s| s as f32).collect())
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stereo_mixes_to_the_channel_mean() {
        assert_eq!(mix_to_mono(&[1.0, 0.0, 0.5, 0.25], 2), [0.5, 0.375]);
    }

    #[test]
    fn a_band_limited_tone_survives_resampling_in_phase() {
        let tone = |rate: f64, n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (2.0 * std::f64::consts::PI * 440.0 * i as f64 / rate).sin() as f32 * 0.5)
                .collect()
        };
        // 44.1 kHz is the case whose odd FFT size rubato would misalign by 0.27 samples.
        for from in [16_000u32, 22_050, 44_100, 48_000] {
            let n = from as usize + 1;
            let out = resample(&tone(f64::from(from), n), from, 24_000).unwrap();
            assert_eq!(out.len(), (n * 24_000).div_ceil(from as usize), "{from} Hz");
            let expected = tone(24_000.0, out.len());
            // Away from the ends, where the filter sees a whole window.
            let err = out[2000..22_000]
                .iter()
                .zip(&expected[2000..22_000])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 1e-5, "{from} Hz: max abs error {err}");
        }
    }

    #[test]
    fn length_limits_are_enforced_in_source_seconds() {
        let short = ReferenceAudio::from_samples(vec![0.1; 15_999], 16_000).unwrap_err();
        assert!(
            matches!(short, ReferenceAudioError::TooShort { .. }),
            "{short}"
        );
        let long = ReferenceAudio::from_samples(vec![0.1; 8_000 * 31], 8_000).unwrap_err();
        assert!(
            matches!(long, ReferenceAudioError::TooLong { .. }),
            "{long}"
        );
        let empty = ReferenceAudio::from_samples(Vec::new(), 24_000).unwrap_err();
        assert!(matches!(empty, ReferenceAudioError::Empty));
        let nan = ReferenceAudio::from_samples(vec![f32::NAN; 24_000], 24_000).unwrap_err();
        assert!(matches!(nan, ReferenceAudioError::NonFinite));
        let ok = ReferenceAudio::from_samples(vec![0.1; 24_000], 24_000).unwrap();
        assert_eq!(ok.samples().len(), 24_000);
    }
}

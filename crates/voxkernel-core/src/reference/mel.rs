//! The speaker encoder's log-mel front end, exactly the official `mel_spectrogram` call of
//! `extract_speaker_embedding` (modeling_qwen3_tts.py:399-464, spec §4.6): reflect-pad 384
//! samples per side, STFT (n_fft 1024, hop 256, periodic Hann, `center=False`), magnitude
//! `sqrt(re² + im² + 1e-9)`, librosa's Slaney mel filterbank (128 bins, 0..12 kHz), then
//! `log(max(mel, 1e-5))`.

use std::f64::consts::PI;
use std::sync::Arc;

use anyhow::{Result, ensure};
use candle_core::{Device, Tensor};
use rustfft::num_complex::Complex;
use rustfft::{Fft, FftPlanner};

use super::conv1d::{Padding, pad_rows};

/// The constants of the official call; the speaker encoder sees nothing else.
pub const SAMPLE_RATE: u32 = 24_000;
pub const N_FFT: usize = 1024;
pub const HOP: usize = 256;
pub const N_MELS: usize = 128;
const F_MAX: f64 = 12_000.0;
const MAGNITUDE_EPS: f64 = 1e-9;
const LOG_CLAMP: f32 = 1e-5;

pub struct MelSpectrogram {
    /// `[N_FFT / 2 + 1, N_MELS]`, the transposed librosa filterbank.
    filters: Tensor,
    window: Vec<f64>,
    fft: Arc<dyn Fft<f64>>,
}

impl MelSpectrogram {
    pub fn new() -> Result<Self> {
        let bins = N_FFT / 2 + 1;
        let bank = slaney_mel_filterbank(SAMPLE_RATE as f64, N_FFT, N_MELS, 0.0, F_MAX);
        let filters = Tensor::from_vec(bank, (N_MELS, bins), &Device::Cpu)?
            .t()?
            .contiguous()?;
        // torch.hann_window(1024) is periodic: the denominator is N, not N - 1.
        let window = (0..N_FFT)
            .map(|n| 0.5 - 0.5 * (2.0 * PI * n as f64 / N_FFT as f64).cos())
            .collect();
        Ok(Self {
            filters,
            window,
            fft: FftPlanner::new().plan_fft_forward(N_FFT),
        })
    }

    /// [`MelSpectrogram::forward`] as row-major `[frames][128]` floats, for a GPU speaker encoder.
    pub fn log_mel(&self, samples: &[f32]) -> Result<Vec<f32>> {
        Ok(self.forward(samples)?.flatten_all()?.to_vec1()?)
    }

    /// Log-mel frames of 24 kHz audio: `[frames, 128]`, frames = `(len + 768 - 1024) / 256 + 1`.
    pub fn forward(&self, samples: &[f32]) -> Result<Tensor> {
        let pad = (N_FFT - HOP) / 2;
        ensure!(
            samples.len() > pad,
            "mel spectrogram: {} samples are too few for the {pad}-sample reflect padding",
            samples.len()
        );
        let audio = Tensor::from_slice(samples, (samples.len(), 1), &Device::Cpu)?;
        let padded: Vec<f32> = pad_rows(&audio, pad, pad, Padding::Reflect)?
            .flatten_all()?
            .to_vec1()?;
        ensure!(
            padded.len() >= N_FFT,
            "mel spectrogram: {} samples give no {N_FFT}-sample frame",
            samples.len()
        );
        let frames = (padded.len() - N_FFT) / HOP + 1;
        let bins = N_FFT / 2 + 1;
        let mut magnitudes = Vec::with_capacity(frames * bins);
        let mut buffer = vec![Complex::new(0.0, 0.0); N_FFT];
        for frame in 0..frames {
            let start = frame * HOP;
            for (slot, (x, w)) in buffer
                .iter_mut()
                .zip(padded[start..start + N_FFT].iter().zip(&self.window))
            {
                *slot = Complex::new(f64::from(*x) * w, 0.0);
            }
            self.fft.process(&mut buffer);
            magnitudes.extend(
                buffer[..bins]
                    .iter()
                    .map(|c| (c.norm_sqr() + MAGNITUDE_EPS).sqrt() as f32),
            );
        }
        let spectrum = Tensor::from_vec(magnitudes, (frames, bins), &Device::Cpu)?;
        Ok(spectrum
            .matmul(&self.filters)?
            .clamp(LOG_CLAMP, f32::INFINITY)?
            .log()?)
    }
}

/// `librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax)` with its defaults (Slaney mel scale,
/// Slaney area normalisation) as librosa 0.11 computes it: f64 arithmetic, each triangle
/// stored as f32 and then scaled. Row-major `[n_mels, n_fft / 2 + 1]`.
fn slaney_mel_filterbank(sr: f64, n_fft: usize, n_mels: usize, fmin: f64, fmax: f64) -> Vec<f32> {
    let bins = n_fft / 2 + 1;
    // np.fft.rfftfreq(n_fft, 1 / sr)
    let step = 1.0 / (n_fft as f64 * (1.0 / sr));
    let fft_freqs: Vec<f64> = (0..bins).map(|k| k as f64 * step).collect();
    let mel_f = mel_frequencies(n_mels + 2, fmin, fmax);
    let mut weights = vec![0f32; n_mels * bins];
    for i in 0..n_mels {
        let (lower_width, upper_width) = (mel_f[i + 1] - mel_f[i], mel_f[i + 2] - mel_f[i + 1]);
        let enorm = 2.0 / (mel_f[i + 2] - mel_f[i]);
        for (k, &f) in fft_freqs.iter().enumerate() {
            let lower = -(mel_f[i] - f) / lower_width;
            let upper = (mel_f[i + 2] - f) / upper_width;
            let triangle = 0f64.max(lower.min(upper)) as f32;
            weights[i * bins + k] = (f64::from(triangle) * enorm) as f32;
        }
    }
    weights
}

/// `librosa.mel_frequencies(n, fmin, fmax, htk=False)`: `n` points evenly spaced in Slaney mel.
fn mel_frequencies(n: usize, fmin: f64, fmax: f64) -> Vec<f64> {
    let (low, high) = (hz_to_mel(fmin), hz_to_mel(fmax));
    let step = (high - low) / (n - 1) as f64;
    // np.linspace: start + i * step, the last point set to `stop` exactly.
    (0..n)
        .map(|i| {
            if i == n - 1 {
                high
            } else {
                low + i as f64 * step
            }
        })
        .map(mel_to_hz)
        .collect()
}

/// Slaney's scale: linear (200/3 Hz per mel) below 1 kHz, logarithmic above.
const F_SP: f64 = 200.0 / 3.0;
const MIN_LOG_HZ: f64 = 1000.0;
const MIN_LOG_MEL: f64 = MIN_LOG_HZ / F_SP;

fn log_step() -> f64 {
    6.4f64.ln() / 27.0
}

fn hz_to_mel(hz: f64) -> f64 {
    if hz >= MIN_LOG_HZ {
        MIN_LOG_MEL + (hz / MIN_LOG_HZ).ln() / log_step()
    } else {
        hz / F_SP
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    if mel >= MIN_LOG_MEL {
        MIN_LOG_HZ * (log_step() * (mel - MIN_LOG_MEL)).exp()
    } else {
        F_SP * mel
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slaney_scale_round_trips_and_is_linear_below_1khz() {
        for hz in [0.0, 300.0, 999.0, 1000.0, 4000.0, 12000.0] {
            assert!((mel_to_hz(hz_to_mel(hz)) - hz).abs() < 1e-9 * (1.0 + hz));
        }
        // 1000 / (200 / 3) is 14.999999999999998 in f64, in librosa too.
        assert!((hz_to_mel(1000.0) - 15.0).abs() < 1e-12);
        assert!((hz_to_mel(200.0) - 3.0).abs() < 1e-12);
    }

    #[test]
    fn filterbank_triangles_are_area_normalised() {
        let bank = slaney_mel_filterbank(24_000.0, 1024, 128, 0.0, 12_000.0);
        let bins = 513;
        let mel_f = mel_frequencies(130, 0.0, 12_000.0);
        for i in [0, 40, 127] {
            let row = &bank[i * bins..(i + 1) * bins];
            assert!(row.iter().all(|&w| w >= 0.0));
            // Slaney norm: peak height 2 / (upper edge - lower edge) in Hz.
            let peak = row.iter().copied().fold(0.0, f32::max);
            let height = 2.0 / (mel_f[i + 2] - mel_f[i]);
            assert!(
                peak as f64 <= height * (1.0 + 1e-6),
                "row {i}: {peak} > {height}"
            );
        }
    }

    #[test]
    fn frame_count_follows_the_official_padding() {
        let mel = MelSpectrogram::new().unwrap();
        let out = mel.forward(&vec![0.1f32; 24_000]).unwrap();
        assert_eq!(out.dims(), [(24_000 + 768 - 1024) / 256 + 1, 128]);
        assert!(mel.forward(&[0.0; 384]).is_err());
    }
}

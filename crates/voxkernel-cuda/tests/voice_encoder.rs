//! `CudaVoiceEncoder` against the CPU reference `VoiceEncoder` (f32) on the tiny Base clone
//! fixture (tests/fixtures/clone/tiny-base): x-vectors and reference codes of every clip the
//! fixture has, and against the official outputs recorded there. They need a CUDA GPU, so they
//! are ignored by default; without a driver they say so and return.
//!
//! `full_size_encode_time` times both encoders on a full-size Base checkpoint (a random one from
//! make_ckpt.py `--type base`) named by `VOXKERNEL_ENCODER_CKPT`, for a 6 s and a 20 s clip.

use std::path::{Path, PathBuf};
use std::time::Instant;

use voxkernel_core::backend::{Frame, NUM_CODE_GROUPS};
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::official_run::rel_err;
use voxkernel_core::reference::mel::MelSpectrogram;
use voxkernel_core::voice_clone::{
    CloneEncoder, CloneMode, CloneRequestError, ReferenceAudio, VoiceEncoder,
};
use voxkernel_cuda::{CudaVoiceEncoder, driver_available};

/// The bound for the x-vector, here GPU against CPU (max |gpu - cpu| / max |cpu|): both
/// are f32 and differ in summation order only.
const MAX_REL_ERR: f32 = 1e-4;

/// Every clip of the fixture (the resampled renderings and the compressed ones too).
const CLIPS: [&str; 6] = [
    "ref_a.wav",
    "ref_b.wav",
    "ref_a_16k.wav",
    "ref_a_44k_stereo.wav",
    "ref_a.flac",
    "ref_a.mp3",
];

/// The tiny clone fixture; `VOXKERNEL_CLONE_FIXTURE` names it where the binary runs away from
/// its source tree (the GPU machine).
fn tiny_dir() -> PathBuf {
    std::env::var_os("VOXKERNEL_CLONE_FIXTURE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clone/tiny-base")
        })
}

/// These tests are ignored by default; run explicitly, they fail rather than pass without a GPU.
fn require_gpu() {
    assert!(
        driver_available(),
        "these tests need a CUDA driver (libcuda)"
    );
}

fn encoders(dir: &Path) -> (VoiceEncoder, CudaVoiceEncoder) {
    let checkpoint = Checkpoint::open(dir).expect("checkpoint");
    let cpu = VoiceEncoder::from_checkpoint(&checkpoint).expect("CPU encoder");
    let gpu = CudaVoiceEncoder::from_checkpoint(&checkpoint).expect("CUDA encoder");
    (cpu, gpu)
}

/// Positions `(frame, codebook)` where two code sequences differ.
fn differences(ours: &[Frame], reference: &[Frame]) -> Vec<(usize, usize)> {
    assert_eq!(ours.len(), reference.len(), "frame counts differ");
    ours.iter()
        .zip(reference)
        .enumerate()
        .flat_map(|(t, (a, b))| {
            (0..NUM_CODE_GROUPS)
                .filter(move |&g| a[g] != b[g])
                .map(move |g| (t, g))
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn x_vectors_match_the_cpu_encoder() {
    require_gpu();
    let dir = tiny_dir();
    let (cpu, gpu) = encoders(&dir);
    for clip in CLIPS {
        let audio = ReferenceAudio::load(&dir.join("audio").join(clip)).unwrap();
        let expected = cpu.x_vector(&audio).unwrap();
        let got = CloneEncoder::x_vector(&gpu, &audio).unwrap();
        let err = rel_err(&got, &expected);
        println!("{clip}: x-vector rel err vs CPU {err:.1e}");
        assert!(err <= MAX_REL_ERR, "{clip}: x-vector rel err {err:e}");
    }
    // And against the official x-vectors of the two 24 kHz clips.
    for clip in ["ref_a", "ref_b"] {
        let audio = ReferenceAudio::load(&dir.join(format!("audio/{clip}.wav"))).unwrap();
        let official = SafetensorsFile::open(&dir.join(format!("references/{clip}.safetensors")))
            .unwrap()
            .f32("x_vector")
            .unwrap()
            .0;
        let err = rel_err(&CloneEncoder::x_vector(&gpu, &audio).unwrap(), &official);
        println!("{clip}: x-vector rel err vs official {err:.1e}");
        assert!(err <= MAX_REL_ERR, "{clip}: x-vector rel err {err:e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reference_codes_match_the_cpu_encoder() {
    require_gpu();
    let dir = tiny_dir();
    let (cpu, gpu) = encoders(&dir);
    for clip in CLIPS {
        let audio = ReferenceAudio::load(&dir.join("audio").join(clip)).unwrap();
        let expected = cpu.reference_codes(&audio).unwrap();
        let got = CloneEncoder::reference_codes(&gpu, &audio).unwrap();
        let differ = differences(&got, &expected);
        println!(
            "{clip}: {} frames, {} of {} codes differ from the CPU's",
            got.len(),
            differ.len(),
            got.len() * NUM_CODE_GROUPS
        );
        assert!(differ.is_empty(), "{clip}: codes differ at {differ:?}");
    }
    for clip in ["ref_a", "ref_b"] {
        let audio = ReferenceAudio::load(&dir.join(format!("audio/{clip}.wav"))).unwrap();
        let official =
            SafetensorsFile::open(&dir.join(format!("references/{clip}.safetensors"))).unwrap();
        let got = CloneEncoder::reference_codes(&gpu, &audio).unwrap();
        assert_eq!(got, official.frames("ref_codes").unwrap(), "{clip}");
    }
}

/// The whole voice through the trait, as the CLI and the server use it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cloned_voices_agree_through_the_trait() {
    require_gpu();
    let dir = tiny_dir();
    let (cpu, gpu) = encoders(&dir);
    let encoders: [&dyn CloneEncoder; 2] = [&cpu, &gpu];
    let audio = ReferenceAudio::load(&dir.join("audio/ref_a.wav")).unwrap();
    let mode = CloneMode::Icl {
        transcript: "This is the reference transcript, spoken slowly.",
    };
    let [cpu_voice, gpu_voice] = encoders.map(|e| e.encode(&audio, mode).unwrap());
    assert_eq!(cpu_voice.reference, gpu_voice.reference);
    assert!(rel_err(&gpu_voice.x_vector, &cpu_voice.x_vector) <= MAX_REL_ERR);
    let x_only = gpu.encode(&audio, CloneMode::XVectorOnly).unwrap();
    assert!(x_only.reference.is_none());
    let blank = gpu.encode(&audio, CloneMode::Icl { transcript: "  " });
    assert!(
        blank
            .unwrap_err()
            .downcast_ref::<CloneRequestError>()
            .is_some()
    );
    println!("{}", gpu.name());
}

/// A voiced, speech-like test signal at 24 kHz: a gliding harmonic tone with a syllable-rate
/// envelope, plus white noise at -60 dB (deterministic).
fn speech_like(seconds: f64) -> Vec<f32> {
    let n = (seconds * 24_000.0) as usize;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut phase = 0.0f64;
    (0..n)
        .map(|i| {
            let t = i as f64 / 24_000.0;
            let pitch = 120.0 + 30.0 * (2.0 * std::f64::consts::PI * 0.7 * t).sin();
            phase += 2.0 * std::f64::consts::PI * pitch / 24_000.0;
            let voiced: f64 = (1..=12).map(|h| (h as f64 * phase).sin() / h as f64).sum();
            let envelope = 0.5 + 0.5 * (2.0 * std::f64::consts::PI * 4.0 * t).sin().abs();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let noise = (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            (0.25 * envelope * voiced + 1e-3 * noise) as f32
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Encode time (and GPU-vs-CPU agreement) on a full-size checkpoint: `VOXKERNEL_ENCODER_CKPT`.
#[test]
#[ignore = "needs a CUDA GPU and a full-size Base checkpoint (VOXKERNEL_ENCODER_CKPT)"]
fn full_size_encode_time() {
    require_gpu();
    let dir = std::env::var_os("VOXKERNEL_ENCODER_CKPT")
        .expect("set VOXKERNEL_ENCODER_CKPT to a full-size Base checkpoint directory");
    let checkpoint = Checkpoint::open(Path::new(&dir)).expect("checkpoint");
    let started = Instant::now();
    let gpu = CudaVoiceEncoder::from_checkpoint(&checkpoint).expect("CUDA encoder");
    println!(
        "{}: loaded in {:.2} s (kernels cached or compiled included)",
        gpu.name(),
        started.elapsed().as_secs_f64()
    );
    let cpu = VoiceEncoder::from_checkpoint(&checkpoint).expect("CPU encoder");
    let mel = MelSpectrogram::new().unwrap();
    for seconds in [6.0, 20.0] {
        let audio = ReferenceAudio::from_samples(speech_like(seconds), 24_000).unwrap();
        let time = |f: &dyn Fn()| {
            let started = Instant::now();
            f();
            1e3 * started.elapsed().as_secs_f64()
        };
        let first = time(&|| {
            CloneEncoder::x_vector(&gpu, &audio).unwrap();
            CloneEncoder::reference_codes(&gpu, &audio).unwrap();
        });
        let runs = 5;
        let mel_ms = median(
            (0..runs)
                .map(|_| time(&|| drop(mel.log_mel(audio.samples()).unwrap())))
                .collect(),
        );
        let x_ms = median(
            (0..runs)
                .map(|_| time(&|| drop(CloneEncoder::x_vector(&gpu, &audio).unwrap())))
                .collect(),
        );
        let codes_ms = median(
            (0..runs)
                .map(|_| time(&|| drop(CloneEncoder::reference_codes(&gpu, &audio).unwrap())))
                .collect(),
        );
        let mode = CloneMode::Icl { transcript: "x" };
        let voice_ms = median(
            (0..runs)
                .map(|_| time(&|| drop(CloneEncoder::encode(&gpu, &audio, mode).unwrap())))
                .collect(),
        );
        let started = Instant::now();
        let cpu_voice = cpu.encode(&audio, mode).unwrap();
        let cpu_ms = 1e3 * started.elapsed().as_secs_f64();
        let gpu_voice = CloneEncoder::encode(&gpu, &audio, mode).unwrap();
        let x_err = rel_err(&gpu_voice.x_vector, &cpu_voice.x_vector);
        let (ours, theirs) = (
            &gpu_voice.reference.as_ref().unwrap().codes,
            &cpu_voice.reference.as_ref().unwrap().codes,
        );
        let differ = differences(ours, theirs);
        println!(
            "{seconds} s clip: GPU encode (ICL, median of {runs}) {voice_ms:.1} ms = x-vector \
             {x_ms:.1} ms (of which log-mel on the CPU {mel_ms:.1} ms) + codes {codes_ms:.1} ms; \
             first call {first:.1} ms; CPU reference {cpu_ms:.0} ms. GPU vs CPU: x-vector rel err \
             {x_err:.1e}, {} of {} codes differ {:?}",
            differ.len(),
            ours.len() * NUM_CODE_GROUPS,
            &differ[..differ.len().min(8)]
        );
        assert!(
            x_err <= MAX_REL_ERR,
            "{seconds} s: x-vector rel err {x_err:e}"
        );
    }
}

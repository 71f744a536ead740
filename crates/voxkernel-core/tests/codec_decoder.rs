//! The CPU codec decoder against the official `speech_tokenizer.decode` waveforms of the parity
//! fixtures, and its stream against its one-pass decode for many ways of splitting the frames.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use voxkernel_core::backend::Frame;
use voxkernel_core::checkpoint::SafetensorsFile;
use voxkernel_core::config::SpeechTokenizerConfig;
use voxkernel_core::reference::codec_decoder::{CodecDecoder, OFFICIAL_CHUNK_FRAMES};

/// Bounds (max abs, RMS) against the official f32 waveform. Max abs is the waveform parity bar
/// of issue #3. The fixture codec is random but conditioned like a trained one (activations
/// O(1), scripts/parity/make_ckpt.py), so f32 rounding is small: the official f32 decode is at most
/// 1.0e-6 max abs / 1.0e-7 RMS from the same model in f64, and this decoder 1.8e-6 / 1.4e-7 from
/// the official f32 samples (docs/codec.md). The RMS bound, ~7x the measured noise, catches a
/// systematic error (wrong window, history or trim) long before it reaches the max abs bar.
const OFFICIAL_TOLERANCE: Tolerance = Tolerance {
    max_abs: 1e-4,
    rms: 1e-6,
};
/// Stream vs one-pass: the same arithmetic but for matmul blocking, measured at up to 1.4e-6 max
/// abs / 9e-8 RMS; both bounds leave ~7x margin. A wrong history or window is orders of magnitude off.
const SPLIT_TOLERANCE: Tolerance = Tolerance {
    max_abs: 1e-5,
    rms: 1e-6,
};

#[derive(Clone, Copy)]
struct Tolerance {
    max_abs: f32,
    rms: f64,
}

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity")
}

fn load_decoder(speech_tokenizer_dir: &Path) -> Arc<CodecDecoder> {
    let config = SpeechTokenizerConfig::from_file(&speech_tokenizer_dir.join("config.json"))
        .expect("speech tokenizer config");
    let file = SafetensorsFile::open(&speech_tokenizer_dir.join("model.safetensors"))
        .expect("speech tokenizer weights");
    Arc::new(CodecDecoder::load(&config, &file).expect("codec decoder"))
}

/// `codes` (i64 `[frames, 16]`) and `wav` (f32) of a case file.
fn load_case(path: &Path) -> (Vec<Frame>, Vec<f32>) {
    let file = SafetensorsFile::open(path).unwrap();
    (file.frames("codes").unwrap(), file.f32("wav").unwrap().0)
}

#[derive(Debug)]
struct Error {
    max_abs: f32,
    rms: f64,
}

impl Error {
    fn within(&self, tolerance: Tolerance) -> bool {
        self.max_abs <= tolerance.max_abs && self.rms <= tolerance.rms
    }
}

fn error(actual: &[f32], expected: &[f32]) -> Error {
    assert_eq!(actual.len(), expected.len(), "sample counts differ");
    let diffs = actual.iter().zip(expected).map(|(a, e)| a - e);
    let square_sum: f64 = diffs.clone().map(|d| f64::from(d) * f64::from(d)).sum();
    Error {
        max_abs: diffs.map(f32::abs).fold(0.0, f32::max),
        rms: (square_sum / actual.len().max(1) as f64).sqrt(),
    }
}

fn tiny_custom_voice() -> PathBuf {
    fixtures_root().join("tiny-custom-voice")
}

fn decoder_long() -> (Vec<Frame>, Vec<f32>) {
    load_case(&tiny_custom_voice().join("cases/decoder_long.safetensors"))
}

/// Decodes `frames` through one stream, pushing pieces of the given sizes in order.
fn stream_in_pieces(decoder: &Arc<CodecDecoder>, frames: &[Frame], sizes: &[usize]) -> Vec<f32> {
    assert_eq!(sizes.iter().sum::<usize>(), frames.len());
    let mut stream = decoder.stream().unwrap();
    let mut out = Vec::new();
    let mut start = 0;
    for &size in sizes {
        let pcm = stream.push(&frames[start..start + size]).unwrap();
        assert_eq!(pcm.len(), size * decoder.samples_per_frame());
        out.extend(pcm);
        start += size;
    }
    assert_eq!(stream.frames_decoded(), frames.len());
    out
}

/// Every way of writing `n` as an ordered sum of positive parts.
fn compositions(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    (1..=n)
        .flat_map(|first| {
            compositions(n - first).into_iter().map(move |mut rest| {
                rest.insert(0, first);
                rest
            })
        })
        .collect()
}

/// Seeded piece sizes drawn from `choices`, summing to `total`.
fn random_sizes(total: usize, choices: &[usize], seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut sizes = Vec::new();
    let mut left = total;
    while left > 0 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let size = choices[(state >> 33) as usize % choices.len()].min(left);
        sizes.push(size);
        left -= size;
    }
    sizes
}

#[test]
fn every_fixture_waveform_matches_the_official_decode() {
    let mut decoders: BTreeMap<PathBuf, Arc<CodecDecoder>> = BTreeMap::new();
    let mut checked = Vec::new();
    for checkpoint in std::fs::read_dir(fixtures_root()).expect("parity fixtures") {
        let checkpoint = checkpoint.unwrap().path();
        let Ok(cases) = std::fs::read_dir(checkpoint.join("cases")) else {
            continue;
        };
        // Checkpoints share one codec through a symlink; load each distinct file once.
        let weights = std::fs::canonicalize(checkpoint.join("speech_tokenizer/model.safetensors"))
            .expect("speech tokenizer weights");
        let decoder = decoders
            .entry(weights)
            .or_insert_with(|| load_decoder(&checkpoint.join("speech_tokenizer")))
            .clone();
        for case in cases {
            let case = case.unwrap().path();
            if case.extension().is_none_or(|e| e != "safetensors") {
                continue;
            }
            let (frames, wav) = load_case(&case);
            assert!(frames.len() <= OFFICIAL_CHUNK_FRAMES);
            let one_pass = decoder.decode(&frames).unwrap();
            let err = error(&one_pass, &wav);
            assert!(
                err.within(OFFICIAL_TOLERANCE),
                "{}: {err:?}",
                case.display()
            );
            let official = decoder.decode_official(&frames).unwrap();
            let err = error(&official, &wav);
            assert!(
                err.within(OFFICIAL_TOLERANCE),
                "{}: official schedule, {err:?}",
                case.display()
            );
            checked.push(case);
        }
    }
    assert!(
        checked
            .iter()
            .any(|c| c.ends_with("decoder_long.safetensors")),
        "the 90-frame decoder_long case (longer than the 72-frame attention window) must be checked; got {checked:?}"
    );
    assert!(checked.len() >= 3, "too few fixture cases: {checked:?}");
}

#[test]
fn every_split_of_a_short_sequence_matches_the_one_pass_decode() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (frames, _) = decoder_long();
    let frames = &frames[..8];
    let one_pass = decoder.decode(frames).unwrap();
    let splits = compositions(frames.len());
    assert_eq!(splits.len(), 1 << (frames.len() - 1));
    for sizes in splits {
        let err = error(&stream_in_pieces(&decoder, frames, &sizes), &one_pass);
        assert!(err.within(SPLIT_TOLERANCE), "split {sizes:?}: {err:?}");
    }
}

#[test]
fn random_splits_of_a_long_sequence_match_one_pass_and_official() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (frames, wav) = decoder_long();
    let one_pass = decoder.decode(&frames).unwrap();
    for seed in 1..=4 {
        let sizes = random_sizes(frames.len(), &[1, 2, 3, 5, 8, 13, 21, 34], seed);
        let streamed = stream_in_pieces(&decoder, &frames, &sizes);
        let err = error(&streamed, &one_pass);
        assert!(
            err.within(SPLIT_TOLERANCE),
            "seed {seed} split {sizes:?}: vs one pass {err:?}"
        );
        let err = error(&streamed, &wav);
        assert!(
            err.within(OFFICIAL_TOLERANCE),
            "seed {seed} split {sizes:?}: vs official {err:?}"
        );
    }
    // One frame at a time is the engine's usual case.
    let err = error(&stream_in_pieces(&decoder, &frames, &[1; 90]), &wav);
    assert!(
        err.within(OFFICIAL_TOLERANCE),
        "frame by frame: vs official {err:?}"
    );
}

#[test]
fn a_stream_can_move_into_another_thread() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (frames, wav) = decoder_long();
    let mut stream = decoder.stream().unwrap();
    let head = stream.push(&frames[..45]).unwrap();
    let tail = std::thread::spawn(move || stream.push(&frames[45..]).unwrap())
        .join()
        .unwrap();
    let err = error(&[head, tail].concat(), &wav);
    assert!(err.within(OFFICIAL_TOLERANCE), "{err:?}");
}

#[test]
fn reset_restarts_the_stream_at_position_zero() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (frames, wav) = decoder_long();
    let mut stream = decoder.stream().unwrap();
    stream.push(&frames[40..50]).unwrap();
    stream.reset().unwrap();
    assert_eq!(stream.frames_decoded(), 0);
    let mut out = stream.push(&frames[..30]).unwrap();
    out.extend(stream.push(&frames[30..]).unwrap());
    let err = error(&out, &wav);
    assert!(err.within(OFFICIAL_TOLERANCE), "after reset: {err:?}");
}

#[test]
fn an_out_of_range_code_is_rejected_with_its_frame_and_codebook() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (mut frames, _) = decoder_long();
    frames[3][5] = 2048;
    let mut stream = decoder.stream().unwrap();
    stream.push(&frames[..2]).unwrap();
    let err = stream.push(&frames[2..5]).unwrap_err().to_string();
    assert!(
        err.contains("frame 3") && err.contains("codebook 5") && err.contains("0..2048"),
        "{err}"
    );
}

#[test]
fn official_schedule_departs_from_the_causal_decode_only_after_300_frames() {
    let decoder = load_decoder(&tiny_custom_voice().join("speech_tokenizer"));
    let (frames, _) = decoder_long();
    let frames: Vec<Frame> = frames
        .iter()
        .cycle()
        .take(OFFICIAL_CHUNK_FRAMES + 40)
        .copied()
        .collect();
    let causal = decoder.decode(&frames).unwrap();
    let official = decoder.decode_official(&frames).unwrap();
    assert_eq!(official.len(), causal.len());
    let boundary = OFFICIAL_CHUNK_FRAMES * decoder.samples_per_frame();
    let err = error(&official[..boundary], &causal[..boundary]);
    assert!(err.within(SPLIT_TOLERANCE), "first chunk: {err:?}");
    // The second chunk restarts RoPE at 0 and sees 25 context frames instead of 72: measured
    // 8.4e-4 RMS, far above the f32 noise that SPLIT_TOLERANCE bounds.
    let err = error(&official[boundary..], &causal[boundary..]);
    assert!(
        err.rms > 100.0 * SPLIT_TOLERANCE.rms,
        "second chunk should differ: {err:?}"
    );
}

/// Full-size check and timing (not run by default: needs a full-size speech tokenizer directory,
/// e.g. a random one built with `make_ckpt.py --size 0.6b`, and optionally `VOXKERNEL_CODEC_CASE`,
/// a safetensors file with `codes` i64 `[T, 16]` and the official `wav`, as written by
/// `scripts/parity/codec_precision.py --speech-tokenizer DIR --save-case FILE`). The case goes
/// through the official chunk schedule, so it may be longer than 300 frames. The random full-size
/// codec is conditioned like the fixture one, so the fixture tolerances apply.
/// `VOXKERNEL_CODEC_DIR=<ckpt>/speech_tokenizer cargo test --release -p voxkernel-core --test codec_decoder -- --ignored --nocapture`
#[test]
#[ignore = "needs VOXKERNEL_CODEC_DIR pointing at a full-size speech_tokenizer directory"]
fn full_size_stream_matches_one_pass() {
    let dir = std::env::var("VOXKERNEL_CODEC_DIR").expect("set VOXKERNEL_CODEC_DIR");
    let decoder = load_decoder(Path::new(&dir));
    if let Ok(case) = std::env::var("VOXKERNEL_CODEC_CASE") {
        let (frames, wav) = load_case(Path::new(&case));
        let err = error(&decoder.decode_official(&frames).unwrap(), &wav);
        println!("{} frames vs official: {err:?}", frames.len());
        assert!(err.within(OFFICIAL_TOLERANCE), "vs official: {err:?}");
    }
    let frames: Vec<Frame> = (0..24u32)
        .map(|t| std::array::from_fn(|g| (t * 977 + g as u32 * 131 + 7) % 2048))
        .collect();
    let started = std::time::Instant::now();
    let one_pass = decoder.decode(&frames).unwrap();
    let one_pass_ms = started.elapsed().as_secs_f64() * 1e3 / frames.len() as f64;
    let started = std::time::Instant::now();
    let streamed = stream_in_pieces(&decoder, &frames, &[1; 24]);
    let streamed_ms = started.elapsed().as_secs_f64() * 1e3 / frames.len() as f64;
    let err = error(&streamed, &one_pass);
    println!(
        "full size: one pass {one_pass_ms:.1} ms/frame, frame by frame {streamed_ms:.1} ms/frame, {err:?}"
    );
    assert!(
        err.within(SPLIT_TOLERANCE),
        "frame by frame vs one pass: {err:?}"
    );
}

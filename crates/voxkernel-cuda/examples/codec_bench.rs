//! Codec decoder benchmark and full-size check:
//! `codec_bench --model DIR [--calls N] [--warmup N] [--batches 1,4,16] [--graphs 1,0]
//! [--skinny-rows 64] [--batch-invariant 1,0] [--plan-frames 1,8] [--pipelined 1,0]
//! [--precision f32,tf32] [--frames-per-call 1,8]
//! [--check-frames N] [--case FILE]`.
//! DIR is a checkpoint (its `speech_tokenizer/` is used) or a speech tokenizer directory.
//!
//! Prints JSON lines: per batch size, the host-side time of `decode` calls of one frame per
//! stream (codes in, samples out, synchronised; p50/p99 over N calls after the warm-up, streams
//! running well past the 72-frame window), for every combination of the `--graphs` and
//! `--skinny-rows` settings (`CudaCodecOptions`); the GPU time per launch of one such call; then
//! the GPU decode of random frames (frame by frame, and in one call) against the CPU reference's
//! one-pass decode, and whether the two GPU decodes are the same bit for bit (once per
//! `--precision`, with that precision's first mode). With `--case FILE` (from
//! `scripts/parity/codec_precision.py --save-case`: `codes`, the official float32 `wav` and its
//! float64 decode `wav64`), the check decodes the case's codes instead and also prints how far the
//! GPU and CPU decodes are from the official ones, and how far the official float32 decode is
//! from its float64 one: the rounding noise of any float32 decode of that codec.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use voxkernel_core::backend::{CodecBackend, CodecSlot, Frame};
use voxkernel_core::checkpoint::SafetensorsFile;
use voxkernel_core::config::SpeechTokenizerConfig;
use voxkernel_core::reference::codec_decoder::CodecDecoder;
use voxkernel_cuda::{CodecPrecision, CudaCodec, CudaCodecOptions};

struct Args {
    model: PathBuf,
    calls: usize,
    warmup: usize,
    batches: Vec<usize>,
    graphs: Vec<bool>,
    skinny_rows: Vec<usize>,
    batch_invariant: Vec<bool>,
    plan_frames: Vec<usize>,
    pipelined: Vec<bool>,
    precision: Vec<CodecPrecision>,
    frames_per_call: Vec<usize>,
    check_frames: usize,
    case: Option<PathBuf>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        model: PathBuf::new(),
        calls: 200,
        warmup: 20,
        batches: vec![1, 4, 16],
        graphs: vec![true, false],
        skinny_rows: vec![CudaCodecOptions::default().skinny_rows],
        batch_invariant: vec![CudaCodecOptions::default().batch_invariant],
        plan_frames: vec![CudaCodecOptions::default().plan_frames],
        pipelined: vec![CudaCodecOptions::default().pipelined],
        precision: vec![CudaCodecOptions::default().precision],
        frames_per_call: vec![1],
        check_frames: 20,
        case: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = PathBuf::from(value()?),
            "--calls" => args.calls = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--batches" => args.batches = list(&value()?)?,
            "--graphs" => args.graphs = flags(&value()?)?,
            "--skinny-rows" => args.skinny_rows = list(&value()?)?,
            "--batch-invariant" => args.batch_invariant = flags(&value()?)?,
            "--pipelined" => args.pipelined = flags(&value()?)?,
            "--precision" => args.precision = precisions(&value()?)?,
            "--frames-per-call" => args.frames_per_call = list(&value()?)?,
            "--plan-frames" => args.plan_frames = list(&value()?)?,
            "--check-frames" => args.check_frames = value()?.parse()?,
            "--case" => args.case = Some(PathBuf::from(value()?)),
            other => bail!(
                "unknown flag {other}; valid: --model, --calls, --warmup, --batches, --graphs, \
                 --skinny-rows, --batch-invariant, --plan-frames, --pipelined, --precision, \
                 --frames-per-call, --check-frames, --case"
            ),
        }
    }
    if args.model.as_os_str().is_empty() {
        bail!("--model DIR is required");
    }
    if args.calls == 0
        || [&args.frames_per_call, &args.plan_frames, &args.batches]
            .iter()
            .any(|l| l.contains(&0))
    {
        bail!("--calls and every --batches entry must be at least 1");
    }
    Ok(args)
}

/// The speech tokenizer directory: `DIR/speech_tokenizer` when present, else DIR itself.
fn tokenizer_dir(model: &Path) -> PathBuf {
    let nested = model.join("speech_tokenizer");
    if nested.join("config.json").is_file() {
        nested
    } else {
        model.to_path_buf()
    }
}

/// Deterministic pseudo-random codes (64-bit LCG, high bits).
fn random_frames(count: usize, codebook_size: usize, seed: u64) -> Vec<Frame> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            std::array::from_fn(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % codebook_size as u64) as u32
            })
        })
        .collect()
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Max abs and RMS of `a - b`.
fn distance(a: &[f32], b: &[f32]) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let square: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y) * f64::from(x - y))
        .sum();
    (max, (square / a.len().max(1) as f64).sqrt())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let dir = tokenizer_dir(&args.model);
    let config = SpeechTokenizerConfig::from_file(&dir.join("config.json"))?;
    let file = SafetensorsFile::open(&dir.join("model.safetensors"))?;
    let size = config.decoder_config.codebook_size;
    let check_case = match &args.case {
        Some(path) => Case::load(path)?,
        None => Case::random(args.check_frames, size),
    };
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let mut modes = Vec::new();
    for &graphs in &args.graphs {
        for &rows in &args.skinny_rows {
            for &invariant in &args.batch_invariant {
                for &plan_frames in &args.plan_frames {
                    for &pipelined in &args.pipelined {
                        for &precision in &args.precision {
                            modes.push(CudaCodecOptions {
                                graphs,
                                skinny_rows: rows,
                                batch_invariant: invariant,
                                plan_frames,
                                pipelined,
                                precision,
                                ..CudaCodecOptions::default()
                            });
                        }
                    }
                }
            }
        }
    }
    let max_per_call = args.frames_per_call.iter().copied().max().unwrap_or(1);
    let mut checked = Vec::new();
    for mode in modes {
        let options = CudaCodecOptions {
            max_streams: max_batch,
            max_pass_frames: (max_batch * max_per_call).max(check_case.frames.len().min(32)),
            ..mode
        };
        let mut codec = CudaCodec::new(&config, &file, options)?;
        for &per_call in &args.frames_per_call {
            for &batch in &args.batches {
                bench(&mut codec, &args, batch, per_call, &options, size)?;
            }
        }
        if !checked.contains(&options.precision) && !check_case.frames.is_empty() {
            checked.push(options.precision);
            check(&mut codec, &config, &file, &check_case, &options)?;
        }
    }
    Ok(())
}

/// A comma-separated list of 0/1 switches.
fn flags(value: &str) -> Result<Vec<bool>> {
    Ok(value
        .split(',')
        .map(|v| v.parse::<u8>().map(|v| v != 0))
        .collect::<Result<_, _>>()?)
}

/// A comma-separated list of `f32` / `tf32`.
fn precisions(value: &str) -> Result<Vec<CodecPrecision>> {
    value
        .split(',')
        .map(|v| match v {
            "f32" => Ok(CodecPrecision::F32),
            "tf32" => Ok(CodecPrecision::Tf32),
            other => bail!("--precision: unknown value {other:?}; valid: f32, tf32"),
        })
        .collect()
}

/// A comma-separated list of counts.
fn list(value: &str) -> Result<Vec<usize>> {
    Ok(value.split(',').map(str::parse).collect::<Result<_, _>>()?)
}

/// Times `decode` calls of `per_call` frames for each of `batch` streams.
fn bench(
    codec: &mut CudaCodec,
    args: &Args,
    batch: usize,
    per_call: usize,
    options: &CudaCodecOptions,
    size: usize,
) -> Result<()> {
    let (graphs, skinny_rows) = (options.graphs, options.skinny_rows);
    let gpu = codec.device_name().to_string();
    let audio_ms = codec.samples_per_frame() as f64 / 24.0;
    let slots: Vec<CodecSlot> = (0..batch).map(|_| codec.open()).collect::<Result<_>>()?;
    let frames = (args.warmup + args.calls + 2) * per_call;
    let codes: Vec<Vec<Frame>> = (0..batch)
        .map(|s| random_frames(frames, size, 1 + s as u64))
        .collect();
    let call = |f: usize| -> Vec<(CodecSlot, &[Frame])> {
        slots
            .iter()
            .zip(&codes)
            .map(|(&slot, c)| (slot, &c[f * per_call..(f + 1) * per_call]))
            .collect()
    };
    let first = Instant::now();
    codec.decode(&call(0))?;
    let first_ms = first.elapsed().as_secs_f64() * 1e3;
    for f in 1..=args.warmup {
        codec.decode(&call(f))?;
    }
    let mut times = Vec::with_capacity(args.calls);
    for f in args.warmup + 1..=args.warmup + args.calls {
        let started = Instant::now();
        let out = codec.decode(&call(f))?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
        assert_eq!(out.len(), batch);
    }
    let launches = codec.profile(&call(args.warmup + args.calls + 1))?;
    let gpu_ms: f32 = launches.iter().map(|(_, ms)| ms).sum();
    times.sort_by(f64::total_cmp);
    let p50 = percentile(&times, 0.5);
    println!(
        "{}",
        serde_json::json!({
            "bench": "codec_decode",
            "gpu": gpu,
            "batch": batch,
            "graphs": graphs,
            "skinny_rows": skinny_rows,
            "batch_invariant": options.batch_invariant,
            "plan_frames": options.plan_frames,
            "pipelined": options.pipelined,
            "precision": format!("{:?}", options.precision),
            "frames_per_stream_per_call": per_call,
            "calls": times.len(),
            "ms_p50": p50,
            "ms_p99": percentile(&times, 0.99),
            "ms_mean": times.iter().sum::<f64>() / times.len() as f64,
            "ms_first_call": first_ms,
            "gpu_ms_sum_of_launches": gpu_ms,
            "launches": launches.len(),
            "rtf_per_stream": p50 / (audio_ms * per_call as f64),
        })
    );
    // Every launch of the profiled call, in order, for tuning.
    for (what, ms) in &launches {
        println!(
            "{}",
            serde_json::json!({
                "profile": what,
                "batch": batch,
                "graphs": graphs,
                "skinny_rows": skinny_rows,
                "precision": format!("{:?}", options.precision),
                "frames_per_stream_per_call": per_call,
                "gpu_ms": ms,
            })
        );
    }
    for slot in slots {
        codec.release(slot);
    }
    Ok(())
}

/// The frames the full-size check decodes, and the official decodes of them when a case file
/// gave them.
struct Case {
    frames: Vec<Frame>,
    /// (name, samples): the official float32 decode (`wav`) and its float64 one (`wav64`).
    official: Vec<(&'static str, Vec<f32>)>,
}

impl Case {
    fn random(count: usize, codebook_size: usize) -> Self {
        Self {
            frames: random_frames(count, codebook_size, 99),
            official: Vec::new(),
        }
    }

    fn load(path: &Path) -> Result<Self> {
        let file = SafetensorsFile::open(path)?;
        let frames = file.frames("codes")?;
        let mut official = Vec::new();
        for name in ["wav", "wav64"] {
            if file.info(name).is_some() {
                let (wav, _) = file.f32(name)?;
                if wav.len() != frames.len() * 1920 {
                    bail!(
                        "{}: {name} has {} samples, not 1920 per frame of its {} frames",
                        path.display(),
                        wav.len(),
                        frames.len()
                    );
                }
                official.push((name, wav));
            }
        }
        if official.is_empty() {
            bail!("{}: no official decode (`wav`) in the case", path.display());
        }
        Ok(Self { frames, official })
    }
}

/// The GPU decode of the case's frames, frame by frame and in one call, against the CPU
/// reference's one-pass decode, and all three against the case's official decodes.
fn check(
    codec: &mut CudaCodec,
    config: &SpeechTokenizerConfig,
    file: &SafetensorsFile,
    case: &Case,
    options: &CudaCodecOptions,
) -> Result<()> {
    let gpu = codec.device_name().to_string();
    let frames = &case.frames;
    let count = frames.len();
    let started = Instant::now();
    let decoder = Arc::new(CodecDecoder::load(config, file)?);
    let expected = decoder.decode(frames)?;
    let cpu_s = started.elapsed().as_secs_f64();
    let slot = codec.open()?;
    let mut by_frame = Vec::with_capacity(expected.len());
    for frame in frames.chunks(1) {
        by_frame.extend(codec.decode(&[(slot, frame)])?.remove(0));
    }
    codec.release(slot);
    let slot = codec.open()?;
    let whole = codec.decode(&[(slot, frames)])?.remove(0);
    codec.release(slot);
    // Batch-invariant plans promise the same samples whatever a pass holds: one frame per pass
    // (a one-frame plan's deep splits) and every frame in one pass (the same splits over many
    // rows, taller tiles). The tiny test fixtures have no split layers, so this is where the
    // promise is checked at full size.
    let differing = by_frame
        .iter()
        .zip(&whole)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    println!(
        "{}",
        serde_json::json!({
            "check": "codec_frame_by_frame_vs_one_call",
            "gpu": gpu,
            "batch_invariant": options.batch_invariant,
            "precision": format!("{:?}", options.precision),
            "frames": count,
            "samples_differing": differing,
        })
    );
    for (mode, wav) in [("frame_by_frame", &by_frame), ("one_call", &whole)] {
        let (max_abs, rms) = distance(wav, &expected);
        println!(
            "{}",
            serde_json::json!({
                "check": "codec_gpu_vs_cpu_one_pass",
                "gpu": gpu,
                "mode": mode,
                "precision": format!("{:?}", options.precision),
                "frames": count,
                "max_abs": max_abs,
                "rms": rms,
                "max_abs_reference": expected.iter().fold(0.0f32, |m, v| m.max(v.abs())),
                "cpu_seconds": cpu_s,
            })
        );
    }
    for (reference, official) in &case.official {
        let mut decodes = vec![
            ("gpu_frame_by_frame", &by_frame),
            ("gpu_one_call", &whole),
            ("cpu_one_pass", &expected),
        ];
        if *reference == "wav64" {
            // the rounding noise of the official float32 decode itself
            decodes.extend(
                case.official
                    .iter()
                    .filter(|(n, _)| *n == "wav")
                    .map(|(_, w)| ("official_f32", w)),
            );
        }
        for (what, wav) in decodes {
            let (max_abs, rms) = distance(wav, official);
            println!(
                "{}",
                serde_json::json!({
                    "check": "codec_vs_official",
                    "gpu": gpu,
                    "precision": format!("{:?}", options.precision),
                    "frames": count,
                    "decode": what,
                    "official": if *reference == "wav" { "float32" } else { "float64" },
                    "max_abs": max_abs,
                    "rms": rms,
                })
            );
        }
    }
    Ok(())
}

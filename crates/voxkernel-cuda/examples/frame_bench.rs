//! Frame-kernel benchmark: `frame_bench --model DIR [--frames N] [--warmup N] [--copy-mib N]`.
//! Use a checkpoint whose codec head cannot emit EOS (make_ckpt.py --no-eos) so every frame
//! runs. Prints JSON lines: per-frame latency, weight bytes per frame, achieved bandwidth, the
//! device-to-device copy bandwidth measured in the same process, and the ratio to that floor.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use voxkernel_core::backend::{FrameBackend, FrameEvent, SequenceSpec};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::prompt::{PromptPlan, PromptRequest, TextIds, TextMode, Voice, build_plan};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};
use voxkernel_cuda::{CudaBackend, CudaOptions};

struct Args {
    model: PathBuf,
    frames: usize,
    warmup: usize,
    copy_mib: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        model: PathBuf::new(),
        frames: 300,
        warmup: 20,
        copy_mib: 2048,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = PathBuf::from(value()?),
            "--frames" => args.frames = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--copy-mib" => args.copy_mib = value()?.parse()?,
            other => bail!("unknown flag {other}; valid: --model, --frames, --warmup, --copy-mib"),
        }
    }
    if args.model.as_os_str().is_empty() {
        bail!("--model DIR is required");
    }
    Ok(args)
}

/// A short prompt built by the real prompt builder: the first preset speaker of a CustomVoice
/// checkpoint, else a designed voice with a one-token instruct.
fn plan(ckpt: &Checkpoint) -> Result<PromptPlan> {
    let cfg = &ckpt.config;
    let voice = match cfg.talker.spk_id.keys().next() {
        Some(name) => Voice::Speaker(name.clone()),
        None => Voice::Design,
    };
    let ids = TextIds {
        // "Hello world, this is a test." in the Qwen2 vocabulary.
        target: vec![9707, 1879, 11, 419, 374, 264, 1273, 13],
        target_role: None,
        instruct: matches!(voice, Voice::Design).then(|| vec![9707]),
        reference: None,
    };
    let request = PromptRequest {
        voice,
        language: "english".into(),
        text_mode: TextMode::Whole,
    };
    build_plan(cfg, &request, &ids)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let ckpt = Checkpoint::open(&args.model)?;
    let total = args.frames + args.warmup;
    let mut backend = CudaBackend::new(
        &ckpt,
        CudaOptions {
            max_slots: 1,
            max_len: total + 64,
            ..CudaOptions::default()
        },
    )?;
    let g = &ckpt.generation;
    let sampling = SamplingConfig {
        talker: SamplerParams {
            do_sample: g.do_sample,
            temperature: g.temperature,
            top_k: g.top_k,
            top_p: 1.0,
            repetition_penalty: g.repetition_penalty,
        },
        subtalker: SamplerParams {
            do_sample: g.subtalker_dosample,
            temperature: g.subtalker_temperature,
            top_k: g.subtalker_top_k,
            top_p: 1.0,
            repetition_penalty: 1.0,
        },
        seed: 1,
    };
    let spec = SequenceSpec {
        plan: plan(&ckpt)?,
        sampling,
        max_frames: total,
    };
    let slot = backend.start_one(&spec)?;
    let mut times_ms = Vec::with_capacity(args.frames);
    for i in 0..total {
        let started = Instant::now();
        let event = backend.step(&[slot])?[0];
        let ms = started.elapsed().as_secs_f64() * 1e3;
        if let FrameEvent::Finished(reason) = event {
            bail!("the sequence finished ({reason:?}) after {i} frames; use a --no-eos checkpoint");
        }
        if i >= args.warmup {
            times_ms.push(ms);
        }
    }
    times_ms.sort_by(|a, b| a.total_cmp(b));
    let copy_gbs = voxkernel_cuda::bench::device_copy_gbs(backend.context(), args.copy_mib << 20)?;
    let bytes = backend.geometry().weight_bytes_per_frame();
    let p50 = percentile(&times_ms, 0.5);
    let achieved = bytes as f64 / (p50 * 1e-3) / 1e9;
    let floor_ms = bytes as f64 / (copy_gbs * 1e9) * 1e3;
    println!(
        "{{\"bench\":\"frame\",\"gpu\":{:?},\"frames\":{},\"ms_per_frame_p50\":{p50:.4},\"ms_per_frame_p99\":{:.4},\"weight_bytes_per_frame\":{bytes},\"achieved_gbs\":{achieved:.1},\"copy_gbs\":{copy_gbs:.1},\"floor_ms\":{floor_ms:.4},\"ratio_to_floor\":{:.3}}}",
        backend.device_name(),
        times_ms.len(),
        percentile(&times_ms, 0.99),
        p50 / floor_ms
    );
    Ok(())
}

//! Compares the CUDA backend with an official qwen-tts run dumped by
//! scripts/gpu/official_dump.py: `megakernel_check --model DIR --official FILE.safetensors`.
//! Teacher-forced: the backend is fed the official prompt rows and codes frame by frame; per step
//! it reports the codebook-0 logits' relative error (max |diff| / max |official|) and whether its
//! own greedy choices (groups 1..15 and the next codebook 0) equal the official codes. Prints one
//! JSON summary line.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use voxkernel_core::backend::{Frame, FrameBackend, FrameEvent};
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};
use voxkernel_cuda::{CudaBackend, CudaOptions};

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn main() -> Result<()> {
    let mut model = None;
    let mut official = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--official" => official = Some(PathBuf::from(value)),
            other => bail!("unknown flag {other}; valid: --model, --official"),
        }
    }
    let ckpt = Checkpoint::open(&model.context("--model DIR is required")?)?;
    let dump = SafetensorsFile::open(&official.context("--official FILE is required")?)?;
    let prefill = dump.f32("prefill_embeds")?.0;
    let trailing = dump.f32("trailing_embeds")?.0;
    let (logits_flat, shape) = dump.f32("logits_c0")?;
    let logits: Vec<&[f32]> = logits_flat.chunks(shape[1]).collect();
    let codes: Vec<Frame> = dump
        .bytes("codes")?
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect::<Vec<_>>()
        .chunks(16)
        .map(|c| Frame::try_from(c).unwrap())
        .collect();
    let eos = ckpt.config.talker.codec_eos_token_id;
    let g = &ckpt.generation;
    let greedy = |p: f32| SamplerParams {
        do_sample: false,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty: p,
    };
    let sampling = SamplingConfig {
        talker: greedy(g.repetition_penalty),
        subtalker: greedy(1.0),
        seed: 0,
    };
    let rows = prefill.len() / ckpt.config.talker.hidden_size;
    let options = CudaOptions {
        max_slots: 1,
        max_len: rows + codes.len() + 8,
        ..Default::default()
    };
    let mut backend = CudaBackend::new(&ckpt, options)?;

    let slot = backend.start_with_rows(&prefill, &trailing, sampling, codes.len())?;
    let mut errs = vec![rel_err(&backend.logits(slot)?, logits[0])];
    let (mut agree, mut total) = (0usize, 0usize);
    for (k, frame) in codes.iter().enumerate() {
        let next = codes.get(k + 1).map_or(eos, |f| f[0]);
        let step = backend.step_forced(slot, frame, next)?;
        if let Some(want) = logits.get(k + 1) {
            errs.push(rel_err(&step.logits, want));
        }
        agree += step.own_frame[1..]
            .iter()
            .zip(&frame[1..])
            .filter(|(a, b)| a == b)
            .count();
        total += 15;
        if k + 1 < codes.len() {
            agree += (step.own_next_c0 == next) as usize;
            total += 1;
        }
        if k < 5 || k % 20 == 0 {
            eprintln!("step {k}: logits rel err {:.3e}", errs.last().unwrap());
        }
    }
    backend.release(slot);

    // Free-running greedy from the same prompt: how long the codes stay identical.
    let slot = backend.start_with_rows(&prefill, &trailing, sampling, codes.len())?;
    let mut identical_frames = 0;
    for want in &codes {
        match backend.step(&[slot])?[0] {
            FrameEvent::Frame(f) if f == *want => identical_frames += 1,
            _ => break,
        }
    }
    let max_err = errs.iter().copied().fold(0f32, f32::max);
    let mean_err = errs.iter().sum::<f32>() / errs.len() as f32;
    println!(
        "{{\"check\":\"megakernel_vs_official\",\"frames\":{},\"logit_steps\":{},\"logits_rel_err_max\":{max_err:.3e},\"logits_rel_err_mean\":{mean_err:.3e},\"teacher_forced_agreement\":{:.4},\"free_running_identical_frames\":{identical_frames}}}",
        codes.len(),
        errs.len(),
        agree as f64 / total as f64
    );
    Ok(())
}

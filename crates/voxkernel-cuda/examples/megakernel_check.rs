//! Compares the CUDA backend with an official qwen-tts run dumped by
//! scripts/gpu/official_dump.py: `megakernel_check --model DIR --official FILE.safetensors`.
//! Teacher-forced (`voxkernel_core::official_run`): the backend is fed the official prompt rows
//! and codes frame by frame; reported are the codebook-0 logits' relative error and how often
//! its own greedy choices equal the official codes. Then, free-running from the same prompt,
//! how many frames stay identical. Prints one JSON summary line.

use anyhow::{Context, Result};
use voxkernel_core::backend::{Frame, FrameBackend, FrameEvent, SlotId};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::official_run::{ForcedStep, OfficialRun, TeacherForced, check_args, compare};
use voxkernel_core::sampling::SamplingConfig;
use voxkernel_cuda::{CudaBackend, CudaOptions};

/// One sequence of the backend, driven teacher-forced.
struct Forcing<'a> {
    backend: &'a mut CudaBackend,
    slot: Option<SlotId>,
}

impl TeacherForced for Forcing<'_> {
    fn start(
        &mut self,
        prefill: &[f32],
        trailing: &[f32],
        sampling: SamplingConfig,
        max_frames: usize,
    ) -> Result<Vec<f32>> {
        let slot = self
            .backend
            .start_with_rows(prefill, trailing, sampling, max_frames)?;
        self.slot = Some(slot);
        self.backend.logits(slot)
    }

    fn step(&mut self, frame: &Frame, next_c0: u32) -> Result<ForcedStep> {
        let slot = self.slot.context("step before start")?;
        self.backend.step_forced(slot, frame, next_c0)
    }
}

fn main() -> Result<()> {
    let (model, official) = check_args(std::env::args().skip(1))?;
    let ckpt = Checkpoint::open(&model)?;
    let run = OfficialRun::open(&official)?;
    let sampling = OfficialRun::sampling(ckpt.generation.repetition_penalty);
    let rows = run.prefill.len() / ckpt.config.talker.hidden_size;
    let options = CudaOptions {
        max_slots: 1,
        max_len: rows + run.codes.len() + 8,
        ..Default::default()
    };
    let mut backend = CudaBackend::new(&ckpt, options)?;
    let eos = ckpt.config.talker.codec_eos_token_id;
    let mut forcing = Forcing {
        backend: &mut backend,
        slot: None,
    };
    let c = compare(&run, &mut forcing, sampling, eos)?;
    if let Some(slot) = forcing.slot {
        backend.release(slot);
    }

    let slot = backend.start_with_rows(&run.prefill, &run.trailing, sampling, run.codes.len())?;
    let mut identical_frames = 0;
    for want in &run.codes {
        match backend.step(&[slot])?[0] {
            FrameEvent::Frame(f) if f == *want => identical_frames += 1,
            _ => break,
        }
    }
    println!(
        "{{\"check\":\"megakernel_vs_official\",\"frames\":{},\"logit_steps\":{},\"logits_rel_err_max\":{:.3e},\"logits_rel_err_mean\":{:.3e},\"teacher_forced_agreement\":{:.4},\"free_running_identical_frames\":{identical_frames}}}",
        c.frames, c.logit_steps, c.logits_rel_err_max, c.logits_rel_err_mean, c.agreement
    );
    Ok(())
}

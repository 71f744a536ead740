//! Compares the CPU reference with an official qwen-tts run dumped by
//! scripts/gpu/official_dump.py (`--device cpu` works too), teacher-forced:
//! `reference_check --model DIR --official FILE.safetensors`.
//! Prints one JSON line (see `voxkernel_core::official_run::Comparison`).

use anyhow::Result;
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::official_run::{OfficialRun, check_args, compare};
use voxkernel_core::reference::{ReferenceForcing, ReferenceModel};

fn main() -> Result<()> {
    let (model, official) = check_args(std::env::args().skip(1))?;
    let ckpt = Checkpoint::open(&model)?;
    let run = OfficialRun::open(&official)?;
    let reference = ReferenceModel::new(&ckpt)?;
    let sampling = OfficialRun::sampling(ckpt.generation.repetition_penalty);
    let eos = ckpt.config.talker.codec_eos_token_id;
    let c = compare(&run, &mut ReferenceForcing::new(&reference), sampling, eos)?;
    println!(
        "{{\"check\":\"reference_vs_official\",\"frames\":{},\"logit_steps\":{},\"logits_rel_err_max\":{:.3e},\"logits_rel_err_mean\":{:.3e},\"teacher_forced_agreement\":{:.4}}}",
        c.frames, c.logit_steps, c.logits_rel_err_max, c.logits_rel_err_mean, c.agreement
    );
    Ok(())
}

//! Batched-prefill check and benchmark on a full-size checkpoint:
//! `prefill_bench --model DIR [--rows 40] [--sequences 1,16] [--reps 20] [--warmup 2]
//! [--cpu-check N] [--no-check]`.
//! Prompts of exactly `--rows` rows (the real prompt builder, CustomVoice or VoiceDesign).
//! Prints JSON lines:
//! - `prefill_check`: the first `--cpu-check` prompts' GPU prefill logits against the CPU f32
//!   reference (relative error, same greedy codebook-0 token); then the largest `--sequences`
//!   count started in one call against each started alone (both skipped with `--no-check`);
//! - `prefill`: per `--sequences` count, the host-timed `start` of that many prompts in one
//!   call (prefill, head and codebook-0 sampling, codes read back), p50 / p90 / min.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use voxkernel_core::backend::{FrameBackend, SequenceSpec, SlotId};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::official_run::rel_err;
use voxkernel_core::prompt::{PromptPlan, PromptRequest, TextIds, TextMode, Voice, build_plan};
use voxkernel_core::reference::ReferenceModel;
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};
use voxkernel_cuda::{CudaBackend, CudaOptions};

struct Args {
    model: PathBuf,
    rows: usize,
    sequences: Vec<usize>,
    reps: usize,
    warmup: usize,
    cpu_check: usize,
    check: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        model: PathBuf::new(),
        rows: 40,
        sequences: vec![1, 16],
        reps: 20,
        warmup: 2,
        cpu_check: 2,
        check: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = PathBuf::from(value()?),
            "--rows" => args.rows = value()?.parse()?,
            "--sequences" => {
                args.sequences = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--reps" => args.reps = value()?.parse()?,
            "--warmup" => args.warmup = value()?.parse()?,
            "--cpu-check" => args.cpu_check = value()?.parse()?,
            "--no-check" => args.check = false,
            other => bail!(
                "unknown flag {other}; valid: --model, --rows, --sequences, --reps, --warmup, \
                 --cpu-check, --no-check"
            ),
        }
    }
    ensure!(
        !args.model.as_os_str().is_empty(),
        "--model DIR is required"
    );
    ensure!(
        args.sequences.iter().all(|&n| n > 0) && args.reps > 0,
        "--sequences and --reps must be at least 1"
    );
    Ok(args)
}

/// A prompt of exactly `rows` rows whose text ids depend on `k` (so prompts differ).
fn plan(ckpt: &Checkpoint, rows: usize, k: usize) -> Result<PromptPlan> {
    let cfg = &ckpt.config;
    let voice = match cfg.talker.spk_id.keys().min() {
        Some(name) => Voice::Speaker(name.clone()),
        None => Voice::Design,
    };
    let request = PromptRequest {
        voice: voice.clone(),
        language: "english".into(),
        text_mode: TextMode::Whole,
    };
    for n in 1..=rows {
        let ids = TextIds {
            target: (0..n)
                .map(|i| 1000 + ((i * 37 + k * 101) % 20000) as u32)
                .collect(),
            target_role: None,
            instruct: matches!(voice, Voice::Design).then(|| vec![9707]),
            reference: None,
        };
        let plan = build_plan(cfg, &request, &ids)?;
        if plan.prefill.len() == rows {
            return Ok(plan);
        }
    }
    bail!("no prompt of this checkpoint has exactly {rows} rows")
}

fn greedy(ckpt: &Checkpoint) -> SamplingConfig {
    let g = &ckpt.generation;
    let params = |repetition_penalty| SamplerParams {
        do_sample: false,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty,
    };
    SamplingConfig {
        talker: params(g.repetition_penalty),
        subtalker: params(1.0),
        seed: 0,
    }
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0
}

fn start_all(backend: &mut CudaBackend, specs: &[SequenceSpec]) -> Result<Vec<SlotId>> {
    backend.start(specs).into_iter().collect()
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let ckpt = Checkpoint::open(&args.model)?;
    let most = args.sequences.iter().copied().max().unwrap_or(1);
    let mut backend = CudaBackend::new(
        &ckpt,
        CudaOptions {
            max_slots: most,
            max_len: args.rows + 8,
            ..CudaOptions::default()
        },
    )?;
    let gpu = backend.device_name().to_string();
    let specs: Vec<SequenceSpec> = (0..most)
        .map(|k| {
            Ok(SequenceSpec {
                plan: plan(&ckpt, args.rows, k)?,
                sampling: greedy(&ckpt),
                max_frames: 1,
            })
        })
        .collect::<Result<_>>()?;

    if args.check {
        check(&args, &ckpt, &mut backend, &specs, &gpu)?;
    }
    for &n in &args.sequences {
        let mut ms = Vec::with_capacity(args.reps);
        for rep in 0..args.warmup + args.reps {
            let started = Instant::now();
            let slots = start_all(&mut backend, &specs[..n])?;
            let elapsed = started.elapsed().as_secs_f64() * 1e3;
            for slot in slots {
                backend.release(slot);
            }
            if rep >= args.warmup {
                ms.push(elapsed);
            }
        }
        ms.sort_by(f64::total_cmp);
        println!(
            "{}",
            serde_json::json!({
                "bench": "prefill", "sequences": n, "rows_per_sequence": args.rows,
                "rows": n * args.rows, "reps": ms.len(), "ms_p50": percentile(&ms, 0.5),
                "ms_p90": percentile(&ms, 0.9), "ms_min": ms[0], "gpu": gpu,
            })
        );
    }
    Ok(())
}

/// The `prefill_check` lines: each prompt alone against the CPU reference, then all in one call
/// against each alone.
fn check(
    args: &Args,
    ckpt: &Checkpoint,
    backend: &mut CudaBackend,
    specs: &[SequenceSpec],
    gpu: &str,
) -> Result<()> {
    let most = specs.len();
    let mut solo = Vec::with_capacity(most);
    for spec in specs {
        let slot = backend.start_one(spec)?;
        solo.push(backend.logits(slot)?);
        backend.release(slot);
    }
    if args.cpu_check > 0 {
        let reference = ReferenceModel::new(ckpt)?;
        for (k, spec) in specs.iter().enumerate().take(args.cpu_check) {
            let started = Instant::now();
            let want = reference
                .teacher_forced_logits(&spec.plan, &[], 1)?
                .pop()
                .context("no logits")?;
            println!(
                "{}",
                serde_json::json!({
                    "bench": "prefill_check", "against": "cpu_reference_f32", "prompt": k,
                    "rows": args.rows, "logits_rel_err": rel_err(&solo[k], &want),
                    "same_argmax": argmax(&solo[k]) == argmax(&want),
                    "cpu_seconds": started.elapsed().as_secs_f64(), "gpu": gpu,
                })
            );
        }
    }
    let slots = start_all(backend, specs)?;
    let mut worst = 0f32;
    let mut same_argmax = true;
    for (slot, want) in slots.iter().zip(&solo) {
        let got = backend.logits(*slot)?;
        worst = worst.max(rel_err(&got, want));
        same_argmax &= argmax(&got) == argmax(want);
        backend.release(*slot);
    }
    println!(
        "{}",
        serde_json::json!({
            "bench": "prefill_check", "against": "solo_starts", "sequences": most,
            "rows": args.rows, "logits_rel_err_max": worst, "same_argmax": same_argmax, "gpu": gpu,
        })
    );
    Ok(())
}

//! GPU parity against the official fixtures (tests/fixtures/parity, made by
//! scripts/parity/make_fixtures.py with qwen-tts 0.1.1 in float32), and the GPU sampler against
//! the CPU reference's processors (voxkernel-core sampling.rs). They need a CUDA GPU, so they
//! are ignored by default (reported as such, never as passed); the GPU machine runs them with
//! `--include-ignored` (scripts/gpu/check_megakernel.sh), where a missing driver fails.

use std::path::{Path, PathBuf};

use voxkernel_core::backend::{
    FinishReason, Frame, FrameBackend, FrameEvent, SequenceSpec, SlotId,
};
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::config::ModelConfig;
use voxkernel_core::official_run::rel_err;
use voxkernel_core::prompt::{PromptPlan, PromptRequest, TextIds, TextMode, Voice, build_plan};
use voxkernel_core::sampling::{
    SamplerParams, SamplingConfig, TalkerLogitRules, apply_repetition_penalty, apply_temperature,
    mask_eos_before_min_tokens, philox4x32_10, suppress_control_tokens, top_k_filter, top_p_filter,
};
use voxkernel_cuda::{CudaBackend, CudaOptions, driver_available};

/// Codebook-0 logits must agree with the official float32 run to this relative error
/// (max |diff| / max |official|); the kernel reads the same bf16 weights and keeps f32 activations.
const LOGITS_REL_TOL: f32 = 1e-3;

fn fixture_root() -> PathBuf {
    std::env::var_os("VOXKERNEL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity")
        })
}

fn require_gpu_and_fixtures() {
    assert!(driver_available(), "these tests need a CUDA driver");
    assert!(
        fixture_root().is_dir(),
        "no fixtures at {}",
        fixture_root().display()
    );
}

struct Case {
    name: String,
    json: serde_json::Value,
    tensors: SafetensorsFile,
    prefill: Vec<f32>,
    trailing: Vec<f32>,
    logits: Vec<Vec<f32>>,
    codes: Vec<Frame>,
}

impl Case {
    fn max_frames(&self) -> usize {
        self.json["max_new_tokens"].as_u64().unwrap() as usize - 1
    }
    fn finished_by(&self) -> FinishReason {
        match self.json["finished_by"].as_str().unwrap() {
            "eos" => FinishReason::Eos,
            _ => FinishReason::MaxFrames,
        }
    }
    fn ids(&self, key: &str) -> Option<Vec<u32>> {
        self.json[key]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_u64().unwrap() as u32).collect())
    }
    /// The case's prompt, built by the real prompt builder from the official token ids.
    fn plan(&self, config: &ModelConfig) -> PromptPlan {
        let voice = match self.json["mode"].as_str().unwrap() {
            "custom_voice" => Voice::Speaker(self.json["speaker"].as_str().unwrap().to_string()),
            "base_xvector" => Voice::XVector(self.tensors.f32("speaker_vector").unwrap().0),
            "voice_design" => Voice::Design,
            other => panic!("unknown case mode {other}"),
        };
        let text_mode = match self.json["text_mode"].as_str().unwrap() {
            "whole" => TextMode::Whole,
            _ => TextMode::Streaming,
        };
        let request = PromptRequest {
            voice,
            language: self.json["language"].as_str().unwrap().to_string(),
            text_mode,
        };
        let ids = TextIds {
            target: self.ids("text_ids").unwrap(),
            target_role: None,
            instruct: self.ids("instruct_ids"),
            reference: None,
        };
        build_plan(config, &request, &ids).unwrap()
    }
}

fn load_cases(ckpt_dir: &Path) -> Vec<Case> {
    let mut names: Vec<String> = std::fs::read_dir(ckpt_dir.join("cases"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "json")
                .then(|| p.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let base = ckpt_dir.join("cases").join(&name);
            let json: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(base.with_extension("json")).unwrap(),
            )
            .unwrap();
            let tensors = SafetensorsFile::open(&base.with_extension("safetensors")).unwrap();
            let (logits_flat, shape) = tensors.f32("logits_c0").unwrap();
            let logits = logits_flat.chunks(shape[1]).map(<[f32]>::to_vec).collect();
            let codes_flat: Vec<u32> = tensors
                .bytes("codes")
                .unwrap()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
            let codes = codes_flat
                .chunks(16)
                .map(|c| <Frame>::try_from(c).unwrap())
                .collect();
            Case {
                name,
                prefill: tensors.f32("prefill_embeds").unwrap().0,
                trailing: tensors.f32("trailing_embeds").unwrap().0,
                json,
                tensors,
                logits,
                codes,
            }
        })
        .collect()
}

fn checkpoints() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixture_root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn greedy(ckpt: &Checkpoint, seed: u64) -> SamplingConfig {
    let g = &ckpt.generation;
    SamplingConfig {
        talker: SamplerParams {
            do_sample: false,
            temperature: g.temperature,
            top_k: g.top_k,
            top_p: 1.0,
            repetition_penalty: g.repetition_penalty,
        },
        subtalker: SamplerParams {
            do_sample: false,
            temperature: g.subtalker_temperature,
            top_k: g.subtalker_top_k,
            top_p: 1.0,
            repetition_penalty: 1.0,
        },
        seed,
    }
}

fn sampled(ckpt: &Checkpoint, seed: u64) -> SamplingConfig {
    let mut s = greedy(ckpt, seed);
    s.talker.do_sample = true;
    s.subtalker.do_sample = true;
    s
}

fn options() -> CudaOptions {
    CudaOptions {
        max_slots: 2,
        max_len: 128,
        ..Default::default()
    }
}

/// Kernel configurations that must give the same results: the default; attention chunks of 4
/// positions (several per sequence even on the tiny fixtures, so the chunks' merge runs); one
/// attention block per (sequence, kv head).
fn variants() -> [(&'static str, CudaOptions); 3] {
    [
        ("default", options()),
        (
            "chunk 4",
            CudaOptions {
                attention_chunk: 4,
                ..options()
            },
        ),
        (
            "chunk 0",
            CudaOptions {
                attention_chunk: 0,
                ..options()
            },
        ),
    ]
}

fn run_to_end(backend: &mut CudaBackend, slot: SlotId) -> (Vec<Frame>, FinishReason) {
    let mut frames = Vec::new();
    loop {
        match backend.step(&[slot]).unwrap()[0] {
            FrameEvent::Frame(f) => frames.push(f),
            FrameEvent::Finished(r) => return (frames, r),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn greedy_codes_and_prefill_logits_match_official() {
    require_gpu_and_fixtures();
    let mut failures = Vec::new();
    for (dir, (variant, opts)) in checkpoints()
        .into_iter()
        .flat_map(|d| variants().map(|v| (d.clone(), v)))
    {
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut backend = CudaBackend::new(&ckpt, opts).unwrap();
        for case in load_cases(&dir) {
            let label = format!(
                "{}/{} ({variant})",
                dir.file_name().unwrap().to_string_lossy(),
                case.name
            );
            let slot = backend
                .start_with_rows(
                    &case.prefill,
                    &case.trailing,
                    greedy(&ckpt, 0),
                    case.max_frames(),
                )
                .unwrap();
            let err = rel_err(&backend.logits(slot).unwrap(), &case.logits[0]);
            let (frames, reason) = run_to_end(&mut backend, slot);
            backend.release(slot);
            let agree = frames
                .iter()
                .zip(&case.codes)
                .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x == y).count())
                .sum::<usize>();
            println!(
                "{label}: prefill logits rel err {err:.2e}; frames {} (official {}); codes agree \
                 {agree}/{}; finished {reason:?}",
                frames.len(),
                case.codes.len(),
                16 * case.codes.len()
            );
            if err > LOGITS_REL_TOL || frames != case.codes || reason != case.finished_by() {
                failures.push(label);
            }
        }
    }
    assert!(failures.is_empty(), "mismatches: {failures:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn teacher_forced_logits_match_official() {
    require_gpu_and_fixtures();
    let mut worst = 0f32;
    for (dir, (variant, opts)) in checkpoints()
        .into_iter()
        .flat_map(|d| variants().map(|v| (d.clone(), v)))
    {
        let ckpt = Checkpoint::open(&dir).unwrap();
        let eos = ckpt.config.talker.codec_eos_token_id;
        let mut backend = CudaBackend::new(&ckpt, opts).unwrap();
        for case in load_cases(&dir) {
            let slot = backend
                .start_with_rows(
                    &case.prefill,
                    &case.trailing,
                    greedy(&ckpt, 0),
                    case.max_frames(),
                )
                .unwrap();
            for step in 0..case.logits.len() - 1 {
                let next = case.codes.get(step + 1).map_or(eos, |f| f[0]);
                let forced = backend.step_forced(slot, &case.codes[step], next).unwrap();
                assert_eq!(
                    forced.own_frame, case.codes[step],
                    "{} ({variant}): step {step}",
                    case.name
                );
                let err = rel_err(&forced.logits, &case.logits[step + 1]);
                worst = worst.max(err);
                assert!(
                    err <= LOGITS_REL_TOL,
                    "{}/{} ({variant}) step {step}: rel err {err:.2e}",
                    dir.display(),
                    case.name
                );
            }
            backend.release(slot);
        }
    }
    println!("teacher-forced codebook-0 logits: worst rel err {worst:.2e}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn same_seed_gives_identical_sampled_frames() {
    require_gpu_and_fixtures();
    let dir = fixture_root().join("tiny-custom-voice");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let case = &load_cases(&dir)[0];
    let mut backend = CudaBackend::new(&ckpt, options()).unwrap();
    let mut run = |seed: u64| {
        let slot = backend
            .start_with_rows(&case.prefill, &case.trailing, sampled(&ckpt, seed), 12)
            .unwrap();
        let out = run_to_end(&mut backend, slot).0;
        backend.release(slot);
        out
    };
    let (a, b, c) = (run(7), run(7), run(8));
    assert!(!a.is_empty());
    assert_eq!(a, b, "same seed, different frames");
    assert_ne!(a, c, "seeds 7 and 8 sampled identical frames");
    for frame in &a {
        assert!(
            frame.iter().all(|&code| code < 2048),
            "sampled a non-audio code: {frame:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn two_sequences_in_one_launch_match_running_alone() {
    require_gpu_and_fixtures();
    let dir = fixture_root().join("tiny-custom-voice");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let cases = load_cases(&dir);
    // cases of different prompt lengths: with small chunks, the shorter one's last chunks are
    // empty in the talker's attention
    assert_ne!(cases[0].prefill.len(), cases[1].prefill.len());
    for (variant, opts) in variants() {
        sequences_together(&ckpt, &[&cases[0], &cases[1]], opts, variant);
    }
}

/// Seven sequences in one launch run on the wide build (launches of 5-8); as they finish, the
/// launches narrow to the full and solo builds. Every sequence gives the official codes.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn seven_sequences_in_one_launch_match_official() {
    require_gpu_and_fixtures();
    let dir = fixture_root().join("tiny-custom-voice");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let cases = load_cases(&dir);
    let seven: Vec<&Case> = cases.iter().cycle().take(7).collect();
    let opts = CudaOptions {
        max_slots: 7,
        ..options()
    };
    sequences_together(&ckpt, &seven, opts, "default");
}

fn sequences_together(ckpt: &Checkpoint, cases: &[&Case], opts: CudaOptions, variant: &str) {
    let mut backend = CudaBackend::new(ckpt, opts).unwrap();
    let slots: Vec<SlotId> = cases
        .iter()
        .map(|case| {
            backend
                .start_with_rows(
                    &case.prefill,
                    &case.trailing,
                    greedy(ckpt, 0),
                    case.max_frames(),
                )
                .unwrap()
        })
        .collect();
    let mut got = vec![Vec::new(); cases.len()];
    loop {
        let events = backend.step(&slots).unwrap();
        let mut done = true;
        for (frames, e) in got.iter_mut().zip(&events) {
            if let FrameEvent::Frame(f) = e {
                frames.push(*f);
                done = false;
            }
        }
        if done {
            break;
        }
    }
    for (frames, case) in got.iter().zip(cases) {
        assert_eq!(*frames, case.codes, "{} ({variant})", case.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn prompt_rows_built_on_the_gpu_reproduce_official_codes() {
    require_gpu_and_fixtures();
    for dir in checkpoints() {
        let ckpt = Checkpoint::open(&dir).unwrap();
        let mut backend = CudaBackend::new(&ckpt, options()).unwrap();
        for case in load_cases(&dir) {
            let label = format!(
                "{}/{}",
                dir.file_name().unwrap().to_string_lossy(),
                case.name
            );
            let plan = case.plan(&ckpt.config);
            assert_eq!(
                plan.prefill.len(),
                case.json["prefill_len"].as_u64().unwrap() as usize,
                "{label}"
            );
            let spec = SequenceSpec {
                plan,
                sampling: greedy(&ckpt, 0),
                max_frames: case.max_frames(),
            };
            let slot = backend.start_one(&spec).unwrap();
            let err = rel_err(&backend.logits(slot).unwrap(), &case.logits[0]);
            let (frames, _) = run_to_end(&mut backend, slot);
            backend.release(slot);
            println!("{label}: plan prefill logits rel err {err:.2e}");
            assert!(err <= LOGITS_REL_TOL, "{label}: rel err {err:.2e}");
            assert_eq!(frames, case.codes, "{label}");
        }
    }
}

/// Codebook-0 logits after the official processors (repetition penalty over `history`, EOS held
/// back before 2 tokens, control rows suppressed), temperature, top-k and top-p, as the CPU
/// reference computes them; also how many logits top-k alone keeps.
fn reference_warped(
    raw_logits: &[f32],
    history: &[u32],
    eos: u32,
    params: &SamplerParams,
) -> (Vec<f32>, usize) {
    let rules = TalkerLogitRules::official(raw_logits.len(), eos);
    let mut logits = raw_logits.to_vec();
    apply_repetition_penalty(&mut logits, history, params.repetition_penalty);
    mask_eos_before_min_tokens(&mut logits, &rules, history.len());
    suppress_control_tokens(&mut logits, &rules);
    apply_temperature(&mut logits, params.temperature);
    top_k_filter(&mut logits, params.top_k);
    let top_k_kept = logits.iter().filter(|x| x.is_finite()).count();
    top_p_filter(&mut logits, params.top_p);
    (logits, top_k_kept)
}

/// The kernel's categorical draw (kernels/frame.cu `sample_logits`), on the CPU: Gumbel-max over
/// the kept logits, the noise of id i from Philox4x32-10 with counter (i, n_sampled, group,
/// 0x766f78) and the sequence seed as key; the lowest id wins ties.
fn gumbel_max_draw(warped: &[f32], seed: u64, n_sampled: u32, group: u32) -> u32 {
    let key = [seed as u32, (seed >> 32) as u32];
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (i, &x) in warped.iter().enumerate() {
        if x == f32::NEG_INFINITY {
            continue;
        }
        let r = philox4x32_10([i as u32, n_sampled, group, 0x766f78], key);
        let u = ((r[0] >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0);
        let score = x - (-u.ln()).ln();
        if score > best.0 {
            best = (score, i as u32);
        }
    }
    best.1
}

/// Every codebook-0 draw of sampled runs (top_p off, then 0.6, then top_k 0: no top-k at all),
/// recomputed on the CPU from the kernel's own raw logits: the kernel's top-k threshold, top-p
/// nucleus and Gumbel-max draw must give exactly the id the CPU computes, and that id must be
/// among the reference's candidates.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn codebook0_draws_equal_the_cpu_recomputation_with_and_without_top_k_and_top_p() {
    require_gpu_and_fixtures();
    let dir = fixture_root().join("tiny-custom-voice");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let eos = ckpt.config.talker.codec_eos_token_id;
    let cases = load_cases(&dir);
    let mut backend = CudaBackend::new(&ckpt, options()).unwrap();
    let default_top_k = sampled(&ckpt, 0).talker.top_k;
    for (top_k, top_p) in [(default_top_k, 1.0), (default_top_k, 0.6), (0, 1.0)] {
        let (mut draws, mut narrowed, mut beyond_default_k) = (0usize, 0usize, 0usize);
        for case in &cases[..3] {
            for seed in 0..4 {
                let mut sampling = sampled(&ckpt, seed);
                sampling.talker.top_k = top_k;
                sampling.talker.top_p = top_p;
                sampling.subtalker.top_p = top_p;
                let slot = backend
                    .start_with_rows(&case.prefill, &case.trailing, sampling, case.max_frames())
                    .unwrap();
                // each codebook 0 is drawn from the logits read before it, with the codebook-0
                // ids before it as the penalty history
                let mut logits = backend.logits(slot).unwrap();
                let mut history: Vec<u32> = Vec::new();
                loop {
                    let drawn = match backend.step(&[slot]).unwrap()[0] {
                        FrameEvent::Frame(f) => f[0],
                        FrameEvent::Finished(FinishReason::Eos) => eos,
                        FrameEvent::Finished(FinishReason::MaxFrames) => break,
                    };
                    let (warped, top_k_kept) =
                        reference_warped(&logits, &history, eos, &sampling.talker);
                    let label = format!(
                        "top_k {top_k} top_p {top_p} {} seed {seed} draw {}",
                        case.name,
                        history.len()
                    );
                    assert!(
                        warped[drawn as usize].is_finite(),
                        "{label}: {drawn} is outside the reference's candidates"
                    );
                    assert_eq!(
                        drawn,
                        gumbel_max_draw(&warped, seed, history.len() as u32, 0),
                        "{label}"
                    );
                    draws += 1;
                    narrowed +=
                        (warped.iter().filter(|x| x.is_finite()).count() < top_k_kept) as usize;
                    let above = warped
                        .iter()
                        .filter(|&&x| x > warped[drawn as usize])
                        .count();
                    beyond_default_k += (above >= default_top_k) as usize;
                    if drawn == eos {
                        break;
                    }
                    history.push(drawn);
                    logits = backend.logits(slot).unwrap();
                }
                backend.release(slot);
            }
        }
        println!(
            "top_k {top_k} top_p {top_p}: {draws} codebook-0 draws, {narrowed} from a narrower \
             nucleus, {beyond_default_k} outside the default top {default_top_k}"
        );
        if top_k == 0 {
            assert!(
                beyond_default_k > 0,
                "with top_k 0 no draw fell outside the default top {default_top_k}: the test \
                 cannot tell top-k off from on"
            );
        }
        if top_p < 1.0 {
            assert!(
                narrowed * 2 >= draws,
                "top_p {top_p} narrowed only {narrowed} of {draws} candidate sets: the test checks \
                 little"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn top_p_this_small_samples_the_greedy_frames() {
    require_gpu_and_fixtures();
    let dir = fixture_root().join("tiny-custom-voice");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let mut backend = CudaBackend::new(&ckpt, options()).unwrap();
    for case in load_cases(&dir) {
        // a nucleus this small holds only the most likely token, in every group
        let mut tiny_p = sampled(&ckpt, 5);
        tiny_p.talker.top_p = 1e-6;
        tiny_p.subtalker.top_p = 1e-6;
        let slot = backend
            .start_with_rows(&case.prefill, &case.trailing, tiny_p, case.max_frames())
            .unwrap();
        let (frames, reason) = run_to_end(&mut backend, slot);
        backend.release(slot);
        assert_eq!(frames, case.codes, "{}", case.name);
        assert_eq!(reason, case.finished_by(), "{}", case.name);
    }
}

//! The CPU reference backend against the official qwen-tts 0.1.1 outputs in
//! `tests/fixtures/parity` (layout: the fixture contract, scripts/parity/README.md).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use voxkernel_core::backend::{
    FinishReason, Frame, FrameBackend, FrameEvent, SequenceSpec, SlotId,
};
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::config::ModelConfig;
use voxkernel_core::official_run::{OfficialRun, compare, rel_err};
use voxkernel_core::prompt::{
    CodecSource, PromptPlan, PromptRequest, TextIds, TextMode, Voice, build_plan,
};
use voxkernel_core::reference::{ReferenceBackend, ReferenceForcing, ReferenceModel};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};

const MAX_REL_ERR: f32 = 1e-4;

#[derive(Debug, Deserialize)]
struct CaseMeta {
    mode: String,
    language: String,
    speaker: Option<String>,
    text_mode: String,
    text_ids: Vec<u32>,
    instruct_ids: Option<Vec<u32>>,
    max_new_tokens: usize,
    prefill_len: usize,
    num_frames: usize,
    finished_by: String,
    logit_steps: usize,
}

struct Case {
    name: String,
    checkpoint_dir: PathBuf,
    meta: CaseMeta,
    tensors_path: PathBuf,
    tensors: SafetensorsFile,
}

impl Case {
    fn f32_rows(&self, name: &str) -> Vec<Vec<f32>> {
        let (data, shape) = self.tensors.f32(name).unwrap();
        let width = *shape.last().unwrap();
        data.chunks(width).map(<[f32]>::to_vec).collect()
    }

    fn codes(&self) -> Vec<Frame> {
        self.tensors.frames("codes").unwrap()
    }

    fn speaker_vector(&self) -> Option<Vec<f32>> {
        self.tensors
            .info("speaker_vector")
            .map(|_| self.tensors.f32("speaker_vector").unwrap().0)
    }

    fn plan(&self, config: &ModelConfig) -> PromptPlan {
        plan_for_case(config, &self.meta, self.speaker_vector())
    }
}

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity")
}

/// Every case of every fixture checkpoint (a case is a `cases/<name>.json` with its tensors).
fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut checkpoints: Vec<PathBuf> = std::fs::read_dir(fixtures_root())
        .expect("tests/fixtures/parity is missing")
        .map(|e| e.unwrap().path())
        .collect();
    checkpoints.sort();
    for dir in checkpoints {
        let mut jsons: Vec<PathBuf> = std::fs::read_dir(dir.join("cases"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        jsons.sort();
        for json in jsons {
            let meta: CaseMeta =
                serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
            cases.push(Case {
                name: format!(
                    "{}/{}",
                    dir.file_name().unwrap().to_string_lossy(),
                    json.file_stem().unwrap().to_string_lossy()
                ),
                checkpoint_dir: dir.clone(),
                meta,
                tensors: SafetensorsFile::open(&json.with_extension("safetensors")).unwrap(),
                tensors_path: json.with_extension("safetensors"),
            });
        }
    }
    assert!(
        cases.len() >= 4,
        "expected the fixture cases, found {}",
        cases.len()
    );
    cases
}

/// The case's plan, built by the real prompt builder from the official token ids.
fn plan_for_case(
    config: &ModelConfig,
    meta: &CaseMeta,
    speaker_vector: Option<Vec<f32>>,
) -> PromptPlan {
    let voice = match meta.mode.as_str() {
        "custom_voice" => Voice::Speaker(meta.speaker.clone().expect("custom_voice case speaker")),
        "base_xvector" => Voice::XVector(speaker_vector.expect("base_xvector case x-vector")),
        "voice_design" => Voice::Design,
        other => panic!("unknown case mode {other}"),
    };
    let request = PromptRequest {
        voice,
        language: meta.language.clone(),
        text_mode: text_mode(meta),
    };
    let ids = TextIds {
        target: meta.text_ids.clone(),
        target_role: None,
        instruct: meta.instruct_ids.clone(),
        reference: None,
    };
    build_plan(config, &request, &ids).unwrap()
}

fn text_mode(meta: &CaseMeta) -> TextMode {
    match meta.text_mode.as_str() {
        "whole" => TextMode::Whole,
        "streaming" => TextMode::Streaming,
        other => panic!("unknown text_mode {other}"),
    }
}

/// max|a - b| / max|b| over a whole tensor (rows must match in shape).
/// rel_err over every row of a matrix.
fn rows_rel_err(ours: &[Vec<f32>], official: &[Vec<f32>]) -> f32 {
    assert_eq!(ours.len(), official.len(), "row count");
    for (a, b) in ours.iter().zip(official) {
        assert_eq!(a.len(), b.len(), "row width");
    }
    rel_err(&ours.concat(), &official.concat())
}

fn greedy() -> SamplerParams {
    SamplerParams {
        do_sample: false,
        temperature: 1.0,
        top_k: 50,
        top_p: 1.0,
        repetition_penalty: 1.05,
    }
}

fn greedy_sampling() -> SamplingConfig {
    SamplingConfig {
        talker: greedy(),
        subtalker: SamplerParams {
            repetition_penalty: 1.0,
            ..greedy()
        },
        seed: 0,
    }
}

/// Drives one sequence to its end through the backend interface.
fn run_to_end(backend: &mut ReferenceBackend, spec: &SequenceSpec) -> (Vec<Frame>, FinishReason) {
    let slot = backend.start_one(spec).unwrap();
    let mut frames = Vec::new();
    loop {
        match backend.step(&[slot]).unwrap()[0] {
            FrameEvent::Frame(frame) => frames.push(frame),
            FrameEvent::Finished(reason) => {
                backend.release(slot);
                return (frames, reason);
            }
        }
        assert!(
            frames.len() <= spec.max_frames,
            "more frames than max_frames"
        );
    }
}

fn open(case: &Case) -> Checkpoint {
    Checkpoint::open(&case.checkpoint_dir).unwrap()
}

#[test]
fn prefill_and_trailing_embeddings_match_official() {
    for case in all_cases() {
        let checkpoint = open(&case);
        let model = ReferenceModel::new(&checkpoint).unwrap();
        let plan = case.plan(model.config());
        let prefill = model.prefill_embeds(&plan).unwrap();
        assert_eq!(
            prefill.len(),
            case.meta.prefill_len,
            "{}: prefill rows",
            case.name
        );
        let err = rows_rel_err(&prefill, &case.f32_rows("prefill_embeds"));
        assert!(err <= MAX_REL_ERR, "{}: prefill rel err {err:e}", case.name);
        let trailing = model.trailing_embeds(&plan).unwrap();
        let err = rows_rel_err(&trailing, &case.f32_rows("trailing_embeds"));
        assert!(
            err <= MAX_REL_ERR,
            "{}: trailing rel err {err:e}",
            case.name
        );
    }
}

#[test]
fn teacher_forced_codebook0_logits_match_official() {
    for case in all_cases() {
        let checkpoint = open(&case);
        let model = ReferenceModel::new(&checkpoint).unwrap();
        let plan = case.plan(model.config());
        let official = case.f32_rows("logits_c0");
        assert_eq!(official.len(), case.meta.logit_steps);
        let ours = model
            .teacher_forced_logits(&plan, &case.codes(), case.meta.logit_steps)
            .unwrap();
        for (step, (a, b)) in ours.iter().zip(&official).enumerate() {
            let err = rel_err(a, b);
            assert!(
                err <= MAX_REL_ERR,
                "{}: step {step} logits rel err {err:e}",
                case.name
            );
        }
    }
}

/// The comparison `megakernel_check` and `reference_check` make against full-size official
/// dumps, on the fixture cases (the same tensor layout): driven with the official rows and
/// codes, the reference's own greedy choices are all the official ones.
#[test]
fn teacher_forced_comparison_agrees_fully_with_official_fixtures() {
    for case in all_cases() {
        let checkpoint = open(&case);
        let model = ReferenceModel::new(&checkpoint).unwrap();
        let run = OfficialRun::open(&case.tensors_path).unwrap();
        let sampling = OfficialRun::sampling(checkpoint.generation.repetition_penalty);
        let eos = checkpoint.config.talker.codec_eos_token_id;
        let c = compare(&run, &mut ReferenceForcing::new(&model), sampling, eos).unwrap();
        assert_eq!(
            (c.frames, c.logit_steps),
            (case.meta.num_frames, case.meta.logit_steps),
            "{}",
            case.name
        );
        assert_eq!(c.agreement, 1.0, "{}: {c:?}", case.name);
        assert!(c.logits_rel_err_max <= MAX_REL_ERR, "{}: {c:?}", case.name);
    }
}

/// The sub-talker has no logit processors, so in the official greedy run codebook `j` of every
/// frame is the argmax of the predictor's raw logits for group `j`.
#[test]
fn teacher_forced_predictor_logits_argmax_to_official_greedy_codes() {
    for case in all_cases() {
        let checkpoint = open(&case);
        let model = ReferenceModel::new(&checkpoint).unwrap();
        let plan = case.plan(model.config());
        let codes = case.codes();
        for frame in [0, codes.len() - 1] {
            let logits = model
                .teacher_forced_predictor_logits(&plan, &codes, frame)
                .unwrap();
            assert_eq!(logits.len(), 15);
            for (j, row) in logits.iter().enumerate() {
                assert_eq!(row.len(), 2048);
                assert_eq!(
                    argmax(row),
                    codes[frame][j + 1],
                    "{}: frame {frame} group {}",
                    case.name,
                    j + 1
                );
            }
        }
    }
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn greedy_codes_match_official_in_every_case() {
    let mut text_modes = std::collections::BTreeSet::new();
    let mut finish_reasons = std::collections::BTreeSet::new();
    for case in all_cases() {
        let checkpoint = open(&case);
        let mut backend = ReferenceBackend::new(&checkpoint).unwrap();
        let spec = SequenceSpec {
            plan: case.plan(backend.model().config()),
            sampling: greedy_sampling(),
            max_frames: case.meta.max_new_tokens - 1,
        };
        let (frames, reason) = run_to_end(&mut backend, &spec);
        let official = case.codes();
        assert_eq!(official.len(), case.meta.num_frames);
        for (g, (ours, theirs)) in frames.iter().zip(&official).enumerate() {
            assert_eq!(ours, theirs, "{}: frame {g}", case.name);
        }
        assert_eq!(frames.len(), official.len(), "{}: frame count", case.name);
        let expected = match case.meta.finished_by.as_str() {
            "eos" => FinishReason::Eos,
            "max_new_tokens" => FinishReason::MaxFrames,
            other => panic!("unknown finished_by {other}"),
        };
        assert_eq!(reason, expected, "{}: finish reason", case.name);
        text_modes.insert(case.meta.text_mode.clone());
        finish_reasons.insert(case.meta.finished_by.clone());
    }
    assert_eq!(text_modes.len(), 2, "both text modes must be covered");
    assert_eq!(
        finish_reasons.len(),
        2,
        "both EOS and max_new_tokens must be covered"
    );
}

fn first_case() -> Case {
    all_cases()
        .into_iter()
        .find(|c| c.name == "tiny-custom-voice/ryan_english_whole")
        .expect("fixture tiny-custom-voice/ryan_english_whole")
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let case = first_case();
    let checkpoint = open(&case);
    let mut backend = ReferenceBackend::new(&checkpoint).unwrap();
    let plan = case.plan(backend.model().config());
    let spec = |seed| SequenceSpec {
        plan: plan.clone(),
        sampling: SamplingConfig::from_generation(&checkpoint.generation, seed),
        max_frames: 12,
    };
    let (a, _) = run_to_end(&mut backend, &spec(42));
    let (b, _) = run_to_end(&mut backend, &spec(42));
    let (c, _) = run_to_end(&mut backend, &spec(43));
    assert!(!a.is_empty());
    assert_eq!(a, b, "same seed, same frames");
    assert_ne!(a, c, "another seed should give other frames");
    assert!(
        a.iter()
            .all(|f| f[0] < 2048 && f[1..].iter().all(|&c| c < 2048)),
        "only audio codes may be emitted"
    );
}

#[test]
fn interleaved_slots_match_sequential_runs_and_max_frames_is_honoured() {
    let case = first_case();
    let checkpoint = open(&case);
    let mut backend = ReferenceBackend::new(&checkpoint).unwrap();
    let plan = case.plan(backend.model().config());
    let official = case.codes();
    let greedy_spec = SequenceSpec {
        plan: plan.clone(),
        sampling: greedy_sampling(),
        max_frames: 3,
    };
    let sampled_spec = SequenceSpec {
        plan,
        sampling: SamplingConfig::from_generation(&checkpoint.generation, 7),
        max_frames: 5,
    };
    let (sampled_alone, _) = run_to_end(&mut backend, &sampled_spec);

    let a = backend.start_one(&greedy_spec).unwrap();
    let b = backend.start_one(&sampled_spec).unwrap();
    let mut frames: [Vec<Frame>; 2] = [Vec::new(), Vec::new()];
    let mut finished: [Option<FinishReason>; 2] = [None, None];
    for _ in 0..7 {
        let events = backend.step(&[a, b]).unwrap();
        for (i, event) in events.into_iter().enumerate() {
            match event {
                FrameEvent::Frame(f) => {
                    assert!(finished[i].is_none(), "a frame after Finished");
                    frames[i].push(f);
                }
                FrameEvent::Finished(r) => finished[i] = Some(r),
            }
        }
    }
    assert_eq!(frames[0], official[..3], "greedy slot: the official prefix");
    assert_eq!(finished[0], Some(FinishReason::MaxFrames));
    assert_eq!(frames[1], sampled_alone, "sampled slot: same as alone");
    assert_eq!(finished[1], Some(FinishReason::MaxFrames));

    backend.release(a);
    let err = backend.step(&[a]).unwrap_err();
    assert!(err.to_string().contains(&format!("slot {}", a.0)), "{err}");
    assert!(backend.step(&[SlotId(99)]).is_err());
}

#[test]
fn zero_max_frames_finishes_without_a_frame() {
    let case = first_case();
    let checkpoint = open(&case);
    let mut backend = ReferenceBackend::new(&checkpoint).unwrap();
    let spec = SequenceSpec {
        plan: case.plan(backend.model().config()),
        sampling: greedy_sampling(),
        max_frames: 0,
    };
    let (frames, reason) = run_to_end(&mut backend, &spec);
    assert!(frames.is_empty());
    assert_eq!(reason, FinishReason::MaxFrames);
}

#[test]
fn bad_requests_are_rejected_with_the_field_named() {
    let case = first_case();
    let checkpoint = open(&case);
    let mut backend = ReferenceBackend::new(&checkpoint).unwrap();
    let mut plan = case.plan(backend.model().config());
    let mut sampling = greedy_sampling();
    sampling.talker.do_sample = true;
    sampling.talker.temperature = 0.0;
    let spec = SequenceSpec {
        plan: plan.clone(),
        sampling,
        max_frames: 4,
    };
    let err = backend.start_one(&spec).unwrap_err();
    assert!(err.to_string().contains("talker.temperature"), "{err}");

    plan.prefill[5].codec = CodecSource::SpeakerVector;
    let spec = SequenceSpec {
        plan,
        sampling: greedy_sampling(),
        max_frames: 4,
    };
    let err = backend.start_one(&spec).unwrap_err();
    assert!(err.to_string().contains("speaker_vector"), "{err}");
}

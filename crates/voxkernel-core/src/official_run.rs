//! An official qwen-tts run dumped by `scripts/gpu/official_dump.py`, and the teacher-forced
//! comparison of any backend against it: fed the official prompt rows and codes frame by
//! frame, how close are its codebook-0 logits, and how often are its own greedy choices the
//! official ones?

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

use crate::backend::{Frame, NUM_CODE_GROUPS};
use crate::checkpoint::SafetensorsFile;
use crate::sampling::{SamplerParams, SamplingConfig};

/// The dump: talker prefill rows and trailing text rows (tts_pad last), both `[rows * hidden]`,
/// the raw codebook-0 logits of the prefill and of the first decode steps (all of them in a
/// dump; the parity fixtures, which share the layout, keep a few), and the greedy codes.
pub struct OfficialRun {
    pub prefill: Vec<f32>,
    pub trailing: Vec<f32>,
    pub logits: Vec<Vec<f32>>,
    pub codes: Vec<Frame>,
}

impl OfficialRun {
    pub fn open(path: &Path) -> Result<Self> {
        let dump = SafetensorsFile::open(path)?;
        let (logits, shape) = dump.f32("logits_c0")?;
        ensure!(
            shape.len() == 2,
            "logits_c0 has shape {shape:?}, want [steps, vocab]"
        );
        Ok(Self {
            prefill: dump.f32("prefill_embeds")?.0,
            trailing: dump.f32("trailing_embeds")?.0,
            logits: logits.chunks(shape[1]).map(<[f32]>::to_vec).collect(),
            codes: dump.frames("codes")?,
        })
    }

    /// Greedy sampling as the dump was made: the talker keeps its repetition penalty.
    pub fn sampling(talker_repetition_penalty: f32) -> SamplingConfig {
        let greedy = |penalty| SamplerParams {
            do_sample: false,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: penalty,
        };
        SamplingConfig {
            talker: greedy(talker_repetition_penalty),
            subtalker: greedy(1.0),
            seed: 0,
        }
    }
}

/// What one teacher-forced frame produced.
#[derive(Debug, Clone)]
pub struct ForcedStep {
    /// Raw codebook-0 logits of the talker step (before any logit processor).
    pub logits: Vec<f32>,
    /// The backend's own choices for groups 1..15 of the forced frame (index 0 repeats the
    /// forced codebook 0).
    pub own_frame: Frame,
    /// The backend's own choice for the next codebook 0.
    pub own_next_c0: u32,
}

/// A backend driven with given rows and codes instead of its own.
pub trait TeacherForced {
    /// Prefills `prefill` (whole talker rows) with `trailing` as the text track; returns the
    /// raw codebook-0 logits of the prefill.
    fn start(
        &mut self,
        prefill: &[f32],
        trailing: &[f32],
        sampling: SamplingConfig,
        max_frames: usize,
    ) -> Result<Vec<f32>>;
    /// Runs the pending frame as `frame` (its codebook 0 is the pending one) and continues
    /// with `next_c0`.
    fn step(&mut self, frame: &Frame, next_c0: u32) -> Result<ForcedStep>;
}

/// The comparison's figures.
#[derive(Debug, Clone, Copy)]
pub struct Comparison {
    pub frames: usize,
    pub logit_steps: usize,
    /// Per step with official logits, max |ours - official| / max |official|: the largest and
    /// the mean over those steps.
    pub logits_rel_err_max: f32,
    pub logits_rel_err_mean: f32,
    /// Share of the backend's own greedy choices (groups 1..15 of every frame and the next
    /// codebook 0) equal to the official codes.
    pub agreement: f64,
}

/// max |got - want| / max |want|. Panics when the lengths differ (`compare` checks them first).
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "rel_err: lengths differ");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// Drives `backend` through `run` teacher-forced; `eos` ends the last frame.
pub fn compare(
    run: &OfficialRun,
    backend: &mut impl TeacherForced,
    sampling: SamplingConfig,
    eos: u32,
) -> Result<Comparison> {
    if run.logits.is_empty() || run.codes.is_empty() {
        bail!("the dump has no logit rows or no frames");
    }
    let first = backend.start(&run.prefill, &run.trailing, sampling, run.codes.len())?;
    ensure!(
        first.len() == run.logits[0].len(),
        "prefill: the backend gave {} codebook-0 logits, the dump has {}",
        first.len(),
        run.logits[0].len()
    );
    let mut errs = vec![rel_err(&first, &run.logits[0])];
    let (mut agree, mut total) = (0usize, 0usize);
    for (k, frame) in run.codes.iter().enumerate() {
        let next = run.codes.get(k + 1).map_or(eos, |f| f[0]);
        let step = backend.step(frame, next)?;
        if let Some(want) = run.logits.get(k + 1) {
            ensure!(
                step.logits.len() == want.len(),
                "frame {k}: the backend gave {} codebook-0 logits, the dump has {}",
                step.logits.len(),
                want.len()
            );
            errs.push(rel_err(&step.logits, want));
        }
        agree += step.own_frame[1..]
            .iter()
            .zip(&frame[1..])
            .filter(|(a, b)| a == b)
            .count();
        total += NUM_CODE_GROUPS - 1;
        if k + 1 < run.codes.len() {
            agree += usize::from(step.own_next_c0 == next);
            total += 1;
        }
    }
    Ok(Comparison {
        frames: run.codes.len(),
        logit_steps: errs.len(),
        logits_rel_err_max: errs.iter().copied().fold(0f32, f32::max),
        logits_rel_err_mean: errs.iter().sum::<f32>() / errs.len() as f32,
        agreement: agree as f64 / total as f64,
    })
}

/// The command line of the comparison tools: `--model DIR --official FILE` (checkpoint, dump).
pub fn check_args(mut args: impl Iterator<Item = String>) -> Result<(PathBuf, PathBuf)> {
    let (mut model, mut official) = (None, None);
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--official" => official = Some(PathBuf::from(value)),
            other => bail!("unknown flag {other}; valid: --model, --official"),
        }
    }
    Ok((
        model.context("--model DIR is required")?,
        official.context("--official FILE is required")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays a run, optionally with one own choice changed and the logits scaled.
    struct Replay<'a> {
        run: &'a OfficialRun,
        frame: usize,
        wrong_group: Option<(usize, usize)>,
        logit_scale: f32,
    }

    impl TeacherForced for Replay<'_> {
        fn start(&mut self, _: &[f32], _: &[f32], _: SamplingConfig, _: usize) -> Result<Vec<f32>> {
            Ok(self.run.logits[0].clone())
        }

        fn step(&mut self, frame: &Frame, next_c0: u32) -> Result<ForcedStep> {
            let k = self.frame;
            self.frame += 1;
            let mut own_frame = *frame;
            if let Some((wrong_frame, group)) = self.wrong_group
                && wrong_frame == k
            {
                own_frame[group] += 1;
            }
            let logits = self.run.logits.get(k + 1).map_or_else(Vec::new, |l| {
                l.iter().map(|v| v * self.logit_scale).collect()
            });
            Ok(ForcedStep {
                logits,
                own_frame,
                own_next_c0: next_c0,
            })
        }
    }

    fn run() -> OfficialRun {
        let codes: Vec<Frame> = (0..3u32).map(|k| [k + 10; NUM_CODE_GROUPS]).collect();
        OfficialRun {
            prefill: vec![0.0; 4],
            trailing: vec![0.0; 4],
            logits: vec![vec![1.0, -2.0], vec![0.5, 4.0], vec![-1.0, 1.0]],
            codes,
        }
    }

    #[test]
    fn counts_every_own_choice_and_compares_the_logits_present() {
        let run = run();
        let sampling = OfficialRun::sampling(1.05);
        let mut exact = Replay {
            run: &run,
            frame: 0,
            wrong_group: None,
            logit_scale: 1.0,
        };
        let c = compare(&run, &mut exact, sampling, 99).unwrap();
        assert_eq!((c.frames, c.logit_steps), (3, 3));
        assert_eq!((c.agreement, c.logits_rel_err_max), (1.0, 0.0));

        // 3 frames x 15 groups + 2 next codebook-0 choices (the last frame's has no official one)
        let mut off = Replay {
            run: &run,
            frame: 0,
            wrong_group: Some((1, 7)),
            logit_scale: 1.01,
        };
        let c = compare(&run, &mut off, sampling, 99).unwrap();
        assert_eq!(c.agreement, 46.0 / 47.0);
        assert!((c.logits_rel_err_max - 0.01).abs() < 1e-6, "{c:?}");
        assert!((c.logits_rel_err_mean - 0.02 / 3.0).abs() < 1e-6, "{c:?}");
    }

    #[test]
    fn check_args_name_what_is_missing_or_unknown() {
        let args = |a: &[&str]| check_args(a.iter().map(|s| s.to_string()));
        let (m, o) = args(&["--official", "run.st", "--model", "ckpt"]).unwrap();
        assert_eq!((m, o), (PathBuf::from("ckpt"), PathBuf::from("run.st")));
        let err = args(&["--model", "ckpt"]).unwrap_err().to_string();
        assert!(err.contains("--official"), "{err}");
        let err = args(&["--modle", "x"]).unwrap_err().to_string();
        assert!(
            err.contains("--modle") && err.contains("valid: --model, --official"),
            "{err}"
        );
    }
}

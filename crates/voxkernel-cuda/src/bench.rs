//! The frame-kernel benchmark behind `voxkernel bench --model DIR`: per-frame latency of the
//! CUDA backend against the bandwidth floor (the weight bytes one frame streams over the
//! device-to-device copy bandwidth measured in the same process), the prefill time of a prompt,
//! and on request where a frame's time goes, phase by phase.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUdevice_attribute;
use serde_json::json;
use voxkernel_core::backend::{FrameBackend, FrameEvent, SequenceSpec};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::prompt::{PromptPlan, PromptRequest, TextIds, TextMode, Voice, build_plan};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};

use crate::backend::PhaseMark;
use crate::layout::{PHASE_NAMES, PHASE_TALKER, PHASE_WAIT};
use crate::{CudaBackend, CudaOptions};

/// Device-to-device copy bandwidth in GB/s over `bytes`-sized buffers, counting bytes read and
/// written (the convention of the ~3.0 TB/s H100 figure the floor in megakernel-notes.md uses).
pub fn device_copy_gbs(ctx: &Arc<CudaContext>, bytes: usize) -> Result<f64> {
    let stream = ctx.default_stream();
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    stream.synchronize()?;
    let reps = 10;
    let started = Instant::now();
    for _ in 0..reps {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((2 * reps * bytes) as f64 / seconds / 1e9)
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct FrameBench {
    /// Frames timed after the warm-up (use a checkpoint whose codec head cannot emit EOS, such
    /// as make_ckpt.py --no-eos, so every frame runs).
    pub frames: usize,
    pub warmup: usize,
    /// Size of the buffers the copy bandwidth is measured with.
    pub copy_mib: usize,
    pub options: CudaOptions,
    /// Frames recorded phase by phase after the timed ones (0 = no profile).
    pub profile_frames: usize,
}

impl Default for FrameBench {
    fn default() -> Self {
        Self {
            frames: 300,
            warmup: 20,
            copy_mib: 2048,
            options: CudaOptions::default(),
            profile_frames: 0,
        }
    }
}

/// Time of one kind of phase, summed over a frame.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseTime {
    /// "predictor" or "talker".
    pub stack: &'static str,
    /// A `layout::PHASE_NAMES` entry.
    pub phase: &'static str,
    /// The part of that phase spent waiting for its inputs (`<phase>.wait` in the JSON); the
    /// rest is the entry without it.
    pub wait: bool,
    /// Phases of this kind per frame.
    pub count: f64,
    /// Their time per frame, microseconds.
    pub us: f64,
}

/// Where a frame's time goes, from block 0's marks: each phase runs from the end of the one
/// before it to the end of its own barrier (so it includes the wait for the slowest block).
#[derive(Debug, Clone, PartialEq)]
pub struct FrameProfile {
    pub frames: usize,
    /// SM clock the cycle counts are converted with (the device's rated clock).
    pub sm_clock_mhz: f64,
    /// First mark to last, per frame.
    pub kernel_us: f64,
    pub phases: Vec<PhaseTime>,
}

impl FrameProfile {
    /// Sums the marks of `frames` launches (each starting with its start mark).
    pub fn from_marks(launches: &[Vec<PhaseMark>], sm_clock_mhz: f64) -> Self {
        let mut phases: Vec<PhaseTime> = Vec::new();
        let mut kernel_cycles = 0u64;
        for marks in launches {
            // each mark's phase: a wait mark takes the phase of the next mark that ends one
            let mut owner = vec![0u64; marks.len()];
            let mut next_end = 0u64;
            for (i, m) in marks.iter().enumerate().rev() {
                if m.phase & PHASE_WAIT == 0 {
                    next_end = m.phase;
                }
                owner[i] = next_end | (m.phase & PHASE_WAIT);
            }
            for (i, pair) in marks.windows(2).enumerate() {
                let cycles = pair[1].clock.saturating_sub(pair[0].clock);
                kernel_cycles += cycles;
                let tag = owner[i + 1];
                let stack = if tag & PHASE_TALKER != 0 {
                    "talker"
                } else {
                    "predictor"
                };
                let wait = tag & PHASE_WAIT != 0;
                let phase = PHASE_NAMES
                    .get((tag & !(PHASE_TALKER | PHASE_WAIT)) as usize)
                    .copied()
                    .unwrap_or("unknown");
                let us = cycles as f64 / sm_clock_mhz;
                match phases
                    .iter_mut()
                    .find(|p| p.stack == stack && p.phase == phase && p.wait == wait)
                {
                    Some(p) => {
                        p.count += 1.0;
                        p.us += us;
                    }
                    None => phases.push(PhaseTime {
                        stack,
                        phase,
                        wait,
                        count: 1.0,
                        us,
                    }),
                }
            }
        }
        let n = launches.len().max(1) as f64;
        for p in &mut phases {
            p.count /= n;
            p.us /= n;
        }
        Self {
            frames: launches.len(),
            sm_clock_mhz,
            kernel_us: kernel_cycles as f64 / sm_clock_mhz / n,
            phases,
        }
    }

    /// The profile as one JSON line.
    pub fn json(&self) -> serde_json::Value {
        let phases: Vec<serde_json::Value> = self
            .phases
            .iter()
            .map(|p| {
                json!({
                    "stack": p.stack,
                    "phase": if p.wait { format!("{}.wait", p.phase) } else { p.phase.to_string() },
                    "per_frame": p.count,
                    "us_per_frame": round(p.us, 2),
                    "mean_us": round(p.us / p.count.max(1e-9), 3),
                })
            })
            .collect();
        json!({
            "bench": "frame_profile",
            "frames": self.frames,
            "sm_clock_mhz": self.sm_clock_mhz,
            "kernel_us": round(self.kernel_us, 1),
            "phases": phases,
        })
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (v * scale).round() / scale
}

#[derive(Debug, Clone)]
pub struct FrameBenchReport {
    pub gpu: String,
    pub frames: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub weight_bytes_per_frame: u64,
    pub achieved_gbs: f64,
    pub copy_gbs: f64,
    pub floor_ms: f64,
    pub ratio_to_floor: f64,
    pub attention_chunk: usize,
    pub prefill_rows: usize,
    pub prefill_ms: f64,
    pub profile: Option<FrameProfile>,
}

impl FrameBenchReport {
    /// The benchmark as one JSON line.
    pub fn json(&self) -> serde_json::Value {
        json!({
            "bench": "frame",
            "gpu": self.gpu,
            "frames": self.frames,
            "ms_per_frame_p50": round(self.p50_ms, 4),
            "ms_per_frame_p99": round(self.p99_ms, 4),
            "weight_bytes_per_frame": self.weight_bytes_per_frame,
            "achieved_gbs": round(self.achieved_gbs, 1),
            "copy_gbs": round(self.copy_gbs, 1),
            "floor_ms": round(self.floor_ms, 4),
            "ratio_to_floor": round(self.ratio_to_floor, 3),
            "attention_chunk": self.attention_chunk,
            "prefill_rows": self.prefill_rows,
            "prefill_ms": round(self.prefill_ms, 3),
        })
    }
}

/// A prompt of about 40 rows built by the real prompt builder: the first preset speaker of a
/// CustomVoice checkpoint, else a designed voice with a one-token instruct.
fn plan(ckpt: &Checkpoint) -> Result<PromptPlan> {
    let cfg = &ckpt.config;
    let voice = match cfg.talker.spk_id.keys().min() {
        Some(name) => Voice::Speaker(name.clone()),
        None => Voice::Design,
    };
    // "Hello world, this is a test." in the Qwen2 vocabulary, three times.
    let sentence = [9707, 1879, 11, 419, 374, 264, 1273, 13];
    let ids = TextIds {
        target: sentence.repeat(3),
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

/// Runs the benchmark on the checkpoint in `model`: the checkpoint's sampling settings with
/// top_p off, one sequence.
pub fn run_frame_bench(model: &Path, cfg: &FrameBench) -> Result<FrameBenchReport> {
    if cfg.frames == 0 {
        bail!("--frames must be at least 1");
    }
    let ckpt = Checkpoint::open(model)?;
    let plan = plan(&ckpt)?;
    let total = cfg.frames + cfg.warmup;
    let options = CudaOptions {
        max_slots: 1,
        max_len: plan.prefill.len() + total + cfg.profile_frames + 8,
        ..cfg.options
    };
    let mut backend = CudaBackend::new(&ckpt, options)?;
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
    let prefill_rows = plan.prefill.len();
    let spec = SequenceSpec {
        plan,
        sampling,
        max_frames: total + cfg.profile_frames,
    };
    // The first start pays for module loading and first-touch costs; time the second.
    let warm = backend.start_one(&spec)?;
    backend.release(warm);
    let started = Instant::now();
    let slot = backend.start_one(&spec)?;
    let prefill_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut times_ms = Vec::with_capacity(cfg.frames);
    for i in 0..total {
        let started = Instant::now();
        let event = backend.step(&[slot])?[0];
        let ms = started.elapsed().as_secs_f64() * 1e3;
        if let FrameEvent::Finished(reason) = event {
            bail!("the sequence finished ({reason:?}) after {i} frames; use a --no-eos checkpoint");
        }
        if i >= cfg.warmup {
            times_ms.push(ms);
        }
    }
    let profile = if cfg.profile_frames > 0 {
        backend.set_profile(true);
        let mut launches = Vec::with_capacity(cfg.profile_frames);
        for _ in 0..cfg.profile_frames {
            backend.step(&[slot])?;
            launches.push(backend.phase_marks()?);
        }
        backend.set_profile(false);
        let khz = backend
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
        Some(FrameProfile::from_marks(&launches, f64::from(khz) / 1e3))
    } else {
        None
    };
    backend.release(slot);
    times_ms.sort_by(|a, b| a.total_cmp(b));
    let copy_gbs = device_copy_gbs(backend.context(), cfg.copy_mib << 20)?;
    let bytes = backend.geometry().weight_bytes_per_frame();
    let p50 = percentile(&times_ms, 0.5);
    let floor_ms = bytes as f64 / (copy_gbs * 1e9) * 1e3;
    Ok(FrameBenchReport {
        gpu: backend.device_name().to_string(),
        frames: times_ms.len(),
        p50_ms: p50,
        p99_ms: percentile(&times_ms, 0.99),
        weight_bytes_per_frame: bytes,
        achieved_gbs: bytes as f64 / (p50 * 1e-3) / 1e9,
        copy_gbs,
        floor_ms,
        ratio_to_floor: p50 / floor_ms,
        attention_chunk: backend.options().attention_chunk,
        prefill_rows,
        prefill_ms,
        profile,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(phase: u64, clock: u64) -> PhaseMark {
        PhaseMark { phase, clock }
    }

    /// The microseconds of a stack's phase in a profile; "name.wait" names its wait.
    fn us(p: &FrameProfile, stack: &str, phase: &str) -> Option<f64> {
        let (phase, wait) = match phase.strip_suffix(".wait") {
            Some(name) => (name, true),
            None => (phase, false),
        };
        p.phases
            .iter()
            .find(|t| t.stack == stack && t.phase == phase && t.wait == wait)
            .map(|t| t.us)
    }

    #[test]
    fn profile_attributes_each_interval_to_the_phase_that_ends_it() {
        // two launches at 1000 MHz: start, predictor qkv, predictor sample, talker head
        let launches = vec![
            vec![
                mark(0, 1000),
                mark(2, 3000),
                mark(8, 4000),
                mark(16 | 7, 10000),
            ],
            vec![
                mark(0, 500),
                mark(2, 4000),
                mark(8, 5000),
                mark(16 | 7, 9000),
            ],
        ];
        let p = FrameProfile::from_marks(&launches, 1000.0);
        assert_eq!(p.frames, 2);
        assert_eq!(p.kernel_us, 8.75);
        let get = |stack: &str, phase: &str| {
            p.phases
                .iter()
                .find(|t| t.stack == stack && t.phase == phase)
                .cloned()
                .unwrap()
        };
        assert_eq!(
            (get("predictor", "qkv").count, get("predictor", "qkv").us),
            (1.0, 2.75)
        );
        assert_eq!(get("predictor", "sample").us, 1.0);
        assert_eq!(get("talker", "head").us, 5.0);
        assert_eq!(p.phases.len(), 3);
    }

    #[test]
    fn a_predictor_sampling_splits_into_its_steps() {
        // start, the logits' arrival, the select, the draw, the argmax, the sample phase's end
        let launches = vec![vec![
            mark(0, 0),
            mark(32, 1000),
            mark(9, 3000),
            mark(10, 4000),
            mark(11, 4500),
            mark(8, 5500),
        ]];
        let p = FrameProfile::from_marks(&launches, 1000.0);
        assert_eq!(us(&p, "predictor", "select.wait"), Some(1.0));
        assert_eq!(us(&p, "predictor", "select"), Some(2.0));
        assert_eq!(us(&p, "predictor", "draw"), Some(1.0));
        assert_eq!(us(&p, "predictor", "argmax"), Some(0.5));
        assert_eq!(us(&p, "predictor", "sample"), Some(1.0));
        assert_eq!(us(&p, "predictor", "sample.wait"), None);
    }

    #[test]
    fn a_wait_mark_splits_off_the_wait_of_the_phase_that_ends_next() {
        // start, inputs of the predictor's qkv, its end, inputs of the talker's head, its end
        let launches = vec![vec![
            mark(0, 0),
            mark(32, 1000),
            mark(2, 1500),
            mark(32, 4000),
            mark(16 | 7, 4250),
        ]];
        let p = FrameProfile::from_marks(&launches, 1000.0);
        assert_eq!(us(&p, "predictor", "qkv.wait"), Some(1.0));
        assert_eq!(us(&p, "predictor", "qkv"), Some(0.5));
        assert_eq!(us(&p, "talker", "head.wait"), Some(2.5));
        assert_eq!(us(&p, "talker", "head"), Some(0.25));
        assert_eq!(p.kernel_us, 4.25);
        assert_eq!(p.phases.len(), 4);
    }
}

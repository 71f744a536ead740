//! `voxkernel bench`: benchmarks printed as JSON lines.
//! - Without `--e2e`, the CUDA frame kernel alone (`voxkernel_cuda::bench`): ms per frame p50/p99,
//!   the weight bytes a frame streams, achieved GB/s, the device copy bandwidth measured in the
//!   same run and the ratio to that floor, the GPU's name; with `--profile`, where a frame's time
//!   goes phase by phase.
//! - `--e2e`: whole sessions through the engine, as a server runs them: time to first audio,
//!   real-time factor, and where each frame's time goes, per concurrency level; with `--joins`,
//!   also the time to first audio of sessions that join while the level's sessions stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;
use voxkernel_core::engine::{
    ChunkSchedule, Engine, EngineOptions, EngineStats, Model, SessionEvent, SessionRequest, Usage,
};
use voxkernel_core::prompt::Voice;
use voxkernel_core::sampling::SamplingConfig;

use voxkernel_cuda::CudaOptions;
use voxkernel_cuda::bench::{FrameBench, run_frame_bench};

use crate::backends::{self, BackendChoice, CodecPrecision};

/// The sentence `run_peers.sh` gives the other systems, so the numbers compare.
const PEER_TEXT: &str =
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.";

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint directory or hub id.
    #[arg(long)]
    model: String,
    /// Benchmark whole sessions through the engine (time to first audio, RTF).
    #[arg(long)]
    e2e: bool,
    /// Sessions running at once, one JSON line each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// With --e2e, frames per session (80 ms each; default 100); else frames timed after the
    /// warm-up (default 300). The checkpoint should not stop early (make_ckpt --no-eos).
    #[arg(long)]
    frames: Option<usize>,
    /// Waves of `concurrency` sessions per level; percentiles are over all their sessions.
    #[arg(long, default_value_t = 3)]
    waves: usize,
    /// With --e2e, also open this many sessions one at a time while `concurrency` sessions
    /// stream, at staggered moments, and report their time to first audio (a session joining
    /// a busy engine).
    #[arg(long, default_value_t = 0)]
    joins: usize,
    #[arg(long, default_value = PEER_TEXT)]
    text: String,
    /// Preset speaker (CustomVoice); the first of the checkpoint's by default.
    #[arg(long)]
    speaker: Option<String>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendChoice,
    /// The CUDA codec's arithmetic for the decoder's big convolutions: f32, or tf32 (tensor
    /// cores; faster, with the error docs/codec.md states).
    #[arg(long, value_enum, default_value = "f32")]
    codec_precision: CodecPrecision,
    /// With --e2e, frames per audio packet: the first packet after the first count, the next
    /// after the second, and so on, the last count repeating (the engine's default, 1,2,4,8,
    /// when absent).
    #[arg(long, value_delimiter = ',')]
    schedule: Option<Vec<usize>>,
    /// With --e2e, packets of the schedule's counts even when a listener would run out of audio
    /// waiting for them (`serve --fixed-packets`).
    #[arg(long)]
    fixed_packets: bool,
    /// Frame-kernel mode: untimed frames first.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Frame-kernel mode: positions per attention block (0 = a whole sequence per kv head); the
    /// backend's default when absent.
    #[arg(long)]
    attention_chunk: Option<usize>,
    /// Frame-kernel mode: also record this many frames phase by phase and print where their
    /// time goes.
    #[arg(long, default_value_t = 0)]
    profile: usize,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.e2e {
        run_e2e(args)
    } else {
        run_frame_kernel(&args)
    }
}

fn run_frame_kernel(args: &BenchArgs) -> Result<()> {
    let dir = voxkernel_core::hub::resolve_model(&args.model)?;
    let defaults = CudaOptions::default();
    let config = FrameBench {
        frames: args.frames.unwrap_or(300),
        warmup: args.warmup,
        options: CudaOptions {
            attention_chunk: args.attention_chunk.unwrap_or(defaults.attention_chunk),
            ..defaults
        },
        profile_frames: args.profile,
        ..FrameBench::default()
    };
    let report = run_frame_bench(&dir, &config)?;
    println!("{}", report.json());
    if let Some(profile) = &report.profile {
        println!("{}", profile.json());
    }
    Ok(())
}

fn run_e2e(args: BenchArgs) -> Result<()> {
    let session_frames = args.frames.unwrap_or(100);
    let max_concurrency = args.concurrency.iter().copied().max().unwrap_or(0);
    if max_concurrency == 0 || session_frames == 0 || args.waves == 0 {
        bail!("--concurrency, --frames and --waves must be at least 1");
    }
    let dir = voxkernel_core::hub::resolve_model(&args.model)?;
    let model = Arc::new(Model::load(&dir)?);
    let speaker = match &args.speaker {
        Some(s) => s.clone(),
        None => model
            .checkpoint
            .config
            .talker
            .spk_id
            .keys()
            .min()
            .cloned()
            .context("the e2e benchmark needs a CustomVoice checkpoint (preset speakers)")?,
    };
    // Sessions streaming while others join run up to the runaway guard, so that they outlast
    // the joins.
    let frames_cap = if args.joins > 0 {
        session_frames.max(BACKGROUND_FRAMES)
    } else {
        session_frames
    };
    let slots = max_concurrency + usize::from(args.joins > 0);
    // Room for the prompt (instruct-free CustomVoice: ~10 rows + the text) and the frames.
    let max_len = args.text.len() + frames_cap + 64;
    let frames = backends::frame_backend(args.backend, &model, slots, max_len)?;
    let codec = backends::codec_backend(args.backend, &model, slots, args.codec_precision)?;
    let mut options = EngineOptions {
        max_active: slots,
        max_frames_cap: frames_cap,
        pacing: !args.fixed_packets,
        ..EngineOptions::default()
    };
    if let Some(frames) = &args.schedule {
        options.schedule = ChunkSchedule::new(frames.clone()).context("--schedule")?;
    }
    let engine = Engine::start(Arc::clone(&model), frames, codec, options)?;
    let (frame_backend, codec_backend) = engine.backend_names();
    let (frame_backend, codec_backend) = (frame_backend.to_string(), codec_backend.to_string());
    let request = |seed: u64| SessionRequest {
        voice: Voice::Speaker(speaker.clone()),
        language: "english".into(),
        instruct: None,
        text_mode: None,
        sampling: SamplingConfig::from_generation(&model.checkpoint.generation, seed),
        text: args.text.clone(),
        text_complete: true,
        max_frames: Some(session_frames),
        schedule: None,
    };
    let background = |seed: u64| SessionRequest {
        max_frames: Some(frames_cap),
        ..request(seed)
    };
    // Warm-up: kernel compilation or cache load, first-touch allocations.
    run_wave(&engine, &[request(0)])?;

    for &n in &args.concurrency {
        let before = engine.stats();
        let started = Instant::now();
        let mut sessions = Vec::new();
        for wave in 0..args.waves {
            let requests: Vec<SessionRequest> =
                (0..n).map(|i| request(1 + (wave * n + i) as u64)).collect();
            sessions.extend(run_wave(&engine, &requests)?);
        }
        let wall = started.elapsed();
        let stats = engine.stats();
        println!(
            "{}",
            report(
                n,
                &args,
                &sessions,
                wall,
                &before,
                &stats,
                &frame_backend,
                &codec_backend
            )
        );
        if args.joins > 0 {
            let joins = run_joins(&engine, n, args.joins, &background, &request)?;
            println!("{}", joins.json(n, &frame_backend));
        }
    }
    Ok(())
}

/// Frames of the sessions that stream while others join: far longer than the joins take, and
/// below the runaway guard's limit for the benchmark's sentence (50 + 20 per text token).
/// `streaming_min` in the report shows whether any ended early all the same.
const BACKGROUND_FRAMES: usize = 400;

/// What the sessions that joined a busy engine saw.
struct Joins {
    /// Each joining session's time to first audio, ms.
    ttfa_ms: Vec<f64>,
    /// The fewest sessions that were streaming when one joined.
    streaming_min: usize,
}

impl Joins {
    fn json(mut self, concurrency: usize, frame_backend: &str) -> serde_json::Value {
        self.ttfa_ms.sort_by(f64::total_cmp);
        json!({
            "bench": "e2e_join",
            "concurrency": concurrency,
            "joins": self.ttfa_ms.len(),
            "streaming_min": self.streaming_min,
            "time_to_first_audio_ms": {
                "p50": percentile(&self.ttfa_ms, 0.5),
                "p95": percentile(&self.ttfa_ms, 0.95),
                "max": self.ttfa_ms.last().copied(),
            },
            "frame_backend": frame_backend,
        })
    }
}

/// Starts `concurrency` long sessions; once each has sent audio, opens `joins` sessions one at
/// a time, a pseudo-random 0-50 ms apart (so that they arrive at every point of the engine's
/// rounds), each cancelled after its first packet. The long sessions are cancelled at the end.
fn run_joins(
    engine: &Engine,
    concurrency: usize,
    joins: usize,
    background: &dyn Fn(u64) -> SessionRequest,
    joining: &dyn Fn(u64) -> SessionRequest,
) -> Result<Joins> {
    let sessions = (0..concurrency)
        .map(|i| engine.open(background(10_000 + i as u64)))
        .collect::<Result<Vec<_>, _>>()?;
    let handles: Vec<_> = sessions.iter().map(|s| s.handle.clone()).collect();
    let (first_audio, first_audios) = std::sync::mpsc::channel();
    let ended = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for mut session in sessions {
            let first_audio = first_audio.clone();
            let ended = &ended;
            scope.spawn(move || {
                let mut heard = false;
                while let Some(event) = session.events.blocking_recv() {
                    match event {
                        SessionEvent::Audio(_) if !heard => {
                            heard = true;
                            let _ = first_audio.send(());
                        }
                        SessionEvent::Audio(_) => {}
                        SessionEvent::Done(_) | SessionEvent::Error(_) => break,
                    }
                }
                ended.fetch_add(1, Ordering::SeqCst);
            });
        }
        let result = (|| {
            for _ in 0..concurrency {
                first_audios
                    .recv_timeout(Duration::from_secs(60))
                    .context("a streaming session sent no audio within 60 s")?;
            }
            let mut joins_seen = Joins {
                ttfa_ms: Vec::with_capacity(joins),
                streaming_min: concurrency,
            };
            let mut state = 0x9e37_79b9_u32;
            for j in 0..joins {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                std::thread::sleep(Duration::from_micros(u64::from(state >> 8) % 50_000));
                let streaming = concurrency - ended.load(Ordering::SeqCst);
                joins_seen.streaming_min = joins_seen.streaming_min.min(streaming);
                let mut session = engine.open(joining(20_000 + j as u64))?;
                let usage = loop {
                    match session.events.blocking_recv() {
                        Some(SessionEvent::Audio(_)) => session.handle.cancel(),
                        Some(SessionEvent::Done(usage)) => break usage,
                        Some(SessionEvent::Error(e)) => bail!("a joining session failed: {e}"),
                        None => bail!("a joining session ended without Done"),
                    }
                };
                let ttfa = usage
                    .time_to_first_audio_ms
                    .context("a joining session ended without audio")?;
                joins_seen.ttfa_ms.push(ttfa);
            }
            Ok(joins_seen)
        })();
        for handle in &handles {
            handle.cancel();
        }
        result
    })
}

/// Opens every request at once and waits for all to finish; per session, its usage and what a
/// listener playing its packets as they arrive would hear as silence.
fn run_wave(engine: &Engine, requests: &[SessionRequest]) -> Result<Vec<(Usage, Playback)>> {
    let sessions = requests
        .iter()
        .map(|r| engine.open(r.clone()).map_err(anyhow::Error::from))
        .collect::<Result<Vec<_>>>()?;
    std::thread::scope(|scope| {
        let waiters: Vec<_> = sessions
            .into_iter()
            .map(|mut session| {
                scope.spawn(move || {
                    let mut packets = Vec::new();
                    loop {
                        match session.events.blocking_recv() {
                            Some(SessionEvent::Audio(chunk)) => {
                                packets.push((Instant::now(), chunk.pcm.len()));
                            }
                            Some(SessionEvent::Done(usage)) => {
                                return Ok((usage, Playback::of(&packets)));
                            }
                            Some(SessionEvent::Error(e)) => bail!("session failed: {e}"),
                            None => bail!("session ended without Done"),
                        }
                    }
                })
            })
            .collect();
        waiters
            .into_iter()
            .map(|w| w.join().map_err(|_| anyhow::anyhow!("waiter panicked"))?)
            .collect()
    })
}

/// A listener who starts playing at the first packet, plays 24 kHz samples in order and waits
/// whenever the next packet has not arrived: the silence it hears inside the audio.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Playback {
    starved: Duration,
    gaps: usize,
}

impl Playback {
    /// `packets`: each packet's arrival and its samples, in order.
    fn of(packets: &[(Instant, usize)]) -> Self {
        let mut played_until = None;
        let mut out = Self {
            starved: Duration::ZERO,
            gaps: 0,
        };
        for &(arrival, samples) in packets {
            let start = match played_until {
                Some(until) if arrival > until => {
                    out.starved += arrival - until;
                    out.gaps += 1;
                    arrival
                }
                Some(until) => until,
                None => arrival,
            };
            let seconds = samples as f64 / f64::from(voxkernel_core::voice_clone::SAMPLE_RATE);
            played_until = Some(start + Duration::from_secs_f64(seconds));
        }
        out
    }
}

#[allow(clippy::too_many_arguments)]
fn report(
    concurrency: usize,
    args: &BenchArgs,
    sessions: &[(Usage, Playback)],
    wall: Duration,
    before: &EngineStats,
    after: &EngineStats,
    frame_backend: &str,
    codec_backend: &str,
) -> serde_json::Value {
    let mut ttfa: Vec<f64> = sessions
        .iter()
        .filter_map(|(u, _)| u.time_to_first_audio_ms)
        .collect();
    let mut rtf: Vec<f64> = sessions.iter().filter_map(|(u, _)| u.rtf).collect();
    let mut starved: Vec<f64> = sessions
        .iter()
        .map(|(_, p)| 1e3 * p.starved.as_secs_f64())
        .collect();
    starved.sort_by(f64::total_cmp);
    ttfa.sort_by(f64::total_cmp);
    rtf.sort_by(f64::total_cmp);
    // Per frame of one stream: with `concurrency` streams advancing together, a round of the
    // engine yields one frame per stream, so stream time per frame = engine time / rounds.
    let rounds = (after.frames_total - before.frames_total) as f64 / concurrency as f64;
    let per_round = |d: Duration| 1e3 * d.as_secs_f64() / rounds.max(1.0);
    let frame_kernel = per_round(after.frame_time - before.frame_time);
    let codec = per_round(after.codec_time - before.codec_time);
    let prefill = per_round(after.prefill_time - before.prefill_time);
    let wall_per_frame = per_round(wall);
    json!({
        "bench": "e2e",
        "concurrency": concurrency,
        "sessions": sessions.len(),
        "frames_per_session": args.frames.unwrap_or(100),
        "schedule": args.schedule,
        "fixed_packets": args.fixed_packets,
        "time_to_first_audio_ms": {"p50": percentile(&ttfa, 0.5), "p95": percentile(&ttfa, 0.95)},
        "rtf_per_stream": {"p50": percentile(&rtf, 0.5), "max": rtf.last().copied()},
        // A listener playing each session's packets as they arrive: its silence inside the audio.
        "playback_gap_ms_per_stream": {
            "p50": percentile(&starved, 0.5),
            "p95": percentile(&starved, 0.95),
            "max": starved.last().copied(),
        },
        "streams_with_gaps": sessions.iter().filter(|(_, p)| p.gaps > 0).count(),
        "ms_per_frame": {
            "wall": wall_per_frame,
            "frame_kernel": frame_kernel,
            "codec": codec,
            "prefill": prefill,
            "other": wall_per_frame - frame_kernel - codec - prefill,
        },
        "frame_backend": frame_backend,
        "codec_backend": codec_backend,
    })
}

fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    Some(sorted[index])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn playback_counts_only_the_waits_for_late_packets() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // 80 ms of audio, then 160 ms arriving 20 ms after the first ran out, then 80 ms
        // arriving while the second still plays (until 260 ms), then 80 ms arriving 40 ms
        // after the third ran out (at 340 ms).
        let packets = [
            (ms(0), 1920),
            (ms(100), 3840),
            (ms(150), 1920),
            (ms(380), 1920),
        ];
        let playback = Playback::of(&packets);
        assert_eq!(playback.gaps, 2);
        let starved_ms = playback.starved.as_secs_f64() * 1e3;
        assert!((starved_ms - 60.0).abs() < 1e-6, "{starved_ms}");
        assert_eq!(
            Playback::of(&[]),
            Playback {
                starved: Duration::ZERO,
                gaps: 0
            }
        );
    }
}

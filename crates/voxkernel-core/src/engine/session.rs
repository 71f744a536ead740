//! What a caller of the engine holds: the request it opens a session with, the handle it steers
//! the session with, and the events it reads back.

use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Result, ensure};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::Frame;
use crate::prompt::{TextMode, Voice};
use crate::sampling::SamplingConfig;

/// Frames per audio packet: the first packet after `frames[0]` frames, the next after
/// `frames[1]`, ...; the last entry repeats. Small first packets give early audio; larger later
/// ones mean fewer packets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSchedule(Vec<usize>);

impl ChunkSchedule {
    pub fn new(frames: Vec<usize>) -> Result<Self> {
        ensure!(
            !frames.is_empty() && frames.iter().all(|&n| n > 0),
            "chunk schedule: give at least one frame count, each at least 1 (got {frames:?})"
        );
        Ok(Self(frames))
    }

    /// Frames in packet `index` (0-based).
    pub fn frames(&self, index: usize) -> usize {
        self.0[index.min(self.0.len() - 1)]
    }
}

impl Default for ChunkSchedule {
    fn default() -> Self {
        Self(vec![1, 2, 4, 8])
    }
}

/// Ends a session that keeps talking far past what its text can need (a sampled model can fail
/// to emit EOS). Speech runs at roughly 3-5 frames per text token; the default allows 20, plus
/// a fixed allowance for short texts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunawayGuard {
    pub base_frames: usize,
    pub frames_per_token: usize,
}

impl RunawayGuard {
    pub fn limit(&self, text_tokens: usize) -> usize {
        self.base_frames
            .saturating_add(self.frames_per_token.saturating_mul(text_tokens))
    }
}

impl Default for RunawayGuard {
    fn default() -> Self {
        Self {
            base_frames: 50,
            frames_per_token: 20,
        }
    }
}

/// One utterance to synthesise.
#[derive(Debug, Clone)]
pub struct SessionRequest {
    pub voice: Voice,
    /// "auto" or a language name.
    pub language: String,
    pub instruct: Option<String>,
    /// `None`: the official default for the voice.
    pub text_mode: Option<TextMode>,
    pub sampling: SamplingConfig,
    /// The text known when the session opens; more may follow through
    /// [`SessionHandle::push_text`] unless `text_complete`.
    pub text: String,
    pub text_complete: bool,
    /// At most this many frames (default and ceiling: the engine's `max_frames_cap`).
    pub max_frames: Option<usize>,
    /// `None`: the engine's default schedule.
    pub schedule: Option<ChunkSchedule>,
}

/// Why a session's audio ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// The talker emitted EOS.
    Eos,
    /// The request's (or the engine's) frame limit.
    MaxFrames,
    /// More frames than the text can plausibly need ([`RunawayGuard`]).
    RunawayGuard,
    /// Cancelled by the caller.
    Cancelled,
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub finish_reason: EndReason,
    /// Frames of audio sent (80 ms each).
    pub frames: usize,
    pub audio_seconds: f64,
    /// From the request's acceptance to its first PCM leaving the engine.
    pub time_to_first_audio_ms: Option<f64>,
    /// From the prefill's start to the end; excludes time spent waiting for a slot.
    pub synthesis_seconds: f64,
    /// `synthesis_seconds / audio_seconds`; `None` without audio.
    pub rtf: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AudioChunk {
    /// 24 kHz mono PCM16.
    pub pcm: Vec<i16>,
    /// Index of the chunk's first frame within the session.
    pub first_frame: usize,
    /// The codes of the chunk's frames.
    pub codes: Vec<Frame>,
}

#[derive(Debug, Clone)]
pub enum SessionEvent {
    Audio(AudioChunk),
    /// The last event of a session that ended normally or was cancelled.
    Done(Usage),
    /// The last event of a session that failed.
    Error(String),
}

pub(super) enum Command {
    Open(Box<super::scheduler::Live>),
    Text { id: u64, piece: String },
    FinishText { id: u64 },
    Cancel { id: u64 },
    Shutdown,
}

/// Steers a session. Cloneable; dropping it does not end the session (dropping its
/// [`SessionEvents`] does).
#[derive(Clone)]
pub struct SessionHandle {
    pub(super) id: u64,
    pub(super) commands: mpsc::Sender<Command>,
}

impl SessionHandle {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Appends text (streaming text arriving piece by piece). Ignored once the session ended.
    pub fn push_text(&self, piece: &str) {
        self.send(Command::Text {
            id: self.id,
            piece: piece.to_string(),
        });
    }

    /// No more text follows.
    pub fn finish_text(&self) {
        self.send(Command::FinishText { id: self.id });
    }

    /// Stops synthesis within one frame; the session ends with [`EndReason::Cancelled`].
    pub fn cancel(&self) {
        self.send(Command::Cancel { id: self.id });
    }

    fn send(&self, command: Command) {
        // The engine is gone only at shutdown, when every session's events end anyway.
        let _ = self.commands.send(command);
    }
}

/// The events of one session, ending with `Done` or `Error`. Dropping it cancels the session
/// (a client that went away), freeing its slot within one frame.
pub struct SessionEvents {
    pub(super) events: UnboundedReceiver<SessionEvent>,
    /// Dropping the events tells the engine at once, even while it sleeps.
    pub(super) cancel_on_drop: SessionHandle,
}

impl Drop for SessionEvents {
    fn drop(&mut self) {
        self.cancel_on_drop.cancel();
    }
}

impl SessionEvents {
    pub async fn recv(&mut self) -> Option<SessionEvent> {
        self.events.recv().await
    }

    /// For callers outside an async runtime.
    pub fn blocking_recv(&mut self) -> Option<SessionEvent> {
        self.events.blocking_recv()
    }
}

pub struct Session {
    pub handle: SessionHandle,
    pub events: SessionEvents,
}

/// Counters of the engine since it started, for metrics and benchmarks.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    /// Sessions holding a sequence slot.
    pub active: usize,
    /// Sessions opened but not yet holding a slot (waiting for text or for a slot).
    pub waiting: usize,
    pub sessions_total: u64,
    pub frames_total: u64,
    /// Time in `FrameBackend::step`.
    pub frame_time: Duration,
    /// Time in `CodecBackend::decode`.
    pub codec_time: Duration,
    /// Time in `FrameBackend::start` (prefill).
    pub prefill_time: Duration,
    /// Sessions that ended in an error.
    pub errors_total: u64,
}

//! The engine: one thread owning the frame backend and the codec backend, advancing every
//! runnable session by one frame per round (so none starves), decoding the new frames and
//! sending PCM packets on each session's channel.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

use super::Model;
use super::session::{
    AudioChunk, ChunkSchedule, Command, EndReason, EngineStats, RunawayGuard, Session,
    SessionEvent, SessionEvents, SessionHandle, SessionRequest, Usage,
};
use super::text::IncrementalText;
use crate::backend::{
    CodecBackend, CodecSlot, FinishReason, Frame, FrameBackend, FrameEvent, SequenceSpec, SlotId,
};
use crate::prompt::{self, PlanLimits, PromptRequest, TextIds, TextMode};
use crate::sampling::SamplingConfig;
use crate::tokenizer::{NOTHING_TO_SPEAK, has_speakable_text};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Sessions synthesising at once (each holds a sequence slot and a codec stream). The
    /// backends must have at least this many slots.
    pub max_active: usize,
    /// Sessions that may wait beyond `max_active`; past that, `open` answers `Overloaded`.
    pub max_queue: usize,
    /// Hard ceiling on a session's frames; the backends' per-slot length must cover the prompt
    /// plus this.
    pub max_frames_cap: usize,
    pub guard: RunawayGuard,
    pub schedule: ChunkSchedule,
    /// Send a packet before the schedule's count when waiting for it would leave the listener
    /// without audio (`paced_frames`): the frames take longer than the audio queued before
    /// them lasts when the engine is loaded. Only with a codec whose samples do not depend on
    /// the split (`CodecBackend::split_invariant`), so that it never changes a session's audio.
    /// Off: every packet has the schedule's count.
    pub pacing: bool,
    pub limits: PlanLimits,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_active: 16,
            max_queue: 64,
            // 164 s of audio: far beyond a voice-agent turn, and bounds each slot's KV cache.
            max_frames_cap: 2048,
            guard: RunawayGuard::default(),
            schedule: ChunkSchedule::default(),
            pacing: true,
            limits: PlanLimits::default(),
        }
    }
}

/// Why `Engine::open` refused a session.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The request is invalid; the message names the field and the valid values.
    #[error("{0:#}")]
    Invalid(anyhow::Error),
    /// `max_active + max_queue` sessions are open.
    #[error("the engine is at capacity ({open} sessions open); retry later")]
    Overloaded { open: usize },
    #[error("the engine has stopped")]
    Stopped,
}

pub struct Engine {
    model: Arc<Model>,
    options: EngineOptions,
    commands: mpsc::Sender<Command>,
    open_sessions: Arc<AtomicUsize>,
    next_id: AtomicUsize,
    stats: Arc<Mutex<EngineStats>>,
    backend_name: String,
    codec_name: String,
    worker: Option<JoinHandle<()>>,
}

impl Engine {
    pub fn start(
        model: Arc<Model>,
        frames: Box<dyn FrameBackend>,
        codec: Box<dyn CodecBackend>,
        mut options: EngineOptions,
    ) -> Result<Self> {
        options.pacing &= codec.split_invariant();
        if options.max_active == 0 {
            bail!("max_active must be at least 1");
        }
        let (commands, receiver) = mpsc::channel();
        let open_sessions = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let backend_name = frames.name();
        let codec_name = codec.name();
        let mut worker = Worker {
            model: Arc::clone(&model),
            frames,
            codec,
            options: options.clone(),
            commands: receiver,
            sessions: Vec::new(),
            open_sessions: Arc::clone(&open_sessions),
            stats: Arc::clone(&stats),
        };
        let worker = std::thread::Builder::new()
            .name("voxkernel-engine".into())
            .spawn(move || worker.run())?;
        Ok(Self {
            model,
            options,
            commands,
            open_sessions,
            next_id: AtomicUsize::new(1),
            stats,
            backend_name,
            codec_name,
            worker: Some(worker),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// The frame backend's and the codec backend's names.
    pub fn backend_names(&self) -> (&str, &str) {
        (&self.backend_name, &self.codec_name)
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Validates the request and queues the session. Audio starts once the text allows (the
    /// first committed token in streaming text mode, else the whole text) and a slot is free.
    pub fn open(&self, request: SessionRequest) -> Result<Session, OpenError> {
        let live = self.prepare(request).map_err(OpenError::Invalid)?;
        let capacity = self.options.max_active + self.options.max_queue;
        let open = self.open_sessions.fetch_add(1, Ordering::SeqCst);
        if open >= capacity {
            self.open_sessions.fetch_sub(1, Ordering::SeqCst);
            return Err(OpenError::Overloaded { open });
        }
        let (events_tx, events) = unbounded_channel();
        let id = live.id;
        let live = Live {
            events: events_tx,
            ..live
        };
        if self.commands.send(Command::Open(Box::new(live))).is_err() {
            self.open_sessions.fetch_sub(1, Ordering::SeqCst);
            return Err(OpenError::Stopped);
        }
        let handle = SessionHandle {
            id,
            commands: self.commands.clone(),
        };
        Ok(Session {
            events: SessionEvents {
                events,
                cancel_on_drop: handle.clone(),
            },
            handle,
        })
    }

    /// Checks everything that can be checked before the text is complete.
    fn prepare(&self, request: SessionRequest) -> Result<Live> {
        let config = &self.model.checkpoint.config;
        let tokenizer = &self.model.tokenizer;
        request.sampling.validate()?;
        let instruct = request
            .instruct
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(|s| tokenizer.instruct_ids(s))
            .transpose()?;
        let text_mode = request
            .text_mode
            .unwrap_or_else(|| prompt::default_text_mode(&request.voice));
        let prompt_request = PromptRequest {
            voice: request.voice.clone(),
            language: request.language.clone(),
            text_mode,
        };
        prompt::check_request(
            config,
            &prompt_request,
            instruct.as_deref(),
            self.options.limits,
        )?;
        if request.text_complete && !has_speakable_text(&request.text) {
            bail!("text: {NOTHING_TO_SPEAK}");
        }
        let cap = self.options.max_frames_cap;
        let max_frames = match request.max_frames {
            None => cap,
            Some(n) if (1..=cap).contains(&n) => n,
            Some(n) => bail!("max_frames: {n} is outside 1..={cap}"),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as u64;
        let mut live = Live {
            id,
            // Replaced by `open` once the request is accepted.
            events: unbounded_channel().0,
            prompt: prompt_request,
            instruct,
            sampling: request.sampling,
            max_frames,
            schedule: request
                .schedule
                .unwrap_or_else(|| self.options.schedule.clone()),
            pacing: self.options.pacing,
            text: IncrementalText::default(),
            slot: None,
            trailing_known: 0,
            frames_out: 0,
            frames_sent: 0,
            chunks_out: 0,
            awaiting_text: false,
            pending: Vec::new(),
            pcm: Vec::new(),
            decoded: Vec::new(),
            accepted: Instant::now(),
            started: None,
            first_audio: None,
            last_frame: None,
            frame_interval: None,
            end: None,
        };
        live.push_text(tokenizer, &request.text, self.options.limits)?;
        if request.text_complete {
            live.text.finish(tokenizer)?;
            live.check_length(self.options.limits)?;
        }
        Ok(live)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// A session as the engine thread sees it.
pub(super) struct Live {
    id: u64,
    events: UnboundedSender<SessionEvent>,
    prompt: PromptRequest,
    instruct: Option<Vec<u32>>,
    sampling: SamplingConfig,
    max_frames: usize,
    schedule: ChunkSchedule,
    pacing: bool,
    text: IncrementalText,
    slot: Option<(SlotId, CodecSlot)>,
    /// Trailing text ids the backend holds (before the text is complete).
    trailing_known: usize,
    /// Frames generated so far.
    frames_out: usize,
    /// Frames whose audio was sent.
    frames_sent: usize,
    chunks_out: usize,
    /// The text so far is not enough to start; set until more text arrives.
    awaiting_text: bool,
    /// Frames generated, not yet decoded.
    pending: Vec<Frame>,
    /// Decoded samples not yet sent, and their frames' codes.
    pcm: Vec<f32>,
    decoded: Vec<Frame>,
    accepted: Instant,
    started: Option<Instant>,
    first_audio: Option<Duration>,
    /// When the session's last frame came, and the time between its last two frames.
    last_frame: Option<Instant>,
    frame_interval: Option<Duration>,
    end: Option<EndReason>,
}

impl Live {
    fn push_text(
        &mut self,
        tokenizer: &crate::tokenizer::TextTokenizer,
        piece: &str,
        limits: PlanLimits,
    ) -> Result<Vec<u32>> {
        let ids = self.text.push(tokenizer, piece)?;
        self.check_length(limits)?;
        Ok(ids)
    }

    fn check_length(&self, limits: PlanLimits) -> Result<()> {
        let n = self.text.committed().len();
        if n > limits.max_text_tokens {
            bail!(
                "text: {n} tokens is over the limit of {} tokens",
                limits.max_text_tokens
            );
        }
        Ok(())
    }

    /// A started session may take its next frame once the text id that frame's talker step
    /// adds is known, or the text is complete (the talker then gets tts_pad).
    fn runnable(&self) -> bool {
        self.slot.is_some()
            && self.end.is_none()
            && (self.text.is_finished() || self.frames_out < self.trailing_known)
    }

    /// The prompt plan, if the text allows starting: the whole text, or in streaming text mode
    /// at least the first token, with the final tts_eos held back until the text is complete.
    /// Text with nothing to speak yet (zero-width characters) does not start a session: if
    /// nothing speakable follows, the session ends in an error without having made a sound.
    fn plan(&self, model: &Model, limits: PlanLimits) -> Result<Option<prompt::PromptPlan>> {
        let committed = self.text.committed();
        if committed.is_empty()
            || !has_speakable_text(self.text.text())
            || (!self.text.is_finished() && self.prompt.text_mode == TextMode::Whole)
        {
            return Ok(None);
        }
        let ids = TextIds {
            target: committed.to_vec(),
            target_role: Some(model.tokenizer.target_role_ids(self.text.text())?),
            instruct: self.instruct.clone(),
            reference: model.reference_text_ids(&self.prompt.voice)?,
        };
        // The engine's limits, which `prepare` already checked the text against.
        let mut plan =
            prompt::build_plan_with_limits(&model.checkpoint.config, &self.prompt, &ids, limits)?;
        if !self.text.is_finished() {
            // Streaming text: the plan ends its trailing ids with tts_eos, which must wait for
            // the end of the text. A prompt that already holds tts_eos (an ICL prompt whose
            // text fits in the reference block) waits for the whole text.
            if plan.trailing.last() != Some(&model.checkpoint.config.tts_eos_token_id) {
                return Ok(None);
            }
            plan.trailing.pop();
        }
        Ok(Some(plan))
    }

    /// The pending frames complete the next packet (or the audio has ended): decoding waits
    /// until then, so the codec runs once per packet instead of once per frame, and a packet's
    /// audio is ready the round its last frame is.
    fn decode_due(&self, samples_per_frame: usize) -> bool {
        let decoded = self.pcm.len() / samples_per_frame;
        !self.pending.is_empty()
            && (self.end.is_some()
                || decoded + self.pending.len() >= self.packet_frames(samples_per_frame))
    }

    /// Frames in the next packet: the schedule's count, or, with pacing, the frames it has
    /// when the listener's queued audio would run out before the rest came.
    fn packet_frames(&self, samples_per_frame: usize) -> usize {
        let frames = self.schedule.frames(self.chunks_out);
        if !self.pacing {
            return frames;
        }
        let (Some(first), Some(interval)) = (self.first_audio, self.frame_interval) else {
            return frames;
        };
        let sent = (self.frames_sent * samples_per_frame) as f64 / SAMPLE_RATE;
        let played = (self.accepted + first).elapsed().as_secs_f64();
        let have = self.pcm.len() / samples_per_frame + self.pending.len();
        paced_frames(frames, have, sent - played, interval.as_secs_f64())
    }

    fn usage(&self, reason: EndReason, samples_per_frame: usize) -> Usage {
        let audio_seconds = (self.frames_sent * samples_per_frame) as f64 / SAMPLE_RATE;
        let synthesis_seconds = self
            .started
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or_default();
        Usage {
            finish_reason: reason,
            frames: self.frames_sent,
            audio_seconds,
            time_to_first_audio_ms: self.first_audio.map(|d| d.as_secs_f64() * 1e3),
            synthesis_seconds,
            rtf: (audio_seconds > 0.0).then(|| synthesis_seconds / audio_seconds),
        }
    }
}

const SAMPLE_RATE: f64 = 24_000.0;

/// The frames of the next packet, `target` by the schedule, when `have` frames are ready or
/// pending and the listener has `queued` seconds of audio left, frames coming every `interval`
/// seconds. Once the queued audio is under two intervals (the next frame, then its codec call
/// and the packet's trip), waiting for one more frame would leave the listener in silence, so
/// the packet goes with what it has.
fn paced_frames(target: usize, have: usize, queued: f64, interval: f64) -> usize {
    if have > 0 && have < target && queued < 2.0 * interval {
        have
    } else {
        target
    }
}

struct Worker {
    model: Arc<Model>,
    frames: Box<dyn FrameBackend>,
    codec: Box<dyn CodecBackend>,
    options: EngineOptions,
    commands: mpsc::Receiver<Command>,
    /// In arrival order, which is the admission order.
    sessions: Vec<Live>,
    open_sessions: Arc<AtomicUsize>,
    stats: Arc<Mutex<EngineStats>>,
}

impl Worker {
    fn run(&mut self) {
        loop {
            if !self.has_work() {
                match self.commands.recv() {
                    Ok(Command::Shutdown) | Err(_) => break,
                    Ok(command) => self.handle(command),
                }
            }
            // Every queued command before the next round.
            if !self.take_commands() || !self.round() {
                break;
            }
        }
        for index in (0..self.sessions.len()).rev() {
            self.end(index, EndReason::Cancelled);
        }
    }

    /// Handles every queued command without waiting; false once the engine must stop.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return false,
                Ok(command) => self.handle(command),
                Err(mpsc::TryRecvError::Empty) => {
                    self.publish_counts();
                    return true;
                }
            }
        }
    }

    fn active(&self) -> usize {
        self.sessions.iter().filter(|s| s.slot.is_some()).count()
    }

    /// Whether a round would do anything; if not, the thread sleeps until the next command.
    fn has_work(&self) -> bool {
        let free_slot = self.active() < self.options.max_active;
        self.sessions.iter().any(|s| {
            s.runnable()
                || s.end.is_some()
                || (s.slot.is_none() && !s.awaiting_text && free_slot)
                || s.events.is_closed()
        })
    }

    fn find(&mut self, id: u64) -> Option<usize> {
        self.sessions.iter().position(|s| s.id == id)
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Open(live) => self.sessions.push(*live),
            Command::Text { id, piece } => {
                if let Some(index) = self.find(id) {
                    let result = self.append_text(index, Some(&piece));
                    self.fail_on_error(index, result);
                }
            }
            Command::FinishText { id } => {
                if let Some(index) = self.find(id) {
                    let result = self.append_text(index, None);
                    self.fail_on_error(index, result);
                }
            }
            Command::Cancel { id } => {
                if let Some(index) = self.find(id) {
                    self.end(index, EndReason::Cancelled);
                }
            }
            Command::Shutdown => {}
        }
    }

    /// Adds a text piece (or, with `None`, the end of the text) and hands the talker whatever
    /// became final.
    fn append_text(&mut self, index: usize, piece: Option<&str>) -> Result<()> {
        let tokenizer = &self.model.tokenizer;
        let live = &mut self.sessions[index];
        live.awaiting_text = false;
        if live.text.is_finished() || live.end.is_some() {
            return match piece {
                Some(_) => Err(anyhow!("text: the session's text was already finished")),
                None => Ok(()),
            };
        }
        let mut ids = match piece {
            Some(piece) => live.push_text(tokenizer, piece, self.options.limits)?,
            None => {
                let rest = live.text.finish(tokenizer)?;
                live.check_length(self.options.limits)?;
                if !has_speakable_text(live.text.text()) {
                    bail!("text: {NOTHING_TO_SPEAK}");
                }
                rest
            }
        };
        if let Some((slot, _)) = live.slot {
            if live.text.is_finished() {
                ids.push(self.model.checkpoint.config.tts_eos_token_id);
            }
            self.frames.append_trailing(slot, &ids)?;
            live.trailing_known += ids.len();
        }
        Ok(())
    }

    fn fail_on_error(&mut self, index: usize, result: Result<()>) {
        if let Err(e) = result {
            self.fail(index, e);
        }
    }

    /// Sends the error as the session's last event and frees what it holds.
    fn fail(&mut self, index: usize, error: anyhow::Error) {
        let live = &self.sessions[index];
        tracing::warn!(session = live.id, "session failed: {error:#}");
        let _ = live.events.send(SessionEvent::Error(format!("{error:#}")));
        self.stats_mut(|s| s.errors_total += 1);
        self.remove(index);
    }

    /// One frame for every runnable session, then the codec and the packets. Sessions that
    /// start during the round take their first frame, and send their first packet, ahead of
    /// the others' frames; the others are stepped, then decoded and sent, in groups of the
    /// backend's step width, with the commands that arrived meanwhile taken between groups, so
    /// that a session joining a busy engine waits for one group's frames or codec call, not for
    /// the whole round. False once the engine must stop.
    fn round(&mut self) -> bool {
        self.drop_abandoned();
        let width = self.frames.step_width().max(1);
        let mut stepped = self.join(&[]);
        loop {
            let group = self.group(width, |s| s.runnable() && !stepped.contains(&s.id));
            if group.is_empty() {
                break;
            }
            stepped.extend(self.step(|live| group.contains(&live.id)));
            if !self.between_groups(&mut stepped) {
                return false;
            }
        }
        let spf = self.codec.samples_per_frame();
        loop {
            let group = self.group(width, |s| s.decode_due(spf));
            if group.is_empty() {
                break;
            }
            self.decode(|live| group.contains(&live.id));
            self.emit(|live| group.contains(&live.id));
            if !self.between_groups(&mut stepped) {
                return false;
            }
        }
        // (sessions that ended with nothing left to decode)
        self.emit(|_| true);
        self.publish_counts();
        true
    }

    /// Takes the commands that arrived during a group and starts the newcomers (`join`),
    /// adding those it stepped to `stepped`; false once the engine must stop.
    fn between_groups(&mut self, stepped: &mut Vec<u64>) -> bool {
        if !self.take_commands() {
            return false;
        }
        let joined = self.join(stepped);
        stepped.extend(joined);
        true
    }

    /// The ids of the first `width` sessions, in arrival order, that `pick` picks.
    fn group(&self, width: usize, pick: impl Fn(&Live) -> bool) -> Vec<u64> {
        (self.sessions.iter())
            .filter(|s| pick(s))
            .take(width)
            .map(|s| s.id)
            .collect()
    }

    /// Starts the sessions that can start. Where others are running, the newcomers' first
    /// frames are stepped, decoded and sent at once, with the first packets of sessions stepped
    /// earlier in the round (`stepped`). Returns the ids of the sessions stepped.
    fn join(&mut self, stepped: &[u64]) -> Vec<u64> {
        let joined = self.admit();
        let others_runnable =
            (self.sessions.iter()).any(|s| s.runnable() && !joined.contains(&s.id));
        if joined.is_empty() || !others_runnable {
            return Vec::new();
        }
        let stepped_now = self.step(|live| joined.contains(&live.id));
        // (not every session: one that ended earlier in the round is ended by `emit` only
        // after its last frames are decoded, and the later packets can wait for the round's
        // end)
        let first_packets = |live: &Live| {
            joined.contains(&live.id) || (live.chunks_out == 0 && stepped.contains(&live.id))
        };
        self.decode(first_packets);
        self.emit(first_packets);
        stepped_now
    }

    /// A session whose events receiver is gone (the client left) is cancelled.
    fn drop_abandoned(&mut self) {
        for index in (0..self.sessions.len()).rev() {
            if self.sessions[index].events.is_closed() {
                tracing::debug!(session = self.sessions[index].id, "client gone, cancelling");
                self.remove(index);
            }
        }
    }

    /// Starts the waiting sessions whose text allows it, in arrival order, while slots are
    /// free: one backend call for all of them, so their prefills run together. A session that
    /// cannot start fails alone. Returns the ids of the sessions started.
    fn admit(&mut self) -> Vec<u64> {
        let free = self.options.max_active.saturating_sub(self.active());
        let mut ids = Vec::new();
        let mut specs = Vec::new();
        let mut failed = Vec::new();
        for live in &mut self.sessions {
            if specs.len() == free {
                break;
            }
            if live.slot.is_some() || live.awaiting_text || live.end.is_some() {
                continue;
            }
            match live.plan(&self.model, self.options.limits) {
                Ok(Some(plan)) => {
                    ids.push(live.id);
                    specs.push(SequenceSpec {
                        plan,
                        sampling: live.sampling,
                        max_frames: live.max_frames,
                    });
                }
                Ok(None) => live.awaiting_text = true,
                Err(e) => failed.push((live.id, e)),
            }
        }
        for (id, error) in failed {
            if let Some(index) = self.find(id) {
                self.fail(index, error);
            }
        }
        if specs.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        let mut results = self.frames.start(&specs).into_iter();
        let mut opened = Vec::with_capacity(specs.len());
        for spec in &specs {
            let result = results
                .next()
                .unwrap_or_else(|| Err(anyhow!("the frame backend returned no slot")))
                .and_then(|slot| match self.open_codec(&spec.plan.reference_codes) {
                    Ok(codec_slot) => Ok((slot, codec_slot)),
                    Err(e) => {
                        self.frames.release(slot);
                        Err(e)
                    }
                });
            opened.push(result);
        }
        // The time of the whole call: the engine thread did nothing else meanwhile.
        let elapsed = started.elapsed();
        let count = opened.iter().filter(|r| r.is_ok()).count() as u64;
        self.stats_mut(|s| {
            s.prefill_time += elapsed;
            s.sessions_total += count;
        });
        let mut joined = Vec::with_capacity(specs.len());
        for ((id, spec), result) in ids.into_iter().zip(&specs).zip(opened) {
            let Some(index) = self.find(id) else {
                if let Ok((slot, codec_slot)) = result {
                    self.frames.release(slot);
                    self.codec.release(codec_slot);
                }
                continue;
            };
            match result {
                Ok(slots) => {
                    let live = &mut self.sessions[index];
                    live.slot = Some(slots);
                    live.trailing_known = spec.plan.trailing.len();
                    live.started = Some(started);
                    joined.push(id);
                }
                Err(e) => self.fail(index, e),
            }
        }
        joined
    }

    /// A codec stream for a new session. An in-context voice's audio continues its reference:
    /// qwen-tts decodes `concat(reference, generated)` and cuts the reference part off, so the
    /// stream is primed with the reference codes and their samples dropped (the official cut can
    /// keep one more sample of float rounding, docs/voice_clone.md).
    fn open_codec(&mut self, reference: &[Frame]) -> Result<CodecSlot> {
        let slot = self.codec.open()?;
        if !reference.is_empty()
            && let Err(e) = self.codec.decode(&[(slot, reference)])
        {
            self.codec.release(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// One frame for every runnable session that `include` picks, in one backend call.
    /// Returns the ids of the sessions stepped.
    fn step(&mut self, include: impl Fn(&Live) -> bool) -> Vec<u64> {
        let runnable: Vec<usize> = (0..self.sessions.len())
            .filter(|&i| self.sessions[i].runnable() && include(&self.sessions[i]))
            .collect();
        if runnable.is_empty() {
            return Vec::new();
        }
        let ids = runnable.iter().map(|&i| self.sessions[i].id).collect();
        let slots: Vec<SlotId> = runnable
            .iter()
            .filter_map(|&i| self.sessions[i].slot.map(|(s, _)| s))
            .collect();
        let started = Instant::now();
        let events = self.frames.step(&slots);
        let elapsed = started.elapsed();
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                for &i in runnable.iter().rev() {
                    self.fail(i, anyhow!("frame backend: {e:#}"));
                }
                return ids;
            }
        };
        let mut new_frames = 0;
        for (&i, event) in runnable.iter().zip(events) {
            let live = &mut self.sessions[i];
            match event {
                FrameEvent::Frame(frame) => {
                    let now = Instant::now();
                    live.frame_interval = live.last_frame.map(|t| now - t);
                    live.last_frame = Some(now);
                    live.pending.push(frame);
                    live.frames_out += 1;
                    new_frames += 1;
                    let guard = self.options.guard.limit(live.text.committed().len());
                    if live.frames_out >= guard && live.frames_out < live.max_frames {
                        live.end = Some(EndReason::RunawayGuard);
                    }
                }
                FrameEvent::Finished(reason) => {
                    live.end = Some(match reason {
                        FinishReason::Eos => EndReason::Eos,
                        FinishReason::MaxFrames => EndReason::MaxFrames,
                    });
                }
            }
        }
        self.stats_mut(|s| {
            s.frame_time += elapsed;
            s.frames_total += new_frames;
        });
        ids
    }

    /// Decodes, in one codec call, the frames of every session that `include` picks whose next
    /// packet they complete.
    fn decode(&mut self, include: impl Fn(&Live) -> bool) {
        let spf = self.codec.samples_per_frame();
        let with_frames: Vec<usize> = (0..self.sessions.len())
            .filter(|&i| self.sessions[i].decode_due(spf) && include(&self.sessions[i]))
            .collect();
        if with_frames.is_empty() {
            return;
        }
        let batch: Vec<(CodecSlot, &[Frame])> = with_frames
            .iter()
            .filter_map(|&i| {
                let live = &self.sessions[i];
                live.slot.map(|(_, c)| (c, live.pending.as_slice()))
            })
            .collect();
        let started = Instant::now();
        let result = self.codec.decode(&batch);
        let elapsed = started.elapsed();
        self.stats_mut(|s| s.codec_time += elapsed);
        match result {
            Ok(outputs) => {
                for (&i, pcm) in with_frames.iter().zip(outputs) {
                    let live = &mut self.sessions[i];
                    live.decoded.append(&mut live.pending);
                    live.pcm.extend_from_slice(&pcm);
                }
            }
            Err(e) => {
                for &i in with_frames.iter().rev() {
                    self.fail(i, anyhow!("codec backend: {e:#}"));
                }
            }
        }
    }

    /// Sends every packet the schedule allows, and ends finished sessions, of the sessions
    /// `include` picks.
    fn emit(&mut self, include: impl Fn(&Live) -> bool) {
        let spf = self.codec.samples_per_frame();
        for index in (0..self.sessions.len()).rev() {
            if !include(&self.sessions[index]) {
                continue;
            }
            let live = &mut self.sessions[index];
            loop {
                let frames = live.packet_frames(spf);
                let ready = live.pcm.len() / spf;
                let last = live.end.is_some() && ready > 0;
                if ready < frames && !last {
                    break;
                }
                let frames = frames.min(ready);
                let chunk = AudioChunk {
                    pcm: live.pcm.drain(..frames * spf).map(to_pcm16).collect(),
                    first_frame: live.frames_sent,
                    codes: live.decoded.drain(..frames).collect(),
                };
                if live.first_audio.is_none() {
                    live.first_audio = Some(live.accepted.elapsed());
                }
                live.chunks_out += 1;
                live.frames_sent += frames;
                let _ = live.events.send(SessionEvent::Audio(chunk));
            }
            if let Some(reason) = live.end {
                self.end(index, reason);
            }
        }
    }

    /// Sends `Done` (if anyone listens) and frees everything the session holds.
    fn end(&mut self, index: usize, reason: EndReason) {
        let spf = self.codec.samples_per_frame();
        let live = &self.sessions[index];
        let usage = live.usage(reason, spf);
        let _ = live.events.send(SessionEvent::Done(usage));
        self.remove(index);
    }

    fn remove(&mut self, index: usize) {
        let live = self.sessions.remove(index);
        if let Some((slot, codec_slot)) = live.slot {
            self.frames.release(slot);
            self.codec.release(codec_slot);
        }
        self.open_sessions.fetch_sub(1, Ordering::SeqCst);
    }

    fn publish_counts(&mut self) {
        let active = self.sessions.iter().filter(|s| s.slot.is_some()).count();
        let waiting = self.sessions.len() - active;
        self.stats_mut(|s| {
            s.active = active;
            s.waiting = waiting;
        });
    }

    fn stats_mut(&self, f: impl FnOnce(&mut EngineStats)) {
        if let Ok(mut stats) = self.stats.lock() {
            f(&mut stats);
        }
    }
}

fn to_pcm16(sample: f32) -> i16 {
    (sample.clamp(-1.0, 1.0) * 32767.0).round() as i16
}

#[cfg(test)]
mod tests {
    use super::paced_frames;

    #[test]
    fn a_packet_goes_early_only_when_the_listener_would_run_out() {
        // Plenty of audio queued: the schedule's count, whatever is ready.
        assert_eq!(paced_frames(8, 3, 0.5, 0.05), 8);
        // Under two intervals of audio left: the frames there are.
        assert_eq!(paced_frames(8, 3, 0.09, 0.05), 3);
        assert_eq!(paced_frames(8, 1, -0.2, 0.05), 1);
        // Nothing to send, or the packet already complete: the schedule's count.
        assert_eq!(paced_frames(8, 0, 0.0, 0.05), 8);
        assert_eq!(paced_frames(4, 4, 0.0, 0.05), 4);
        // A fast engine (2.6 ms a frame) never sends early with 80 ms queued.
        assert_eq!(paced_frames(2, 1, 0.0774, 0.0026), 2);
    }
}

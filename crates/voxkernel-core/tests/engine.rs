//! The streaming engine on the CPU backends with the tiny fixture checkpoints: sessions run
//! alone and side by side give the same codes and PCM, sessions waiting together start in one
//! backend call, a session joining mid-round sends its first packet before the rest of the
//! round, the chunk schedule, streaming text, cancellation, the runaway guard, admission limits and
//! request validation.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};

use voxkernel_core::backend::{
    CodecBackend, CodecSlot, Frame, FrameBackend, FrameEvent, SequenceSpec, SlotId,
};
use voxkernel_core::engine::{
    self, ChunkSchedule, EndReason, Engine, EngineOptions, Model, OpenError, RunawayGuard, Session,
    SessionEvent, SessionRequest, SpeechRequest, Usage,
};
use voxkernel_core::prompt::{PlanLimits, TextMode, Voice};
use voxkernel_core::reference::codec_decoder::CodecDecoder;
use voxkernel_core::reference::{ReferenceBackend, ReferenceCodec};
use voxkernel_core::sampling::SamplingConfig;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/parity")
        .join(name)
}

fn load(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&fixture(name)).unwrap())
}

fn engine(model: &Arc<Model>, options: EngineOptions) -> Engine {
    let frames = ReferenceBackend::new(&model.checkpoint).unwrap();
    let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
    Engine::start(
        Arc::clone(model),
        Box::new(frames),
        Box::new(ReferenceCodec::new(decoder)),
        options,
    )
    .unwrap()
}

fn sampling(model: &Model, seed: u64) -> SamplingConfig {
    SamplingConfig::from_generation(&model.checkpoint.generation, seed)
}

fn request(model: &Model, text: &str, seed: u64, max_frames: usize) -> SessionRequest {
    SessionRequest {
        voice: Voice::Speaker("ryan".into()),
        language: "english".into(),
        instruct: None,
        text_mode: None,
        sampling: sampling(model, seed),
        text: text.into(),
        text_complete: true,
        max_frames: Some(max_frames),
        schedule: None,
    }
}

/// Everything a session produced.
#[derive(Debug, PartialEq)]
struct Output {
    chunk_frames: Vec<usize>,
    codes: Vec<Frame>,
    pcm: Vec<i16>,
    end: EndReason,
}

fn collect(mut session: Session) -> (Output, Usage) {
    let mut out = Output {
        chunk_frames: Vec::new(),
        codes: Vec::new(),
        pcm: Vec::new(),
        end: EndReason::Cancelled,
    };
    loop {
        match session
            .events
            .blocking_recv()
            .expect("the session ended without Done")
        {
            SessionEvent::Audio(chunk) => {
                assert_eq!(chunk.first_frame, out.codes.len());
                assert_eq!(chunk.pcm.len(), chunk.codes.len() * 1920);
                out.chunk_frames.push(chunk.codes.len());
                out.codes.extend(chunk.codes);
                out.pcm.extend(chunk.pcm);
            }
            SessionEvent::Done(usage) => {
                out.end = usage.finish_reason;
                assert_eq!(usage.frames, out.codes.len());
                return (out, usage);
            }
            SessionEvent::Error(e) => panic!("session error: {e}"),
        }
    }
}

fn pcm16(samples: &[f32]) -> Vec<i16> {
    samples
        .iter()
        .map(|&s| (s.clamp(-1.0, 1.0) * 32767.0).round() as i16)
        .collect()
}

/// The codes `engine::generate` gives for the same request (no engine involved).
fn generate_codes(model: &Model, text: &str, seed: u64, max_frames: usize) -> Vec<Frame> {
    let plan = model
        .plan(&SpeechRequest {
            text: text.into(),
            voice: Voice::Speaker("ryan".into()),
            language: "english".into(),
            instruct: None,
            text_mode: None,
        })
        .unwrap();
    let spec = SequenceSpec {
        plan,
        sampling: sampling(model, seed),
        max_frames,
    };
    let mut backend = ReferenceBackend::new(&model.checkpoint).unwrap();
    engine::generate(&mut backend, &spec).unwrap().0
}

#[test]
fn a_session_equals_the_one_request_path() {
    let model = load("tiny-custom-voice");
    let engine = engine(&model, EngineOptions::default());
    let (out, usage) = collect(
        engine
            .open(request(&model, "Hello there.", 11, 21))
            .unwrap(),
    );
    assert_eq!(out.codes, generate_codes(&model, "Hello there.", 11, 21));
    // The engine decodes each packet's frames once they are all there: the same split, so the
    // same samples.
    let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
    let mut stream = decoder.stream().unwrap();
    let mut samples = Vec::new();
    let mut frames = out.codes.as_slice();
    for &n in &out.chunk_frames {
        let (packet, rest) = frames.split_at(n);
        samples.extend(stream.push(packet).unwrap());
        frames = rest;
    }
    assert_eq!(out.pcm, pcm16(&samples));
    assert_eq!(out.end, EndReason::MaxFrames);
    // The default schedule: 1, 2, 4, then 8 frames per packet; the rest in a last packet.
    assert_eq!(out.chunk_frames, vec![1, 2, 4, 8, 6]);
    assert!((usage.audio_seconds - 21.0 * 0.08).abs() < 1e-9);
    assert!(usage.time_to_first_audio_ms.is_some() && usage.rtf.is_some());
}

/// A frame backend that takes at least `delay` for every step: an engine so loaded that its
/// frames come almost as slowly as their audio plays.
struct Slow {
    inner: ReferenceBackend,
    delay: std::time::Duration,
}

impl FrameBackend for Slow {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn start(&mut self, specs: &[SequenceSpec]) -> Vec<anyhow::Result<SlotId>> {
        self.inner.start(specs)
    }

    fn step(&mut self, slots: &[SlotId]) -> anyhow::Result<Vec<FrameEvent>> {
        std::thread::sleep(self.delay);
        self.inner.step(slots)
    }

    fn append_trailing(&mut self, slot: SlotId, ids: &[u32]) -> anyhow::Result<()> {
        self.inner.append_trailing(slot, ids)
    }

    fn release(&mut self, slot: SlotId) {
        self.inner.release(slot)
    }
}

/// The CPU codec declared split-invariant, as the GPU codec is: the engine paces packets only
/// for such a codec. (The CPU decoder's samples differ between splits by f32 rounding; this
/// test compares codes, not samples.)
struct SplitInvariant(ReferenceCodec);

impl CodecBackend for SplitInvariant {
    fn name(&self) -> String {
        self.0.name()
    }

    fn samples_per_frame(&self) -> usize {
        self.0.samples_per_frame()
    }

    fn open(&mut self) -> anyhow::Result<CodecSlot> {
        self.0.open()
    }

    fn decode(&mut self, batch: &[(CodecSlot, &[Frame])]) -> anyhow::Result<Vec<Vec<f32>>> {
        self.0.decode(batch)
    }

    fn release(&mut self, slot: CodecSlot) {
        self.0.release(slot)
    }

    fn split_invariant(&self) -> bool {
        true
    }
}

#[test]
fn a_loaded_engine_sends_a_packet_early_rather_than_let_the_listener_run_out() {
    let model = load("tiny-custom-voice");
    let frames = Slow {
        inner: ReferenceBackend::new(&model.checkpoint).unwrap(),
        delay: std::time::Duration::from_millis(60),
    };
    let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
    let codec = SplitInvariant(ReferenceCodec::new(decoder));
    let engine = Engine::start(
        Arc::clone(&model),
        Box::new(frames),
        Box::new(codec),
        EngineOptions::default(),
    )
    .unwrap();
    let (out, _) = collect(
        engine
            .open(request(&model, "Hello there.", 11, 21))
            .unwrap(),
    );
    // The first packet (80 ms of audio) has played for a frame's time, 60 ms or more, when the
    // second frame comes: under two frames' time is left, so that frame goes alone instead of
    // waiting for the schedule's second.
    assert_eq!(out.chunk_frames[..2], [1, 1]);
    let schedule = ChunkSchedule::default();
    for (k, &n) in out.chunk_frames.iter().enumerate() {
        assert!(
            n <= schedule.frames(k),
            "packet {k}: {:?}",
            out.chunk_frames
        );
    }
    // Pacing changes the packets, not the frames.
    assert_eq!(out.codes, generate_codes(&model, "Hello there.", 11, 21));
    assert_eq!(out.pcm.len(), 21 * 1920);
}

#[test]
fn concurrent_sessions_equal_their_solo_runs() {
    let model = load("tiny-custom-voice");
    let texts = [
        ("Good morning.", 1u64, 9usize),
        ("How are you doing today?", 2, 14),
        ("Fine.", 3, 5),
        ("A somewhat longer sentence, to keep going.", 4, 17),
    ];
    let solo: Vec<Output> = {
        let engine = engine(&model, EngineOptions::default());
        texts
            .iter()
            .map(|&(t, seed, n)| collect(engine.open(request(&model, t, seed, n)).unwrap()).0)
            .collect()
    };
    // Two at a time, so sessions also wait for a slot and start mid-way through others.
    let options = EngineOptions {
        max_active: 2,
        ..EngineOptions::default()
    };
    let engine = engine(&model, options);
    let sessions: Vec<Session> = texts
        .iter()
        .map(|&(t, seed, n)| engine.open(request(&model, t, seed, n)).unwrap())
        .collect();
    let together: Vec<Output> = std::thread::scope(|scope| {
        let handles: Vec<_> = sessions
            .into_iter()
            .map(|s| scope.spawn(move || collect(s).0))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, solo);
    // Different seeds and texts really differ, so the comparison above means something.
    assert_ne!(solo[0].codes[..5], solo[2].codes[..5]);
}

/// A backend call, as the recording backends saw it.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    /// `start` with this many specs; the slots of those it started.
    Start {
        specs: usize,
        slots: Vec<SlotId>,
    },
    Step(Vec<SlotId>),
    /// A codec call with this many streams.
    Decode(usize),
}

type CallLog = Arc<Mutex<Vec<Call>>>;

/// The CPU reference backend, recording its calls in `calls`. While the test holds `hold`,
/// `step` waits (after saying so on `stepping`), so that sessions opened meanwhile queue up;
/// so does the first step of exactly the slots `pause_at`, until `resume` says go on. Specs
/// with the seed `refuse_seed` are refused; it says it steps `width` sequences at once.
struct Recording {
    inner: ReferenceBackend,
    calls: CallLog,
    hold: Arc<Mutex<()>>,
    stepping: mpsc::Sender<()>,
    pause_at: Vec<SlotId>,
    resume: Option<mpsc::Receiver<()>>,
    refuse_seed: u64,
    width: usize,
}

impl FrameBackend for Recording {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn start(&mut self, specs: &[SequenceSpec]) -> Vec<anyhow::Result<SlotId>> {
        let results: Vec<anyhow::Result<SlotId>> = specs
            .iter()
            .map(|spec| {
                if spec.sampling.seed == self.refuse_seed {
                    anyhow::bail!(
                        "sampling.seed: {} is refused by this test",
                        self.refuse_seed
                    );
                }
                self.inner.start_one(spec)
            })
            .collect();
        let slots = results.iter().filter_map(|r| r.as_ref().ok()).copied();
        self.calls.lock().unwrap().push(Call::Start {
            specs: specs.len(),
            slots: slots.collect(),
        });
        results
    }

    fn step(&mut self, slots: &[SlotId]) -> anyhow::Result<Vec<FrameEvent>> {
        self.calls.lock().unwrap().push(Call::Step(slots.to_vec()));
        let _ = self.stepping.send(());
        drop(self.hold.lock().unwrap());
        if slots == self.pause_at
            && let Some(resume) = self.resume.take()
        {
            resume.recv().unwrap();
        }
        self.inner.step(slots)
    }

    fn step_width(&self) -> usize {
        self.width
    }

    fn append_trailing(&mut self, slot: SlotId, ids: &[u32]) -> anyhow::Result<()> {
        self.inner.append_trailing(slot, ids)
    }

    fn release(&mut self, slot: SlotId) {
        self.inner.release(slot)
    }
}

/// The CPU reference codec, recording its decode calls in the same log.
struct RecordingCodec {
    inner: ReferenceCodec,
    calls: CallLog,
}

impl CodecBackend for RecordingCodec {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn samples_per_frame(&self) -> usize {
        self.inner.samples_per_frame()
    }

    fn open(&mut self) -> anyhow::Result<CodecSlot> {
        self.inner.open()
    }

    fn decode(&mut self, batch: &[(CodecSlot, &[Frame])]) -> anyhow::Result<Vec<Vec<f32>>> {
        self.calls.lock().unwrap().push(Call::Decode(batch.len()));
        self.inner.decode(batch)
    }

    fn release(&mut self, slot: CodecSlot) {
        self.inner.release(slot)
    }
}

/// An engine on the recording backends, and what the test needs to steer them.
struct Recorded {
    engine: Engine,
    calls: CallLog,
    hold: Arc<Mutex<()>>,
    stepped: mpsc::Receiver<()>,
    resume: mpsc::Sender<()>,
}

fn recorded(
    model: &Arc<Model>,
    max_active: usize,
    refuse_seed: u64,
    width: usize,
    pause_at: Vec<SlotId>,
) -> Recorded {
    let calls = CallLog::default();
    let hold = Arc::new(Mutex::new(()));
    let (stepping, stepped) = mpsc::channel();
    let (resume, resumed) = mpsc::channel();
    let frames = Recording {
        inner: ReferenceBackend::new(&model.checkpoint).unwrap(),
        calls: Arc::clone(&calls),
        hold: Arc::clone(&hold),
        stepping,
        pause_at,
        resume: Some(resumed),
        refuse_seed,
        width,
    };
    let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
    let codec = RecordingCodec {
        inner: ReferenceCodec::new(decoder),
        calls: Arc::clone(&calls),
    };
    let options = EngineOptions {
        max_active,
        ..EngineOptions::default()
    };
    let engine = Engine::start(
        Arc::clone(model),
        Box::new(frames),
        Box::new(codec),
        options,
    );
    Recorded {
        engine: engine.unwrap(),
        calls,
        hold,
        stepped,
        resume,
    }
}

/// The codes of every session, or its error, collected side by side.
fn codes_of(sessions: Vec<Session>) -> Vec<Result<(Vec<Frame>, EndReason), String>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = sessions
            .into_iter()
            .map(|mut session| {
                scope.spawn(move || {
                    let mut codes = Vec::new();
                    loop {
                        match session.events.blocking_recv().expect("no Done") {
                            SessionEvent::Audio(chunk) => codes.extend(chunk.codes),
                            SessionEvent::Done(usage) => return Ok((codes, usage.finish_reason)),
                            SessionEvent::Error(e) => return Err(e),
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn sessions_waiting_together_start_in_one_backend_call() {
    let model = load("tiny-custom-voice");
    let run = recorded(&model, 5, 99, usize::MAX, Vec::new());

    let held = run.hold.lock().unwrap();
    let first = run.engine.open(request(&model, "First.", 1, 6)).unwrap();
    // The engine thread is inside its first step: what is opened now waits for the next round.
    run.stepped.recv().unwrap();
    let texts = [
        ("Good morning.", 2u64, 9usize),
        ("How are you doing today?", 3, 7),
        ("Refused.", 99, 5),
        ("A somewhat longer sentence, to keep going.", 4, 8),
    ];
    let sessions: Vec<Session> = texts
        .iter()
        .map(|&(t, seed, n)| run.engine.open(request(&model, t, seed, n)).unwrap())
        .collect();
    drop(held);

    let mut outcomes = codes_of(sessions);
    assert_eq!(
        collect(first).0.codes,
        generate_codes(&model, "First.", 1, 6)
    );
    // The four waiting sessions: one backend call, after the first session's own.
    let starts: Vec<usize> = (run.calls.lock().unwrap().iter())
        .filter_map(|c| match c {
            Call::Start { specs, .. } => Some(*specs),
            _ => None,
        })
        .collect();
    assert_eq!(starts, vec![1, 4]);
    let refused = outcomes.remove(2).unwrap_err();
    assert!(refused.contains("sampling.seed"), "{refused}");
    for (outcome, &(text, seed, n)) in outcomes.into_iter().zip(texts.iter().filter(|t| t.1 != 99))
    {
        let (codes, end) = outcome.unwrap();
        assert_eq!(codes, generate_codes(&model, text, seed, n), "{text}");
        assert_eq!(end, EndReason::MaxFrames);
    }
    wait_idle(&run.engine);
}

#[test]
fn a_session_joining_mid_round_sends_its_first_packet_before_the_rest_of_the_round() {
    let model = load("tiny-custom-voice");
    // Three busy sessions in groups of two: once all run, a round steps [a, b], then [c], and
    // decodes at most two at a time. They
    // take slots 0, 1 and 2 in arrival order, however their starts fall; the backend pauses in
    // the first step of [a, b], where the joining session arrives.
    let (a_b, c) = (vec![SlotId(0), SlotId(1)], vec![SlotId(2)]);
    let run = recorded(&model, 4, u64::MAX, 2, a_b.clone());
    let busy = [
        ("First.", 1u64, 12usize),
        ("Good morning.", 2, 11),
        ("How are you?", 3, 10),
    ];
    let mut sessions: Vec<Session> = busy
        .iter()
        .map(|&(t, seed, n)| run.engine.open(request(&model, t, seed, n)).unwrap())
        .collect();
    let paused = || run.calls.lock().unwrap().last() == Some(&Call::Step(a_b.clone()));
    while !paused() {
        run.stepped.recv().unwrap();
    }
    let joining = ("Hello there.", 4u64, 5usize);
    sessions.push(
        run.engine
            .open(request(&model, joining.0, joining.1, joining.2))
            .unwrap(),
    );
    run.resume.send(()).unwrap();

    let outcomes = codes_of(sessions);
    for (outcome, &(text, seed, n)) in outcomes.iter().zip(busy.iter().chain([&joining])) {
        let (codes, end) = outcome.as_ref().unwrap();
        assert_eq!(*codes, generate_codes(&model, text, seed, n), "{text}");
        assert_eq!(*end, EndReason::MaxFrames);
    }
    wait_idle(&run.engine);

    let calls = run.calls.lock().unwrap().clone();
    let paused_at = calls
        .iter()
        .position(|c| *c == Call::Step(a_b.clone()))
        .unwrap();
    let joined = vec![SlotId(3)];
    let after: Vec<Call> = calls[paused_at + 1..].to_vec();
    assert_eq!(
        after[..3],
        [
            Call::Start {
                specs: 1,
                slots: joined.clone()
            },
            // its first frame alone
            Call::Step(joined.clone()),
            // its first packet (with any first packets of [a, b])
            after[2].clone(),
        ],
        "{calls:?}"
    );
    assert!(matches!(after[2], Call::Decode(_)), "{calls:?}");
    // then the rest of the round, and the next round, in groups of two
    let steps: Vec<&Call> = (after[3..].iter())
        .filter(|c| matches!(c, Call::Step(_)))
        .take(3)
        .collect();
    let c_joined = Call::Step([c.clone(), joined].concat());
    assert_eq!(
        steps,
        [&Call::Step(c), &Call::Step(a_b), &c_joined],
        "{calls:?}"
    );
    // Steps and the rounds' codec calls are at most two wide (a newcomers' decode, which takes
    // the first packets of the round so far too, excepted: it follows their start and step).
    for (i, call) in calls.iter().enumerate() {
        let joins = i >= 2 && matches!(calls[i - 2], Call::Start { .. });
        match call {
            Call::Step(slots) => assert!(slots.len() <= 2, "a step too wide: {calls:?}"),
            Call::Decode(n) if !joins => assert!(*n <= 2, "a decode too wide: {calls:?}"),
            _ => {}
        }
    }
}

#[test]
fn streamed_text_equals_whole_text_in_streaming_mode() {
    let model = load("tiny-custom-voice");
    let engine = engine(&model, EngineOptions::default());
    let text = "Well, this text arrives one piece at a time.";
    let mut whole = request(&model, text, 5, 30);
    whole.text_mode = Some(TextMode::Streaming);
    let (expected, _) = collect(engine.open(whole.clone()).unwrap());

    let mut first = whole;
    first.text = "Well, th".into();
    first.text_complete = false;
    let session = engine.open(first).unwrap();
    let handle = session.handle.clone();
    let feeder = std::thread::spawn(move || {
        for piece in ["is te", "xt arrives one", " piece", " at a time."] {
            // Let the audio catch up with the text, so the session has to wait for it.
            std::thread::sleep(std::time::Duration::from_millis(60));
            handle.push_text(piece);
        }
        handle.finish_text();
    });
    let (streamed, _) = collect(session);
    feeder.join().unwrap();
    assert_eq!(streamed.codes, expected.codes);
    assert_eq!(streamed.pcm, expected.pcm);
}

#[test]
fn streamed_text_of_only_invisible_characters_ends_in_an_error() {
    let model = load("tiny-custom-voice");
    let engine = engine(&model, EngineOptions::default());
    let mut first = request(&model, "\u{200B}", 5, 30);
    first.text_mode = Some(TextMode::Streaming);
    first.text_complete = false;
    let mut session = engine.open(first).unwrap();
    // Commits several ids (the text before the last space but one): enough for frames.
    session
        .handle
        .push_text(" \u{FEFF} \u{2060} \u{200D} \u{00AD} \u{200B} \u{2060}");
    // Time enough for a first packet, had those ids started the session.
    std::thread::sleep(std::time::Duration::from_millis(200));
    session.handle.finish_text();
    match session.events.blocking_recv() {
        Some(SessionEvent::Error(e)) => {
            assert!(e.starts_with("text") && e.contains("invisible"), "{e}")
        }
        Some(SessionEvent::Audio(_)) => panic!("audio for text with nothing to speak"),
        other => panic!("expected an error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn cancel_ends_the_session_and_frees_its_slot() {
    let model = load("tiny-custom-voice");
    let engine = engine(&model, EngineOptions::default());
    let mut session = engine
        .open(request(&model, "Cancel me soon.", 1, 500))
        .unwrap();
    let mut cancelled = false;
    let usage = loop {
        match session.events.blocking_recv().expect("no Done") {
            SessionEvent::Audio(_) if !cancelled => {
                session.handle.cancel();
                cancelled = true;
            }
            SessionEvent::Audio(_) => {}
            SessionEvent::Done(usage) => break usage,
            SessionEvent::Error(e) => panic!("{e}"),
        }
    };
    assert_eq!(usage.finish_reason, EndReason::Cancelled);
    // Cancelled within a round or two of the first packet, far from the 500-frame limit.
    assert!(usage.frames < 10, "{usage:?}");
    wait_idle(&engine);

    // A client that simply goes away (events dropped) is cancelled too.
    let session = engine
        .open(request(&model, "Nobody listens.", 2, 500))
        .unwrap();
    drop(session);
    wait_idle(&engine);
}

fn wait_idle(engine: &Engine) {
    for _ in 0..500 {
        let stats = engine.stats();
        if stats.active == 0 && stats.waiting == 0 {
            // A new session is admitted at once, so nothing leaked.
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("sessions still held: {:?}", engine.stats());
}

#[test]
fn the_runaway_guard_ends_a_session_cleanly() {
    let model = load("tiny-custom-voice");
    let options = EngineOptions {
        guard: RunawayGuard {
            base_frames: 3,
            frames_per_token: 1,
        },
        schedule: ChunkSchedule::new(vec![2]).unwrap(),
        ..EngineOptions::default()
    };
    let engine = engine(&model, options);
    let text = "Two words";
    let tokens = model.tokenizer.target_text_ids(text).unwrap().len();
    let (out, _) = collect(engine.open(request(&model, text, 1, 100)).unwrap());
    assert_eq!(out.end, EndReason::RunawayGuard);
    assert_eq!(out.codes.len(), 3 + tokens);
    assert_eq!(out.pcm.len(), (3 + tokens) * 1920);
}

#[test]
fn eos_ends_the_session_like_the_official_loop() {
    let model = load("tiny-voice-design");
    let engine = engine(&model, EngineOptions::default());
    let mut req = request(&model, "Short.", 0, 200);
    req.voice = Voice::Design;
    req.instruct = Some("A calm voice.".into());
    req.sampling.talker.do_sample = false;
    req.sampling.subtalker.do_sample = false;
    let (out, _) = collect(engine.open(req).unwrap());
    assert_eq!(out.end, EndReason::Eos);
    assert!(!out.codes.is_empty() && out.codes.len() < 200);
    // The EOS token is never expanded into a frame.
    let eos = model.checkpoint.config.talker.codec_eos_token_id;
    assert!(out.codes.iter().all(|f| f[0] != eos));
}

#[test]
fn admission_is_bounded() {
    let model = load("tiny-custom-voice");
    let options = EngineOptions {
        max_active: 1,
        max_queue: 1,
        ..EngineOptions::default()
    };
    let engine = engine(&model, options);
    let a = engine.open(request(&model, "One.", 1, 300)).unwrap();
    let b = engine.open(request(&model, "Two.", 2, 3)).unwrap();
    match engine.open(request(&model, "Three.", 3, 3)) {
        Err(OpenError::Overloaded { open: 2 }) => {}
        other => panic!("expected Overloaded, got {:?}", other.map(|_| ())),
    }
    a.handle.cancel();
    assert_eq!(collect(a).0.end, EndReason::Cancelled);
    assert_eq!(collect(b).0.end, EndReason::MaxFrames);
    wait_idle(&engine);
    assert!(engine.open(request(&model, "Again.", 4, 2)).is_ok());
}

#[test]
fn bad_requests_name_the_field() {
    let model = load("tiny-custom-voice");
    let engine = engine(&model, EngineOptions::default());
    let error = |req: SessionRequest| match engine.open(req) {
        Err(OpenError::Invalid(e)) => format!("{e:#}"),
        other => panic!("expected Invalid, got {:?}", other.map(|_| ())),
    };
    let mut req = request(&model, "Hi.", 1, 5);
    req.voice = Voice::Speaker("bob".into());
    let message = error(req);
    assert!(
        message.contains("bob") && message.contains("ryan"),
        "{message}"
    );

    let mut req = request(&model, "Hi.", 1, 5);
    req.language = "klingon".into();
    let message = error(req);
    assert!(
        message.contains("klingon") && message.contains("english"),
        "{message}"
    );

    let message = error(request(&model, "Hi.", 1, 0));
    assert!(message.contains("max_frames"), "{message}");

    let message = error(request(&model, "   ", 1, 5));
    assert!(message.starts_with("text"), "{message}");
    let message = error(request(&model, " \u{200B}\u{FEFF}\u{2060}", 1, 5));
    assert!(
        message.starts_with("text") && message.contains("invisible"),
        "{message}"
    );

    let mut req = request(&model, "Hi.", 1, 5);
    req.sampling.talker.top_p = 1.5;
    let message = error(req);
    assert!(message.contains("top_p"), "{message}");
}

#[test]
fn the_engine_text_limit_also_bounds_the_prompt() {
    // A whole text over the prompt builder's default limit (4096 tokens) but within the
    // engine's: the prompt is built with the engine's limit, not the default.
    let model = load("tiny-custom-voice");
    let options = EngineOptions {
        limits: PlanLimits {
            max_text_tokens: 6000,
        },
        ..EngineOptions::default()
    };
    let engine = engine(&model, options);
    let text = "word ".repeat(4200);
    assert!(model.tokenizer.target_text_ids(&text).unwrap().len() > 4096);
    let (out, _) = collect(engine.open(request(&model, &text, 1, 2)).unwrap());
    assert_eq!(out.codes.len(), 2);
}

//! The streaming engine on the CPU backends with the tiny fixture checkpoints: sessions run
//! alone and side by side give the same codes and PCM, the chunk schedule, streaming text,
//! cancellation, the runaway guard, admission limits and request validation.

use std::path::PathBuf;
use std::sync::Arc;

use voxkernel_core::backend::{Frame, SequenceSpec};
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

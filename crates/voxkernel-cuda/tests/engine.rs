//! The streaming engine on the CUDA backends (frame kernel and codec; tiny fixture checkpoint):
//! sessions side by side give exactly the codes and the PCM of their solo runs, and text
//! streamed in pieces (appended to running sequences) gives exactly what the whole text gives.
//! Needs a CUDA GPU, so ignored by default (reported as ignored, never as passed); the GPU
//! machine runs it with `--include-ignored`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use voxkernel_core::backend::Frame;
use voxkernel_core::engine::{
    EndReason, Engine, EngineOptions, Model, Session, SessionEvent, SessionRequest,
};
use voxkernel_core::prompt::{TextMode, Voice};
use voxkernel_core::sampling::SamplingConfig;
use voxkernel_cuda::{CudaBackend, CudaCodec, CudaCodecOptions, CudaOptions, driver_available};

fn model() -> Arc<Model> {
    let root = std::env::var_os("VOXKERNEL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity")
        });
    Arc::new(Model::load(&root.join("tiny-custom-voice")).unwrap())
}

fn engine(model: &Arc<Model>, max_active: usize) -> Engine {
    assert!(driver_available(), "this test needs a CUDA driver");
    let frames = CudaBackend::new(
        &model.checkpoint,
        CudaOptions {
            max_slots: max_active,
            max_len: 256,
            ..Default::default()
        },
    )
    .unwrap();
    let codec = CudaCodec::from_checkpoint(
        &model.checkpoint,
        CudaCodecOptions {
            max_streams: max_active,
            ..CudaCodecOptions::default()
        },
    )
    .unwrap();
    let options = EngineOptions {
        max_active,
        max_frames_cap: 128,
        ..EngineOptions::default()
    };
    Engine::start(
        Arc::clone(model),
        Box::new(frames),
        Box::new(codec),
        options,
    )
    .unwrap()
}

fn request(model: &Model, text: &str, seed: u64, max_frames: usize) -> SessionRequest {
    SessionRequest {
        voice: Voice::Speaker("ryan".into()),
        language: "english".into(),
        instruct: None,
        text_mode: None,
        sampling: SamplingConfig::from_generation(&model.checkpoint.generation, seed),
        text: text.into(),
        text_complete: true,
        max_frames: Some(max_frames),
        schedule: None,
    }
}

fn collect(mut session: Session) -> (Vec<Frame>, Vec<i16>, EndReason) {
    let (mut codes, mut pcm) = (Vec::new(), Vec::new());
    loop {
        match session.events.blocking_recv().expect("no Done") {
            SessionEvent::Audio(chunk) => {
                codes.extend(chunk.codes);
                pcm.extend(chunk.pcm);
            }
            SessionEvent::Done(usage) => return (codes, pcm, usage.finish_reason),
            SessionEvent::Error(e) => panic!("session error: {e}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn concurrent_sessions_equal_their_solo_runs_on_the_gpu() {
    let model = model();
    // Ten sessions of different lengths: launches of 8 (the wide build) and 2 at first, then,
    // as sessions end, launches of every width down to one.
    let texts = [
        ("Good morning.", 1u64, 12usize),
        ("How are you doing today?", 2, 20),
        ("Fine.", 3, 7),
        ("A somewhat longer sentence, to keep going.", 4, 25),
        ("Five sessions, more than one batch.", 5, 16),
        ("Six.", 6, 9),
        ("Seven sessions still fit one wide launch.", 7, 22),
        ("Eight.", 8, 14),
        ("Nine sessions need a second launch.", 9, 18),
        ("Ten, and the last one.", 10, 11),
    ];
    let solo: Vec<_> = {
        let engine = engine(&model, 1);
        texts
            .iter()
            .map(|&(t, s, n)| collect(engine.open(request(&model, t, s, n)).unwrap()))
            .collect()
    };
    let engine = engine(&model, texts.len());
    let sessions: Vec<Session> = texts
        .iter()
        .map(|&(t, s, n)| engine.open(request(&model, t, s, n)).unwrap())
        .collect();
    let together: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = sessions
            .into_iter()
            .map(|s| scope.spawn(move || collect(s)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, b)) in together.iter().zip(&solo).enumerate() {
        assert_eq!(a.0, b.0, "session {i}: codes differ from its solo run");
        assert_eq!(a.2, b.2);
        // The CUDA codec's plans are batch-invariant and the engine decodes each session in
        // its own packets, so the audio is the solo run's, bit for bit.
        assert!(a.1 == b.1, "session {i}: audio differs from its solo run");
    }
    assert_ne!(solo[0].0[..5], solo[2].0[..5]);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn streamed_text_equals_whole_text_on_the_gpu() {
    let model = model();
    let engine = engine(&model, 2);
    let text = "Well, this text arrives one piece at a time.";
    let mut whole = request(&model, text, 5, 40);
    whole.text_mode = Some(TextMode::Streaming);
    let expected = collect(engine.open(whole.clone()).unwrap());
    let mut first = whole;
    first.text = "Well, th".into();
    first.text_complete = false;
    let session = engine.open(first).unwrap();
    let handle = session.handle.clone();
    let feeder = std::thread::spawn(move || {
        for piece in ["is te", "xt arrives one", " piece", " at a time."] {
            std::thread::sleep(std::time::Duration::from_millis(20));
            handle.push_text(piece);
        }
        handle.finish_text();
    });
    let streamed = collect(session);
    feeder.join().unwrap();
    assert_eq!(streamed, expected);
}

//! Registered voices on the tiny Base checkpoint: `POST /v1/voices` (multipart), listing,
//! speech in a registered voice against the library's clone path, deletion, persistence in a
//! voices directory, and every refused registration. Encoder parity with the official code is
//! voxkernel-core's test (tests/voice_clone.rs).

use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};
use voxkernel_core::engine::{
    Engine, Model, SamplerOverrides, SessionEvent, SessionRequest, sampling_config_named,
};
use voxkernel_core::prompt::TextMode;
use voxkernel_core::voice_clone::{
    CloneEncoder, CloneMode, ClonedVoice, ReferenceAudio, VoiceEncoder,
};
use voxkernel_server::{Server, ServerOptions};

use crate::common::*;

/// What the fixture clip `ref_a` says (cases/icl_streaming.json).
const TRANSCRIPT: &str = "This is the reference transcript, spoken slowly.";
const TEXT: &str = "Hello world, this is a test.";
const BOUNDARY: &str = "voxkernel-test-boundary-7d3f";

fn ref_a() -> Vec<u8> {
    std::fs::read(base_model_dir().join("audio/ref_a.wav")).unwrap()
}

/// One form part: name, file name (file parts only), content.
type Part<'a> = (&'a str, Option<&'a str>, &'a [u8]);

fn multipart_body(parts: &[Part<'_>]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, file_name, content) in parts {
        body.extend(format!("--{BOUNDARY}\r\n").bytes());
        match file_name {
            Some(file) => body.extend(
                format!(
                    "content-disposition: form-data; name=\"{name}\"; filename=\"{file}\"\r\n\
                     content-type: application/octet-stream\r\n\r\n"
                )
                .bytes(),
            ),
            None => body
                .extend(format!("content-disposition: form-data; name=\"{name}\"\r\n\r\n").bytes()),
        }
        body.extend_from_slice(content);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{BOUNDARY}--\r\n").bytes());
    body
}

async fn post_voice(server: &TestServer, parts: &[Part<'_>]) -> HttpResponse {
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");
    http(
        server.addr,
        "POST",
        "/v1/voices",
        &[("content-type", &content_type)],
        &multipart_body(parts),
    )
    .await
}

/// Registers `ref_a` in-context as "alice".
async fn register_icl(server: &TestServer) -> Value {
    let audio = ref_a();
    let response = post_voice(
        server,
        &[
            ("name", None, b"alice"),
            ("audio", Some("ref_a.wav"), &audio),
            ("transcript", None, TRANSCRIPT.as_bytes()),
        ],
    )
    .await;
    assert_eq!(
        response.status,
        201,
        "{}",
        String::from_utf8_lossy(&response.body)
    );
    response.json()
}

async fn base_server(options: ServerOptions) -> TestServer {
    TestServer::start_model(base_model(), engine_options(2, 4, 6), options).await
}

fn base_options() -> ServerOptions {
    ServerOptions::new("tiny-base")
}

fn speech(voice: &str, seed: u64) -> Value {
    json!({"model": "tts-1", "input": TEXT, "voice": voice, "language": "english",
           "seed": seed, "response_format": "pcm"})
}

async fn speak_http(server: &TestServer, voice: &str, seed: u64) -> Vec<i16> {
    let response = post_json(server.addr, "/v1/audio/speech", &speech(voice, seed)).await;
    assert_eq!(
        response.status,
        200,
        "{}",
        String::from_utf8_lossy(&response.body)
    );
    assert!(response.complete);
    pcm_of(&response.body)
}

fn library_voice(model: &Model, mode: CloneMode<'_>) -> ClonedVoice {
    // The library path: the CPU encoder called directly, not through the server.
    let encoder = VoiceEncoder::from_checkpoint(&model.checkpoint).unwrap();
    let audio = ReferenceAudio::load(&base_model_dir().join("audio/ref_a.wav")).unwrap();
    encoder.encode(&audio, mode).unwrap()
}

/// A session in `voice` opened on the engine directly, with the sampling the server derives
/// from a seed alone: its PCM and codes.
async fn library_session(
    engine: &Engine,
    voice: &ClonedVoice,
    seed: u64,
    text_mode: Option<TextMode>,
) -> (Vec<i16>, usize) {
    let generation = &engine.model().checkpoint.generation;
    let defaults = SamplerOverrides::default();
    let sampling =
        sampling_config_named(generation, &defaults, &defaults, seed, |f, _| f.into()).unwrap();
    let mut session = engine
        .open(SessionRequest {
            voice: voice.voice(),
            language: "english".into(),
            instruct: None,
            text_mode,
            sampling,
            text: TEXT.into(),
            text_complete: true,
            max_frames: None,
            schedule: None,
        })
        .unwrap();
    let (mut pcm, mut frames) = (Vec::new(), 0);
    loop {
        match tokio::time::timeout(HANG, session.events.recv())
            .await
            .expect("the engine hung")
            .expect("no Done event")
        {
            SessionEvent::Audio(chunk) => {
                frames += chunk.codes.len();
                pcm.extend(chunk.pcm);
            }
            SessionEvent::Done(_) => return (pcm, frames),
            SessionEvent::Error(e) => panic!("session error: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_voice_speaks_as_the_library_clone_path() {
    let server = base_server(base_options()).await;
    let addr = server.addr;
    let library = library_voice(
        &base_model(),
        CloneMode::Icl {
            transcript: TRANSCRIPT,
        },
    );

    let created = register_icl(&server).await;
    let id = created["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("voice_"), "{created}");
    assert_eq!(created["object"], "voice");
    assert_eq!(created["name"], "alice");
    assert_eq!(created["mode"], "icl");
    assert_eq!(created["transcript"], TRANSCRIPT);
    let reference = library.reference.as_ref().unwrap();
    assert_eq!(created["reference_frames"], reference.codes.len());
    assert!((created["audio_seconds"].as_f64().unwrap() - 3.0).abs() < 1e-6);
    assert!(created["created_at"].as_u64().unwrap() > 0);

    let listed = http(addr, "GET", "/v1/voices", &[], b"").await.json();
    let entry = &listed["data"][0];
    assert_eq!(entry["model_type"], "base");
    assert_eq!(entry["voices"], json!([id]));
    assert_eq!(entry["registered_voices"], json!([created]));
    assert_eq!(entry["max_registered_voices"], 100);
    let shown = http(addr, "GET", &format!("/v1/voices/{id}"), &[], b"").await;
    assert_eq!(shown.status, 200);
    assert_eq!(shown.json(), created);

    // The server's voice speaks exactly as the library's encoding of the same clip.
    let pcm = speak_http(&server, &id, 11).await;
    let (expected, frames) = library_session(&server.engine, &library, 11, None).await;
    assert_eq!(frames, 6, "the server's frame cap");
    assert_eq!(pcm.len(), frames * 1920);
    assert_eq!(pcm, expected);
    // The voice object form of `voice` too.
    let mut body = speech(&id, 11);
    body["voice"] = json!({"id": id});
    let response = post_json(addr, "/v1/audio/speech", &body).await;
    assert_eq!(pcm_of(&response.body), pcm);

    // The WebSocket takes the id as well (its default text mode is streaming, the official
    // default of a cloned voice, so it matches the HTTP audio).
    let mut ws = ws_connect(&server).await;
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "c", "text": TEXT, "voice": id,
               "language": "english", "seed": 11}),
    )
    .await;
    send(&mut ws, json!({"type": "flush", "context_id": "c"})).await;
    let (ws_pcm, done) = collect_context(&mut ws, "c", &mut Vec::new()).await;
    assert_eq!(done["usage"]["frames"], 6);
    assert_eq!(ws_pcm, pcm);
    let (streaming, _) =
        library_session(&server.engine, &library, 11, Some(TextMode::Streaming)).await;
    assert_eq!(ws_pcm, streaming);

    // The comparisons can fail: another seed, or the same clip without its codes, differ.
    assert_ne!(speak_http(&server, &id, 12).await, pcm);
    let audio = ref_a();
    let x_vector = post_voice(
        &server,
        &[
            ("audio", Some("ref_a.wav"), &audio),
            ("name", None, "alice, timbre only".as_bytes()),
            ("mode", None, b"x_vector_only"),
        ],
    )
    .await;
    assert_eq!(x_vector.status, 201);
    let x_vector = x_vector.json();
    assert_eq!(x_vector["mode"], "x_vector_only");
    assert_eq!(x_vector["transcript"], Value::Null);
    assert_eq!(x_vector["reference_frames"], Value::Null);
    let x_id = x_vector["id"].as_str().unwrap();
    let x_pcm = speak_http(&server, x_id, 11).await;
    assert_ne!(x_pcm, pcm);
    let (x_expected, _) = library_session(
        &server.engine,
        &library_voice(&base_model(), CloneMode::XVectorOnly),
        11,
        None,
    )
    .await;
    assert_eq!(x_pcm, x_expected);
    let listed = http(addr, "GET", "/v1/voices", &[], b"").await.json();
    assert_eq!(
        listed["data"][0]["voices"],
        json!([id, x_id]),
        "oldest first"
    );

    let metrics = metrics(addr).await;
    assert_eq!(metrics["voxkernel_registered_voices"], 2.0);
    assert_eq!(metrics["voxkernel_voice_encode_seconds_count"], 2.0);

    let deleted = http(addr, "DELETE", &format!("/v1/voices/{id}"), &[], b"").await;
    assert_eq!(deleted.status, 200);
    assert_eq!(
        deleted.json(),
        json!({"id": id, "object": "voice.deleted", "deleted": true})
    );
    for method in ["GET", "DELETE"] {
        let response = http(addr, method, &format!("/v1/voices/{id}"), &[], b"").await;
        assert_eq!(response.status, 404, "{method}");
        let error = response.error();
        assert_eq!(error["param"], "voice_id");
        assert!(error["message"].as_str().unwrap().contains(&id), "{error}");
    }
    let response = post_json(addr, "/v1/audio/speech", &speech(&id, 11)).await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert_eq!(error["param"], "voice");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("not a registered voice") && message.contains(x_id),
        "{message}"
    );
    assert_eq!(
        http(addr, "GET", "/v1/voices", &[], b"").await.json()["data"][0]["voices"],
        json!([x_id])
    );
    assert_eq!(metrics_of(addr, "voxkernel_registered_voices").await, 1.0);
    server.wait_idle().await;
}

async fn metrics_of(addr: std::net::SocketAddr, name: &str) -> f64 {
    metrics(addr).await[name]
}

async fn stop(server: TestServer) {
    server.shutdown.stop();
    server.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saved_voices_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let options = || ServerOptions {
        voices_dir: Some(dir.path().to_path_buf()),
        ..base_options()
    };
    let server = base_server(options()).await;
    let created = register_icl(&server).await;
    let id = created["id"].as_str().unwrap().to_string();
    let file = dir.path().join(format!("{id}.json"));
    assert!(file.is_file());
    let pcm = speak_http(&server, &id, 3).await;
    stop(server).await;

    let server = base_server(options()).await;
    let listed = http(server.addr, "GET", "/v1/voices", &[], b"")
        .await
        .json();
    assert_eq!(listed["data"][0]["registered_voices"], json!([created]));
    assert_eq!(
        metrics_of(server.addr, "voxkernel_registered_voices").await,
        1.0
    );
    assert_eq!(speak_http(&server, &id, 3).await, pcm);
    let deleted = http(server.addr, "DELETE", &format!("/v1/voices/{id}"), &[], b"").await;
    assert_eq!(deleted.status, 200);
    assert!(!file.exists());
    stop(server).await;

    let server = base_server(options()).await;
    let listed = http(server.addr, "GET", "/v1/voices", &[], b"")
        .await
        .json();
    assert_eq!(listed["data"][0]["registered_voices"], json!([]));
    stop(server).await;
}

fn start_error(
    model: Arc<Model>,
    encoder: Option<Box<dyn CloneEncoder>>,
    dir: Option<&Path>,
) -> String {
    let engine = TestEngine::new(model);
    let options = ServerOptions {
        voices_dir: dir.map(Path::to_path_buf),
        ..base_options()
    };
    match Server::new(engine.0, options, encoder) {
        Ok(_) => panic!("the server started"),
        Err(e) => format!("{e:#}"),
    }
}

/// An engine for a server that is built but never served.
struct TestEngine(Arc<Engine>);

impl TestEngine {
    fn new(model: Arc<Model>) -> Self {
        use voxkernel_core::reference::codec_decoder::CodecDecoder;
        use voxkernel_core::reference::{ReferenceBackend, ReferenceCodec};
        let frames = ReferenceBackend::new(&model.checkpoint).unwrap();
        let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
        Self(Arc::new(
            Engine::start(
                model,
                Box::new(frames),
                Box::new(ReferenceCodec::new(decoder)),
                engine_options(1, 1, 1),
            )
            .unwrap(),
        ))
    }
}

#[test]
fn a_voices_dir_that_is_not_this_models_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("voice_0000000000000001.json");
    std::fs::write(&file, b"{\"id\": \"voice_0000000000000001\"").unwrap();
    let message = start_error(base_model(), voice_encoder(&base_model()), Some(dir.path()));
    assert!(
        message.contains(&file.display().to_string()) && message.contains("not a saved voice"),
        "{message}"
    );

    // A voice of another geometry (an x-vector of the wrong width).
    let voice = json!({"id": "voice_0000000000000001", "name": "n", "created_at": 1,
                       "audio_seconds": 2.0, "voice": {"x_vector": [0.5, 0.5, 0.5], "reference": null}});
    std::fs::write(&file, voice.to_string()).unwrap();
    let message = start_error(base_model(), voice_encoder(&base_model()), Some(dir.path()));
    assert!(
        message.contains("not a voice of this model") && message.contains("x_vector"),
        "{message}"
    );

    // Other files are left alone; a directory on a model that cannot clone is an error.
    std::fs::remove_file(&file).unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"hello").unwrap();
    let engine = TestEngine::new(base_model());
    let options = ServerOptions {
        voices_dir: Some(dir.path().to_path_buf()),
        ..base_options()
    };
    assert!(Server::new(engine.0, options, voice_encoder(&base_model())).is_ok());
    let message = start_error(model(), None, Some(dir.path()));
    assert!(message.contains("only a base model"), "{message}");
}

#[test]
fn a_base_model_needs_a_voice_encoder_and_the_others_take_none() {
    let message = start_error(base_model(), None, None);
    assert!(message.contains("needs a voice encoder"), "{message}");
    let encoder = voice_encoder(&base_model());
    let message = start_error(model(), encoder, None);
    assert!(
        message.contains("custom_voice") && message.contains("only base models"),
        "{message}"
    );
}

/// A mono 16-bit WAV of `samples` samples of a quiet sawtooth.
fn wav(samples: usize, sample_rate: u32) -> Vec<u8> {
    let mut cursor = std::io::Cursor::new(Vec::new());
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut writer = hound::WavWriter::new(&mut cursor, spec).unwrap();
    for i in 0..samples {
        writer.write_sample(((i % 100) as i16 - 50) * 100).unwrap();
    }
    writer.finalize().unwrap();
    cursor.into_inner()
}

/// The parts sent, then the status, `param` and phrases of the message expected.
type BadCase<'a> = (Vec<Part<'a>>, u16, Option<&'a str>, &'a [&'a str]);

fn file(bytes: &[u8]) -> Part<'_> {
    ("audio", Some("clip.wav"), bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_registrations_get_4xx_naming_the_field() {
    let options = ServerOptions {
        max_upload_bytes: 200_000,
        max_text_chars: 100,
        ..base_options()
    };
    let server = base_server(options).await;
    let audio = ref_a();
    // A low rate keeps a 32 s clip under the upload limit.
    let (empty, short, long, large, garbage) = (
        wav(0, 24_000),
        wav(12_000, 24_000),
        wav(32 * 1000, 1000),
        wav(5 * 24_000, 24_000),
        b"definitely not audio".to_vec(),
    );
    assert!(long.len() < 200_000 && large.len() > 200_000);
    let name: Part<'_> = ("name", None, b"n");
    let transcript: Part<'_> = ("transcript", None, TRANSCRIPT.as_bytes());
    let long_transcript = "a".repeat(101);
    let long_name = "n".repeat(65);
    let cases: Vec<BadCase<'_>> = vec![
        (
            vec![name, transcript],
            400,
            Some("audio"),
            &["missing", "WAV"],
        ),
        (
            vec![name, transcript, file(&garbage)],
            400,
            Some("audio"),
            &["not a decodable audio file"],
        ),
        (
            vec![name, transcript, file(b"")],
            400,
            Some("audio"),
            &["empty"],
        ),
        (
            vec![name, transcript, file(&empty)],
            400,
            Some("audio"),
            &["no samples"],
        ),
        (
            vec![name, transcript, file(&short)],
            400,
            Some("audio"),
            &["0.50 s", "at least 1 s"],
        ),
        (
            vec![name, file(&audio)],
            400,
            Some("transcript"),
            &["required", "icl", "x_vector_only"],
        ),
        (
            vec![name, ("transcript", None, b"  "), file(&audio)],
            400,
            Some("transcript"),
            &["required"],
        ),
        (
            vec![
                name,
                ("transcript", None, long_transcript.as_bytes()),
                file(&audio),
            ],
            400,
            Some("transcript"),
            &["101", "100"],
        ),
        (
            vec![
                name,
                transcript,
                ("mode", None, b"x_vector_only"),
                file(&audio),
            ],
            400,
            Some("transcript"),
            &["not used in x_vector_only mode"],
        ),
        (
            vec![transcript, file(&audio)],
            400,
            Some("name"),
            &["missing"],
        ),
        (
            vec![("name", None, b" "), transcript, file(&audio)],
            400,
            Some("name"),
            &["missing"],
        ),
        (
            vec![
                ("name", None, long_name.as_bytes()),
                transcript,
                file(&audio),
            ],
            400,
            Some("name"),
            &["65", "64"],
        ),
        (
            vec![name, name, transcript, file(&audio)],
            400,
            Some("name"),
            &["twice"],
        ),
        (
            vec![("name", None, b"\xff\xfe"), transcript, file(&audio)],
            400,
            Some("name"),
            &["UTF-8"],
        ),
        (
            vec![name, transcript, ("mode", None, b"clone"), file(&audio)],
            400,
            Some("mode"),
            &["\"clone\"", "icl", "x_vector_only"],
        ),
        (
            vec![name, transcript, ("speaker", None, b"ryan"), file(&audio)],
            400,
            Some("speaker"),
            &["unknown field", "audio, name, transcript, mode"],
        ),
        (
            vec![name, transcript, file(&long)],
            400,
            Some("audio"),
            &["over 30 s"],
        ),
        (
            vec![name, transcript, file(&large)],
            413,
            None,
            &["body", "200000", "--max-upload-bytes"],
        ),
    ];
    for (parts, status, param, needles) in cases {
        let fields: Vec<&str> = parts.iter().map(|p| p.0).collect();
        let response = post_voice(&server, &parts).await;
        assert_eq!(response.status, status, "{fields:?}");
        let error = response.error();
        assert_eq!(error["param"], json!(param), "{fields:?}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.starts_with(param.unwrap_or("body")),
            "{fields:?}: {message}"
        );
        for needle in needles {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }

    // Not multipart at all.
    let response = post_json(server.addr, "/v1/voices", &json!({"name": "n"})).await;
    assert_eq!(response.status, 400);
    let message = response.error()["message"].as_str().unwrap().to_string();
    assert!(
        message.starts_with("body:") && message.contains("multipart/form-data"),
        "{message}"
    );

    // Nothing was registered, nothing encoded.
    let metrics = metrics(server.addr).await;
    assert_eq!(metrics["voxkernel_registered_voices"], 0.0);
    assert_eq!(
        metrics
            .get("voxkernel_voice_encode_seconds_count")
            .copied()
            .unwrap_or_default(),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_voice_limit_is_enforced_and_named() {
    let options = ServerOptions {
        max_voices: 1,
        ..base_options()
    };
    let server = base_server(options).await;
    let first = register_icl(&server).await;
    let audio = ref_a();
    let parts: [Part<'_>; 3] = [
        ("name", None, b"bob"),
        ("audio", Some("ref_a.wav"), &audio),
        ("mode", None, b"x_vector_only"),
    ];
    let refused = post_voice(&server, &parts).await;
    assert_eq!(refused.status, 409);
    let error = refused.error();
    assert_eq!(error["code"], "voice_limit_reached");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("1 registered voices") && message.contains("--max-voices"),
        "{message}"
    );
    let id = first["id"].as_str().unwrap();
    let deleted = http(server.addr, "DELETE", &format!("/v1/voices/{id}"), &[], b"").await;
    assert_eq!(deleted.status, 200);
    assert_eq!(post_voice(&server, &parts).await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_voices_and_preset_speakers_do_not_mix() {
    // A Base model speaks only in registered voices, and takes no instruction.
    let server = base_server(base_options()).await;
    let id = register_icl(&server).await["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut no_voice = speech(&id, 1);
    no_voice.as_object_mut().unwrap().remove("voice");
    let mut instructed = speech(&id, 1);
    instructed["instructions"] = json!("Speak slowly.");
    let cases: [(Value, &str, &[&str]); 3] = [
        (
            speech("ryan", 1),
            "voice",
            &[
                "\"ryan\"",
                "not a registered voice",
                "POST /v1/voices",
                id.as_str(),
            ],
        ),
        (no_voice, "voice", &["required", id.as_str()]),
        (instructed, "instructions", &["base model", "omit"]),
    ];
    for (body, param, needles) in cases {
        let response = post_json(server.addr, "/v1/audio/speech", &body).await;
        assert_eq!(response.status, 400, "{body}");
        let error = response.error();
        assert_eq!(error["param"], param);
        let message = error["message"].as_str().unwrap();
        assert!(message.starts_with(param), "{message}");
        for needle in needles {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }
    let mut ws = ws_connect(&server).await;
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "a", "text": "Hi.", "voice": "ryan"}),
    )
    .await;
    let error = recv_json(&mut ws).await;
    assert_eq!(error["code"], "invalid_request");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("voice: \"ryan\" is not a registered voice"),
        "{error}"
    );

    // A CustomVoice model registers nothing and names its speakers when given a voice id.
    let custom = TestServer::default().await;
    let audio = ref_a();
    let response = post_voice(
        &custom,
        &[
            ("name", None, b"alice"),
            ("audio", Some("ref_a.wav"), &audio),
            ("transcript", None, TRANSCRIPT.as_bytes()),
        ],
    )
    .await;
    assert_eq!(response.status, 400);
    let message = response.error()["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("only a base model") && message.contains("custom_voice"),
        "{message}"
    );
    let mut body = speech(&id, 1);
    body["input"] = json!("Hello.");
    body["language"] = json!("auto");
    let response = post_json(custom.addr, "/v1/audio/speech", &body).await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert_eq!(error["param"], "voice");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("need a base model") && message.contains("ryan"),
        "{message}"
    );
    let listed = http(custom.addr, "GET", "/v1/voices", &[], b"")
        .await
        .json();
    assert_eq!(listed["data"][0]["registered_voices"], json!([]));
    assert_eq!(listed["data"][0]["max_registered_voices"], 0);
    for method in ["GET", "DELETE"] {
        let response = http(custom.addr, method, &format!("/v1/voices/{id}"), &[], b"").await;
        assert_eq!(response.status, 404, "{method}");
    }
}

//! The HTTP API: OpenAI's speech endpoint in every format, its errors, auth and the info
//! endpoints.

use base64::Engine as _;
use serde_json::{Value, json};
use voxkernel_server::ServerOptions;

use crate::common::*;

fn speech(extra: Value) -> Value {
    let mut body = json!({"model": "tts-1", "input": "Hello there.", "voice": "ryan", "seed": 5});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_carries_the_same_audio() {
    let server = TestServer::default().await;
    let addr = server.addr;

    let pcm = post_json(
        addr,
        "/v1/audio/speech",
        &speech(json!({"response_format": "pcm"})),
    )
    .await;
    assert_eq!(pcm.status, 200);
    assert!(pcm.complete);
    assert_eq!(pcm.headers["content-type"], "audio/pcm");
    assert!(pcm.headers.contains_key("x-request-id"));
    // Six frames of 1920 samples (the server's frame cap: the random weights never say EOS).
    assert_eq!(pcm.body.len(), 6 * 1920 * 2);
    let samples = pcm_of(&pcm.body);

    let wav = post_json(
        addr,
        "/v1/audio/speech",
        &speech(json!({"response_format": "wav"})),
    )
    .await;
    assert_eq!(wav.status, 200);
    assert_eq!(wav.headers["content-type"], "audio/wav");
    assert_eq!(&wav.body[..4], b"RIFF");
    assert_eq!(pcm_of(&wav.body[44..]), samples);

    // The default format is wav.
    let default = post_json(addr, "/v1/audio/speech", &speech(json!({}))).await;
    assert_eq!(default.body, wav.body);

    let flac = post_json(
        addr,
        "/v1/audio/speech",
        &speech(json!({"response_format": "flac"})),
    )
    .await;
    assert_eq!(flac.status, 200);
    assert_eq!(flac.headers["content-type"], "audio/flac");
    let mut reader = claxon::FlacReader::new(std::io::Cursor::new(flac.body)).unwrap();
    let decoded: Vec<i16> = reader.samples().map(|s| s.unwrap() as i16).collect();
    assert_eq!(decoded, samples);

    let sse = post_json(
        addr,
        "/v1/audio/speech",
        &speech(json!({"response_format": "pcm", "stream_format": "sse"})),
    )
    .await;
    assert_eq!(sse.status, 200);
    assert_eq!(sse.headers["content-type"], "text/event-stream");
    let events: Vec<Value> = String::from_utf8(sse.body)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let (done, deltas) = events.split_last().unwrap();
    let mut audio = Vec::new();
    for delta in deltas {
        assert_eq!(delta["type"], "speech.audio.delta");
        audio.extend(
            base64::engine::general_purpose::STANDARD
                .decode(delta["audio"].as_str().unwrap())
                .unwrap(),
        );
    }
    assert_eq!(pcm_of(&audio), samples);
    assert_eq!(done["type"], "speech.audio.done");
    assert_eq!(done["finish_reason"], "max_frames");
    let usage = &done["usage"];
    assert_eq!(usage["output_tokens"], 6);
    assert!(usage["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + 6)
    );
    assert!(usage["time_to_first_audio_ms"].as_f64().is_some());

    // Another seed, other audio: the comparisons above mean something.
    let other = post_json(
        addr,
        "/v1/audio/speech",
        &speech(json!({"response_format": "pcm", "seed": 6})),
    )
    .await;
    assert_ne!(other.body, pcm.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_400s_naming_the_field_and_the_valid_values() {
    let server = TestServer::default().await;
    let cases: Vec<(Value, &str, &[&str])> = vec![
        (
            speech(json!({"response_format": "mp3"})),
            "response_format",
            &["mp3", "wav", "pcm", "flac"],
        ),
        (
            speech(json!({"stream_format": "chunks"})),
            "stream_format",
            &["audio", "sse"],
        ),
        (speech(json!({"speed": 1.5})), "speed", &["1.0"]),
        (
            speech(json!({"voice": "bob"})),
            "voice",
            &["bob", "ryan", "vivian"],
        ),
        (speech(json!({"voice": {"name": "ryan"}})), "voice", &["id"]),
        (
            speech(json!({"language": "klingon"})),
            "language",
            &["klingon", "english", "auto"],
        ),
        (speech(json!({"input": "  "})), "input", &["empty"]),
        (
            speech(json!({"input": " \u{200B}\u{FEFF}\u{2060} "})),
            "input",
            &["empty", "invisible"],
        ),
        (
            speech(json!({"input": "a".repeat(4097)})),
            "input",
            &["4097", "4096"],
        ),
        (
            speech(json!({"model": "whisper-1"})),
            "model",
            &["whisper-1", "tiny-custom-voice", "tts-1"],
        ),
        (
            speech(json!({"sampling": {"top_p": 1.5}})),
            "sampling.top_p",
            &["(0, 1]"],
        ),
        (
            speech(json!({"sampling": {"temperature": 0}})),
            "sampling.temperature",
            &["> 0"],
        ),
        (
            speech(json!({"sampling": {"top_k": -1}})),
            "sampling.top_k",
            &["-1", "a whole number >= 0"],
        ),
        (
            speech(json!({"seed": "seven"})),
            "seed",
            &["seven", "a whole number >= 0"],
        ),
        (speech(json!({"speed": "fast"})), "speed", &["a number"]),
        (
            speech(json!({"text_mode": "eventually"})),
            "text_mode",
            &["whole", "streaming"],
        ),
        (
            speech(json!({"instructions": "x".repeat(5000)})),
            "instructions",
            &["5000"],
        ),
    ];
    for (body, param, needles) in cases {
        let response = post_json(server.addr, "/v1/audio/speech", &body).await;
        assert_eq!(response.status, 400, "{body}");
        let error = response.error();
        assert_eq!(error["param"], param, "{error}");
        assert_eq!(error["type"], "invalid_request_error");
        let message = error["message"].as_str().unwrap();
        assert!(message.starts_with(param), "{message}");
        for needle in needles {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }

    // Whole-body problems: unknown and missing fields, not JSON, too large.
    let response = post_json(
        server.addr,
        "/v1/audio/speech",
        &speech(json!({"pitch": 2})),
    )
    .await;
    assert_eq!(response.status, 400);
    let message = response.error()["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("pitch") && message.contains("input"),
        "{message}"
    );

    // A JSON array is not taken as the fields in order.
    let response = post_json(
        server.addr,
        "/v1/audio/speech",
        &json!([
            "tts-1", "Hi", "ryan", null, "pcm", null, null, null, null, null, null
        ]),
    )
    .await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("body: must be a JSON object"),
        "{error}"
    );

    // A missing or repeated field is named first and in `param`, like every other error.
    let response = post_json(server.addr, "/v1/audio/speech", &json!({"model": "tts-1"})).await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert_eq!(error["param"], "input", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("input: missing"),
        "{error}"
    );
    let response = http(
        server.addr,
        "POST",
        "/v1/audio/speech",
        &[("content-type", "application/json")],
        br#"{"model": "tts-1", "model": "tts-1", "input": "Hi", "voice": "ryan"}"#,
    )
    .await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert_eq!(error["param"], "model", "{error}");
    assert!(
        error["message"].as_str().unwrap().starts_with("model: "),
        "{error}"
    );

    let response = http(
        server.addr,
        "POST",
        "/v1/audio/speech",
        &[],
        b"{\"model\": ",
    )
    .await;
    assert_eq!(response.status, 400);
    assert_eq!(response.error()["code"], "invalid_json");

    // Well-formed JSON whose number no f64 holds: a bad value of its field, not bad JSON.
    let response = http(
        server.addr,
        "POST",
        "/v1/audio/speech",
        &[],
        b"{\"input\": \"Hi.\", \"voice\": \"ryan\", \"sampling\": {\"temperature\": 1e400}}",
    )
    .await;
    assert_eq!(response.status, 400);
    let error = response.error();
    assert_eq!(error["code"], "invalid_request", "{error}");
    assert_eq!(error["param"], "sampling.temperature", "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("out of range"),
        "{error}"
    );

    let huge = speech(json!({"input": "a".repeat(70_000)}));
    let response = post_json(server.addr, "/v1/audio/speech", &huge).await;
    assert_eq!(response.status, 413);
    assert_eq!(response.error()["code"], "payload_too_large");

    let response = http(server.addr, "GET", "/v1/nothing", &[], b"").await;
    assert_eq!(response.status, 404);
    assert_eq!(response.error()["code"], "not_found");
    let response = http(server.addr, "GET", "/v1/audio/speech", &[], b"").await;
    assert_eq!(response.status, 405);
    response.error();

    // Every refusal is counted by its code.
    let metrics = metrics(server.addr).await;
    assert!(metrics[r#"voxkernel_errors_total{kind="invalid_request"}"#] >= 15.0);
    assert_eq!(
        metrics[r#"voxkernel_errors_total{kind="payload_too_large"}"#],
        1.0
    );
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_endpoints_and_metrics() {
    let server = TestServer::default().await;
    let addr = server.addr;
    let models = http(addr, "GET", "/v1/models", &[], b"").await.json();
    assert_eq!(models["data"][0]["id"], "tiny-custom-voice");
    assert_eq!(models["object"], "list");

    let voices = http(addr, "GET", "/v1/voices", &[], b"").await.json();
    let entry = &voices["data"][0];
    assert_eq!(entry["model_type"], "custom_voice");
    let names: Vec<&str> = entry["voices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(names.contains(&"ryan") && names.contains(&"vivian"));
    let languages = entry["languages"].as_array().unwrap();
    assert!(languages.contains(&json!("english")) && languages.contains(&json!("auto")));

    assert_eq!(http(addr, "GET", "/healthz", &[], b"").await.status, 200);
    assert_eq!(http(addr, "GET", "/readyz", &[], b"").await.status, 200);

    let response = post_json(addr, "/v1/audio/speech", &speech(json!({}))).await;
    assert_eq!(response.status, 200);
    // The engine frees the slot just after the last audio goes out.
    server.wait_idle().await;
    let metrics = metrics(addr).await;
    assert_eq!(metrics["voxkernel_time_to_first_audio_seconds_count"], 1.0);
    assert_eq!(metrics["voxkernel_rtf_count"], 1.0);
    assert_eq!(metrics["voxkernel_frames_total"], 6.0);
    assert_eq!(
        metrics[r#"voxkernel_sessions_finished_total{finish_reason="max_frames"}"#],
        1.0
    );
    assert_eq!(metrics["voxkernel_sessions_active"], 0.0);
    assert_eq!(metrics["voxkernel_sessions_queued"], 0.0);
    assert_eq!(metrics["voxkernel_http_streams"], 0.0);
    assert!(metrics["process_resident_memory_bytes"] > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_guards_everything_but_health() {
    let options = ServerOptions {
        api_key: Some("sekret".into()),
        ..ServerOptions::new("tiny-custom-voice")
    };
    let server = TestServer::start(engine_options(2, 2, 3), options).await;
    let addr = server.addr;
    for headers in [
        &[][..],
        &[("authorization", "Bearer nope")][..],
        &[("authorization", "sekret")][..],
    ] {
        for (method, path) in [
            ("GET", "/v1/models"),
            ("GET", "/v1/voices"),
            ("GET", "/metrics"),
            ("POST", "/v1/audio/speech"),
            ("POST", "/v1/voices"),
            ("GET", "/v1/voices/voice_0000000000000001"),
            ("DELETE", "/v1/voices/voice_0000000000000001"),
        ] {
            let response = http(addr, method, path, headers, b"{}").await;
            assert_eq!(response.status, 401, "{method} {path} {headers:?}");
            assert_eq!(response.error()["code"], "invalid_api_key");
            assert_eq!(response.headers["www-authenticate"], "Bearer");
        }
    }
    let ok = [("authorization", "Bearer sekret")];
    assert_eq!(http(addr, "GET", "/v1/models", &ok, b"").await.status, 200);
    let body = speech(json!({"response_format": "pcm"})).to_string();
    let response = http(addr, "POST", "/v1/audio/speech", &ok, body.as_bytes()).await;
    assert_eq!((response.status, response.body.len()), (200, 3 * 3840));
    assert_eq!(http(addr, "GET", "/healthz", &[], b"").await.status, 200);
    assert_eq!(http(addr, "GET", "/readyz", &[], b"").await.status, 200);

    // The WebSocket upgrade too.
    let refused = tokio_tungstenite::connect_async(server.ws_url()).await;
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 401)
        }
        other => panic!("expected 401, got {other:?}"),
    }
    let mut request =
        tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
            server.ws_url(),
        )
        .unwrap();
    request
        .headers_mut()
        .insert("authorization", "Bearer sekret".parse().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "a", "text": "Hi there.", "voice": "ryan"}),
    )
    .await;
    send(&mut ws, json!({"type": "flush", "context_id": "a"})).await;
    let (pcm, done) = collect_context(&mut ws, "a", &mut Vec::new()).await;
    assert_eq!(done["usage"]["frames"], 3);
    assert_eq!(pcm.len(), 3 * 1920);
}

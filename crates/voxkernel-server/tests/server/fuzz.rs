//! Property tests of both APIs with generated input, valid and not: every HTTP request gets a
//! 2xx or a 4xx in OpenAI's error shape (never a 5xx, a cut stream or a hang), and every
//! WebSocket message sequence gets only audio, `done` and client-side error codes, on a
//! connection that stays usable.

use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Map, Value, json};
use tokio_tungstenite::tungstenite::Message;
use voxkernel_server::ServerOptions;

use crate::common::*;

/// Mostly plausible values, some hostile ones.
fn text() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => Just(json!("Hello there.")),
        2 => "[a-zA-Z ,.!?']{0,40}".prop_map(Value::from),
        2 => any::<String>().prop_map(Value::from),
        1 => Just(json!("   \n\t")),
        1 => Just(json!("你好，世界。 🎉🎉 \u{0} \u{feff}")),
        1 => Just(Value::from("word ".repeat(900))),
        1 => Just(json!("")),
        1 => any::<i64>().prop_map(Value::from),
        1 => Just(Value::Null),
    ]
    .boxed()
}

fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(0.5)),
        Just(json!(1e-40)),
        Just(json!(1e-30)),
        Just(json!(1e39)),
        Just(json!(1e300)),
        Just(json!(u64::MAX)),
        Just(json!("1")),
        any::<f64>().prop_map(|x| json!(x)),
        any::<i64>().prop_map(|x| json!(x)),
    ]
    .boxed()
}

fn one_of(valid: &'static [&'static str]) -> BoxedStrategy<Value> {
    prop_oneof![
        4 => prop::sample::select(valid).prop_map(Value::from),
        1 => "[a-z_]{0,8}".prop_map(Value::from),
        1 => number(),
        1 => Just(json!({"id": "ryan"})),
        1 => Just(json!(["ryan"])),
    ]
    .boxed()
}

fn sampling() -> BoxedStrategy<Value> {
    prop::collection::btree_map(
        prop::sample::select(
            &[
                "temperature",
                "top_k",
                "top_p",
                "repetition_penalty",
                "greedy",
                "min_p",
            ][..],
        ),
        prop_oneof![number(), any::<bool>().prop_map(Value::from)],
        0..4,
    )
    .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
    .boxed()
}

/// A JSON object of optional fields: each present with some probability.
fn object(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> BoxedStrategy<Value> {
    fields
        .into_iter()
        .map(|(name, value)| prop::option::weighted(0.7, value).prop_map(move |v| (name, v)))
        .collect::<Vec<_>>()
        .prop_map(|pairs| {
            Value::Object(
                pairs
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
                    .collect::<Map<_, _>>(),
            )
        })
        .boxed()
}

/// Sets (or, with `None`, removes) one field of a request.
fn mutation() -> BoxedStrategy<(&'static str, Option<Value>)> {
    let field = |name: &'static str, value: BoxedStrategy<Value>| {
        prop::option::weighted(0.9, value)
            .prop_map(move |v| (name, v))
            .boxed()
    };
    prop_oneof![
        field(
            "model",
            one_of(&["tts-1", "tiny", "gpt-4o-mini-tts", "tts-1-hd"])
        ),
        field("input", text()),
        field("voice", one_of(&["ryan", "Vivian", "SERENA", "bob"])),
        field("instructions", text()),
        field("response_format", one_of(&["wav", "pcm", "flac", "mp3"])),
        field(
            "speed",
            prop_oneof![3 => Just(json!(1.0)), 1 => number()].boxed()
        ),
        field("stream_format", one_of(&["audio", "sse"])),
        field(
            "language",
            one_of(&["english", "auto", "Chinese", "klingon"])
        ),
        field(
            "seed",
            prop_oneof![3 => any::<u64>().prop_map(Value::from), 1 => number()].boxed()
        ),
        field(
            "sampling",
            prop_oneof![3 => sampling(), 1 => number()].boxed()
        ),
        field("text_mode", one_of(&["whole", "streaming"])),
        field("volume", number()),
    ]
    .boxed()
}

/// A valid request with a few fields changed, or a body that is not one at all.
fn speech_body() -> BoxedStrategy<Vec<u8>> {
    let request = prop::collection::vec(mutation(), 0..4).prop_map(|mutations| {
        let mut body = json!({"model": "tts-1", "input": "Hello there.", "voice": "ryan"});
        let fields = body.as_object_mut().unwrap();
        for (name, value) in mutations {
            match value {
                Some(value) => fields.insert(name.to_string(), value),
                None => fields.remove(name),
            };
        }
        body.to_string().into_bytes()
    });
    prop_oneof![
        8 => request,
        1 => prop::collection::vec(any::<u8>(), 0..200),
        1 => Just(b"[1, 2, 3]".to_vec()),
        1 => Just(b"{\"model\": \"tts-1\", \"input\": \"Hi\"".to_vec()),
        1 => Just(b"{\"model\":\"tts-1\",\"input\":\"Hi\",\"voice\":\"ryan\"} trailing".to_vec()),
    ]
    .boxed()
}

#[test]
fn any_speech_request_gets_a_2xx_or_a_4xx() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Two frames per utterance keep the accepted ones quick.
    let server = runtime.block_on(TestServer::start(
        engine_options(4, 16, 2),
        ServerOptions::new("tiny"),
    ));
    let served = std::cell::Cell::new(0);
    let config = Config {
        cases: 160,
        failure_persistence: None,
        ..Config::default()
    };
    proptest!(config, |(body in speech_body())| {
        let response = runtime.block_on(http(server.addr, "POST", "/v1/audio/speech", &[], &body));
        let shown = String::from_utf8_lossy(&body).chars().take(300).collect::<String>();
        match response.status {
            200 => {
                prop_assert!(response.complete, "cut stream for {}", shown);
                served.set(served.get() + 1);
            }
            400..=499 => {
                response.error();
            }
            status => prop_assert!(false, "{} for {}: {:?}", status, shown, response),
        }
    });
    // Enough of the cases were valid to reach the engine.
    assert!(
        served.get() >= 10,
        "only {} requests were valid",
        served.get()
    );
    runtime.block_on(server.wait_idle());
}

#[derive(Debug, Clone)]
enum Step {
    Json(Value),
    Raw(String),
    Binary(Vec<u8>),
}

fn context_id() -> BoxedStrategy<Value> {
    prop_oneof![
        6 => prop::sample::select(&["a", "b", "c"][..]).prop_map(Value::from),
        1 => Just(json!("")),
        1 => Just(Value::from("x".repeat(129))),
        1 => Just(json!("bad id")),
        1 => number(),
    ]
    .boxed()
}

fn step() -> BoxedStrategy<Step> {
    let speak = (
        context_id(),
        object(vec![
            ("text", text()),
            ("voice", one_of(&["ryan", "aiden", "bob"])),
            ("language", one_of(&["english", "auto", "klingon"])),
            ("instruct", text()),
            ("text_mode", one_of(&["streaming", "whole"])),
            ("seed", number()),
            ("sampling", sampling()),
        ]),
    )
        .prop_map(|(id, mut fields)| {
            fields["type"] = json!("speak");
            fields["context_id"] = id;
            fields
        });
    let control = (
        prop::sample::select(&["flush", "cancel", "pause", ""][..]),
        context_id(),
    )
        .prop_map(|(kind, id)| json!({"type": kind, "context_id": id}));
    prop_oneof![
        6 => speak.prop_map(Step::Json),
        4 => control.prop_map(Step::Json),
        1 => any::<String>().prop_map(Step::Raw),
        1 => Just(Step::Raw("{\"type\": \"speak\", \"context_id\": \"a\"".into())),
        1 => prop::collection::vec(any::<u8>(), 0..16).prop_map(Step::Binary),
    ]
    .boxed()
}

const CLIENT_CODES: [&str; 5] = [
    "invalid_json",
    "invalid_request",
    "unknown_context",
    "context_closed",
    "overloaded",
];

#[test]
fn any_websocket_message_sequence_keeps_the_connection_usable() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = runtime.block_on(TestServer::start(
        engine_options(4, 16, 2),
        ServerOptions::new("tiny"),
    ));
    let config = Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    };
    proptest!(config, |(steps in prop::collection::vec(step(), 1..12))| {
        let result: Result<(), String> = runtime.block_on(async {
            let mut ws = ws_connect(&server).await;
            for step in &steps {
                let message = match step {
                    Step::Json(v) => Message::text(v.to_string()),
                    Step::Raw(s) => Message::text(s.clone()),
                    Step::Binary(b) => Message::binary(b.clone()),
                };
                futures::SinkExt::send(&mut ws, message).await.map_err(|e| e.to_string())?;
            }
            for id in ["a", "b", "c"] {
                send(&mut ws, json!({"type": "cancel", "context_id": id})).await;
            }
            // A well-formed context still works on this connection.
            send(&mut ws, json!({"type": "speak", "context_id": "sentinel", "text": "Still here.",
                                 "voice": "ryan"})).await;
            send(&mut ws, json!({"type": "flush", "context_id": "sentinel"})).await;
            loop {
                match recv(&mut ws).await {
                    Received::Audio { .. } => {}
                    Received::Json(v) => match v["type"].as_str() {
                        Some("done") if v["context_id"] == "sentinel" => return Ok(()),
                        Some("done") => {}
                        Some("error") => {
                            let code = v["code"].as_str().unwrap_or_default();
                            if !CLIENT_CODES.contains(&code) {
                                return Err(format!("server-side error {v}"));
                            }
                        }
                        _ => return Err(format!("unexpected message {v}")),
                    },
                }
            }
        });
        prop_assert!(result.is_ok(), "{:?} after {:?}", result, steps);
    });
    runtime.block_on(server.wait_idle());
}

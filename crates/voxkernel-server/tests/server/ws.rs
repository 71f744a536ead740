//! The WebSocket context protocol (docs/protocol.md).

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

use crate::common::*;

fn speak(id: &str, text: &str) -> Value {
    json!({"type": "speak", "context_id": id, "text": text})
}

fn first_speak(id: &str, text: &str, seed: u64) -> Value {
    json!({"type": "speak", "context_id": id, "text": text, "voice": "ryan",
           "language": "english", "seed": seed})
}

fn flush(id: &str) -> Value {
    json!({"type": "flush", "context_id": id})
}

const B_PIECES: [&str; 4] = ["Second ", "context, spoken ", "token by", " token."];

/// Context "b" alone on its own connection.
async fn solo_b(server: &TestServer) -> (Vec<i16>, Value) {
    let mut ws = ws_connect(server).await;
    send(&mut ws, first_speak("b", B_PIECES[0], 2)).await;
    for piece in &B_PIECES[1..] {
        send(&mut ws, speak("b", piece)).await;
    }
    send(&mut ws, flush("b")).await;
    let mut others = Vec::new();
    let out = collect_context(&mut ws, "b", &mut others).await;
    assert!(others.is_empty(), "{others:?}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_contexts_with_a_cancel_leave_the_other_unchanged() {
    // Two slots: both contexts synthesise side by side.
    let server = TestServer::start(
        engine_options(2, 2, 40),
        voxkernel_server::ServerOptions::new("tiny"),
    )
    .await;
    let mut ws = ws_connect(&server).await;
    // "a" is long and gets cancelled once its audio flows; "b" arrives piece by piece between
    // "a"'s messages.
    send(
        &mut ws,
        first_speak("a", "The first context talks for a long while, ", 1),
    )
    .await;
    send(&mut ws, first_speak("b", B_PIECES[0], 2)).await;
    send(&mut ws, speak("a", "on and on ")).await;
    send(&mut ws, speak("b", B_PIECES[1])).await;
    send(&mut ws, flush("a")).await;
    send(&mut ws, speak("b", B_PIECES[2])).await;

    let mut a_audio = 0;
    let mut b_pcm = Vec::new();
    let mut b_done = None;
    let mut a_done = None;
    let mut b_rest_sent = false;
    while a_done.is_none() || b_done.is_none() {
        match recv(&mut ws).await {
            Received::Audio { context_id, pcm } if context_id == "a" => {
                a_audio += pcm.len();
                if a_audio == pcm.len() {
                    send(&mut ws, json!({"type": "cancel", "context_id": "a"})).await;
                }
            }
            Received::Audio { context_id, pcm } => {
                assert_eq!(context_id, "b");
                b_pcm.extend(pcm);
                if !b_rest_sent {
                    b_rest_sent = true;
                    send(&mut ws, speak("b", B_PIECES[3])).await;
                    send(&mut ws, flush("b")).await;
                }
            }
            Received::Json(v) => {
                assert_eq!(v["type"], "done", "{v}");
                if v["context_id"] == "a" {
                    a_done = Some(v);
                } else {
                    b_done = Some(v);
                }
            }
        }
    }
    let (a_done, b_done) = (a_done.unwrap(), b_done.unwrap());
    assert_eq!(a_done["finish_reason"], "cancelled");
    // Cut short of its 40-frame cap (the engine tests time the cancel to a frame).
    assert!(a_done["usage"]["frames"].as_u64().unwrap() < 40, "{a_done}");
    assert_eq!(
        a_done["usage"]["frames"].as_u64().unwrap() as usize * 1920,
        a_audio
    );

    // "b" is the same alone on a fresh connection.
    let (solo_pcm, solo_done) = solo_b(&server).await;
    assert_eq!(b_pcm, solo_pcm);
    assert_eq!(b_done["finish_reason"], solo_done["finish_reason"]);
    assert_eq!(b_done["usage"]["frames"], solo_done["usage"]["frames"]);
    assert!(!solo_pcm.is_empty());
    server.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_get_errors_and_the_connection_survives() {
    // One slot, so a context can be made to wait for it.
    let server = TestServer::start(
        engine_options(1, 8, 6),
        voxkernel_server::ServerOptions::new("tiny"),
    )
    .await;
    let mut ws = ws_connect(&server).await;
    let error = |v: &Value, id: Value, code: &str| {
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["context_id"], id, "{v}");
        assert_eq!(v["code"], code, "{v}");
        v["message"].as_str().unwrap().to_string()
    };

    ws.send(Message::text("hello?")).await.unwrap();
    error(&recv_json(&mut ws).await, Value::Null, "invalid_json");
    ws.send(Message::text(
        r#"{"type": "speak", "context_id": "n", "text": "Hi.", "seed": 1e400}"#,
    ))
    .await
    .unwrap();
    let message = error(&recv_json(&mut ws).await, Value::Null, "invalid_request");
    assert!(
        message.starts_with("seed: ") && message.contains("out of range"),
        "{message}"
    );
    ws.send(Message::binary(vec![1, 2, 3])).await.unwrap();
    error(&recv_json(&mut ws).await, Value::Null, "invalid_request");
    send(&mut ws, json!([1, 2])).await;
    error(&recv_json(&mut ws).await, Value::Null, "invalid_request");
    send(&mut ws, json!({"type": "speak", "text": "Hi"})).await;
    let message = error(&recv_json(&mut ws).await, Value::Null, "invalid_request");
    assert!(message.starts_with("context_id"), "{message}");
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "no spaces", "text": "Hi"}),
    )
    .await;
    error(&recv_json(&mut ws).await, Value::Null, "invalid_request");
    send(&mut ws, json!({"type": "shout", "context_id": "x"})).await;
    let message = error(&recv_json(&mut ws).await, json!("x"), "invalid_request");
    assert!(message.contains("speak, flush, cancel"), "{message}");

    // Bad settings name the field and the valid values.
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "x", "text": "Hi", "voice": "bob"}),
    )
    .await;
    let message = error(&recv_json(&mut ws).await, json!("x"), "invalid_request");
    assert!(
        message.starts_with("voice") && message.contains("ryan"),
        "{message}"
    );
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "x", "text": "Hi", "voice": "ryan",
                         "sampling": {"top_p": 0}}),
    )
    .await;
    let message = error(&recv_json(&mut ws).await, json!("x"), "invalid_request");
    assert!(message.contains("sampling.top_p"), "{message}");
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "x", "text": "Hi", "pitch": 3}),
    )
    .await;
    let message = error(&recv_json(&mut ws).await, json!("x"), "invalid_request");
    assert!(
        message.contains("pitch") && message.contains("voice"),
        "{message}"
    );
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "x", "voice": "ryan"}),
    )
    .await;
    let message = error(&recv_json(&mut ws).await, json!("x"), "invalid_request");
    assert!(message.starts_with("text: missing"), "{message}");

    // Context life cycle errors.
    send(&mut ws, flush("nobody")).await;
    error(
        &recv_json(&mut ws).await,
        json!("nobody"),
        "unknown_context",
    );
    send(&mut ws, json!({"type": "cancel", "context_id": "nobody"})).await;
    error(
        &recv_json(&mut ws).await,
        json!("nobody"),
        "unknown_context",
    );
    send(&mut ws, first_speak("y", "", 1)).await;
    send(&mut ws, flush("y")).await;
    let message = error(&recv_json(&mut ws).await, json!("y"), "invalid_request");
    assert!(message.starts_with("text"), "{message}");
    // Zero-width characters tokenize to ids, but there is nothing in them to speak.
    send(&mut ws, first_speak("w", "\u{200B}", 1)).await;
    send(&mut ws, speak("w", " \u{FEFF}\u{2060}")).await;
    send(&mut ws, flush("w")).await;
    let message = error(&recv_json(&mut ws).await, json!("w"), "invalid_request");
    assert!(message.contains("no text to speak"), "{message}");
    send(&mut ws, first_speak("z", "Hello ", 1)).await;
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "z", "text": "again", "seed": 4}),
    )
    .await;
    let message = error(&recv_json(&mut ws).await, json!("z"), "invalid_request");
    assert!(
        message.contains("seed") && message.contains("first speak"),
        "{message}"
    );
    // That error closed "z": a flush of it is now unknown.
    send(&mut ws, flush("z")).await;
    error(&recv_json(&mut ws).await, json!("z"), "unknown_context");
    send(&mut ws, speak("t", &"x".repeat(4097))).await;
    let message = error(&recv_json(&mut ws).await, json!("t"), "invalid_request");
    assert!(message.contains("4096"), "{message}");

    // Through all that the connection stayed up. "hold" takes the one slot (its text waits
    // for more), so "ok" cannot finish before the speak that follows its flush.
    send(&mut ws, first_speak("hold", "Hold on ", 9)).await;
    send(&mut ws, first_speak("ok", "All good.", 0)).await;
    send(&mut ws, flush("ok")).await;
    send(&mut ws, speak("ok", " More?")).await;
    error(&recv_json(&mut ws).await, json!("ok"), "context_closed");
    // A stray speak neither cuts the flushed "ok" nor keeps the cancelled "hold" from its done.
    // (The speak after the cancel is refused with context_closed if it comes before that done,
    // else it opens a new "hold" without a voice: an invalid_request. Either way it is one
    // error, and both contexts end with their done.)
    send(&mut ws, json!({"type": "cancel", "context_id": "hold"})).await;
    send(&mut ws, speak("hold", "more")).await;
    let mut received = Vec::new();
    let mut hold_error = None;
    while received
        .iter()
        .filter(|m| matches!(m, Received::Json(v) if v["type"] == "done"))
        .count()
        < 2
    {
        match recv(&mut ws).await {
            Received::Json(v) if v["type"] == "error" => {
                assert!(hold_error.is_none(), "a second error: {v}");
                hold_error = Some(v);
            }
            other => received.push(other),
        }
    }
    let hold_error = match hold_error {
        Some(v) => v,
        None => recv_json(&mut ws).await,
    };
    assert_eq!(hold_error["context_id"], "hold", "{hold_error}");
    assert!(
        ["context_closed", "invalid_request"].contains(&hold_error["code"].as_str().unwrap()),
        "{hold_error}"
    );
    let ended = collect_contexts(&mut ws, &["hold", "ok"], received).await;
    assert_eq!(ended["hold"].1["finish_reason"], "cancelled");
    assert_eq!(ended["ok"].1["finish_reason"], "max_frames");
    assert_eq!(ended["ok"].0.len(), 6 * 1920);
    // A context works, and an id is reusable after its done.
    for _ in 0..2 {
        send(&mut ws, first_speak("ok", "All good.", 0)).await;
        send(&mut ws, flush("ok")).await;
        let (pcm, done) = collect_context(&mut ws, "ok", &mut Vec::new()).await;
        assert_eq!(done["finish_reason"], "max_frames");
        assert_eq!(done["usage"]["frames"], 6);
        assert_eq!(pcm.len(), 6 * 1920);
        assert!(done["usage"]["time_to_first_audio_ms"].as_f64().unwrap() > 0.0);
        assert!(done["usage"]["rtf"].as_f64().unwrap() > 0.0);
    }
    server.wait_idle().await;
    let metrics = metrics(server.addr).await;
    assert_eq!(metrics["voxkernel_ws_contexts"], 0.0);
    assert_eq!(metrics["voxkernel_ws_connections"], 1.0);
    drop(ws);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_limit_closes_the_connection_with_1009() {
    let options = voxkernel_server::ServerOptions::new("tiny");
    let max = options.max_ws_message_bytes;
    let server = TestServer::start(engine_options(1, 8, 6), options).await;
    let mut ws = ws_connect(&server).await;
    send(&mut ws, first_speak("a", "Hello ", 1)).await;
    let text = "x".repeat(max);
    send(&mut ws, speak("a", &text)).await;
    let close = loop {
        match tokio::time::timeout(HANG, ws.next())
            .await
            .expect("the server hung")
        {
            Some(Ok(Message::Close(frame))) => break frame,
            Some(Ok(_)) => continue,
            other => panic!("no close frame: {other:?}"),
        }
    };
    let close = close.expect("a close code");
    assert_eq!(u16::from(close.code), 1009, "{close:?}");
    assert!(close.reason.contains(&max.to_string()), "{close:?}");
    // The connection's context was cancelled with it.
    server.wait_idle().await;
    assert_eq!(metrics(server.addr).await["voxkernel_ws_contexts"], 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audio_header_carries_the_context_id_and_packets_grow() {
    let server = TestServer::start(
        engine_options(2, 2, 20),
        voxkernel_server::ServerOptions::new("tiny"),
    )
    .await;
    let mut ws = ws_connect(&server).await;
    let id = "turn-1:a.b_c";
    send(&mut ws, first_speak(id, "Packets grow as they go.", 3)).await;
    send(&mut ws, flush(id)).await;
    let mut sizes = Vec::new();
    loop {
        match recv(&mut ws).await {
            Received::Audio { context_id, pcm } => {
                assert_eq!(context_id, id);
                sizes.push(pcm.len() / 1920);
            }
            Received::Json(v) => {
                assert_eq!(v["type"], "done");
                break;
            }
        }
    }
    // docs/protocol.md: 1, 2, 4, 8 frames, then 8 each; here 20 frames in all.
    assert_eq!(sizes, vec![1, 2, 4, 8, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_after_drain_cuts_open_contexts_and_the_server_returns() {
    let server = TestServer::default().await;
    let mut ws = ws_connect(&server).await;
    // A context whose text never ends would keep a draining server up forever.
    send(&mut ws, first_speak("open", "Never finished ", 1)).await;
    let Received::Audio { .. } = recv(&mut ws).await else {
        panic!("expected audio first");
    };
    server.shutdown.drain();
    send(&mut ws, first_speak("new", "Too late.", 2)).await;
    let refused = recv_json(&mut ws).await;
    assert_eq!(refused["code"], "overloaded", "{refused}");
    server.shutdown.stop();
    // The server closes the connection (going away), cancelling the context, and returns.
    loop {
        match tokio::time::timeout(HANG, futures::StreamExt::next(&mut ws))
            .await
            .unwrap()
        {
            Some(Ok(Message::Close(Some(frame)))) => {
                assert_eq!(u16::from(frame.code), 1001);
                break;
            }
            Some(Ok(_)) => {}
            other => panic!("expected a close frame, got {other:?}"),
        }
    }
    let engine = std::sync::Arc::clone(&server.engine);
    tokio::time::timeout(HANG, server.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    wait_engine_idle(&engine).await;
}

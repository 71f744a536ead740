//! Admission: past `--max-sessions` + `--max-queue`, requests get 503 with Retry-After
//! (WebSocket: `overloaded`), and every accepted request still completes.

use serde_json::json;
use voxkernel_server::ServerOptions;

use crate::common::*;

fn speech(seed: u64) -> serde_json::Value {
    json!({"model": "tts-1", "input": "Busy, busy.", "voice": "ryan", "seed": seed,
           "response_format": "pcm"})
}

async fn burst(server: &TestServer, n: u64) -> Vec<HttpResponse> {
    let requests = (0..n).map(|seed| {
        let addr = server.addr;
        tokio::spawn(async move { post_json(addr, "/v1/audio/speech", &speech(seed)).await })
    });
    let mut responses = Vec::new();
    for request in requests.collect::<Vec<_>>() {
        responses.push(request.await.unwrap());
    }
    responses
}

fn assert_refused(response: &HttpResponse) {
    assert_eq!(response.status, 503);
    assert_eq!(response.headers["retry-after"], "1");
    let error = response.error();
    assert_eq!(error["code"], "overloaded");
    assert_eq!(error["type"], "server_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_capacity_gets_503s_and_accepted_requests_complete() {
    const MAX_SESSIONS: usize = 2;
    const FRAMES: usize = 12;
    let server = TestServer::start(
        engine_options(MAX_SESSIONS, 0, FRAMES),
        ServerOptions::new("tiny"),
    )
    .await;

    // Two contexts whose text is still open hold both sessions, so the whole burst meets a
    // full server: 10x max-sessions requests in all.
    let mut ws = ws_connect(&server).await;
    for (id, seed) in [("h1", 1), ("h2", 2)] {
        send(
            &mut ws,
            json!({"type": "speak", "context_id": id, "text": "Hold on ",
                             "voice": "ryan", "seed": seed}),
        )
        .await;
    }
    // Audio read before each context's own collection below.
    let mut others = Vec::new();
    let mut audio_from = std::collections::HashSet::new();
    while audio_from.len() < MAX_SESSIONS {
        let message = recv(&mut ws).await;
        if let Received::Audio { context_id, .. } = &message {
            audio_from.insert(context_id.clone());
        }
        others.push(message);
    }
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "h3", "text": "Me too.",
                         "voice": "ryan"}),
    )
    .await;
    let refused = loop {
        match recv(&mut ws).await {
            Received::Json(v) => break v,
            audio => others.push(audio),
        }
    };
    assert_eq!(
        (refused["code"].as_str(), refused["context_id"].as_str()),
        (Some("overloaded"), Some("h3"))
    );
    let responses = burst(&server, 10 * MAX_SESSIONS as u64 - 3).await;
    responses.iter().for_each(assert_refused);
    // The accepted ones complete in full.
    for id in ["h1", "h2"] {
        send(&mut ws, json!({"type": "flush", "context_id": id})).await;
    }
    for (_, (pcm, done)) in collect_contexts(&mut ws, &["h1", "h2"], others).await {
        assert_eq!(done["finish_reason"], "max_frames");
        assert_eq!(done["usage"]["frames"], FRAMES);
        assert_eq!(pcm.len(), FRAMES * 1920);
    }
    server.wait_idle().await;

    // A burst with nothing held: whatever fits is served in full, the rest is refused.
    let responses = burst(&server, 10 * MAX_SESSIONS as u64).await;
    let mut served = 0;
    for response in &responses {
        if response.status == 200 {
            assert!(response.complete);
            assert_eq!(response.body.len(), FRAMES * 1920 * 2);
            served += 1;
        } else {
            assert_refused(response);
        }
    }
    assert!(served >= MAX_SESSIONS, "{served} served");
    server.wait_idle().await;
    let metrics = metrics(server.addr).await;
    assert!(metrics[r#"voxkernel_errors_total{kind="overloaded"}"#] >= 18.0);
}

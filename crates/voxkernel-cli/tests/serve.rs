//! `voxkernel serve` as a process, on the CPU backend with the tiny random CustomVoice
//! checkpoint: clients that vanish or cancel at random leave nothing behind, SIGTERM drains
//! in-flight streams before exiting, and the official `openai` Python package streams speech
//! from it.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// Nothing here may take this long; reaching it means a hang.
const HANG: Duration = Duration::from_secs(120);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity/tiny-custom-voice")
}

/// A `voxkernel serve` child on 127.0.0.1 with a free port; killed when dropped.
struct ServeProcess {
    child: Child,
    addr: SocketAddr,
    /// The server's log lines, gathered by a thread.
    log: std::sync::mpsc::Receiver<String>,
}

impl ServeProcess {
    fn start(extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_voxkernel"))
            .args(["serve", "--backend", "cpu", "--port", "0", "--model"])
            .arg(fixture())
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, log) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let addr = loop {
            let line = log
                .recv_timeout(HANG)
                .expect("voxkernel serve exited or hung before listening");
            if let Some((_, addr)) = line.split_once("listening on http://") {
                break addr.trim().parse().unwrap();
            }
        };
        Self { child, addr, log }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the exit, returning its status and the log lines since the last read.
    fn wait(&mut self) -> (std::process::ExitStatus, Vec<String>) {
        for _ in 0..(HANG.as_millis() / 50) {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, self.log.try_iter().collect());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("voxkernel serve did not exit");
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn request(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Status and body of one request on its own connection (a chunked body is left as sent).
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    tokio::time::timeout(HANG, async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(&request(method, path, body))
            .await
            .unwrap();
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
        let body = raw.split_once("\r\n\r\n").unwrap().1.to_string();
        (status, body)
    })
    .await
    .expect("the server hung")
}

/// Whether `/readyz` answers 200 (a refused connection is not ready).
async fn ready(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return false;
    };
    let mut raw = Vec::new();
    if stream
        .write_all(&request("GET", "/readyz", ""))
        .await
        .is_err()
        || stream.read_to_end(&mut raw).await.is_err()
    {
        return false;
    }
    raw.starts_with(b"HTTP/1.1 200")
}

async fn metrics(addr: SocketAddr) -> HashMap<String, f64> {
    let (status, body) = http(addr, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    body.lines()
        .filter(|l| l.starts_with("voxkernel_") || l.starts_with("process_"))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

async fn ws_connect(addr: SocketAddr) -> Ws {
    tokio_tungstenite::connect_async(format!("ws://{addr}/v1/tts/ws"))
        .await
        .unwrap()
        .0
}

async fn send(ws: &mut Ws, message: Value) {
    ws.send(Message::text(message.to_string())).await.unwrap();
}

/// The next JSON message, skipping audio; `None` once the server closed the connection.
async fn next_json(ws: &mut Ws) -> Option<Value> {
    loop {
        let message = tokio::time::timeout(HANG, ws.next())
            .await
            .expect("the server hung")?;
        match message {
            Ok(Message::Text(text)) => return Some(serde_json::from_str(&text).unwrap()),
            Ok(Message::Close(_)) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

fn speak(id: &str, text: &str, seed: u64) -> Value {
    json!({"type": "speak", "context_id": id, "text": text, "voice": "ryan", "seed": seed})
}

const SPEECH: &str = r#"{"model":"tts-1","input":"Random clients come and go.","voice":"ryan","response_format":"pcm"}"#;

/// A small deterministic generator, so a failing run can be replayed.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// One client that leaves early in one of several ways.
async fn misbehave(addr: SocketAddr, kind: u64, wait: u64) {
    match kind {
        // HTTP: gone before the response starts.
        0 => {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(&request("POST", "/v1/audio/speech", SPEECH))
                .await
                .unwrap();
        }
        // HTTP: gone after some audio.
        1 => {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream
                .write_all(&request("POST", "/v1/audio/speech", SPEECH))
                .await
                .unwrap();
            let mut buf = vec![0; 1 + wait as usize * 2000];
            let _ = stream.read_exact(&mut buf).await;
        }
        // WebSocket: contexts open, the socket dropped without a close frame.
        2 => {
            let mut ws = ws_connect(addr).await;
            for i in 0..=wait % 3 {
                send(&mut ws, speak(&format!("c{i}"), "Drop me now, ", i)).await;
            }
            // Streamed text runs out, so a context may go quiet: read a little, briefly.
            for _ in 0..wait {
                let _ = tokio::time::timeout(Duration::from_millis(100), ws.next()).await;
            }
        }
        // WebSocket: cancel mid-stream and wait for the cancelled done.
        _ => {
            let mut ws = ws_connect(addr).await;
            send(&mut ws, speak("x", "Cancel me in a moment.", wait)).await;
            send(&mut ws, json!({"type": "flush", "context_id": "x"})).await;
            for _ in 0..wait {
                let _ = ws.next().await;
            }
            send(&mut ws, json!({"type": "cancel", "context_id": "x"})).await;
            let done = next_json(&mut ws).await.unwrap();
            assert_eq!(done["type"], "done", "{done}");
            ws.close(None).await.unwrap();
        }
    }
}

/// Waits until the server holds no session, stream, context or connection.
async fn wait_baseline(addr: SocketAddr) -> HashMap<String, f64> {
    let keys = [
        "voxkernel_sessions_active",
        "voxkernel_sessions_queued",
        "voxkernel_http_streams",
        "voxkernel_ws_connections",
        "voxkernel_ws_contexts",
    ];
    for _ in 0..1000 {
        let m = metrics(addr).await;
        if keys.iter().all(|k| m[*k] == 0.0) {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not back to baseline: {:?}", metrics(addr).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_disconnects_and_cancels_leave_nothing_behind() {
    let server = ServeProcess::start(&[
        "--max-sessions",
        "4",
        "--max-queue",
        "64",
        "--max-frames",
        "24",
    ]);
    let addr = server.addr;
    let mut rng = Lcg(0x5eed);
    let mut plan =
        |n: usize| -> Vec<(u64, u64)> { (0..n).map(|_| (rng.below(4), rng.below(6))).collect() };
    let run = |ops: Vec<(u64, u64)>| async move {
        // Eight clients at a time.
        for batch in ops.chunks(8) {
            let clients: Vec<_> = batch
                .iter()
                .map(|&(kind, wait)| tokio::spawn(misbehave(addr, kind, wait)))
                .collect();
            for client in clients {
                tokio::time::timeout(HANG, client)
                    .await
                    .expect("a client hung")
                    .unwrap();
            }
        }
    };
    // Warm-up: allocator pools, thread stacks and caches reach their working size.
    run(plan(40)).await;
    let before = wait_baseline(addr).await;
    let ops = plan(200);
    // Clients that read audio before leaving surely had their session started.
    let surely_started = ops
        .iter()
        .filter(|&&(kind, wait)| kind == 1 || (kind == 3 && wait > 0))
        .count() as f64;
    run(ops).await;
    let after = wait_baseline(addr).await;

    let started =
        after["voxkernel_sessions_started_total"] - before["voxkernel_sessions_started_total"];
    let finished: f64 = ["cancelled", "disconnected", "error", "max_frames", "eos"]
        .iter()
        .map(|r| {
            let key = format!("voxkernel_sessions_finished_total{{finish_reason=\"{r}\"}}");
            after.get(&key).unwrap_or(&0.0) - before.get(&key).unwrap_or(&0.0)
        })
        .sum();
    // Sessions ran (some clients left before theirs started), and every end was accounted for.
    assert!(started >= surely_started, "{started} sessions started");
    assert!(
        finished >= started,
        "{finished} sessions ended, {started} started"
    );
    // Memory back to its warmed-up level (within allocator slack).
    let growth = after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"];
    assert!(
        growth < 16.0 * 1024.0 * 1024.0,
        "RSS grew by {} MiB",
        growth / 1048576.0
    );
    // And it still serves.
    let (status, body) = http(addr, "POST", "/v1/audio/speech", SPEECH).await;
    assert_eq!(status, 200);
    assert!(body.ends_with("0\r\n\r\n"), "cut stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_streams_then_exits() {
    // One slot for two sessions (a WebSocket context whose text is still open, and an HTTP
    // request), so both are surely in flight when SIGTERM comes.
    let mut server = ServeProcess::start(&["--max-sessions", "1", "--max-frames", "8"]);
    let addr = server.addr;
    let mut ws = ws_connect(addr).await;
    send(&mut ws, speak("turn", "Hold on, ", 1)).await;
    let waiting = tokio::spawn(http(addr, "POST", "/v1/audio/speech", SPEECH));
    // Both sessions in the engine. Not `queued >= 1` alone: the WebSocket context counts as
    // queued while it waits for text, before the HTTP request has even been read, and a
    // connection not yet read from is closed unanswered by the drain.
    loop {
        let m = metrics(addr).await;
        if m["voxkernel_sessions_active"] + m["voxkernel_sessions_queued"] >= 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    server.signal("TERM");
    // Draining: the listener closes (or, on a kept-alive connection, /readyz says 503).
    while ready(addr).await {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Draining: no new contexts, the open one finishes.
    send(&mut ws, speak("late", "Too late.", 2)).await;
    let refused = next_json(&mut ws).await.unwrap();
    assert_eq!(
        (refused["code"].as_str(), refused["context_id"].as_str()),
        (Some("overloaded"), Some("late"))
    );
    send(
        &mut ws,
        json!({"type": "speak", "context_id": "turn", "text": "almost done."}),
    )
    .await;
    send(&mut ws, json!({"type": "flush", "context_id": "turn"})).await;
    let done = next_json(&mut ws).await.unwrap();
    assert_eq!(
        (done["type"].as_str(), done["finish_reason"].as_str()),
        (Some("done"), Some("max_frames"))
    );
    // With its last context done, the server closes the connection.
    assert!(next_json(&mut ws).await.is_none());
    let (status, body) = waiting.await.unwrap();
    assert_eq!(status, 200);
    assert!(body.ends_with("0\r\n\r\n"), "cut stream");

    let (exit, log) = server.wait();
    assert!(exit.success(), "{exit}: {log:?}");
    assert!(log.iter().any(|l| l.contains("drained")), "{log:?}");
}

/// Runs crates/voxkernel-cli/tests/openai_speech.py with the Python named by
/// VOXKERNEL_TEST_PYTHON (scripts/test.sh makes a venv with `openai` and runs this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs VOXKERNEL_TEST_PYTHON with the openai package; scripts/test.sh runs it"]
async fn the_openai_python_package_streams_speech() {
    let python = std::env::var("VOXKERNEL_TEST_PYTHON")
        .expect("VOXKERNEL_TEST_PYTHON: a Python with the openai package");
    let server = ServeProcess::start(&["--max-frames", "10", "--api-key", "test-key"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_speech.py");
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .arg(format!("http://{}/v1", server.addr))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = common::stdout_of_success(&output);
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    // Ten frames of 1920 samples each way.
    assert_eq!(report["pcm_bytes"], 10 * 1920 * 2);
    assert_eq!(report["wav_bytes"], 44 + 10 * 1920 * 2);
    assert_eq!(report["sse_audio_bytes"], 10 * 1920 * 2);
    assert_eq!(report["sse_output_tokens"], 10);
    assert_eq!(report["bad_format_status"], 400);
    assert_eq!(report["no_key_status"], 401);
}

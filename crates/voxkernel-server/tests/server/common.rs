//! A server on 127.0.0.1:0 in this process (CPU backends, the tiny random CustomVoice
//! checkpoint, or the tiny random Base checkpoint for voice cloning), a minimal HTTP/1.1 client
//! and WebSocket helpers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::{Engine, EngineOptions, Model};
use voxkernel_core::reference::codec_decoder::CodecDecoder;
use voxkernel_core::reference::{ReferenceBackend, ReferenceCodec};
use voxkernel_core::voice_clone::{CloneEncoder, VoiceEncoder};
use voxkernel_server::{Server, ServerOptions, ShutdownHandle};

/// Nothing in these tests may take this long; reaching it means a hang.
pub const HANG: Duration = Duration::from_secs(120);

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| {
        Arc::new(Model::load(&fixtures().join("parity/tiny-custom-voice")).unwrap())
    }))
}

/// The tiny Base checkpoint of the voice-clone fixtures.
pub fn base_model_dir() -> PathBuf {
    fixtures().join("clone/tiny-base")
}

pub fn base_model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| Arc::new(Model::load(&base_model_dir()).unwrap())))
}

/// The CPU voice encoder a Base model's server needs; none for the others.
pub fn voice_encoder(model: &Model) -> Option<Box<dyn CloneEncoder>> {
    (model.checkpoint.config.model_type == ModelType::Base).then(|| {
        Box::new(VoiceEncoder::from_checkpoint(&model.checkpoint).unwrap()) as Box<dyn CloneEncoder>
    })
}

/// Short utterances keep the tests fast: the random weights never say EOS.
pub fn engine_options(max_active: usize, max_queue: usize, max_frames: usize) -> EngineOptions {
    EngineOptions {
        max_active,
        max_queue,
        max_frames_cap: max_frames,
        ..EngineOptions::default()
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub shutdown: ShutdownHandle,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    pub async fn start(engine: EngineOptions, options: ServerOptions) -> Self {
        Self::start_model(model(), engine, options).await
    }

    pub async fn start_model(
        model: Arc<Model>,
        engine: EngineOptions,
        options: ServerOptions,
    ) -> Self {
        let frames = ReferenceBackend::new(&model.checkpoint).unwrap();
        let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint).unwrap());
        let encoder = voice_encoder(&model);
        let engine = Arc::new(
            Engine::start(
                model,
                Box::new(frames),
                Box::new(ReferenceCodec::new(decoder)),
                engine,
            )
            .unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = Server::new(Arc::clone(&engine), options, encoder).unwrap();
        let shutdown = server.shutdown_handle();
        let task = tokio::spawn(server.serve(listener));
        Self {
            addr,
            engine,
            shutdown,
            task,
        }
    }

    pub async fn default() -> Self {
        Self::start(
            engine_options(4, 8, 6),
            ServerOptions::new("tiny-custom-voice"),
        )
        .await
    }

    pub fn ws_url(&self) -> String {
        format!("ws://{}/v1/tts/ws", self.addr)
    }

    /// Waits until the engine holds no session (a leak would time out).
    pub async fn wait_idle(&self) {
        wait_engine_idle(&self.engine).await;
    }
}

pub async fn wait_engine_idle(engine: &Engine) {
    {
        for _ in 0..2000 {
            let stats = engine.stats();
            if stats.active == 0 && stats.waiting == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("sessions still held: {:?}", engine.stats());
    }
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    /// A chunked body ended with its last chunk (the stream was not cut).
    pub complete: bool,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// The OpenAI error object, checking its shape.
    pub fn error(&self) -> Value {
        let json = self.json();
        let error = json["error"].clone();
        assert!(error["message"].is_string(), "{json}");
        assert!(error["type"].is_string(), "{json}");
        assert!(error["code"].is_string(), "{json}");
        assert!(error.get("param").is_some(), "{json}");
        error
    }
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// One request on its own connection, read to the end.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    tokio::time::timeout(HANG, async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(&request_bytes(method, path, headers, body))
            .await
            .unwrap();
        let mut raw = Vec::new();
        // A cut stream ends in a reset; what came before it still counts.
        let _ = stream.read_to_end(&mut raw).await;
        parse_response(&raw)
    })
    .await
    .expect("the server hung")
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    http(
        addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .await
}

pub fn parse_response(raw: &[u8]) -> HttpResponse {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rest = &raw[end + 4..];
    let (body, complete) =
        if headers.get("transfer-encoding").map(String::as_str) == Some("chunked") {
            dechunk(rest)
        } else {
            (rest.to_vec(), true)
        };
    HttpResponse {
        status,
        headers,
        body,
        complete,
    }
}

fn dechunk(mut raw: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(line_end) = raw.windows(2).position(|w| w == b"\r\n") else {
            return (body, false);
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).unwrap(), 16).unwrap();
        raw = &raw[line_end + 2..];
        if size == 0 {
            return (body, true);
        }
        if raw.len() < size + 2 {
            body.extend_from_slice(&raw[..raw.len().min(size)]);
            return (body, false);
        }
        body.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

pub type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<TcpStream>>;

pub async fn ws_connect(server: &TestServer) -> Ws {
    tokio_tungstenite::connect_async(server.ws_url())
        .await
        .unwrap()
        .0
}

pub async fn send(ws: &mut Ws, message: Value) {
    ws.send(Message::text(message.to_string())).await.unwrap();
}

/// A server message: audio for a context, or JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    Audio { context_id: String, pcm: Vec<i16> },
    Json(Value),
}

pub async fn recv(ws: &mut Ws) -> Received {
    loop {
        let message = tokio::time::timeout(HANG, ws.next())
            .await
            .expect("the server hung")
            .expect("the connection closed")
            .expect("a websocket error");
        match message {
            Message::Binary(bytes) => {
                let h = bytes[0] as usize;
                assert!(h >= 2 && bytes.len() >= h && (bytes.len() - h).is_multiple_of(2));
                return Received::Audio {
                    context_id: String::from_utf8(bytes[1..h].to_vec()).unwrap(),
                    pcm: bytes[h..]
                        .chunks(2)
                        .map(|b| i16::from_le_bytes([b[0], b[1]]))
                        .collect(),
                };
            }
            Message::Text(text) => return Received::Json(serde_json::from_str(&text).unwrap()),
            _ => {}
        }
    }
}

/// Reads until a JSON message (skipping audio), which it returns.
pub async fn recv_json(ws: &mut Ws) -> Value {
    loop {
        if let Received::Json(v) = recv(ws).await {
            return v;
        }
    }
}

/// A context's audio and its `done`, reading until that `done` (other contexts' messages are
/// kept in `others`).
pub async fn collect_context(
    ws: &mut Ws,
    id: &str,
    others: &mut Vec<Received>,
) -> (Vec<i16>, Value) {
    let mut pcm = Vec::new();
    loop {
        match recv(ws).await {
            Received::Audio { context_id, pcm: p } if context_id == id => pcm.extend(p),
            Received::Json(v) if v["context_id"] == id => {
                assert_eq!(v["type"], "done", "{v}");
                return (pcm, v);
            }
            other => others.push(other),
        }
    }
}

/// Every listed context's audio and `done`, counting messages already `received` first, and
/// reading until each is done (in whatever order they finish).
pub async fn collect_contexts(
    ws: &mut Ws,
    ids: &[&str],
    received: Vec<Received>,
) -> HashMap<String, (Vec<i16>, Value)> {
    let mut pcm: HashMap<String, Vec<i16>> = HashMap::new();
    let mut done = HashMap::new();
    let mut pending = received.into_iter();
    while ids.iter().any(|id| !done.contains_key(*id)) {
        let message = match pending.next() {
            Some(message) => message,
            None => recv(ws).await,
        };
        match message {
            Received::Audio { context_id, pcm: p } => pcm.entry(context_id).or_default().extend(p),
            Received::Json(v) => {
                assert_eq!(v["type"], "done", "{v}");
                done.insert(v["context_id"].as_str().unwrap().to_string(), v);
            }
        }
    }
    ids.iter()
        .map(|&id| {
            let id = id.to_string();
            let audio = pcm.remove(&id).unwrap_or_default();
            let done = done.remove(&id).unwrap();
            (id, (audio, done))
        })
        .collect()
}

pub fn pcm_of(bytes: &[u8]) -> Vec<i16> {
    bytes
        .chunks(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// Reads `/metrics` into name{labels} -> value.
pub async fn metrics(addr: SocketAddr) -> HashMap<String, f64> {
    let response = http(addr, "GET", "/metrics", &[], b"").await;
    assert_eq!(response.status, 200);
    String::from_utf8(response.body)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

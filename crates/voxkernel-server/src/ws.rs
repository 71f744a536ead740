//! `/v1/tts/ws`: the context protocol of docs/protocol.md. One task per connection owns the
//! socket, the open contexts and their engine sessions; closing the connection drops them all,
//! which cancels every session.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, Stream, StreamExt};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio_stream::StreamMap;
use tracing::Instrument;
use voxkernel_core::engine::{OpenError, SessionEvent, SessionEvents, SessionHandle, Usage};
use voxkernel_core::tokenizer::has_speakable_text;

use crate::error::{ApiError, FieldError, is_number_out_of_range};
use crate::metrics::GaugeGuard;
use crate::request::{SamplingFields, Settings, TextModeField};
use crate::state::{AppState, Phase, WsConnectionGuard};

pub async fn upgrade(State(state): State<Arc<AppState>>, ws: WebSocketUpgrade) -> Response {
    if state.phase() != Phase::Serving {
        return ApiError::overloaded("the server is shutting down").into_response();
    }
    let span = tracing::Span::current();
    let guard = state.ws_connection();
    let max = state.options.max_ws_message_bytes;
    ws.max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| Connection::new(state, guard).run(socket).instrument(span))
}

type EventStream = Pin<Box<dyn Stream<Item = SessionEvent> + Send>>;

/// A session's events, ending after `Done` or `Error`; an engine that went away without either
/// reads as an error, so every context gets a last word.
fn event_stream(events: SessionEvents) -> EventStream {
    Box::pin(futures::stream::unfold(Some(events), |events| async move {
        let mut events = events?;
        match events.recv().await {
            Some(event @ (SessionEvent::Done(_) | SessionEvent::Error(_))) => Some((event, None)),
            Some(event) => Some((event, Some(events))),
            None => Some((SessionEvent::Error("the engine stopped".into()), None)),
        }
    }))
}

struct Context {
    handle: SessionHandle,
    flushed: bool,
    cancelled: bool,
    /// Whether any non-blank text arrived (a flush needs some).
    has_text: bool,
    chars: usize,
    _open: GaugeGuard,
}

impl Context {
    /// Whether the client may still add text (neither flushed nor cancelled).
    fn takes_text(&self) -> bool {
        !self.flushed && !self.cancelled
    }
}

struct Connection {
    state: Arc<AppState>,
    contexts: HashMap<String, Context>,
    /// Keyed by context id: removing one drops its events, which cancels its session.
    events: StreamMap<String, EventStream>,
    _connection: WsConnectionGuard,
    _gauge: GaugeGuard,
}

/// What the client may send; each message type is parsed with unknown fields refused.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Speak {
    #[serde(rename = "type")]
    _type: String,
    #[serde(rename = "context_id")]
    _context_id: String,
    text: String,
    voice: Option<String>,
    language: Option<String>,
    instruct: Option<String>,
    text_mode: Option<TextModeField>,
    seed: Option<u64>,
    sampling: Option<SamplingFields>,
}

impl Speak {
    /// The settings this message carries, by name (only a context's first speak may).
    fn settings(&self) -> Vec<&'static str> {
        [
            ("voice", self.voice.is_some()),
            ("language", self.language.is_some()),
            ("instruct", self.instruct.is_some()),
            ("text_mode", self.text_mode.is_some()),
            ("seed", self.seed.is_some()),
            ("sampling", self.sampling.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

/// `flush` and `cancel` carry nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Control {
    #[serde(rename = "type")]
    _type: String,
    #[serde(rename = "context_id")]
    _context_id: String,
}

/// A protocol error: its code (docs/protocol.md) and message.
struct WsError {
    code: &'static str,
    message: String,
}

impl WsError {
    fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid_request", message)
    }
}

const CONTEXT_ID_RULE: &str =
    "context_id: must be a string of 1-128 letters, digits, '-', '_', '.' or ':'";

fn valid_context_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

impl Connection {
    fn new(state: Arc<AppState>, connection: WsConnectionGuard) -> Self {
        let gauge = GaugeGuard::new(&state.metrics.ws_connections);
        Self {
            state,
            contexts: HashMap::new(),
            events: StreamMap::new(),
            _connection: connection,
            _gauge: gauge,
        }
    }

    async fn run(mut self, socket: WebSocket) {
        tracing::info!("websocket open");
        let (mut sink, mut incoming) = socket.split();
        let mut phase = self.state.watch_phase();
        loop {
            let current = *phase.borrow_and_update();
            let closing = match current {
                Phase::Stopping => true,
                Phase::Draining => self.contexts.is_empty(),
                Phase::Serving => false,
            };
            if closing {
                let frame = CloseFrame {
                    code: close_code::AWAY,
                    reason: "the server is shutting down".into(),
                };
                let _ = sink.send(Message::Close(Some(frame))).await;
                break;
            }
            let out = tokio::select! {
                message = incoming.next() => match message {
                    Some(Ok(Message::Close(_))) | None => break,
                    Some(Err(error)) => {
                        if message_too_big(error) {
                            let frame = CloseFrame {
                                code: close_code::SIZE,
                                reason: format!(
                                    "a message may hold at most {} bytes",
                                    self.state.options.max_ws_message_bytes
                                )
                                .into(),
                            };
                            let _ = sink.send(Message::Close(Some(frame))).await;
                        }
                        break;
                    }
                    Some(Ok(message)) => self.on_message(message),
                },
                Some((id, event)) = self.events.next(), if !self.events.is_empty() => {
                    vec![self.on_event(id, event)]
                }
                changed = phase.changed() => match changed {
                    Ok(()) => Vec::new(),
                    Err(_) => break,
                },
            };
            let mut sent = true;
            for message in out {
                if sink.send(message).await.is_err() {
                    tracing::debug!("websocket write failed; closing");
                    sent = false;
                    break;
                }
            }
            if !sent {
                break;
            }
        }
        tracing::info!(
            open_contexts = self.contexts.len(),
            "websocket closed; its open contexts are cancelled"
        );
        for _ in self.contexts.drain() {
            self.state.metrics.session_ended("disconnected");
        }
    }

    fn on_message(&mut self, message: Message) -> Vec<Message> {
        match message {
            Message::Text(text) => self
                .on_text(text.as_str())
                .err()
                .into_iter()
                .map(|(id, e)| self.error_message(id, e))
                .collect(),
            Message::Binary(_) => vec![self.error_message(
                None,
                WsError::invalid(
                    "binary messages are not accepted: send JSON text messages (docs/protocol.md)",
                ),
            )],
            // Pings are answered by the socket itself.
            _ => Vec::new(),
        }
    }

    /// Handles one client message. An error tied to a context whose text is open closes it.
    fn on_text(&mut self, text: &str) -> Result<(), (Option<String>, WsError)> {
        let value: Value =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
                .map_err(|e| {
                    let path = e.path().to_string();
                    let inner = e.into_inner();
                    let field = is_number_out_of_range(&inner)
                        .then(|| FieldError::of_deserialize(&path, &inner.to_string()))
                        .flatten();
                    let error = match field {
                        Some(field) => WsError::invalid(field.message),
                        None => WsError::new("invalid_json", format!("not JSON: {inner}")),
                    };
                    (None, error)
                })?;
        let Some(object) = value.as_object() else {
            return Err((
                None,
                WsError::invalid("a message must be a JSON object with type and context_id"),
            ));
        };
        let id = match object.get("context_id") {
            None | Some(Value::Null) => {
                return Err((
                    None,
                    WsError::invalid("context_id: missing; every message names its context"),
                ));
            }
            Some(Value::String(id)) if valid_context_id(id) => id.clone(),
            Some(_) => return Err((None, WsError::invalid(CONTEXT_ID_RULE))),
        };
        let result = match object.get("type").and_then(Value::as_str) {
            Some("speak") => parse(value).and_then(|m| self.speak(&id, m)),
            Some("flush") => parse::<Control>(value).and_then(|_| self.flush(&id)),
            Some("cancel") => parse::<Control>(value).and_then(|_| self.cancel(&id)),
            other => Err(WsError::invalid(format!(
                "type: {}; valid: speak, flush, cancel",
                match other {
                    Some(t) => format!("unknown message type {t:?}"),
                    None => "missing or not a string".into(),
                }
            ))),
        };
        result.map_err(|e| {
            // What the client meant for a context whose text is still open is unknown, so the
            // error closes it; a flushed or cancelled context has all its text already and runs
            // to its done whatever stray message follows.
            if self.contexts.get(&id).is_some_and(Context::takes_text) {
                self.close(&id);
            }
            (Some(id), e)
        })
    }

    fn speak(&mut self, id: &str, message: Speak) -> Result<(), WsError> {
        let settings = message.settings();
        let limit = self.state.options.max_text_chars;
        let chars = message.text.chars().count();
        if let Some(context) = self.contexts.get_mut(id) {
            if !context.takes_text() {
                return Err(WsError::new(
                    "context_closed",
                    format!(
                        "context {id:?} was {}; its text is closed (open a new context after its \
                         done)",
                        if context.cancelled {
                            "cancelled"
                        } else {
                            "flushed"
                        }
                    ),
                ));
            }
            if !settings.is_empty() {
                return Err(WsError::invalid(format!(
                    "{}: settings go only in the first speak of a context",
                    settings.join(", ")
                )));
            }
            if context.chars + chars > limit {
                return Err(WsError::invalid(format!(
                    "text: the context's text would be {} characters, over the limit of {limit}",
                    context.chars + chars
                )));
            }
            context.chars += chars;
            context.has_text |= has_speakable_text(&message.text);
            if !message.text.is_empty() {
                context.handle.push_text(&message.text);
            }
            return Ok(());
        }
        if self.state.phase() != Phase::Serving {
            return Err(WsError::new(
                "overloaded",
                "the server is shutting down: no new contexts on this connection; reconnect",
            ));
        }
        self.state
            .check_text_length("text", &message.text)
            .map_err(|e| WsError::invalid(e.message))?;
        let settings = Settings {
            voice: message.voice.as_deref(),
            voice_field: "voice",
            language: message.language.as_deref(),
            instruct: message.instruct.as_deref(),
            instruct_field: "instruct",
            // Text arrives as an LLM streams it: start speaking before the sentence is done.
            text_mode: Some(message.text_mode.unwrap_or(TextModeField::Streaming)),
            seed: message.seed,
            sampling: message.sampling.as_ref(),
        };
        let has_text = has_speakable_text(&message.text);
        let request = settings
            .session_request(&self.state, message.text, false)
            .map_err(|e| WsError::invalid(e.message))?;
        let session = self.state.engine.open(request).map_err(|e| match e {
            OpenError::Invalid(e) => WsError::invalid(format!("{e:#}")),
            OpenError::Overloaded { .. } => WsError::new(
                "overloaded",
                "the server is at its session limit and its queue is full; retry later",
            ),
            OpenError::Stopped => WsError::new("internal", "the engine has stopped"),
        })?;
        tracing::debug!(
            context_id = id,
            session = session.handle.id(),
            "context open"
        );
        self.events
            .insert(id.to_string(), event_stream(session.events));
        self.contexts.insert(
            id.to_string(),
            Context {
                handle: session.handle,
                flushed: false,
                cancelled: false,
                has_text,
                chars,
                _open: GaugeGuard::new(&self.state.metrics.ws_contexts),
            },
        );
        Ok(())
    }

    fn flush(&mut self, id: &str) -> Result<(), WsError> {
        let context = self.contexts.get_mut(id).ok_or_else(|| unknown(id))?;
        // A repeated flush, or one after cancel, changes nothing.
        if !context.takes_text() {
            return Ok(());
        }
        if !context.has_text {
            return Err(WsError::invalid(
                "text: the context has no text to speak; send it in speak before flush",
            ));
        }
        context.flushed = true;
        context.handle.finish_text();
        Ok(())
    }

    fn cancel(&mut self, id: &str) -> Result<(), WsError> {
        let context = self.contexts.get_mut(id).ok_or_else(|| unknown(id))?;
        if !context.cancelled {
            context.cancelled = true;
            context.handle.cancel();
            tracing::debug!(context_id = id, "context cancelled by the client");
        }
        Ok(())
    }

    /// Forgets the context; dropping its events cancels its session.
    fn close(&mut self, id: &str) {
        if self.contexts.remove(id).is_some() {
            self.events.remove(id);
            self.state.metrics.session_ended("error");
        }
    }

    fn on_event(&mut self, id: String, event: SessionEvent) -> Message {
        match event {
            SessionEvent::Audio(chunk) => {
                let mut bytes = Vec::with_capacity(1 + id.len() + 2 * chunk.pcm.len());
                // Context ids are at most 128 bytes, so the header length fits in one byte.
                bytes.push(1 + id.len() as u8);
                bytes.extend_from_slice(id.as_bytes());
                bytes.extend(chunk.pcm.iter().flat_map(|s| s.to_le_bytes()));
                Message::Binary(bytes.into())
            }
            SessionEvent::Done(usage) => {
                self.contexts.remove(&id);
                self.state.metrics.session_done(&usage);
                tracing::info!(
                    context_id = id,
                    finish_reason = ?usage.finish_reason,
                    frames = usage.frames,
                    ttfa_ms = usage.time_to_first_audio_ms,
                    rtf = usage.rtf,
                    "context done"
                );
                text_message(done_json(&id, &usage))
            }
            SessionEvent::Error(message) => {
                self.contexts.remove(&id);
                self.state.metrics.session_ended("error");
                // The engine names the field first; its text errors are the client's (e.g. a
                // text whose tokens exceed the limit), anything else is ours.
                let code = if message.starts_with("text:") {
                    "invalid_request"
                } else {
                    tracing::error!(context_id = id, "session failed: {message}");
                    "internal"
                };
                self.error_message(Some(id), WsError::new(code, message))
            }
        }
    }

    fn error_message(&self, id: Option<String>, error: WsError) -> Message {
        self.state.metrics.error(error.code);
        tracing::debug!(context_id = id, code = error.code, "{}", error.message);
        text_message(json!({
            "type": "error",
            "context_id": id,
            "code": error.code,
            "message": error.message,
        }))
    }
}

/// Whether reading failed on a message or frame over the connection's size limit.
fn message_too_big(error: axum::Error) -> bool {
    error
        .into_inner()
        .downcast_ref::<tokio_tungstenite::tungstenite::Error>()
        .is_some_and(|e| matches!(e, tokio_tungstenite::tungstenite::Error::Capacity(_)))
}

fn unknown(id: &str) -> WsError {
    WsError::new(
        "unknown_context",
        format!("no open context {id:?}; a speak opens one"),
    )
}

/// Parses a message, naming the offending field.
fn parse<T: DeserializeOwned>(value: Value) -> Result<T, WsError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        WsError::invalid(match FieldError::of_deserialize(&path, &inner) {
            Some(e) => e.message,
            None => inner,
        })
    })
}

pub fn done_json(id: &str, usage: &Usage) -> Value {
    json!({
        "type": "done",
        "context_id": id,
        "finish_reason": usage.finish_reason,
        "usage": {
            "frames": usage.frames,
            "audio_seconds": usage.audio_seconds,
            "time_to_first_audio_ms": usage.time_to_first_audio_ms,
            "synthesis_seconds": usage.synthesis_seconds,
            "rtf": usage.rtf,
        },
    })
}

fn text_message(value: Value) -> Message {
    Message::Text(value.to_string().into())
}

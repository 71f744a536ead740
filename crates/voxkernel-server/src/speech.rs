//! `POST /v1/audio/speech`: OpenAI's speech endpoint, streamed as the engine synthesises.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{StatusCode, header};
use axum::response::Response;
use base64::Engine as _;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::Instrument;
use voxkernel_core::engine::{SessionEvent, SessionEvents, Usage};
use voxkernel_core::tokenizer::{NOTHING_TO_SPEAK, has_speakable_text};

use crate::audio::{AudioFormat, Encoder};
use crate::error::{ApiError, FieldError, is_number_out_of_range};
use crate::metrics::GaugeGuard;
use crate::request::{SamplingFields, Settings, TextModeField};
use crate::state::{AppState, Phase};

/// OpenAI's model names, accepted for the one loaded model so that clients work unchanged.
const OPENAI_MODELS: [&str; 5] = [
    "tts-1",
    "tts-1-hd",
    "gpt-4o-mini-tts",
    "gpt-4o-mini-tts-2025-03-20",
    "gpt-4o-mini-tts-2025-12-15",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum StreamFormat {
    Audio,
    Sse,
}

/// OpenAI's fields, then voxkernel's extensions (`language`, `seed`, `sampling`, `text_mode`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeechBody {
    model: String,
    input: String,
    /// A name, or `{"id": name}`.
    voice: Option<Value>,
    instructions: Option<String>,
    response_format: Option<AudioFormat>,
    speed: Option<f64>,
    stream_format: Option<StreamFormat>,
    language: Option<String>,
    seed: Option<u64>,
    sampling: Option<SamplingFields>,
    text_mode: Option<TextModeField>,
}

pub async fn speech(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    if state.phase() != Phase::Serving {
        return Err(ApiError::overloaded("the server is shutting down"));
    }
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!(
                "body: over the limit of {} bytes",
                state.options.max_body_bytes
            ))
        } else {
            ApiError::invalid(format!("body: {e}"))
        }
    })?;
    let request: SpeechBody = parse_json(&body)?;
    let model_ok =
        request.model == state.options.model_id || OPENAI_MODELS.contains(&request.model.as_str());
    if !model_ok {
        return Err(FieldError::new(
            "model",
            format!(
                "unknown model {:?}; valid: {}, {}",
                request.model,
                state.options.model_id,
                OPENAI_MODELS.join(", ")
            ),
        )
        .into());
    }
    if !has_speakable_text(&request.input) {
        return Err(FieldError::new("input", NOTHING_TO_SPEAK).into());
    }
    state.check_text_length("input", &request.input)?;
    if let Some(speed) = request.speed
        && speed != 1.0
    {
        return Err(FieldError::new(
            "speed",
            format!("{speed} is not supported; valid: 1.0 (omit it for normal speed)"),
        )
        .into());
    }
    let voice = match &request.voice {
        None => None,
        Some(Value::String(name)) => Some(name.as_str()),
        Some(Value::Object(o)) if o.len() == 1 && o.get("id").is_some_and(Value::is_string) => {
            o["id"].as_str()
        }
        Some(_) => {
            return Err(FieldError::new(
                "voice",
                "must be a voice name or {\"id\": name}; see GET /v1/voices",
            )
            .into());
        }
    };
    let format = request.response_format.unwrap_or(AudioFormat::Wav);
    let sse = request.stream_format == Some(StreamFormat::Sse);
    let settings = Settings {
        voice,
        voice_field: "voice",
        language: request.language.as_deref(),
        instruct: request.instructions.as_deref(),
        instruct_field: "instructions",
        // The model's official default unless asked otherwise.
        text_mode: request.text_mode,
        seed: request.seed,
        sampling: request.sampling.as_ref(),
    };
    let input_tokens = state
        .engine
        .model()
        .tokenizer
        .target_text_ids(&request.input)
        .map(|ids| ids.len())
        .unwrap_or_default();
    let session_request = settings.session_request(&state, request.input, true)?;
    let session = state.engine.open(session_request)?;
    tracing::info!(
        session = session.handle.id(),
        voice,
        format = ?format,
        sse,
        input_tokens,
        "speech accepted"
    );
    let mut stream = SpeechStream {
        _guard: GaugeGuard::new(&state.metrics.http_streams),
        phase: state.watch_phase(),
        state,
        events: session.events,
        first: None,
        encoder: Encoder::new(format),
        sse,
        input_tokens,
        finished: false,
    };
    // Wait for the first event, so that a session failing before any audio gets an error
    // status rather than a broken stream. (A client leaving meanwhile drops `stream`.)
    match stream.events.recv().await {
        Some(SessionEvent::Error(e)) => {
            stream.finished = true;
            stream.state.metrics.session_ended("error");
            tracing::error!("session failed before audio: {e}");
            return Err(ApiError::internal(format!("synthesis failed: {e}")));
        }
        Some(event) => stream.first = Some(event),
        None => {
            stream.finished = true;
            return Err(ApiError::overloaded("the server is shutting down"));
        }
    }
    let span = tracing::Span::current();
    let body = Body::from_stream(futures::stream::unfold(stream, move |mut stream| {
        let span = span.clone();
        async move { stream.next().await.map(|item| (item, stream)) }.instrument(span)
    }));
    let content_type = if sse {
        "text/event-stream"
    } else {
        format.content_type()
    };
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("static headers are valid"))
}

/// The response body: encoded audio, or SSE events carrying it, as the session produces it.
struct SpeechStream {
    state: Arc<AppState>,
    events: SessionEvents,
    first: Option<SessionEvent>,
    encoder: Encoder,
    sse: bool,
    input_tokens: usize,
    phase: watch::Receiver<Phase>,
    finished: bool,
    _guard: GaugeGuard,
}

type Chunk = Result<Bytes, std::io::Error>;

impl SpeechStream {
    async fn next(&mut self) -> Option<Chunk> {
        if self.finished {
            return None;
        }
        let event = match self.first.take() {
            Some(event) => Some(event),
            None => {
                let stopping = tokio::select! {
                    event = self.events.recv() => Ok(event),
                    _ = self.phase.wait_for(|&p| p == Phase::Stopping) => Err(()),
                };
                match stopping {
                    Ok(event) => event,
                    Err(()) => return self.fail("the server is stopping"),
                }
            }
        };
        match event {
            Some(SessionEvent::Audio(chunk)) => {
                let bytes = self.encoder.encode(&chunk.pcm);
                Some(Ok(self.wrap(bytes)))
            }
            Some(SessionEvent::Done(usage)) => {
                self.finished = true;
                self.state.metrics.session_done(&usage);
                tracing::info!(
                    finish_reason = ?usage.finish_reason,
                    frames = usage.frames,
                    ttfa_ms = usage.time_to_first_audio_ms,
                    rtf = usage.rtf,
                    "speech done"
                );
                let tail = self.encoder.finish();
                let mut out = if tail.is_empty() {
                    Vec::new()
                } else {
                    self.wrap(tail).to_vec()
                };
                if self.sse {
                    out.extend(sse_event(&self.done_event(&usage)));
                }
                Some(Ok(out.into()))
            }
            Some(SessionEvent::Error(e)) => {
                tracing::error!("session failed mid-stream: {e}");
                self.fail(&format!("synthesis failed: {e}"))
            }
            None => self.fail("the engine stopped"),
        }
    }

    /// Ends the stream with an error: an SSE error event, or a broken body (the client sees
    /// the response end without its last chunk).
    fn fail(&mut self, message: &str) -> Option<Chunk> {
        self.finished = true;
        self.state.metrics.session_ended("error");
        self.state.metrics.error("internal");
        if self.sse {
            let event = json!({
                "type": "error",
                "error": {"message": message, "type": "server_error", "param": null,
                          "code": "internal"},
            });
            Some(Ok(sse_event(&event).into()))
        } else {
            Some(Err(std::io::Error::other(message.to_string())))
        }
    }

    fn wrap(&self, audio: Vec<u8>) -> Bytes {
        if self.sse {
            let audio = base64::engine::general_purpose::STANDARD.encode(audio);
            sse_event(&json!({"type": "speech.audio.delta", "audio": audio})).into()
        } else {
            audio.into()
        }
    }

    fn done_event(&self, usage: &Usage) -> Value {
        json!({
            "type": "speech.audio.done",
            "finish_reason": usage.finish_reason,
            "usage": {
                "input_tokens": self.input_tokens,
                // One audio token per frame (its 16 codes).
                "output_tokens": usage.frames,
                "total_tokens": self.input_tokens + usage.frames,
                "audio_seconds": usage.audio_seconds,
                "time_to_first_audio_ms": usage.time_to_first_audio_ms,
                "rtf": usage.rtf,
            },
        })
    }
}

impl Drop for SpeechStream {
    fn drop(&mut self) {
        if !self.finished {
            // Dropping `events` cancels the session within one frame.
            tracing::info!("client went away; session cancelled");
            self.state.metrics.session_ended("disconnected");
        }
    }
}

fn sse_event(value: &Value) -> Vec<u8> {
    format!("data: {value}\n\n").into_bytes()
}

/// Parses a JSON body, naming the offending field.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // serde would take a JSON array as the fields in order; a request is an object.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{')
        && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
    {
        return Err(ApiError::invalid(
            "body: must be a JSON object of named fields",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if (inner.is_syntax() && !is_number_out_of_range(&inner)) || inner.is_eof() {
            ApiError::invalid_json(format!("body: not valid JSON: {inner}"))
        } else {
            let inner = inner.to_string();
            match FieldError::of_deserialize(&path, &inner) {
                Some(e) => e.into(),
                None => ApiError::invalid(inner),
            }
        }
    })?;
    de.end()
        .map_err(|e| ApiError::invalid_json(format!("body: not valid JSON: {e}")))?;
    Ok(value)
}

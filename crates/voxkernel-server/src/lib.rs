//! voxkernel's HTTP and WebSocket server: thin handlers over the engine.
//!
//! - `POST /v1/audio/speech`: OpenAI's speech endpoint, streamed ([`speech`]);
//! - `GET /v1/tts/ws`: the WebSocket context protocol of docs/protocol.md ([`ws`]);
//! - `POST /v1/voices`, `GET`/`DELETE /v1/voices/{id}`: registered (cloned) voices of a Base
//!   model ([`voices`]);
//! - `GET /v1/models`, `GET /v1/voices`, `/healthz`, `/readyz`, `/metrics`.
//!
//! docs/server.md documents the HTTP API.

mod audio;
mod error;
mod metrics;
mod request;
mod speech;
mod state;
mod voices;
mod ws;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{delete, get, post};
use serde_json::json;
use tokio::net::TcpListener;
use tracing::Instrument;
use voxkernel_core::engine::Engine;
use voxkernel_core::voice_clone::CloneEncoder;

pub use state::ServerOptions;

use error::{ApiError, ErrorCode};
use state::{AppState, Phase};

/// The server: build it, take a [`ShutdownHandle`], then [`Server::serve`].
pub struct Server {
    state: Arc<AppState>,
}

/// Ends the server: [`drain`](Self::drain) refuses new sessions and lets running ones finish;
/// [`stop`](Self::stop) ends every stream now.
#[derive(Clone)]
pub struct ShutdownHandle {
    state: Arc<AppState>,
}

impl ShutdownHandle {
    pub fn drain(&self) {
        self.state.advance(Phase::Draining);
    }

    pub fn stop(&self) {
        self.state.advance(Phase::Stopping);
    }
}

impl Server {
    /// `voice_encoder` encodes the uploads of `POST /v1/voices`: required for a Base model
    /// (the CPU reference `VoiceEncoder` or a GPU one), refused for the others. Fails also when
    /// the voices saved in [`ServerOptions::voices_dir`] cannot be loaded.
    pub fn new(
        engine: Arc<Engine>,
        options: ServerOptions,
        voice_encoder: Option<Box<dyn CloneEncoder>>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            state: Arc::new(AppState::new(engine, options, voice_encoder)?),
        })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            state: Arc::clone(&self.state),
        }
    }

    pub fn router(&self) -> Router {
        router(Arc::clone(&self.state))
    }

    /// Serves until shut down through a [`ShutdownHandle`], then returns once every HTTP
    /// response and WebSocket connection has ended.
    pub async fn serve(self, listener: TcpListener) -> std::io::Result<()> {
        let mut phase = self.state.watch_phase();
        let drained = async move {
            let _ = phase.wait_for(|&p| p != Phase::Serving).await;
        };
        axum::serve(listener, self.router())
            .with_graceful_shutdown(drained)
            .await?;
        // Upgraded WebSocket connections are not the HTTP server's to wait for.
        self.state.ws_closed().await;
        Ok(())
    }
}

fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/audio/speech", post(speech::speech))
        .route("/v1/tts/ws", get(ws::upgrade))
        .route("/v1/models", get(models))
        .route(
            "/v1/voices",
            get(list_voices)
                .post(voices::register)
                .layer(DefaultBodyLimit::max(state.options.max_upload_bytes)),
        )
        .route(
            "/v1/voices/{id}",
            get(voices::show).merge(delete(voices::delete)),
        )
        .route("/metrics", get(prometheus))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.options.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            request_context,
        ))
        .with_state(state)
}

/// Gives every request an id (the client's `x-request-id` if sane), a tracing span carrying
/// it, the id on the response, and counts error responses by code.
async fn request_context(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            (1..=64).contains(&v.len())
                && v.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", request::random_u64()));
    let span = tracing::info_span!(
        "request",
        id = %id,
        method = %request.method(),
        path = %request.uri().path(),
    );
    let mut response = next.run(request).instrument(span.clone()).await;
    if let Some(ErrorCode(code)) = response.extensions().get::<ErrorCode>().copied() {
        state.metrics.error(code);
        span.in_scope(|| {
            tracing::info!(status = response.status().as_u16(), code, "request refused")
        });
    }
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

async fn auth(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.options.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|given| same_secret(given.trim().as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// Compares without stopping at the first difference, so timing does not reveal the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Ready while serving; 503 once draining, so load balancers stop sending work.
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match state.phase() {
        Phase::Serving => Json(json!({"status": "ready"})).into_response(),
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.options.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "voxkernel",
        }],
    }))
}

async fn list_voices(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let config = &state.engine.model().checkpoint.config;
    let registered: Vec<_> = state.voices.list().iter().map(|v| v.json()).collect();
    Json(json!({
        "object": "list",
        "data": [{
            "model": state.options.model_id,
            "model_type": config.model_type,
            "voices": state.voice_names(),
            "registered_voices": registered,
            "max_registered_voices": state.voices.max_voices(),
            "languages": config.languages(),
            "supports_instruct": config.supports_instruct(),
        }],
    }))
}

async fn prometheus(State(state): State<Arc<AppState>>) -> Response {
    let body = state.metrics.render(&state.engine.stats());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(request.uri().path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

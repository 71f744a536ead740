//! Errors of the HTTP API, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use voxkernel_core::engine::OpenError;

/// A request problem tied to one field of the request.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    /// The field's name as the client wrote it (`voice`, `sampling.top_p`).
    pub field: String,
    /// Starts with the field's name, and says what is valid.
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, detail: impl std::fmt::Display) -> Self {
        let field = field.into();
        Self {
            message: format!("{field}: {detail}"),
            field,
        }
    }

    /// A deserialisation error at `path` (serde_path_to_error's, "." for the top level), named by
    /// its field and in JSON's words rather than Rust's ("expected f64" is "expected a
    /// number"). None for an error about the top level that names no field.
    pub fn of_deserialize(path: &str, error: &str) -> Option<Self> {
        // Errors about a whole object name their field only inside the text ("missing field
        // `input` at line 1 column 32").
        let prefix = if path == "." {
            String::new()
        } else {
            format!("{path}.")
        };
        for (lead, what) in [
            ("missing field `", "missing; it is required"),
            ("duplicate field `", "given more than once"),
        ] {
            if let Some(name) = error.strip_prefix(lead).and_then(|r| r.split('`').next()) {
                return Some(Self::new(format!("{prefix}{name}"), what));
            }
        }
        (path != ".").then(|| Self::new(path, json_words(error)))
    }
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Also the `kind` label of the errors metric.
    pub code: &'static str,
    pub param: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            code,
            param: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_json", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            "missing or wrong API key; send `Authorization: Bearer <key>`",
        )
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no endpoint at {path}; see GET /v1/models, POST /v1/audio/speech, /v1/tts/ws"),
        )
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this endpoint does not take that method",
        )
    }

    pub fn voice_not_found(id: &str) -> Self {
        Self {
            param: Some("voice_id".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("voice_id: no registered voice {id:?}; GET /v1/voices lists them"),
            )
        }
    }

    /// A registration past the server's voice limit.
    pub fn voice_limit(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "voice_limit_reached", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// OpenAI's `type`: who is to blame.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }
}

/// serde_json counts a number beyond f64 (`1e400`) as a syntax error, but the JSON is well
/// formed: the number is a bad value of its field.
pub fn is_number_out_of_range(error: &serde_json::Error) -> bool {
    error.is_syntax() && error.to_string().starts_with("number out of range")
}

/// serde names the Rust type a value should have had; a client wrote JSON.
fn json_words(error: &str) -> String {
    let mut out = error.to_string();
    for (rust, json) in [
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
        ("expected u64", "expected a whole number >= 0"),
        ("expected u32", "expected a whole number >= 0"),
        ("expected usize", "expected a whole number >= 0"),
        ("expected a boolean", "expected true or false"),
    ] {
        out = out.replace(rust, json);
    }
    out
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        Self {
            param: Some(e.field),
            ..Self::invalid(e.message)
        }
    }
}

impl From<OpenError> for ApiError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Invalid(e) => Self::invalid(format!("{e:#}")),
            OpenError::Overloaded { .. } => Self::overloaded(
                "the server is at its session limit and its queue is full; retry later",
            ),
            OpenError::Stopped => Self::overloaded("the server is shutting down"),
        }
    }
}

/// Seconds a client should wait before retrying an overloaded server: about one utterance.
const RETRY_AFTER_SECONDS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        });
        let mut response = (self.status, Json(body)).into_response();
        let headers = response.headers_mut();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // The metrics layer counts errors by this code.
        response.extensions_mut().insert(ErrorCode(self.code));
        response
    }
}

/// Left on an error response for the metrics middleware.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCode(pub &'static str);

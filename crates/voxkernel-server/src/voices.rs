//! Registered voices (Base models): `POST /v1/voices` encodes a reference clip once with the
//! library's encoders (`voxkernel_core::voice_clone`) and keeps the result, so a speech request
//! in that voice pays no encoder cost; `GET /v1/voices/{id}`, `DELETE /v1/voices/{id}`.
//! With a voices directory every voice is also a JSON file there, loaded again at start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use axum::extract::multipart::{Field, MultipartError, MultipartRejection};
use axum::extract::{Multipart, Path as UrlPath, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use voxkernel_core::config::ModelType;
use voxkernel_core::engine::{Model, SpeechRequest};
use voxkernel_core::voice_clone::{
    CloneEncoder, CloneMode, CloneRequestError, ClonedVoice, MAX_SECONDS, MIN_SECONDS,
    ReferenceAudio, ReferenceAudioError,
};

use crate::error::{ApiError, FieldError};
use crate::request::random_u64;
use crate::state::AppState;

/// The multipart fields `POST /v1/voices` takes.
const FIELDS: &str = "audio, name, transcript, mode";
/// Characters in a voice's name.
const MAX_NAME_CHARS: usize = 64;
/// Registered voice ids start with this (OpenAI's custom voice ids look alike).
pub const ID_PREFIX: &str = "voice_";

/// A registered voice: the encoders' output and what the client said about it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisteredVoice {
    pub id: String,
    pub name: String,
    /// Unix seconds.
    pub created_at: u64,
    /// Length of the reference clip.
    pub audio_seconds: f64,
    pub voice: ClonedVoice,
}

impl RegisteredVoice {
    /// The voice object of the API.
    pub fn json(&self) -> Value {
        let reference = self.voice.reference.as_ref();
        json!({
            "id": self.id,
            "object": "voice",
            "name": self.name,
            "mode": if reference.is_some() { "icl" } else { "x_vector_only" },
            "transcript": reference.map(|r| &r.transcript),
            "reference_frames": reference.map(|r| r.codes.len()),
            "audio_seconds": self.audio_seconds,
            "created_at": self.created_at,
        })
    }
}

/// The registered voices of a Base model (none elsewhere) and the encoder that makes them.
pub struct VoiceRegistry {
    /// Base models only.
    encoder: Option<Arc<dyn CloneEncoder>>,
    voices: RwLock<HashMap<String, Arc<RegisteredVoice>>>,
    dir: Option<PathBuf>,
    max_voices: usize,
    /// One encode at a time: on the CPU one takes both cores for half a second at full size,
    /// and two at once would only slow each other and the engine down (a GPU encoder
    /// serializes its device work anyway). The permit also makes the limit check and the
    /// insert of one registration atomic.
    encoding: Arc<Semaphore>,
}

impl VoiceRegistry {
    /// A Base model's registry, with its voice encoder and, with `dir`, the voices saved there
    /// (creating the directory if needed; any file there that is not a voice of this model is
    /// an error). Other models take neither.
    pub fn new(
        model: &Model,
        encoder: Option<Box<dyn CloneEncoder>>,
        dir: Option<PathBuf>,
        max_voices: usize,
    ) -> Result<Self> {
        let config = &model.checkpoint.config;
        let model_type = config.model_type.as_str();
        match (config.model_type == ModelType::Base, &encoder, &dir) {
            (true, None, _) => {
                bail!("a base model needs a voice encoder (CPU or GPU) to register voices")
            }
            (false, Some(_), _) => bail!(
                "a voice encoder was given for a {model_type} model; only base models encode \
                 voices"
            ),
            (false, None, Some(dir)) => bail!(
                "voices directory {}: only a base model registers voices; this model is \
                 {model_type}",
                dir.display()
            ),
            _ => {}
        }
        let encoder: Option<Arc<dyn CloneEncoder>> = encoder.map(Arc::from);
        let voices = match &dir {
            Some(dir) => load_dir(dir, model)?,
            None => Vec::new(),
        };
        if voices.len() > max_voices {
            tracing::warn!(
                loaded = voices.len(),
                max_voices,
                "more saved voices than the limit: new registrations are refused until some \
                 are deleted"
            );
        }
        Ok(Self {
            encoder,
            voices: RwLock::new(
                voices
                    .into_iter()
                    .map(|v| (v.id.clone(), Arc::new(v)))
                    .collect(),
            ),
            dir,
            max_voices,
            encoding: Arc::new(Semaphore::new(1)),
        })
    }

    pub fn get(&self, id: &str) -> Option<Arc<RegisteredVoice>> {
        self.read().get(id).cloned()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Oldest first.
    pub fn list(&self) -> Vec<Arc<RegisteredVoice>> {
        let mut voices: Vec<_> = self.read().values().cloned().collect();
        voices.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        voices
    }

    /// Voices this server may hold: 0 unless the model is a Base model.
    pub fn max_voices(&self) -> usize {
        if self.encoder.is_some() {
            self.max_voices
        } else {
            0
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<RegisteredVoice>>> {
        // A panic while holding the lock leaves the map itself consistent.
        self.voices.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Arc<RegisteredVoice>>> {
        self.voices.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// Every `voice_*.json` of `dir`, each checked to plan on this model.
fn load_dir(dir: &Path, model: &Model) -> Result<Vec<RegisteredVoice>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut voices = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|stem| stem.starts_with(ID_PREFIX))
        else {
            continue;
        };
        let voice: RegisteredVoice = std::fs::read(&path)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| Ok(serde_json::from_slice(&bytes)?))
            .with_context(|| format!("{}: not a saved voice", path.display()))?;
        if voice.id != stem {
            bail!(
                "{}: holds voice {:?}; a voice's file is named by its id",
                path.display(),
                voice.id
            );
        }
        model
            .plan(&SpeechRequest {
                text: "a".into(),
                voice: voice.voice.voice(),
                language: "auto".into(),
                instruct: None,
                text_mode: None,
            })
            .with_context(|| format!("{}: not a voice of this model", path.display()))?;
        voices.push(voice);
    }
    Ok(voices)
}

/// Writes through a temporary file, so a crash leaves no half-written voice.
fn save(dir: &Path, voice: &RegisteredVoice) -> Result<()> {
    let path = dir.join(format!("{}.json", voice.id));
    let partial = dir.join(format!(".{}.json.partial", voice.id));
    std::fs::write(&partial, serde_json::to_vec(voice)?)
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModeField {
    Icl,
    XVectorOnly,
}

struct AudioUpload {
    bytes: Vec<u8>,
    /// From the part's file name; speeds up the format probe.
    extension: Option<String>,
}

#[derive(Default)]
struct Upload {
    audio: Option<AudioUpload>,
    name: Option<String>,
    transcript: Option<String>,
    mode: Option<String>,
}

/// A checked registration, ready to encode.
struct Registration {
    audio: AudioUpload,
    name: String,
    /// In-context cloning with this transcript; `None`: x-vector only.
    transcript: Option<String>,
}

/// `POST /v1/voices`.
pub async fn register(
    State(state): State<Arc<AppState>>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let registry = &state.voices;
    let Some(encoder) = &registry.encoder else {
        let model_type = state.engine.model().checkpoint.config.model_type;
        return Err(ApiError::invalid(format!(
            "voice registration clones a voice, which only a base model can do; this server \
             runs a {} model, whose voices GET /v1/voices lists",
            model_type.as_str()
        )));
    };
    let multipart = multipart.map_err(|e| {
        ApiError::invalid(format!(
            "body: {}; send multipart/form-data with the fields {FIELDS}",
            e.body_text()
        ))
    })?;
    let upload = read_upload(&state, multipart).await?;
    let registration = check_upload(&state, upload)?;

    let permit = Arc::clone(&registry.encoding)
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the voice encoder is closed"))?;
    let count = registry.len();
    if count >= registry.max_voices {
        return Err(ApiError::voice_limit(format!(
            "the server holds {count} registered voices, its limit (--max-voices) is {}; \
             DELETE /v1/voices/{{id}} one first",
            registry.max_voices
        )));
    }
    let encoder = Arc::clone(encoder);
    let Registration {
        audio,
        name,
        transcript,
    } = registration;
    let encoded = tokio::task::spawn_blocking(move || {
        // Held until the encode ends, even if the client leaves and drops the handler.
        let _permit = permit;
        let started = Instant::now();
        let clip = ReferenceAudio::from_bytes(audio.bytes, audio.extension.as_deref())
            .map_err(|e: ReferenceAudioError| ApiError::from(FieldError::new("audio", e)))?;
        let mode = match &transcript {
            Some(transcript) => CloneMode::Icl { transcript },
            None => CloneMode::XVectorOnly,
        };
        let voice = encoder.encode(&clip, mode).map_err(|e| {
            if e.downcast_ref::<CloneRequestError>().is_some() {
                FieldError::new("transcript", format!("{e:#}")).into()
            } else {
                ApiError::internal(format!("encoding the voice failed: {e:#}"))
            }
        })?;
        Ok::<_, ApiError>((voice, clip.seconds(), started.elapsed()))
    })
    .await
    .map_err(|e| ApiError::internal(format!("the voice encoder failed: {e}")))??;
    let (voice, audio_seconds, took) = encoded;
    state
        .metrics
        .voice_encode_seconds
        .observe(took.as_secs_f64());

    let voice = {
        let voices = registry.read();
        let id = std::iter::repeat_with(|| format!("{ID_PREFIX}{:016x}", random_u64()))
            .find(|id| !voices.contains_key(id))
            .expect("an endless iterator");
        Arc::new(RegisteredVoice {
            id,
            name,
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            audio_seconds,
            voice,
        })
    };
    if let Some(dir) = registry.dir.clone() {
        let saved = Arc::clone(&voice);
        tokio::task::spawn_blocking(move || save(&dir, &saved))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|saved| saved)
            .map_err(|e| {
                tracing::error!("saving a voice: {e:#}");
                ApiError::internal(format!("saving the voice failed: {e:#}"))
            })?;
    }
    let count = {
        let mut voices = registry.write();
        voices.insert(voice.id.clone(), Arc::clone(&voice));
        voices.len()
    };
    state.metrics.registered_voices.set(count as i64);
    tracing::info!(
        id = voice.id,
        name = voice.name,
        audio_seconds,
        encode_ms = took.as_secs_f64() * 1e3,
        "voice registered"
    );
    let mut response = (StatusCode::CREATED, Json(voice.json())).into_response();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/voices/{}", voice.id)) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// `GET /v1/voices/{id}`.
pub async fn show(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let voice = state
        .voices
        .get(&id)
        .ok_or_else(|| ApiError::voice_not_found(&id))?;
    Ok(Json(voice.json()))
}

/// `DELETE /v1/voices/{id}`. Sessions already speaking in the voice keep their copy of it.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let registry = &state.voices;
    if registry.get(&id).is_none() {
        return Err(ApiError::voice_not_found(&id));
    }
    if let Some(dir) = registry.dir.clone() {
        let path = dir.join(format!("{id}.json"));
        tokio::task::spawn_blocking(move || match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(anyhow::Error::from(e).context(format!("removing {}", path.display())))
            }
            _ => Ok(()),
        })
        .await
        .map_err(anyhow::Error::from)
        .and_then(|removed| removed)
        .map_err(|e| {
            tracing::error!("deleting a voice: {e:#}");
            ApiError::internal(format!("deleting the voice failed: {e:#}"))
        })?;
    }
    let (removed, count) = {
        let mut voices = registry.write();
        (voices.remove(&id).is_some(), voices.len())
    };
    // A concurrent DELETE of the same voice got there first.
    if !removed {
        return Err(ApiError::voice_not_found(&id));
    }
    state.metrics.registered_voices.set(count as i64);
    tracing::info!(id, "voice deleted");
    Ok(Json(
        json!({"id": id, "object": "voice.deleted", "deleted": true}),
    ))
}

async fn read_upload(state: &AppState, mut multipart: Multipart) -> Result<Upload, ApiError> {
    let limit = state.options.max_upload_bytes;
    let body_error = |e: MultipartError| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(format!(
                "body: over the limit of {limit} bytes for a voice upload (--max-upload-bytes)"
            ))
        } else {
            ApiError::invalid(format!(
                "body: not valid multipart/form-data ({}); send the fields {FIELDS}",
                e.body_text()
            ))
        }
    };
    let mut upload = Upload::default();
    while let Some(field) = multipart.next_field().await.map_err(body_error)? {
        let Some(name) = field.name().map(str::to_string) else {
            return Err(ApiError::invalid(format!(
                "body: a form part has no name; valid fields: {FIELDS}"
            )));
        };
        let slot = match name.as_str() {
            "audio" => {
                if upload.audio.is_some() {
                    return Err(given_twice(&name));
                }
                let extension = field
                    .file_name()
                    .and_then(|f| Path::new(f).extension())
                    .and_then(|e| e.to_str())
                    .map(str::to_ascii_lowercase);
                let bytes = field.bytes().await.map_err(body_error)?;
                upload.audio = Some(AudioUpload {
                    bytes: bytes.into(),
                    extension,
                });
                continue;
            }
            "name" => &mut upload.name,
            "transcript" => &mut upload.transcript,
            "mode" => &mut upload.mode,
            _ => {
                return Err(
                    FieldError::new(name, format!("unknown field; valid: {FIELDS}")).into(),
                );
            }
        };
        if slot.is_some() {
            return Err(given_twice(&name));
        }
        *slot = Some(text_field(field).await.map_err(|e| match e {
            TextFieldError::Body(e) => body_error(e),
            TextFieldError::NotUtf8 => FieldError::new(&name, "not UTF-8 text").into(),
        })?);
    }
    Ok(upload)
}

enum TextFieldError {
    Body(MultipartError),
    NotUtf8,
}

async fn text_field(field: Field<'_>) -> Result<String, TextFieldError> {
    let bytes = field.bytes().await.map_err(TextFieldError::Body)?;
    String::from_utf8(bytes.into()).map_err(|_| TextFieldError::NotUtf8)
}

fn given_twice(name: &str) -> ApiError {
    FieldError::new(name, "given twice; send each field once").into()
}

/// Checks the fields in the order a client would fix them; the audio itself is checked when
/// it is decoded.
fn check_upload(state: &AppState, upload: Upload) -> Result<Registration, ApiError> {
    let name = upload.name.as_deref().map(str::trim).unwrap_or_default();
    if name.is_empty() {
        return Err(FieldError::new("name", "missing; give the voice a name").into());
    }
    let name_chars = name.chars().count();
    if name_chars > MAX_NAME_CHARS {
        return Err(FieldError::new(
            "name",
            format!("{name_chars} characters is over the limit of {MAX_NAME_CHARS}"),
        )
        .into());
    }
    if name.chars().any(char::is_control) {
        return Err(FieldError::new("name", "must not hold control characters").into());
    }
    let mode = match upload.mode.as_deref().map(str::trim) {
        None | Some("icl") => ModeField::Icl,
        Some("x_vector_only") => ModeField::XVectorOnly,
        Some(other) => {
            return Err(FieldError::new(
                "mode",
                format!("unknown mode {other:?}; valid: icl (default), x_vector_only"),
            )
            .into());
        }
    };
    let transcript = upload.transcript.filter(|t| !t.trim().is_empty());
    match (mode, &transcript) {
        (ModeField::Icl, None) => {
            return Err(FieldError::new(
                "transcript",
                "required in icl mode (the default): the words spoken in the audio; or set \
                 mode to x_vector_only to clone from the speaker embedding alone",
            )
            .into());
        }
        (ModeField::Icl, Some(transcript)) => state.check_text_length("transcript", transcript)?,
        (ModeField::XVectorOnly, Some(_)) => {
            return Err(FieldError::new(
                "transcript",
                "not used in x_vector_only mode; omit it, or use mode icl",
            )
            .into());
        }
        (ModeField::XVectorOnly, None) => {}
    }
    let audio = upload.audio.ok_or_else(|| {
        FieldError::new(
            "audio",
            format!(
                "missing; upload the reference clip as a file part (WAV, FLAC, MP3 or Ogg \
                 Vorbis, {MIN_SECONDS} to {MAX_SECONDS} s)"
            ),
        )
    })?;
    if audio.bytes.is_empty() {
        return Err(FieldError::new("audio", "the file is empty").into());
    }
    Ok(Registration {
        audio,
        name: name.to_string(),
        transcript,
    })
}

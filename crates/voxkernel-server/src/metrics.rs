//! Prometheus metrics. Per-session figures are observed as sessions end; engine counters and
//! gauges are read from the engine at scrape time.

use std::sync::Mutex;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use voxkernel_core::engine::{EngineStats, Usage};

pub struct Metrics {
    registry: Registry,
    ttfa: Histogram,
    rtf: Histogram,
    audio_seconds: prometheus::Counter,
    finished: IntCounterVec,
    errors: IntCounterVec,
    active: IntGauge,
    queued: IntGauge,
    frames: IntCounter,
    sessions: IntCounter,
    engine_errors: IntCounter,
    pub http_streams: IntGauge,
    pub ws_connections: IntGauge,
    pub ws_contexts: IntGauge,
    pub registered_voices: IntGauge,
    pub voice_encode_seconds: Histogram,
    rss: IntGauge,
    /// The engine's counters at the last scrape, so ours advance by the difference.
    last: Mutex<EngineStats>,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let ttfa = Histogram::with_opts(
            HistogramOpts::new(
                "voxkernel_time_to_first_audio_seconds",
                "From a session's acceptance to its first audio leaving the engine",
            )
            .buckets(vec![
                0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
            ]),
        )
        .expect("valid histogram");
        let rtf = Histogram::with_opts(
            HistogramOpts::new(
                "voxkernel_rtf",
                "Real-time factor of finished sessions: synthesis seconds per audio second",
            )
            .buckets(vec![
                0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0,
            ]),
        )
        .expect("valid histogram");
        let voice_encode_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "voxkernel_voice_encode_seconds",
                "Decoding and encoding a registered voice's reference clip (POST /v1/voices)",
            )
            .buckets(vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]),
        )
        .expect("valid histogram");
        let audio_seconds = prometheus::Counter::new(
            "voxkernel_audio_seconds_total",
            "Seconds of audio sent by finished sessions",
        )
        .expect("valid counter");
        let finished = IntCounterVec::new(
            Opts::new(
                "voxkernel_sessions_finished_total",
                "Sessions that ended, by finish reason (eos, max_frames, runaway_guard, \
                 cancelled, disconnected, error), also those that ended before they got a slot",
            ),
            &["finish_reason"],
        )
        .expect("valid counter");
        let errors = IntCounterVec::new(
            Opts::new(
                "voxkernel_errors_total",
                "Errors sent to clients, by code (invalid_request, invalid_json, overloaded, ...)",
            ),
            &["kind"],
        )
        .expect("valid counter");
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("valid gauge");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid counter");
        let metrics = Self {
            active: gauge(
                "voxkernel_sessions_active",
                "Sessions holding a sequence slot",
            ),
            queued: gauge(
                "voxkernel_sessions_queued",
                "Sessions waiting for a slot or for their text (queue depth)",
            ),
            frames: counter(
                "voxkernel_frames_total",
                "Audio frames generated (80 ms each); rate() gives frames per second",
            ),
            sessions: counter(
                "voxkernel_sessions_started_total",
                "Sessions that got a slot",
            ),
            engine_errors: counter(
                "voxkernel_engine_session_errors_total",
                "Sessions the engine ended with an error",
            ),
            http_streams: gauge(
                "voxkernel_http_streams",
                "HTTP speech responses in progress",
            ),
            ws_connections: gauge("voxkernel_ws_connections", "Open WebSocket connections"),
            ws_contexts: gauge(
                "voxkernel_ws_contexts",
                "Open contexts over all WebSocket connections",
            ),
            registered_voices: gauge(
                "voxkernel_registered_voices",
                "Voices registered with POST /v1/voices (Base models)",
            ),
            voice_encode_seconds,
            rss: gauge(
                "process_resident_memory_bytes",
                "Resident memory of the server process (Linux)",
            ),
            registry,
            ttfa,
            rtf,
            audio_seconds,
            finished,
            errors,
            last: Mutex::new(EngineStats::default()),
        };
        let r = &metrics.registry;
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(metrics.ttfa.clone()),
            Box::new(metrics.rtf.clone()),
            Box::new(metrics.audio_seconds.clone()),
            Box::new(metrics.finished.clone()),
            Box::new(metrics.errors.clone()),
            Box::new(metrics.active.clone()),
            Box::new(metrics.queued.clone()),
            Box::new(metrics.frames.clone()),
            Box::new(metrics.sessions.clone()),
            Box::new(metrics.engine_errors.clone()),
            Box::new(metrics.http_streams.clone()),
            Box::new(metrics.ws_connections.clone()),
            Box::new(metrics.ws_contexts.clone()),
            Box::new(metrics.registered_voices.clone()),
            Box::new(metrics.voice_encode_seconds.clone()),
            Box::new(metrics.rss.clone()),
        ];
        for c in collectors {
            r.register(c).expect("unique metric names");
        }
        metrics
    }

    pub fn session_done(&self, usage: &Usage) {
        if let Some(ms) = usage.time_to_first_audio_ms {
            self.ttfa.observe(ms / 1e3);
        }
        if let Some(rtf) = usage.rtf {
            self.rtf.observe(rtf);
        }
        self.audio_seconds.inc_by(usage.audio_seconds);
        let reason = serde_json::to_value(usage.finish_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        self.finished.with_label_values(&[reason.as_str()]).inc();
    }

    /// A session that ended without `Done`: `disconnected` (the client left) or `error`.
    pub fn session_ended(&self, reason: &str) {
        self.finished.with_label_values(&[reason]).inc();
    }

    pub fn error(&self, kind: &str) {
        self.errors.with_label_values(&[kind]).inc();
    }

    /// The text exposition, with the engine's figures as of now.
    pub fn render(&self, stats: &EngineStats) -> String {
        if let Ok(mut last) = self.last.lock() {
            self.frames
                .inc_by(stats.frames_total.saturating_sub(last.frames_total));
            self.sessions
                .inc_by(stats.sessions_total.saturating_sub(last.sessions_total));
            self.engine_errors
                .inc_by(stats.errors_total.saturating_sub(last.errors_total));
            *last = stats.clone();
        }
        self.active.set(stats.active as i64);
        self.queued.set(stats.waiting as i64);
        if let Some(rss) = resident_memory_bytes() {
            self.rss.set(rss as i64);
        }
        let mut out = Vec::new();
        // Encoding to a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// VmRSS from /proc/self/status; `None` off Linux.
fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Holds a gauge up while alive.
pub struct GaugeGuard(IntGauge);

impl GaugeGuard {
    pub fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

//! `voxkernel bench --e2e --joins` as a process, on the CPU backend with the tiny random
//! CustomVoice checkpoint: every level prints its sessions' line, then the line of the sessions
//! that joined while the level's sessions streamed (no timing is asserted: it is a benchmark).

mod common;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity/tiny-custom-voice")
}

#[test]
fn e2e_with_joins_reports_every_joining_session_beside_the_streaming_ones() {
    let output = Command::new(env!("CARGO_BIN_EXE_voxkernel"))
        .args(["bench", "--e2e", "--backend", "cpu", "--model"])
        .arg(fixture())
        .args(["--concurrency", "1,2", "--frames", "4", "--waves", "1"])
        .args(["--joins", "3"])
        .output()
        .unwrap();
    let stdout = common::stdout_of_success(&output);
    let lines: Vec<Value> = (stdout.lines())
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<(&str, u64)> = (lines.iter())
        .map(|l| {
            (
                l["bench"].as_str().unwrap(),
                l["concurrency"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [("e2e", 1), ("e2e_join", 1), ("e2e", 2), ("e2e_join", 2)],
        "{stdout}"
    );
    for join in lines.iter().filter(|l| l["bench"] == "e2e_join") {
        assert_eq!(join["joins"], 3, "{join}");
        // the long sessions outlast the joins
        assert_eq!(join["streaming_min"], join["concurrency"], "{join}");
        let ttfa = &join["time_to_first_audio_ms"];
        let (p50, p95, max) = (
            ttfa["p50"].as_f64(),
            ttfa["p95"].as_f64(),
            ttfa["max"].as_f64(),
        );
        let (p50, p95, max) = (p50.unwrap(), p95.unwrap(), max.unwrap());
        assert!(0.0 < p50 && p50 <= p95 && p95 <= max, "{join}");
    }
}

#[test]
fn tf32_codec_on_the_cpu_backend_is_refused_with_a_reason() {
    let output = Command::new(env!("CARGO_BIN_EXE_voxkernel"))
        .args(["bench", "--e2e", "--backend", "cpu", "--model"])
        .arg(fixture())
        .args(["--concurrency", "1", "--frames", "2", "--waves", "1"])
        .args(["--codec-precision", "tf32"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--codec-precision tf32 needs the CUDA backend"),
        "{stderr}"
    );
}

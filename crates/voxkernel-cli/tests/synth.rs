//! `voxkernel synth` as a process, on the CPU backend with the tiny random CustomVoice
//! checkpoint: bad input is refused before any synthesis, in the words of the flags.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/parity/tiny-custom-voice")
}

fn synth(args: &[&str], output: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_voxkernel"))
        .args(["synth", "--backend", "cpu", "--max-frames", "2", "--model"])
        .arg(fixture())
        .args(args)
        .arg("-o")
        .arg(output)
        .output()
        .unwrap()
}

/// The error a failed run printed; it must not have started synthesising.
fn refusal(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{stderr}");
    assert!(!stderr.contains("synthesising"), "{stderr}");
    stderr
}

#[test]
fn an_output_path_that_cannot_be_written_is_refused_before_synthesis() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/out.wav");
    let stderr = refusal(&synth(&["--speaker", "ryan", "--text", "Hi."], &missing));
    assert!(
        stderr.contains("--output") && stderr.contains("does not exist"),
        "{stderr}"
    );
    let stderr = refusal(&synth(&["--speaker", "ryan", "--text", "Hi."], dir.path()));
    assert!(
        stderr.contains("--output") && stderr.contains("is a directory"),
        "{stderr}"
    );
    // The same request with a good path runs.
    let wav = dir.path().join("out.wav");
    let output = synth(&["--speaker", "ryan", "--text", "Hi."], &wav);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(hound::WavReader::open(&wav).unwrap().len(), 2 * 1920);
}

#[test]
fn request_errors_name_the_flag_and_the_valid_values() {
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("out.wav");
    let stderr = refusal(&synth(&["--speaker", "bob", "--text", "Hi."], &wav));
    assert!(
        stderr.contains("--speaker: unknown speaker \"bob\"") && stderr.contains("ryan"),
        "{stderr}"
    );
    let stderr = refusal(&synth(
        &[
            "--speaker",
            "ryan",
            "--language",
            "klingon",
            "--text",
            "Hi.",
        ],
        &wav,
    ));
    assert!(
        stderr.contains("--language: unknown language") && stderr.contains("english"),
        "{stderr}"
    );
    let stderr = refusal(&synth(&["--speaker", "ryan", "--text", ""], &wav));
    assert!(stderr.contains("--text: empty"), "{stderr}");
    assert!(!wav.exists());
}

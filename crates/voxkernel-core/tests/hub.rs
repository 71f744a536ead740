//! `hub::resolve_model` against a local stand-in for the Hugging Face Hub.
//!
//! hf-hub reads `HF_ENDPOINT` and `HF_HOME` from the process environment, and setting the
//! environment in-process is unsafe under edition 2024, so the download runs in a child
//! process (this test binary, running the ignored `child_resolve` test) with those variables
//! set, while the parent serves the files and counts requests.

mod checkpoint_support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use checkpoint_support::*;
use voxkernel_core::checkpoint::{Checkpoint, REQUIRED_FILES, expected_tensors};
use voxkernel_core::config::{ModelConfig, SpeechTokenizerConfig};
use voxkernel_core::hub::{PROCESSOR_FILES, resolve_model};

const REPO: &str = "voxtest/tiny-base";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const SPEC_VAR: &str = "VOXKERNEL_HUB_TEST_SPEC";
const RESULT_VAR: &str = "VOXKERNEL_HUB_TEST_RESULT";

/// Request counters of the stand-in Hub.
#[derive(Default)]
struct Counts {
    all: AtomicUsize,
    cdn: AtomicUsize,
}

/// Serves `files` the way the Hub does: `/{repo}/resolve/{rev}/{file}` answers with
/// `x-repo-commit` and an `etag`; LFS files (`*.safetensors`) redirect to a CDN URL and carry
/// their etag in `x-linked-etag`; ranged GETs get 206 with `content-range`.
fn start_hub(files: BTreeMap<String, Vec<u8>>) -> (String, Arc<Counts>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let counts = Arc::new(Counts::default());
    let (served_base, served_counts) = (base.clone(), counts.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let stream = stream.unwrap();
            served_counts.all.fetch_add(1, Ordering::SeqCst);
            answer(stream, &files, &served_base, &served_counts);
        }
    });
    (base, counts)
}

fn answer(mut stream: TcpStream, files: &BTreeMap<String, Vec<u8>>, base: &str, counts: &Counts) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut request_line = String::new();
    reader.read_line(&mut request_line).unwrap();
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
            break;
        }
        if let Some((key, value)) = line.split_once(':')
            && key.eq_ignore_ascii_case("range")
        {
            range = Some(value.trim().to_string());
        }
    }
    let resolve_prefix = format!("/{REPO}/resolve/main/");
    let response = if let Some(file) = path.strip_prefix(&resolve_prefix) {
        match files.get(file) {
            None => not_found(),
            Some(_) if file.ends_with(".safetensors") => {
                let headers = [
                    format!("Location: {base}/cdn/{file}"),
                    format!("x-repo-commit: {COMMIT}"),
                    format!("x-linked-etag: \"{}\"", etag(file, &files[file])),
                ];
                respond("302 Found", &headers, &[])
            }
            Some(bytes) => {
                let headers = [
                    format!("x-repo-commit: {COMMIT}"),
                    format!("etag: \"{}\"", etag(file, bytes)),
                ];
                ranged(bytes, range.as_deref(), &headers)
            }
        }
    } else if let Some(file) = path.strip_prefix("/cdn/") {
        counts.cdn.fetch_add(1, Ordering::SeqCst);
        match files.get(file) {
            Some(bytes) => ranged(bytes, range.as_deref(), &[]),
            None => not_found(),
        }
    } else {
        not_found()
    };
    stream.write_all(&response).unwrap();
}

/// A stable, content-derived etag (FNV-1a); the blob cache is keyed by it.
fn etag(file: &str, bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf29ce484222325;
    for &b in file.as_bytes().iter().chain(bytes) {
        hash = (hash ^ b as u64).wrapping_mul(0x100000001b3);
    }
    format!("{hash:016x}{:08x}", bytes.len())
}

fn ranged(bytes: &[u8], range: Option<&str>, headers: &[String]) -> Vec<u8> {
    let Some(spec) = range.and_then(|r| r.strip_prefix("bytes=")) else {
        return respond("200 OK", headers, bytes);
    };
    let (start, end) = spec.split_once('-').unwrap();
    let start: usize = start.parse().unwrap();
    let end = match end {
        "" => bytes.len() - 1,
        end => end.parse::<usize>().unwrap().min(bytes.len() - 1),
    };
    let mut headers = headers.to_vec();
    headers.push(format!(
        "Content-Range: bytes {start}-{end}/{}",
        bytes.len()
    ));
    respond("206 Partial Content", &headers, &bytes[start..=end])
}

fn not_found() -> Vec<u8> {
    respond(
        "404 Not Found",
        &["x-error-code: EntryNotFound".into()],
        b"not found",
    )
}

fn respond(status: &str, headers: &[String], body: &[u8]) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status}\r\n");
    for header in headers {
        out.push_str(header);
        out.push_str("\r\n");
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

/// A tiny Base checkpoint (configs from the fixtures, zero weights shaped by
/// `expected_tensors`), as the files a Hub repo would serve.
fn tiny_checkpoint_files() -> BTreeMap<String, Vec<u8>> {
    let fixture = fixtures().join("tiny-base");
    let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
    let speech_path = fixture.join("speech_tokenizer_config.json");
    let speech = std::fs::read_to_string(&speech_path).unwrap();
    let expected = expected_tensors(
        &ModelConfig::from_json(&config).unwrap(),
        &SpeechTokenizerConfig::from_file(&speech_path).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &config, &speech, &inventory_of(&expected));
    REQUIRED_FILES
        .iter()
        .chain(PROCESSOR_FILES.iter())
        .map(|file| {
            (
                file.to_string(),
                std::fs::read(dir.path().join(file)).unwrap(),
            )
        })
        .collect()
}

/// Runs `child_resolve` in a child process against `endpoint` with cache root `hf_home`.
fn resolve_in_child(endpoint: &str, hf_home: &Path) -> PathBuf {
    let result = hf_home.join("resolved.txt");
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["child_resolve", "--exact", "--ignored", "--test-threads=1"])
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", hf_home)
        .env_remove("HF_TOKEN")
        .env(SPEC_VAR, REPO)
        .env(RESULT_VAR, &result)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(std::fs::read_to_string(&result).unwrap())
}

#[test]
#[ignore = "run by resolve_model_downloads_into_hf_home_and_then_uses_the_cache with HF_ENDPOINT/HF_HOME set"]
fn child_resolve() {
    let spec = std::env::var(SPEC_VAR).expect("run through the parent test, which sets the spec");
    let path = resolve_model(&spec).unwrap();
    std::fs::write(std::env::var(RESULT_VAR).unwrap(), path.to_str().unwrap()).unwrap();
}

#[test]
fn resolve_model_downloads_into_hf_home_and_then_uses_the_cache() {
    let files = tiny_checkpoint_files();
    let (endpoint, counts) = start_hub(files.clone());
    let hf_home = tempfile::tempdir().unwrap();

    let snapshot = resolve_in_child(&endpoint, hf_home.path());
    assert_eq!(
        snapshot,
        hf_home
            .path()
            .join("hub/models--voxtest--tiny-base/snapshots")
            .join(COMMIT)
    );
    for (file, bytes) in &files {
        let cached = std::fs::read(snapshot.join(file)).unwrap();
        assert!(cached == *bytes, "{file} differs from what was served");
    }
    Checkpoint::open(&snapshot).unwrap();
    let first = counts.all.load(Ordering::SeqCst);
    assert!(
        first >= files.len(),
        "only {first} requests for {} files",
        files.len()
    );
    assert!(
        counts.cdn.load(Ordering::SeqCst) >= 2,
        "LFS files did not follow the redirect"
    );

    let again = resolve_in_child(&endpoint, hf_home.path());
    assert_eq!(again, snapshot);
    assert_eq!(
        counts.all.load(Ordering::SeqCst),
        first,
        "second resolve hit the network"
    );
}

#[test]
fn an_existing_directory_is_used_as_is() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        resolve_model(dir.path().to_str().unwrap()).unwrap(),
        dir.path()
    );
}

#[test]
fn a_spec_that_is_neither_directory_nor_repo_id_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    std::fs::write(&file, b"").unwrap();
    let err = resolve_model(file.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a file"), "{err}");

    let missing = dir.path().join("no/such/dir");
    for spec in [
        missing.to_str().unwrap(),
        "just-a-name",
        "a/b/c",
        "./rel/dir",
    ] {
        let err = resolve_model(spec).unwrap_err().to_string();
        assert!(
            err.contains("neither an existing checkpoint directory nor")
                && err.contains("owner/name"),
            "{spec}: {err}"
        );
    }
}

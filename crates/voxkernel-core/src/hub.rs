//! Resolving a model spec (a local directory or a Hugging Face `owner/name` repo id) to a
//! checkpoint directory, downloading through the hf-hub cache when needed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use hf_hub::api::sync::{Api, ApiBuilder};

use crate::checkpoint::REQUIRED_FILES;

/// Files of the released layout that `Checkpoint::open` does not read but the official
/// processors do; fetched so the snapshot is a complete copy of the release.
pub const PROCESSOR_FILES: [&str; 2] = [
    "preprocessor_config.json",
    "speech_tokenizer/preprocessor_config.json",
];

/// Resolves `spec` to a checkpoint directory. An existing directory is used as is. An
/// `owner/name` repo id is fetched from the Hub (`HF_ENDPOINT`, default huggingface.co) into
/// the hf-hub cache (`HF_HOME/hub`, default `~/.cache/huggingface/hub`); files already in the
/// cache are not requested again. `HF_TOKEN` or the cache's `token` file authenticates.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    let local = Path::new(spec);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    if local.exists() {
        bail!("model {spec:?} is a file; expected a checkpoint directory or an owner/name repo id");
    }
    if !is_repo_id(spec) {
        bail!(
            "model {spec:?} is neither an existing checkpoint directory nor a Hugging Face repo id \
             of the form owner/name (e.g. Qwen/Qwen3-TTS-12Hz-0.6B-Base)"
        );
    }
    download_snapshot(spec)
}

/// `owner/name` with Hub-legal characters; anything path-like (`./x`, `/x`, `a/b/c`) is not.
fn is_repo_id(spec: &str) -> bool {
    let legal = |part: &str| {
        !part.is_empty()
            && !part.starts_with(['.', '-'])
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(spec.split_once('/'), Some((owner, name)) if legal(owner) && legal(name))
}

fn download_snapshot(repo_id: &str) -> Result<PathBuf> {
    // from_env reads HF_HOME (cache) and HF_ENDPOINT; progress is on, so every download
    // draws an indicatif bar (hidden when stderr is not a terminal).
    let mut builder = ApiBuilder::from_env();
    if let Ok(token) = std::env::var("HF_TOKEN") {
        builder = builder.with_token(Some(token));
    }
    let api: Api = builder
        .build()
        .context("building the Hugging Face Hub client")?;
    let repo = api.model(repo_id.to_string());

    let mut snapshot: Option<PathBuf> = None;
    for file in REQUIRED_FILES.iter().chain(PROCESSOR_FILES.iter()) {
        // `get` answers from the cache when the file is there for the cached `main` ref.
        let path = repo
            .get(file)
            .with_context(|| format!("downloading {file} of {repo_id} from {}", repo.url(file)))?;
        let dir = snapshot_dir(&path, file)?;
        match &snapshot {
            Some(first) if *first != dir => bail!(
                "{repo_id} changed while downloading: {file} is in {} but earlier files are in {}; \
                 run again",
                dir.display(),
                first.display()
            ),
            _ => snapshot = Some(dir),
        }
    }
    Ok(snapshot.expect("the file lists are not empty"))
}

/// The snapshot directory holding `path`, which is `file` (possibly nested) inside it.
fn snapshot_dir(path: &Path, file: &str) -> Result<PathBuf> {
    let depth = Path::new(file).components().count();
    path.ancestors()
        .nth(depth)
        .map(Path::to_path_buf)
        .with_context(|| format!("hf-hub returned {} for {file}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_owner_slash_name() {
        assert!(is_repo_id("Qwen/Qwen3-TTS-12Hz-0.6B-Base"));
        assert!(is_repo_id("a_b/c.d-e"));
        for bad in [
            "Qwen",
            "a/b/c",
            "./a/b",
            "/abs/path",
            "a/",
            "/a",
            "../x",
            "a b/c",
            "",
        ] {
            assert!(!is_repo_id(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn snapshot_dir_strips_nested_file_names() {
        let root = Path::new("/c/snapshots/abc");
        assert_eq!(
            snapshot_dir(&root.join("config.json"), "config.json").unwrap(),
            root
        );
        let nested = root.join("speech_tokenizer/model.safetensors");
        assert_eq!(
            snapshot_dir(&nested, "speech_tokenizer/model.safetensors").unwrap(),
            root
        );
    }
}

//! Header-only synthetic checkpoints for the checkpoint and hub tests.

// Each test binary compiles this module and uses a different subset of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::Deserialize;
use voxkernel_core::checkpoint::{ExpectedTensor, WeightFile};

/// One tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HeaderTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Name -> tensor, per weight file.
pub type Inventory = BTreeMap<WeightFile, BTreeMap<String, HeaderTensor>>;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint")
}

pub fn reference_checkpoints() -> PathBuf {
    PathBuf::from("/work/shared/reference/checkpoints")
}

/// Reads a `tensors.json` inventory (`{"files": {"model.safetensors": {name: {dtype, shape}}}}`).
pub fn read_inventory(path: &Path) -> Inventory {
    #[derive(Deserialize)]
    struct Raw {
        files: BTreeMap<String, BTreeMap<String, HeaderTensor>>,
    }
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let raw: Raw = serde_json::from_str(&text).unwrap();
    raw.files
        .into_iter()
        .map(|(file, tensors)| {
            let file = WeightFile::ALL
                .into_iter()
                .find(|f| f.relative_path() == file)
                .unwrap_or_else(|| panic!("unknown file {file} in {}", path.display()));
            (file, tensors)
        })
        .collect()
}

pub fn inventory_of(expected: &[ExpectedTensor]) -> Inventory {
    let mut out = Inventory::new();
    for t in expected {
        out.entry(t.file).or_default().insert(
            t.name.clone(),
            HeaderTensor {
                dtype: t.dtype,
                shape: t.shape.clone(),
            },
        );
    }
    out
}

/// The bytes of a safetensors header (length prefix included) for `tensors`, laid out
/// back to back in name order, and the size of the data section.
pub fn safetensors_header(tensors: &BTreeMap<String, HeaderTensor>) -> (Vec<u8>, u64) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, t) in tensors {
        let bytes = t.shape.iter().product::<usize>() * t.dtype.bitsize() / 8;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    (out, offset as u64)
}

/// Writes the header, then extends the file to its full size without writing the zeros, so
/// a 1.8 GB model costs a few kilobytes of disk.
pub fn write_sparse_safetensors(path: &Path, tensors: &BTreeMap<String, HeaderTensor>) {
    let (header, data_len) = safetensors_header(tensors);
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&header).unwrap();
    file.set_len(header.len() as u64 + data_len).unwrap();
}

pub const GENERATION_CONFIG: &str = r#"{"do_sample": true, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50, "subtalker_dosample": true, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50, "max_new_tokens": 8192}"#;

/// Writes a complete checkpoint directory: configs, placeholder tokenizer files (only their
/// presence is checked here) and header-only weight files.
pub fn write_checkpoint(dir: &Path, config: &str, speech_config: &str, inventory: &Inventory) {
    std::fs::create_dir_all(dir.join("speech_tokenizer")).unwrap();
    let files = [
        ("config.json", config),
        ("speech_tokenizer/config.json", speech_config),
        ("generation_config.json", GENERATION_CONFIG),
        ("vocab.json", "{}"),
        ("merges.txt", "#version: 0.2\n"),
        ("tokenizer_config.json", "{}"),
        ("preprocessor_config.json", "{}"),
        ("speech_tokenizer/preprocessor_config.json", "{}"),
    ];
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    for file in WeightFile::ALL {
        let empty = BTreeMap::new();
        let tensors = inventory.get(&file).unwrap_or(&empty);
        write_sparse_safetensors(&dir.join(file.relative_path()), tensors);
    }
}

//! Loading a checkpoint directory in the released layout.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use std::os::unix::fs::FileExt;

use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};

use crate::config::{GenerationConfig, ModelConfig, SpeechTokenizerConfig};

/// A safetensors file whose header is parsed up front and whose tensors are read on demand
/// with positioned reads. Reading through the page cache gives what a memory map would (no
/// full copy, only the tensors asked for are touched) while keeping `unsafe` out of this crate.
pub struct SafetensorsFile {
    path: PathBuf,
    file: std::fs::File,
    /// Byte offset of the data section (8 + header length).
    data_start: u64,
    metadata: Metadata,
}

/// One tensor's entry in a safetensors header.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let file_len = file.metadata()?.len();
        let corrupt =
            |why: String| anyhow::anyhow!("{}: corrupt safetensors header: {why}", path.display());
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0)
            .map_err(|e| corrupt(format!("cannot read the header length ({e})")))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > 100_000_000 || 8 + header_len > file_len {
            return Err(corrupt(format!(
                "header length {header_len} does not fit a {file_len}-byte file"
            )));
        }
        let mut header = vec![0u8; 8 + header_len as usize];
        file.read_exact_at(&mut header, 0)?;
        let (_, metadata) =
            SafeTensors::read_metadata(&header).map_err(|e| corrupt(format!("{e:?}")))?;
        let data_len = metadata
            .tensors()
            .values()
            .map(|t| t.data_offsets.1)
            .max()
            .unwrap_or(0) as u64;
        if 8 + header_len + data_len > file_len {
            return Err(corrupt(format!(
                "tensors need {} bytes of data but the file has {}",
                data_len,
                file_len - 8 - header_len
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            data_start: 8 + header_len,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor in the header, sorted by name.
    pub fn infos(&self) -> Vec<TensorInfo> {
        let mut out: Vec<TensorInfo> = self
            .metadata
            .tensors()
            .into_iter()
            .map(|(name, t)| TensorInfo {
                name,
                dtype: t.dtype,
                shape: t.shape.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn info(&self, name: &str) -> Option<TensorInfo> {
        self.metadata.info(name).map(|t| TensorInfo {
            name: name.to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
    }

    /// The raw little-endian bytes of a tensor.
    pub fn bytes(&self, name: &str) -> Result<Vec<u8>> {
        let t = self
            .metadata
            .info(name)
            .with_context(|| format!("{}: missing tensor {name}", self.path.display()))?;
        let (begin, end) = t.data_offsets;
        let mut buf = vec![0u8; end - begin];
        self.file
            .read_exact_at(&mut buf, self.data_start + begin as u64)
            .with_context(|| format!("{}: reading tensor {name}", self.path.display()))?;
        Ok(buf)
    }

    /// A tensor converted to f32 (from bf16, f16 or f32), with its shape.
    pub fn f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let info = self
            .info(name)
            .with_context(|| format!("{}: missing tensor {name}", self.path.display()))?;
        let bytes = self.bytes(name)?;
        let data = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => bail!(
                "{}: tensor {name} has unsupported dtype {other:?}",
                self.path.display()
            ),
        };
        Ok((data, info.shape))
    }
}

/// A loaded checkpoint directory.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub speech_tokenizer_config: SpeechTokenizerConfig,
    pub generation: GenerationConfig,
    /// bf16 `model.safetensors`.
    pub model: SafetensorsFile,
    /// f32 `speech_tokenizer/model.safetensors`.
    pub speech_tokenizer: SafetensorsFile,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        Ok(Self {
            dir: dir.to_path_buf(),
            config: ModelConfig::from_file(&dir.join("config.json"))?,
            speech_tokenizer_config: SpeechTokenizerConfig::from_file(
                &dir.join("speech_tokenizer/config.json"),
            )?,
            generation: GenerationConfig::from_file(&dir.join("generation_config.json"))?,
            model: SafetensorsFile::open(&dir.join("model.safetensors"))?,
            speech_tokenizer: SafetensorsFile::open(
                &dir.join("speech_tokenizer/model.safetensors"),
            )?,
        })
    }
}

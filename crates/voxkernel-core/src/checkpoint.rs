//! Loading a checkpoint directory in the released layout, validating every tensor against
//! the shapes its configs imply, and summarising it for `voxkernel inspect`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::os::unix::fs::FileExt;

use safetensors::Dtype;
use safetensors::tensor::Metadata;

use crate::backend::{Frame, NUM_CODE_GROUPS};
use crate::config::{
    CodePredictorConfig, CodecDecoderConfig, CodecEncoderConfig, GenerationConfig, ModelConfig,
    ModelType, SpeakerEncoderConfig, SpeechTokenizerConfig, TalkerConfig,
};

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
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(|e| corrupt(format!("cannot read the header ({e})")))?;
        // `SafeTensors::read_metadata` wants the whole file in memory; deserialising
        // `Metadata` runs the same checks (contiguous offsets, sizes matching dtype x shape)
        // on the header alone.
        let metadata: Metadata =
            serde_json::from_slice(&header).map_err(|e| corrupt(e.to_string()))?;
        let data_len = metadata.data_len() as u64;
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

    /// An int64 `[frames, NUM_CODE_GROUPS]` tensor of codes (the official dumps and fixtures).
    pub fn frames(&self, name: &str) -> Result<Vec<Frame>> {
        let info = self
            .info(name)
            .with_context(|| format!("{}: missing tensor {name}", self.path.display()))?;
        if info.dtype != Dtype::I64 || info.shape.len() != 2 || info.shape[1] != NUM_CODE_GROUPS {
            bail!(
                "{}: tensor {name} is {:?} {:?}, want I64 [frames, {NUM_CODE_GROUPS}]",
                self.path.display(),
                info.dtype,
                info.shape
            );
        }
        let codes = self
            .bytes(name)?
            .chunks_exact(8)
            .map(|b| u32::try_from(i64::from_le_bytes(b.try_into().expect("8 bytes"))))
            .collect::<Result<Vec<u32>, _>>()
            .with_context(|| {
                format!("{}: tensor {name} has a negative code", self.path.display())
            })?;
        Ok(codes
            .chunks_exact(NUM_CODE_GROUPS)
            .map(|c| Frame::try_from(c).expect("whole frames"))
            .collect())
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

/// Files `Checkpoint::open` needs, relative to the checkpoint directory.
pub const REQUIRED_FILES: [&str; 8] = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
];

/// The two weight files of the released layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFile {
    /// `model.safetensors`: talker, code predictor and (Base) speaker encoder, BF16 as released.
    Model,
    /// `speech_tokenizer/model.safetensors`: the 12 Hz codec, F32 as released.
    SpeechTokenizer,
}

impl WeightFile {
    pub const ALL: [WeightFile; 2] = [WeightFile::Model, WeightFile::SpeechTokenizer];

    /// Path relative to the checkpoint directory.
    pub const fn relative_path(self) -> &'static str {
        match self {
            WeightFile::Model => "model.safetensors",
            WeightFile::SpeechTokenizer => "speech_tokenizer/model.safetensors",
        }
    }

    /// The dtype of this file in the released checkpoints.
    pub const fn released_dtype(self) -> Dtype {
        match self {
            WeightFile::Model => Dtype::BF16,
            WeightFile::SpeechTokenizer => Dtype::F32,
        }
    }

    /// Random test checkpoints come in either float width; both load through `f32()`.
    pub fn accepts(dtype: Dtype) -> bool {
        matches!(dtype, Dtype::BF16 | Dtype::F32)
    }
}

impl fmt::Display for WeightFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.relative_path())
    }
}

/// One tensor a checkpoint must contain, derived from its configs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedTensor {
    pub file: WeightFile,
    pub name: String,
    /// The released dtype; validation also accepts the other float width (`WeightFile::accepts`).
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// Every tensor the model needs, in (file, name) order: talker, code predictor (with
/// `small_to_mtp_projection` iff its hidden size differs from the talker's), the speaker
/// encoder for Base checkpoints, and the speech tokenizer's decoder and encoder.
pub fn expected_tensors(
    config: &ModelConfig,
    codec: &SpeechTokenizerConfig,
) -> Result<Vec<ExpectedTensor>> {
    let encoder = &codec.encoder_config;
    check_counts(config, codec, encoder)?;
    let mut model = TensorList::new(WeightFile::Model);
    push_talker(&mut model, &config.talker);
    push_code_predictor(
        &mut model,
        &config.talker.code_predictor_config,
        config.talker.hidden_size,
    );
    if config.model_type == ModelType::Base {
        push_speaker_encoder(&mut model, &config.speaker_encoder);
    }
    let mut speech = TensorList::new(WeightFile::SpeechTokenizer);
    push_codec_decoder(&mut speech, &codec.decoder_config);
    push_codec_encoder(&mut speech, encoder);
    let mut all = model.tensors;
    all.extend(speech.tensors);
    all.sort_by(|a, b| (a.file, &a.name).cmp(&(b.file, &b.name)));
    Ok(all)
}

/// Rejects counts the shape derivation would underflow or divide by.
fn check_counts(
    config: &ModelConfig,
    codec: &SpeechTokenizerConfig,
    encoder: &CodecEncoderConfig,
) -> Result<()> {
    let predictor_groups = config.talker.code_predictor_config.num_code_groups;
    if predictor_groups < 2 {
        bail!(
            "config.json: talker_config.code_predictor_config.num_code_groups is {predictor_groups}; must be at least 2"
        );
    }
    let decoder_quantizers = codec.decoder_config.num_quantizers;
    if decoder_quantizers < 2 {
        bail!(
            "speech_tokenizer/config.json: decoder_config.num_quantizers is {decoder_quantizers}; must be at least 2"
        );
    }
    if encoder.num_semantic_quantizers > encoder.num_quantizers {
        bail!(
            "speech_tokenizer/config.json: encoder_config.num_semantic_quantizers ({}) exceeds num_quantizers ({})",
            encoder.num_semantic_quantizers,
            encoder.num_quantizers
        );
    }
    if encoder.compress == 0 || encoder.upsampling_ratios.contains(&0) {
        bail!(
            "speech_tokenizer/config.json: encoder_config.compress and upsampling_ratios must be positive"
        );
    }
    Ok(())
}

/// Collects the tensors of one file; the helpers mirror the torch modules they stand for.
struct TensorList {
    file: WeightFile,
    tensors: Vec<ExpectedTensor>,
}

impl TensorList {
    fn new(file: WeightFile) -> Self {
        Self {
            file,
            tensors: Vec::new(),
        }
    }

    fn push(&mut self, name: String, shape: &[usize]) {
        self.tensors.push(ExpectedTensor {
            file: self.file,
            name,
            dtype: self.file.released_dtype(),
            shape: shape.to_vec(),
        });
    }

    /// `nn.Linear(input, output)`: weight `[out, in]`.
    fn linear(&mut self, prefix: &str, input: usize, output: usize, bias: bool) {
        self.push(format!("{prefix}.weight"), &[output, input]);
        if bias {
            self.push(format!("{prefix}.bias"), &[output]);
        }
    }

    /// `nn.Conv1d`: weight `[out, in / groups, kernel]`. `nn.ConvTranspose1d` stores
    /// `[in, out, kernel]`; callers pass the dimensions in stored order.
    fn conv(&mut self, prefix: &str, dims: [usize; 3], bias_len: Option<usize>) {
        self.push(format!("{prefix}.weight"), &dims);
        if let Some(len) = bias_len {
            self.push(format!("{prefix}.bias"), &[len]);
        }
    }

    fn vector(&mut self, name: String, len: usize) {
        self.push(name, &[len]);
    }
}

/// Width of one attention + MLP block, shared by the talker, code predictor and codec
/// transformers.
struct BlockShape {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
}

impl BlockShape {
    fn attention(&self, list: &mut TensorList, prefix: &str, bias: bool) {
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        list.linear(&format!("{prefix}.q_proj"), self.hidden, q, bias);
        list.linear(&format!("{prefix}.k_proj"), self.hidden, kv, bias);
        list.linear(&format!("{prefix}.v_proj"), self.hidden, kv, bias);
        list.linear(&format!("{prefix}.o_proj"), q, self.hidden, bias);
    }

    fn swiglu(&self, list: &mut TensorList, prefix: &str) {
        let (h, i) = (self.hidden, self.intermediate);
        list.linear(&format!("{prefix}.gate_proj"), h, i, false);
        list.linear(&format!("{prefix}.up_proj"), h, i, false);
        list.linear(&format!("{prefix}.down_proj"), i, h, false);
    }

    /// `Qwen3TTSDecoderLayer` x `layers`: RMSNorm, attention with q/k RMSNorm, SwiGLU.
    fn qwen3_layers(&self, list: &mut TensorList, prefix: &str, layers: usize) {
        for n in 0..layers {
            let layer = format!("{prefix}.{n}");
            list.vector(format!("{layer}.input_layernorm.weight"), self.hidden);
            self.attention(list, &format!("{layer}.self_attn"), false);
            list.vector(format!("{layer}.self_attn.q_norm.weight"), self.head_dim);
            list.vector(format!("{layer}.self_attn.k_norm.weight"), self.head_dim);
            list.vector(
                format!("{layer}.post_attention_layernorm.weight"),
                self.hidden,
            );
            self.swiglu(list, &format!("{layer}.mlp"));
        }
    }
}

fn push_talker(list: &mut TensorList, t: &TalkerConfig) {
    let h = t.hidden_size;
    list.push(
        "talker.model.text_embedding.weight".into(),
        &[t.text_vocab_size, t.text_hidden_size],
    );
    let text = t.text_hidden_size;
    list.linear("talker.text_projection.linear_fc1", text, text, true);
    list.linear("talker.text_projection.linear_fc2", text, h, true);
    list.push(
        "talker.model.codec_embedding.weight".into(),
        &[t.vocab_size, h],
    );
    let block = BlockShape {
        hidden: h,
        heads: t.num_attention_heads,
        kv_heads: t.num_key_value_heads,
        head_dim: t.head_dim,
        intermediate: t.intermediate_size,
    };
    block.qwen3_layers(list, "talker.model.layers", t.num_hidden_layers);
    list.vector("talker.model.norm.weight".into(), h);
    list.linear("talker.codec_head", h, t.vocab_size, false);
}

fn push_code_predictor(list: &mut TensorList, p: &CodePredictorConfig, talker_hidden: usize) {
    let prefix = "talker.code_predictor";
    // One embedding and one head per residual codebook (groups 1..num_code_groups); the
    // embeddings are talker-wide because their rows enter the talker's input too.
    for g in 0..p.num_code_groups - 1 {
        list.push(
            format!("{prefix}.model.codec_embedding.{g}.weight"),
            &[p.vocab_size, talker_hidden],
        );
        list.linear(
            &format!("{prefix}.lm_head.{g}"),
            p.hidden_size,
            p.vocab_size,
            false,
        );
    }
    let block = BlockShape {
        hidden: p.hidden_size,
        heads: p.num_attention_heads,
        kv_heads: p.num_key_value_heads,
        head_dim: p.head_dim,
        intermediate: p.intermediate_size,
    };
    block.qwen3_layers(list, &format!("{prefix}.model.layers"), p.num_hidden_layers);
    list.vector(format!("{prefix}.model.norm.weight"), p.hidden_size);
    if p.hidden_size != talker_hidden {
        list.linear(
            &format!("{prefix}.small_to_mtp_projection"),
            talker_hidden,
            p.hidden_size,
            true,
        );
    }
}

fn push_speaker_encoder(list: &mut TensorList, cfg: &SpeakerEncoderConfig) {
    let c = &cfg.enc_channels;
    let k = &cfg.enc_kernel_sizes;
    let enc_dim = cfg.enc_dim;
    let p = "speaker_encoder";
    list.conv(
        &format!("{p}.blocks.0.conv"),
        [c[0], cfg.mel_dim, k[0]],
        Some(c[0]),
    );
    for i in 1..c.len() - 1 {
        let block = format!("{p}.blocks.{i}");
        list.conv(
            &format!("{block}.tdnn1.conv"),
            [c[i], c[i - 1], 1],
            Some(c[i]),
        );
        let split = c[i] / cfg.enc_res2net_scale;
        for j in 0..cfg.enc_res2net_scale - 1 {
            list.conv(
                &format!("{block}.res2net_block.blocks.{j}.conv"),
                [split, split, k[i]],
                Some(split),
            );
        }
        list.conv(&format!("{block}.tdnn2.conv"), [c[i], c[i], 1], Some(c[i]));
        let se = cfg.enc_se_channels;
        list.conv(&format!("{block}.se_block.conv1"), [se, c[i], 1], Some(se));
        list.conv(
            &format!("{block}.se_block.conv2"),
            [c[i], se, 1],
            Some(c[i]),
        );
    }
    let last = c[c.len() - 1];
    let att = cfg.enc_attention_channels;
    list.conv(
        &format!("{p}.mfa.conv"),
        [last, last, k[k.len() - 1]],
        Some(last),
    );
    list.conv(&format!("{p}.asp.tdnn.conv"), [att, last * 3, 1], Some(att));
    list.conv(&format!("{p}.asp.conv"), [last, att, 1], Some(last));
    list.conv(&format!("{p}.fc"), [enc_dim, last * 2, 1], Some(enc_dim));
}

/// `Qwen3TTSTokenizerV2Decoder` (modeling_qwen3_tts_tokenizer_v2.py:824-865).
fn push_codec_decoder(list: &mut TensorList, d: &CodecDecoderConfig) {
    // The decoder hard-codes one semantic quantizer and a codebook half as wide as
    // `codebook_dim` (:830-837), whatever `num_semantic_quantizers` says.
    let vq_dim = d.codebook_dim / 2;
    let semantic = 1;
    for (name, count) in [
        ("rvq_first", semantic),
        ("rvq_rest", d.num_quantizers - semantic),
    ] {
        let rvq = format!("decoder.quantizer.{name}");
        list.conv(
            &format!("{rvq}.input_proj"),
            [vq_dim, d.codebook_dim, 1],
            None,
        );
        list.conv(
            &format!("{rvq}.output_proj"),
            [d.codebook_dim, vq_dim, 1],
            None,
        );
        for q in 0..count {
            let codebook = format!("{rvq}.vq.layers.{q}._codebook");
            list.vector(format!("{codebook}.cluster_usage"), d.codebook_size);
            list.push(
                format!("{codebook}.embedding_sum"),
                &[d.codebook_size, vq_dim],
            );
        }
    }
    list.conv(
        "decoder.pre_conv.conv",
        [d.latent_dim, d.codebook_dim, 3],
        Some(d.latent_dim),
    );

    let t = "decoder.pre_transformer";
    list.linear(
        &format!("{t}.input_proj"),
        d.latent_dim,
        d.hidden_size,
        true,
    );
    let block = BlockShape {
        hidden: d.hidden_size,
        heads: d.num_attention_heads,
        kv_heads: d.num_key_value_heads,
        head_dim: d.head_dim,
        intermediate: d.intermediate_size,
    };
    for n in 0..d.num_hidden_layers {
        let layer = format!("{t}.layers.{n}");
        list.vector(format!("{layer}.input_layernorm.weight"), d.hidden_size);
        block.attention(list, &format!("{layer}.self_attn"), false);
        list.vector(
            format!("{layer}.self_attn_layer_scale.scale"),
            d.hidden_size,
        );
        list.vector(
            format!("{layer}.post_attention_layernorm.weight"),
            d.hidden_size,
        );
        block.swiglu(list, &format!("{layer}.mlp"));
        list.vector(format!("{layer}.mlp_layer_scale.scale"), d.hidden_size);
    }
    list.vector(format!("{t}.norm.weight"), d.hidden_size);
    list.linear(
        &format!("{t}.output_proj"),
        d.hidden_size,
        d.latent_dim,
        true,
    );

    let latent = d.latent_dim;
    for (i, &factor) in d.upsampling_ratios.iter().enumerate() {
        let up = format!("decoder.upsample.{i}");
        list.conv(
            &format!("{up}.0.conv"),
            [latent, latent, factor],
            Some(latent),
        );
        let convnext = format!("{up}.1");
        list.conv(
            &format!("{convnext}.dwconv.conv"),
            [latent, 1, 7],
            Some(latent),
        );
        list.vector(format!("{convnext}.norm.weight"), latent);
        list.vector(format!("{convnext}.norm.bias"), latent);
        list.linear(&format!("{convnext}.pwconv1"), latent, 4 * latent, true);
        list.linear(&format!("{convnext}.pwconv2"), 4 * latent, latent, true);
        list.vector(format!("{convnext}.gamma"), latent);
    }

    list.conv(
        "decoder.decoder.0.conv",
        [d.decoder_dim, latent, 7],
        Some(d.decoder_dim),
    );
    let snake = |list: &mut TensorList, prefix: &str, channels: usize| {
        list.vector(format!("{prefix}.alpha"), channels);
        list.vector(format!("{prefix}.beta"), channels);
    };
    for (i, &rate) in d.upsample_rates.iter().enumerate() {
        let (input, output) = (d.decoder_dim >> i, d.decoder_dim >> (i + 1));
        let block = format!("decoder.decoder.{}.block", i + 1);
        snake(list, &format!("{block}.0"), input);
        list.conv(
            &format!("{block}.1.conv"),
            [input, output, 2 * rate],
            Some(output),
        );
        // Three residual units (dilations 1, 3, 9).
        for unit in 2..5 {
            let unit = format!("{block}.{unit}");
            snake(list, &format!("{unit}.act1"), output);
            list.conv(
                &format!("{unit}.conv1.conv"),
                [output, output, 7],
                Some(output),
            );
            snake(list, &format!("{unit}.act2"), output);
            list.conv(
                &format!("{unit}.conv2.conv"),
                [output, output, 1],
                Some(output),
            );
        }
    }
    let blocks = d.upsample_rates.len();
    let output = d.decoder_dim >> blocks;
    snake(list, &format!("decoder.decoder.{}", blocks + 1), output);
    list.conv(
        &format!("decoder.decoder.{}.conv", blocks + 2),
        [1, output, 7],
        Some(1),
    );
}

/// `MimiModel` without its decoder half (transformers modeling_mimi.py: `MimiEncoder`,
/// `MimiTransformerModel`, the downsample conv and `MimiSplitResidualVectorQuantizer`).
fn push_codec_encoder(list: &mut TensorList, e: &CodecEncoderConfig) {
    let seanet = "encoder.encoder.layers";
    let mut index = 0;
    list.conv(
        &format!("{seanet}.{index}.conv"),
        [e.num_filters, e.audio_channels, e.kernel_size],
        Some(e.num_filters),
    );
    index += 1;
    let mut channels = e.num_filters;
    for &ratio in e.upsampling_ratios.iter().rev() {
        let hidden = channels / e.compress;
        for _ in 0..e.num_residual_layers {
            // Resnet block = [ELU, conv k, ELU, conv 1]: the convs sit at 1 and 3.
            let block = format!("{seanet}.{index}");
            list.conv(
                &format!("{block}.block.1.conv"),
                [hidden, channels, e.residual_kernel_size],
                Some(hidden),
            );
            list.conv(
                &format!("{block}.block.3.conv"),
                [channels, hidden, 1],
                Some(channels),
            );
            if e.use_conv_shortcut {
                list.conv(
                    &format!("{block}.shortcut.conv"),
                    [channels, channels, 1],
                    Some(channels),
                );
            }
            index += 1;
        }
        index += 1; // ELU
        list.conv(
            &format!("{seanet}.{index}.conv"),
            [2 * channels, channels, 2 * ratio],
            Some(2 * channels),
        );
        index += 1;
        channels *= 2;
    }
    index += 1; // ELU
    list.conv(
        &format!("{seanet}.{index}.conv"),
        [e.hidden_size, channels, e.last_kernel_size],
        Some(e.hidden_size),
    );

    let block = BlockShape {
        hidden: e.hidden_size,
        heads: e.num_attention_heads,
        kv_heads: e.num_key_value_heads,
        head_dim: e.head_dim,
        intermediate: e.intermediate_size,
    };
    for n in 0..e.num_hidden_layers {
        let layer = format!("encoder.encoder_transformer.layers.{n}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            list.vector(format!("{layer}.{norm}.weight"), e.hidden_size);
            list.vector(format!("{layer}.{norm}.bias"), e.hidden_size);
        }
        block.attention(list, &format!("{layer}.self_attn"), e.attention_bias);
        list.vector(
            format!("{layer}.self_attn_layer_scale.scale"),
            e.hidden_size,
        );
        list.linear(
            &format!("{layer}.mlp.fc1"),
            e.hidden_size,
            e.intermediate_size,
            false,
        );
        list.linear(
            &format!("{layer}.mlp.fc2"),
            e.intermediate_size,
            e.hidden_size,
            false,
        );
        list.vector(format!("{layer}.mlp_layer_scale.scale"), e.hidden_size);
    }

    // MimiModel adds the stride-2 downsample only when the SEANet rate differs from the
    // frame rate (MimiConfig.encodec_frame_rate / frame_rate).
    if let Some(kernel) = e.downsample_kernel() {
        list.conv(
            "encoder.downsample.conv",
            [e.hidden_size, e.hidden_size, kernel],
            None,
        );
    }

    let vq_hidden = e.vector_quantization_hidden_dimension;
    for (name, count) in [
        ("semantic", e.num_semantic_quantizers),
        ("acoustic", e.num_quantizers - e.num_semantic_quantizers),
    ] {
        let rvq = format!("encoder.quantizer.{name}_residual_vector_quantizer");
        if vq_hidden != e.hidden_size {
            list.conv(
                &format!("{rvq}.input_proj"),
                [vq_hidden, e.hidden_size, 1],
                None,
            );
            list.conv(
                &format!("{rvq}.output_proj"),
                [e.hidden_size, vq_hidden, 1],
                None,
            );
        }
        for q in 0..count {
            let codebook = format!("{rvq}.layers.{q}.codebook");
            list.vector(format!("{codebook}.initialized"), 1);
            list.vector(format!("{codebook}.cluster_usage"), e.codebook_size);
            list.push(
                format!("{codebook}.embed_sum"),
                &[e.codebook_size, e.codebook_dim],
            );
        }
    }
}

/// Every way the weight files disagree with `expected`, one line each, naming the file.
pub fn tensor_mismatches(
    expected: &[ExpectedTensor],
    model: &SafetensorsFile,
    speech_tokenizer: &SafetensorsFile,
) -> Vec<String> {
    expected
        .iter()
        .filter_map(|want| {
            let file = match want.file {
                WeightFile::Model => model,
                WeightFile::SpeechTokenizer => speech_tokenizer,
            };
            let wanted = format!("{:?} {:?}", want.dtype, want.shape);
            match file.info(&want.name) {
                None => Some(format!(
                    "{}: missing {} (expected {wanted})",
                    want.file, want.name
                )),
                Some(got) if got.shape != want.shape || !WeightFile::accepts(got.dtype) => {
                    Some(format!(
                        "{}: {} is {:?} {:?}, expected {wanted} (BF16 or F32)",
                        want.file, want.name, got.dtype, got.shape
                    ))
                }
                Some(_) => None,
            }
        })
        .collect()
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
    /// Opens `dir` and checks that every file of the released layout is there and that
    /// every tensor the configs imply is present with the right shape and a float dtype.
    /// Extra tensors are ignored.
    pub fn open(dir: &Path) -> Result<Self> {
        let missing: Vec<&str> = REQUIRED_FILES
            .into_iter()
            .filter(|file| !dir.join(file).is_file())
            .collect();
        if !missing.is_empty() {
            bail!(
                "{}: checkpoint is missing {}",
                dir.display(),
                missing.join(", ")
            );
        }
        let checkpoint = Self {
            dir: dir.to_path_buf(),
            config: ModelConfig::from_file(&dir.join("config.json"))?,
            speech_tokenizer_config: SpeechTokenizerConfig::from_file(
                &dir.join("speech_tokenizer/config.json"),
            )?,
            generation: GenerationConfig::from_file(&dir.join("generation_config.json"))?,
            model: SafetensorsFile::open(&dir.join(WeightFile::Model.relative_path()))?,
            speech_tokenizer: SafetensorsFile::open(
                &dir.join(WeightFile::SpeechTokenizer.relative_path()),
            )?,
        };
        let expected = expected_tensors(&checkpoint.config, &checkpoint.speech_tokenizer_config)?;
        let problems =
            tensor_mismatches(&expected, &checkpoint.model, &checkpoint.speech_tokenizer);
        if !problems.is_empty() {
            bail!(
                "{}: {} tensor(s) do not match config.json and speech_tokenizer/config.json:\n  {}",
                dir.display(),
                problems.len(),
                problems.join("\n  ")
            );
        }
        Ok(checkpoint)
    }
}

/// What `voxkernel inspect` prints about a checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    pub dir: PathBuf,
    /// `tts_model_type`.
    pub variant: ModelType,
    /// `tts_model_size` ("0b6" or "1b7").
    pub size: String,
    pub supports_instruct: bool,
    pub talker: TransformerSummary,
    pub code_predictor: TransformerSummary,
    pub num_code_groups: usize,
    pub codec_decoder: CodecSummary,
    /// Base checkpoints only.
    pub speaker_encoder_parameters: Option<u64>,
    pub codec_encoder_parameters: u64,
    pub speakers: Vec<SpeakerSummary>,
    pub languages: Vec<String>,
    /// Keyed by the file's path relative to the checkpoint.
    pub files: BTreeMap<String, FileSummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TransformerSummary {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub parameters: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CodecSummary {
    pub num_quantizers: usize,
    pub codebook_size: usize,
    pub transformer_layers: usize,
    pub sliding_window: usize,
    pub output_sample_rate: u32,
    pub samples_per_frame: usize,
    pub parameters: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpeakerSummary {
    pub name: String,
    /// Row of the talker's codec embedding.
    pub codec_id: u32,
    pub dialect: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FileSummary {
    pub tensors: usize,
    pub parameters: u64,
    /// Tensor count per dtype name ("BF16", "F32", ...).
    pub dtypes: BTreeMap<String, usize>,
}

impl ModelSummary {
    pub fn new(checkpoint: &Checkpoint) -> Self {
        let config = &checkpoint.config;
        let talker = &config.talker;
        let predictor = &talker.code_predictor_config;
        let codec = &checkpoint.speech_tokenizer_config;
        let decoder = &codec.decoder_config;
        let model = &checkpoint.model;
        let speech = &checkpoint.speech_tokenizer;
        let talker_parameters =
            parameters_under(model, "talker.") - parameters_under(model, "talker.code_predictor.");
        let speaker_encoder_parameters = match parameters_under(model, "speaker_encoder.") {
            0 => None,
            n => Some(n),
        };
        Self {
            dir: checkpoint.dir.clone(),
            variant: config.model_type,
            size: config.model_size.clone(),
            supports_instruct: config.supports_instruct(),
            talker: TransformerSummary {
                hidden_size: talker.hidden_size,
                num_layers: talker.num_hidden_layers,
                num_attention_heads: talker.num_attention_heads,
                num_key_value_heads: talker.num_key_value_heads,
                head_dim: talker.head_dim,
                intermediate_size: talker.intermediate_size,
                vocab_size: talker.vocab_size,
                parameters: talker_parameters,
            },
            code_predictor: TransformerSummary {
                hidden_size: predictor.hidden_size,
                num_layers: predictor.num_hidden_layers,
                num_attention_heads: predictor.num_attention_heads,
                num_key_value_heads: predictor.num_key_value_heads,
                head_dim: predictor.head_dim,
                intermediate_size: predictor.intermediate_size,
                vocab_size: predictor.vocab_size,
                parameters: parameters_under(model, "talker.code_predictor."),
            },
            num_code_groups: talker.num_code_groups,
            codec_decoder: CodecSummary {
                num_quantizers: decoder.num_quantizers,
                codebook_size: decoder.codebook_size,
                transformer_layers: decoder.num_hidden_layers,
                sliding_window: decoder.sliding_window,
                output_sample_rate: codec.output_sample_rate,
                samples_per_frame: codec.samples_per_frame(),
                parameters: parameters_under(speech, "decoder."),
            },
            speaker_encoder_parameters,
            codec_encoder_parameters: parameters_under(speech, "encoder."),
            speakers: talker
                .spk_id
                .iter()
                .map(|(name, &codec_id)| SpeakerSummary {
                    name: name.clone(),
                    codec_id,
                    dialect: talker.spk_is_dialect.get(name).cloned(),
                })
                .collect(),
            languages: config.languages(),
            files: [
                (WeightFile::Model, model),
                (WeightFile::SpeechTokenizer, speech),
            ]
            .into_iter()
            .map(|(file, st)| (file.relative_path().to_string(), FileSummary::new(st)))
            .collect(),
        }
    }
}

impl FileSummary {
    fn new(file: &SafetensorsFile) -> Self {
        let infos = file.infos();
        let mut dtypes = BTreeMap::new();
        for info in &infos {
            *dtypes.entry(format!("{:?}", info.dtype)).or_insert(0) += 1;
        }
        Self {
            tensors: infos.len(),
            parameters: infos.iter().map(TensorInfo::parameters).sum(),
            dtypes,
        }
    }
}

impl TensorInfo {
    /// Number of elements.
    pub fn parameters(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

fn parameters_under(file: &SafetensorsFile, prefix: &str) -> u64 {
    file.infos()
        .iter()
        .filter(|info| info.name.starts_with(prefix))
        .map(TensorInfo::parameters)
        .sum()
}

//! The speech tokenizer's encoder (`MimiModel` without its decoder: SEANet, the transformer,
//! the downsample and the split residual VQ) as `speech_tokenizer/config.json` lays it out.
//! Names are under `encoder.`.

use anyhow::{Result, bail, ensure};

use crate::backend::NUM_CODE_GROUPS;
use crate::config::{CodecEncoderConfig, SpeechTokenizerConfig};

/// `MimiModel` builds its downsample with stride 2 whatever the rates.
const DOWNSAMPLE_STRIDE: usize = 2;

/// How a causal conv's padding rows are made (`pad_mode`; the downsample always replicates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CausalPadding {
    Zeros,
    Replicate,
}

/// A causal `MimiConv1d`: `{name}.conv.weight` `[out, inp, kernel]`, and `{name}.conv.bias`
/// `[out]` when `bias`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MimiConv {
    pub name: String,
    pub out: usize,
    pub inp: usize,
    pub kernel: usize,
    pub bias: bool,
    pub stride: usize,
    pub dilation: usize,
    pub padding: CausalPadding,
}

impl MimiConv {
    /// The weight's shape, `[out, inp, kernel]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.out, self.inp, self.kernel]
    }
}

/// ELU, conv (kernel `residual_kernel_size`), ELU, conv 1x1, plus the shortcut: a 1x1 conv
/// with `use_conv_shortcut`, else the block's input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResnetBlockGeometry {
    pub conv1: MimiConv,
    pub conv2: MimiConv,
    pub shortcut: Option<MimiConv>,
}

/// One stride of the encoder: residual blocks, then ELU and the strided conv that doubles the
/// channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeanetStageGeometry {
    pub blocks: Vec<ResnetBlockGeometry>,
    pub downsample: MimiConv,
}

/// `MimiEncoder`: waveform to `hidden_size` channels at the SEANet rate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeanetGeometry {
    pub conv_in: MimiConv,
    pub stages: Vec<SeanetStageGeometry>,
    /// After an ELU.
    pub conv_out: MimiConv,
}

/// One residual VQ of the split quantizer: its first `layers` codebooks are used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizerGeometry {
    /// `quantizer.semantic_residual_vector_quantizer` or the acoustic one.
    pub name: &'static str,
    pub layers: usize,
}

/// The layers both backends load; the transformer's need no more than the config's fields
/// (checked here too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerEncoderGeometry {
    pub seanet: SeanetGeometry,
    /// The stride-2 downsample `MimiModel` adds when the SEANet rate differs from the frame
    /// rate.
    pub downsample: Option<MimiConv>,
    pub semantic: QuantizerGeometry,
    pub acoustic: QuantizerGeometry,
}

impl TokenizerEncoderGeometry {
    pub fn new(config: &SpeechTokenizerConfig) -> Result<Self> {
        let c = &config.encoder_config;
        let kept = config.encoder_valid_num_quantizers;
        ensure!(
            kept == NUM_CODE_GROUPS,
            "speech_tokenizer encoder_valid_num_quantizers is {kept}, but frames carry \
             {NUM_CODE_GROUPS} codebooks"
        );
        ensure!(
            c.num_semantic_quantizers >= 1
                && c.num_semantic_quantizers < kept
                && c.num_quantizers >= kept,
            "speech_tokenizer encoder_config: {} semantic of {} quantizers cannot give {kept} codes",
            c.num_semantic_quantizers,
            c.num_quantizers
        );
        let downsample = c.downsample_kernel().map(|kernel| MimiConv {
            name: "downsample".into(),
            out: c.hidden_size,
            inp: c.hidden_size,
            kernel,
            bias: false,
            stride: DOWNSAMPLE_STRIDE,
            dilation: 1,
            padding: CausalPadding::Replicate,
        });
        let downsampling = c.seanet_hop() * downsample.as_ref().map_or(1, |conv| conv.stride);
        ensure!(
            downsampling == config.encode_downsample_rate,
            "speech_tokenizer encoder_config strides give {downsampling} samples per code, but \
             encode_downsample_rate is {}",
            config.encode_downsample_rate
        );
        let seanet = SeanetGeometry::new(c)?;
        check_transformer(c)?;
        ensure!(
            c.codebook_dim == c.vector_quantization_hidden_dimension,
            "speech_tokenizer encoder_config: codebook_dim {} differs from \
             vector_quantization_hidden_dimension {}; Mimi's encode needs them equal",
            c.codebook_dim,
            c.vector_quantization_hidden_dimension
        );
        Ok(Self {
            seanet,
            downsample,
            semantic: QuantizerGeometry {
                name: "quantizer.semantic_residual_vector_quantizer",
                layers: c.num_semantic_quantizers,
            },
            acoustic: QuantizerGeometry {
                name: "quantizer.acoustic_residual_vector_quantizer",
                layers: kept - c.num_semantic_quantizers,
            },
        })
    }
}

impl SeanetGeometry {
    /// The layer indices follow `MimiEncoder`'s module list, where every ELU also takes an
    /// index.
    fn new(c: &CodecEncoderConfig) -> Result<Self> {
        if !c.use_causal_conv {
            bail!(
                "speech_tokenizer encoder_config.use_causal_conv is false; only causal is supported"
            );
        }
        let padding = match c.pad_mode.as_str() {
            "constant" => CausalPadding::Zeros,
            "replicate" => CausalPadding::Replicate,
            other => bail!(
                "speech_tokenizer encoder_config.pad_mode {other:?} is not supported (constant, \
                 replicate)"
            ),
        };
        ensure!(
            c.audio_channels == 1,
            "speech_tokenizer encoder_config.audio_channels is {}; only mono is supported",
            c.audio_channels
        );
        let conv = |index: &str, [out, inp, kernel]: [usize; 3], stride, dilation| MimiConv {
            name: format!("encoder.layers.{index}"),
            out,
            inp,
            kernel,
            bias: true,
            stride,
            dilation,
            padding,
        };
        let mut index = 0;
        let conv_in = conv("0", [c.num_filters, 1, c.kernel_size], 1, 1);
        index += 1;
        let mut channels = c.num_filters;
        let mut stages = Vec::new();
        for &ratio in c.upsampling_ratios.iter().rev() {
            let hidden = channels / c.compress;
            let mut blocks = Vec::new();
            for j in 0..c.num_residual_layers {
                let block = format!("{index}.block");
                blocks.push(ResnetBlockGeometry {
                    conv1: conv(
                        &format!("{block}.1"),
                        [hidden, channels, c.residual_kernel_size],
                        1,
                        c.dilation_growth_rate.pow(j as u32),
                    ),
                    conv2: conv(&format!("{block}.3"), [channels, hidden, 1], 1, 1),
                    shortcut: c
                        .use_conv_shortcut
                        .then(|| conv(&format!("{index}.shortcut"), [channels, channels, 1], 1, 1)),
                });
                index += 1;
            }
            index += 1; // ELU
            let downsample = conv(
                &index.to_string(),
                [2 * channels, channels, 2 * ratio],
                ratio,
                1,
            );
            index += 1;
            stages.push(SeanetStageGeometry { blocks, downsample });
            channels *= 2;
        }
        index += 1; // ELU
        let conv_out = conv(
            &index.to_string(),
            [c.hidden_size, channels, c.last_kernel_size],
            1,
            1,
        );
        Ok(Self {
            conv_in,
            stages,
            conv_out,
        })
    }
}

/// What `MimiTransformerModel` as released needs of the config.
fn check_transformer(c: &CodecEncoderConfig) -> Result<()> {
    ensure!(
        c.num_key_value_heads == c.num_attention_heads,
        "speech_tokenizer encoder_config.num_key_value_heads is {} but only {} (= \
         num_attention_heads, as released) is supported",
        c.num_key_value_heads,
        c.num_attention_heads
    );
    ensure!(
        c.hidden_act == "gelu",
        "speech_tokenizer encoder_config.hidden_act {:?} is not supported (gelu)",
        c.hidden_act
    );
    ensure!(
        c.head_dim.is_multiple_of(2),
        "speech_tokenizer encoder_config.head_dim must be even for RoPE, got {}",
        c.head_dim
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const FIXTURE: &str = "../../tests/fixtures/clone/tiny-base/speech_tokenizer/config.json";

    fn fixture_json() -> serde_json::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// The tiny fixture's config with `patch` applied to its `encoder_config`, or to the top
    /// level for the keys named `top.*`.
    fn config(patch: serde_json::Value) -> SpeechTokenizerConfig {
        let mut json = fixture_json();
        for (key, value) in patch.as_object().unwrap() {
            match key.strip_prefix("top.") {
                Some(top) => json[top] = value.clone(),
                None => json["encoder_config"][key] = value.clone(),
            }
        }
        serde_json::from_value(json).unwrap()
    }

    fn error(patch: serde_json::Value) -> String {
        TokenizerEncoderGeometry::new(&config(patch))
            .unwrap_err()
            .to_string()
    }

    /// `MimiEncoder`'s module list: conv, then per stride [resnet block, ELU, conv], then ELU
    /// and conv; the block's convs sit at 1 and 3 of [ELU, conv, ELU, conv].
    #[test]
    fn seanet_names_follow_the_module_list() {
        let geometry = TokenizerEncoderGeometry::new(&config(serde_json::json!({}))).unwrap();
        let seanet = &geometry.seanet;
        assert_eq!(seanet.conv_in.name, "encoder.layers.0");
        assert_eq!(seanet.conv_in.shape(), [8, 1, 7]);
        let names: Vec<_> = seanet
            .stages
            .iter()
            .flat_map(|s| [&s.blocks[0].conv1.name, &s.downsample.name])
            .collect();
        assert_eq!(
            names,
            [
                "encoder.layers.1.block.1",
                "encoder.layers.3",
                "encoder.layers.4.block.1",
                "encoder.layers.6",
                "encoder.layers.7.block.1",
                "encoder.layers.9",
                "encoder.layers.10.block.1",
                "encoder.layers.12",
            ]
        );
        let last = &seanet.stages[3];
        assert_eq!(last.blocks[0].conv2.shape(), [64, 32, 1]);
        assert_eq!(
            (last.downsample.shape(), last.downsample.stride),
            ([128, 64, 16], 8)
        );
        assert_eq!(seanet.conv_out.name, "encoder.layers.14");
        assert_eq!(seanet.conv_out.shape(), [32, 128, 3]);
        let downsample = geometry.downsample.unwrap();
        assert_eq!((downsample.shape(), downsample.stride), ([32, 32, 4], 2));
        assert_eq!(
            (geometry.semantic.layers, geometry.acoustic.layers),
            (1, 15)
        );
    }

    #[test]
    fn resnet_dilations_grow_and_shortcuts_follow_the_config() {
        let geometry = TokenizerEncoderGeometry::new(&config(serde_json::json!({
            "num_residual_layers": 3,
            "use_conv_shortcut": true,
        })))
        .unwrap();
        let stage = &geometry.seanet.stages[1];
        let dilations: Vec<_> = stage.blocks.iter().map(|b| b.conv1.dilation).collect();
        assert_eq!(dilations, [1, 2, 4]);
        let shortcut = stage.blocks[2].shortcut.as_ref().unwrap();
        assert_eq!(shortcut.name, "encoder.layers.8.shortcut");
        assert_eq!(stage.downsample.name, "encoder.layers.10");
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases = [
            (
                serde_json::json!({"top.encoder_valid_num_quantizers": 8}),
                "encoder_valid_num_quantizers is 8",
            ),
            (
                serde_json::json!({"num_semantic_quantizers": 0}),
                "0 semantic of 17 quantizers cannot give 16 codes",
            ),
            (
                serde_json::json!({"top.encode_downsample_rate": 960}),
                "strides give 1920 samples per code, but encode_downsample_rate is 960",
            ),
            (
                serde_json::json!({"use_causal_conv": false}),
                "use_causal_conv is false",
            ),
            (
                serde_json::json!({"pad_mode": "reflect"}),
                "pad_mode \"reflect\" is not supported",
            ),
            (
                serde_json::json!({"audio_channels": 2}),
                "audio_channels is 2",
            ),
            (
                serde_json::json!({"num_key_value_heads": 2}),
                "num_key_value_heads is 2",
            ),
            (
                serde_json::json!({"hidden_act": "relu"}),
                "hidden_act \"relu\" is not supported",
            ),
            (
                serde_json::json!({"head_dim": 7}),
                "head_dim must be even for RoPE, got 7",
            ),
            (
                serde_json::json!({"codebook_dim": 16}),
                "codebook_dim 16 differs from vector_quantization_hidden_dimension 8",
            ),
        ];
        for (patch, expected) in cases {
            let err = error(patch);
            assert!(err.contains(expected), "{expected:?} not in {err:?}");
        }
    }
}

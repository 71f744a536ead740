//! The Base models' speaker encoder (`Qwen3TTSSpeakerEncoder`, modeling_qwen3_tts.py:95-394)
//! as `speaker_encoder_config` lays it out.

use anyhow::{Result, ensure};

use crate::checkpoint::Checkpoint;
use crate::config::{ModelType, SpeakerEncoderConfig};
use crate::reference::mel::SAMPLE_RATE;

/// A stride-1 `Conv1d` with bias: `{name}.weight` `[out, inp, kernel]` and `{name}.bias`
/// `[out]`, named under `speaker_encoder.`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeakerConv {
    pub name: String,
    pub out: usize,
    pub inp: usize,
    pub kernel: usize,
    pub dilation: usize,
}

impl SpeakerConv {
    fn new(name: String, [out, inp, kernel, dilation]: [usize; 4]) -> Self {
        Self {
            name,
            out,
            inp,
            kernel,
            dilation,
        }
    }

    /// The weight's shape, `[out, inp, kernel]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.out, self.inp, self.kernel]
    }
}

/// TDNN 1x1, Res2Net, TDNN 1x1, then the squeeze-excitation's two 1x1 convs. The TDNNs'
/// convs are `…tdnn1.conv` and the like; the squeeze-excitation's have no `.conv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeRes2NetBlockGeometry {
    pub tdnn1: SpeakerConv,
    /// Chunk `i >= 1` of `enc_res2net_scale` goes through `res2net[i - 1]`; chunk 0 passes
    /// through.
    pub res2net: Vec<SpeakerConv>,
    pub tdnn2: SpeakerConv,
    pub se_conv1: SpeakerConv,
    pub se_conv2: SpeakerConv,
}

/// Every convolution of the speaker encoder, in the order the forward pass runs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpeakerEncoderGeometry {
    pub block0: SpeakerConv,
    pub blocks: Vec<SeRes2NetBlockGeometry>,
    /// The multi-layer aggregation over the blocks' outputs side by side.
    pub mfa: SpeakerConv,
    pub asp_tdnn: SpeakerConv,
    pub asp_conv: SpeakerConv,
    pub fc: SpeakerConv,
}

impl SpeakerEncoderGeometry {
    /// The speaker encoder of a Base checkpoint.
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        ensure!(
            checkpoint.config.model_type == ModelType::Base,
            "only Base checkpoints have a speaker encoder (voice cloning)"
        );
        // extract_speaker_embedding asserts 24 kHz; the mel constants assume it.
        let rate = checkpoint.config.speaker_encoder.sample_rate;
        ensure!(
            rate == SAMPLE_RATE,
            "config.json: speaker_encoder_config.sample_rate is {rate}; only {SAMPLE_RATE} is \
             supported (the official mel front end is fixed to it)"
        );
        Self::new(&checkpoint.config.speaker_encoder)
    }

    pub fn new(config: &SpeakerEncoderConfig) -> Result<Self> {
        let c = &config.enc_channels;
        let (k, d) = (&config.enc_kernel_sizes, &config.enc_dilations);
        ensure!(
            c.len() >= 3 && k.len() == c.len() && d.len() == c.len(),
            "speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations must have \
             the same length (at least 3), got {}, {} and {}",
            c.len(),
            k.len(),
            d.len()
        );
        let last = c.len() - 1;
        let scale = config.enc_res2net_scale;
        let aggregated: usize = c[1..last].iter().sum();
        ensure!(
            aggregated == c[last],
            "speaker_encoder_config: the multi-layer aggregation takes {aggregated} channels \
             (enc_channels[1..-1]) but enc_channels[-1] is {}",
            c[last]
        );
        let se = config.enc_se_channels;
        let blocks = (1..last)
            .map(|i| {
                ensure!(
                    c[i] == c[i - 1] && c[i].is_multiple_of(scale),
                    "speaker_encoder_config: SE-Res2Net block {i} needs enc_channels[{i}] equal \
                     to the previous width and divisible by enc_res2net_scale {scale}"
                );
                let name = format!("blocks.{i}");
                let conv = |part: &str, dims| SpeakerConv::new(format!("{name}.{part}"), dims);
                let width = c[i] / scale;
                Ok(SeRes2NetBlockGeometry {
                    tdnn1: conv("tdnn1.conv", [c[i], c[i - 1], 1, 1]),
                    res2net: (0..scale - 1)
                        .map(|j| {
                            let part = format!("res2net_block.blocks.{j}.conv");
                            conv(&part, [width, width, k[i], d[i]])
                        })
                        .collect(),
                    tdnn2: conv("tdnn2.conv", [c[i], c[i], 1, 1]),
                    se_conv1: conv("se_block.conv1", [se, c[i], 1, 1]),
                    se_conv2: conv("se_block.conv2", [c[i], se, 1, 1]),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let attention = config.enc_attention_channels;
        let conv = |name: &str, dims| SpeakerConv::new(name.to_string(), dims);
        Ok(Self {
            block0: conv("blocks.0.conv", [c[0], config.mel_dim, k[0], d[0]]),
            blocks,
            mfa: conv("mfa.conv", [c[last], c[last], k[last], d[last]]),
            asp_tdnn: conv("asp.tdnn.conv", [attention, 3 * c[last], 1, 1]),
            asp_conv: conv("asp.conv", [c[last], attention, 1, 1]),
            fc: conv("fc", [config.enc_dim, 2 * c[last], 1, 1]),
        })
    }

    /// Mel bins per input frame (`mel_dim`).
    pub fn mel_dim(&self) -> usize {
        self.block0.inp
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn config(patch: serde_json::Value) -> SpeakerEncoderConfig {
        let mut json = serde_json::json!({"enc_dim": 16, "sample_rate": 24000});
        json.as_object_mut()
            .unwrap()
            .extend(patch.as_object().unwrap().clone());
        serde_json::from_value(json).unwrap()
    }

    fn error(patch: serde_json::Value) -> String {
        SpeakerEncoderGeometry::new(&config(patch))
            .unwrap_err()
            .to_string()
    }

    /// The released layout: `Qwen3TTSSpeakerEncoderConfig`'s defaults.
    #[test]
    fn the_default_config_gives_the_released_layers() {
        let geometry = SpeakerEncoderGeometry::new(&config(serde_json::json!({}))).unwrap();
        assert_eq!(geometry.mel_dim(), 128);
        assert_eq!(geometry.block0.shape(), [512, 128, 5]);
        assert_eq!(geometry.blocks.len(), 3);
        let block = &geometry.blocks[2];
        assert_eq!(block.tdnn1.name, "blocks.3.tdnn1.conv");
        assert_eq!(block.res2net.len(), 7);
        assert_eq!(
            block.res2net[6],
            SpeakerConv::new(
                "blocks.3.res2net_block.blocks.6.conv".into(),
                [64, 64, 3, 4]
            )
        );
        assert_eq!(block.se_conv2.name, "blocks.3.se_block.conv2");
        assert_eq!(block.se_conv2.shape(), [512, 128, 1]);
        assert_eq!(geometry.mfa.shape(), [1536, 1536, 1]);
        assert_eq!(geometry.asp_tdnn.shape(), [128, 3 * 1536, 1]);
        assert_eq!(geometry.fc.shape(), [16, 2 * 1536, 1]);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let err = error(serde_json::json!({"enc_dilations": [1, 2, 3, 4]}));
        assert!(
            err.contains("enc_dilations must have the same length") && err.contains("5, 5 and 4"),
            "{err}"
        );
        let err = error(serde_json::json!({"enc_channels": [512, 512, 512, 512, 1024]}));
        assert!(
            err.contains("aggregation takes 1536 channels")
                && err.contains("enc_channels[-1] is 1024"),
            "{err}"
        );
        let err = error(serde_json::json!({"enc_res2net_scale": 5}));
        assert!(
            err.contains("block 1 needs enc_channels[1]") && err.contains("enc_res2net_scale 5"),
            "{err}"
        );
    }

    #[test]
    fn only_base_checkpoints_at_24_khz_have_one() {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clone/tiny-base");
        let mut checkpoint = Checkpoint::open(&dir).unwrap();
        SpeakerEncoderGeometry::from_checkpoint(&checkpoint).unwrap();
        checkpoint.config.speaker_encoder.sample_rate = 16_000;
        let err = SpeakerEncoderGeometry::from_checkpoint(&checkpoint)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("speaker_encoder_config.sample_rate is 16000"),
            "{err}"
        );
        checkpoint.config.model_type = ModelType::CustomVoice;
        let err = SpeakerEncoderGeometry::from_checkpoint(&checkpoint)
            .unwrap_err()
            .to_string();
        assert!(err.contains("only Base checkpoints"), "{err}");
    }
}

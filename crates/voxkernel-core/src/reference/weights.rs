//! Reading checkpoint tensors into f32 candle tensors (bf16 weights are widened exactly).

use anyhow::{Context, Result, bail};
use candle_core::{Device, Tensor};
use candle_nn::Linear;

use crate::checkpoint::SafetensorsFile;

/// A view of one safetensors file under a name prefix, e.g. `talker.model.`.
pub(crate) struct Weights<'a> {
    file: &'a SafetensorsFile,
    prefix: String,
}

impl<'a> Weights<'a> {
    pub(crate) fn new(file: &'a SafetensorsFile, prefix: &str) -> Self {
        Self {
            file,
            prefix: prefix.to_string(),
        }
    }

    /// The same file under `prefix` + `sub` + ".".
    pub(crate) fn sub(&self, sub: &str) -> Weights<'a> {
        Weights::new(self.file, &format!("{}{sub}.", self.prefix))
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.file.info(&self.full(name)).is_some()
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub(crate) fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let full = self.full(name);
        let (data, actual) = self.file.f32(&full)?;
        if actual != shape {
            bail!(
                "{}: tensor {full} has shape {actual:?}, the config implies {shape:?}",
                self.file.path().display()
            );
        }
        Tensor::from_vec(data, actual, &Device::Cpu).with_context(|| format!("loading {full}"))
    }

    /// `name.weight` `[out, in]` and, when `bias`, `name.bias` `[out]`.
    pub(crate) fn linear(
        &self,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = self.tensor(&format!("{name}.weight"), &[out_dim, in_dim])?;
        let bias = if bias {
            Some(self.tensor(&format!("{name}.bias"), &[out_dim])?)
        } else {
            None
        };
        Ok(Linear::new(weight, bias))
    }

    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

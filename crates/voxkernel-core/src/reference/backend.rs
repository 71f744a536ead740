//! [`ReferenceBackend`]: the [`FrameBackend`] over [`Sequence`]s, one at a time, on the CPU;
//! [`ReferenceCodec`]: the [`CodecBackend`] over [`CodecStream`]s.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Result, bail};

use super::codec_decoder::{CodecDecoder, CodecStream};
use super::model::ReferenceModel;
use super::sequence::Sequence;
use crate::backend::{
    CodecBackend, CodecSlot, Frame, FrameBackend, FrameEvent, SequenceSpec, SlotId,
};
use crate::checkpoint::Checkpoint;

pub struct ReferenceBackend {
    model: ReferenceModel,
    slots: HashMap<SlotId, Sequence>,
    next_slot: usize,
}

impl ReferenceBackend {
    pub fn new(checkpoint: &Checkpoint) -> Result<Self> {
        Ok(Self {
            model: ReferenceModel::new(checkpoint)?,
            slots: HashMap::new(),
            next_slot: 0,
        })
    }

    pub fn model(&self) -> &ReferenceModel {
        &self.model
    }
}

fn active(slots: &mut HashMap<SlotId, Sequence>, slot: SlotId) -> Result<&mut Sequence> {
    match slots.get_mut(&slot) {
        Some(sequence) => Ok(sequence),
        None => bail!(
            "slot {} is not active: never started, or already released",
            slot.0
        ),
    }
}

impl FrameBackend for ReferenceBackend {
    fn name(&self) -> String {
        "reference (candle, CPU, f32)".to_string()
    }

    /// One sequence after the other: the CPU gains nothing from running prefills together.
    fn start(&mut self, specs: &[SequenceSpec]) -> Vec<Result<SlotId>> {
        specs
            .iter()
            .map(|spec| {
                let sequence = Sequence::start(&self.model, spec)?;
                let slot = SlotId(self.next_slot);
                self.next_slot += 1;
                self.slots.insert(slot, sequence);
                Ok(slot)
            })
            .collect()
    }

    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>> {
        let mut events = Vec::with_capacity(slots.len());
        for slot in slots {
            let sequence = active(&mut self.slots, *slot)?;
            events.push(sequence.advance(&self.model)?);
        }
        Ok(events)
    }

    fn append_trailing(&mut self, slot: SlotId, ids: &[u32]) -> Result<()> {
        active(&mut self.slots, slot)?.append_trailing(&self.model, ids)
    }

    fn release(&mut self, slot: SlotId) {
        self.slots.remove(&slot);
    }
}

pub struct ReferenceCodec {
    decoder: Arc<CodecDecoder>,
    streams: HashMap<CodecSlot, CodecStream>,
    next_slot: usize,
}

impl ReferenceCodec {
    pub fn new(decoder: Arc<CodecDecoder>) -> Self {
        Self {
            decoder,
            streams: HashMap::new(),
            next_slot: 0,
        }
    }
}

impl CodecBackend for ReferenceCodec {
    fn name(&self) -> String {
        "reference codec (candle, CPU, f32)".to_string()
    }

    fn samples_per_frame(&self) -> usize {
        self.decoder.samples_per_frame()
    }

    fn open(&mut self) -> Result<CodecSlot> {
        let slot = CodecSlot(self.next_slot);
        self.next_slot += 1;
        self.streams.insert(slot, self.decoder.stream()?);
        Ok(slot)
    }

    fn decode(&mut self, batch: &[(CodecSlot, &[Frame])]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter()
            .map(|(slot, frames)| match self.streams.get_mut(slot) {
                Some(stream) => stream.push(frames),
                None => bail!("codec stream {} is not open", slot.0),
            })
            .collect()
    }

    fn release(&mut self, slot: CodecSlot) {
        self.streams.remove(&slot);
    }
}

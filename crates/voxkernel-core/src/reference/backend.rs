//! [`ReferenceBackend`]: the [`FrameBackend`] over [`Sequence`]s, one at a time, on the CPU.

use std::collections::HashMap;

use anyhow::{Result, bail};

use super::model::ReferenceModel;
use super::sequence::Sequence;
use crate::backend::{FrameBackend, FrameEvent, SequenceSpec, SlotId};
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

impl FrameBackend for ReferenceBackend {
    fn name(&self) -> String {
        "reference (candle, CPU, f32)".to_string()
    }

    fn start(&mut self, spec: &SequenceSpec) -> Result<SlotId> {
        let sequence = Sequence::start(&self.model, spec)?;
        let slot = SlotId(self.next_slot);
        self.next_slot += 1;
        self.slots.insert(slot, sequence);
        Ok(slot)
    }

    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>> {
        let mut events = Vec::with_capacity(slots.len());
        for slot in slots {
            let Some(sequence) = self.slots.get_mut(slot) else {
                bail!(
                    "slot {} is not active: never started, or already released",
                    slot.0
                );
            };
            events.push(sequence.advance(&self.model)?);
        }
        Ok(events)
    }

    fn release(&mut self, slot: SlotId) {
        self.slots.remove(&slot);
    }
}

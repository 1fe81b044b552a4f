//! The CPU kernels' step: one mixed prefill + decode forward per step, every sequence
//! with its own key/value buffer (joining and leaving copy nothing).

use super::core::{Core, Seq, now_ms};
use super::{Event, StepBackend};
use crate::infer::{CpuModel, SeqKv};
use crate::{Result, Transformer};

/// The [CPU kernels](crate::infer) (f32 weights on the CPU).
pub(crate) struct CpuStep(pub(crate) Box<CpuModel>);

impl StepBackend for CpuStep {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// One step on the CPU kernels: the running sequences' newest tokens and the
    /// newcomers' prompts go through one forward; every one of them gets its next token.
    fn step(&mut self, core: &mut Core, events: &mut Vec<Event>) -> Result<()> {
        // The CPU kernels prefill inside the decode step's forward: admit at once.
        let admitted = core.admit(1);
        let cpu = &self.0;
        let mut seqs = std::mem::take(&mut core.running);
        let decoding = seqs.len();
        let started = now_ms();
        let ctx = core.model.config().max_positions;
        for mut s in admitted {
            s.kv = Some(cpu.new_kv(s.budget().min(ctx)));
            s.started_at = started;
            seqs.push(s);
        }
        if seqs.is_empty() {
            return Ok(());
        }
        let logits = {
            let mut entries: Vec<(&mut SeqKv, &[u32])> = seqs
                .iter_mut()
                .map(|s| {
                    let Seq { kv, prompt, tokens, .. } = s;
                    let new: &[u32] = match tokens.last() {
                        Some(t) => std::slice::from_ref(t),
                        None => prompt,
                    };
                    (kv.as_mut().expect("CPU sequences have a cache"), new)
                })
                .collect();
            cpu.forward(&mut entries)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // Nothing was cached (the kernels check before they write): put everyone back.
                let newcomers = seqs.split_off(decoding);
                core.running = seqs;
                for mut s in newcomers.into_iter().rev() {
                    s.kv = None;
                    core.waiting.push_front(s);
                }
                return Err(e);
            }
        };
        core.stats.prefilled += seqs[decoding..].iter().map(|s| s.prompt.len() as u64).sum::<u64>();
        if decoding > 0 {
            core.stats.decode_steps += 1;
            core.stats.batch_rows += decoding as u64;
        }
        let v = core.model.config().vocab;
        let rows = logits.chunks_exact(v).map(<[f32]>::to_vec).collect();
        core.running = core.advance(seqs, rows, events)?.into_iter().map(|(_, s)| s).collect();
        Ok(())
    }

    fn drop_row(&mut self, _row: usize) -> Result<()> {
        Ok(())
    }

    fn swap(&mut self, model: &Transformer, layout: Option<Box<CpuModel>>) -> Result<Option<Box<CpuModel>>> {
        let new = match layout {
            Some(l) => l,
            None => Box::new(CpuModel::new(model)?),
        };
        Ok(Some(std::mem::replace(&mut self.0, new)))
    }
}

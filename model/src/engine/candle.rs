//! The candle step (any device, any dtype): a batched decode of the running sequences
//! over one batch cache, then a ragged prefill of the newcomers, who join that cache as
//! rows.

use candle_core::Tensor;

use super::core::{Core, Seq, now_ms};
use super::{Event, StepBackend};
use crate::infer::CpuModel;
use crate::model::{BatchKv, KvCache, MASKED};
use crate::{Result, Transformer};

/// candle ops: the running batch's keys and values are the rows of one [`BatchKv`]
/// (row r = running sequence r).
#[derive(Default)]
pub(crate) struct CandleStep {
    batch: BatchKv,
}

impl StepBackend for CandleStep {
    fn name(&self) -> &'static str {
        "candle"
    }

    fn step(&mut self, core: &mut Core, events: &mut Vec<Event>) -> Result<()> {
        // Decode first for the sequences already running, then admit: a newcomer's first
        // token comes from its prefill, so it joins the decode batch from the next step.
        if !core.running.is_empty() {
            self.decode(core, events)?;
        }
        // A prefill is a forward pass of its own: with sequences running, wait until
        // enough slots are free to amortise it over several newcomers (or nothing else is
        // waiting to fill them anyway).
        let admitted = core.admit(core.cfg.min_prefill_batch.clamp(1, core.cfg.max_num_seqs));
        if !admitted.is_empty() {
            self.prefill(core, admitted, events)?;
        }
        Ok(())
    }

    fn drop_row(&mut self, row: usize) -> Result<()> {
        let keep: Vec<u32> = (0..self.batch.rows() as u32).filter(|r| *r as usize != row).collect();
        self.batch.keep(&keep)
    }

    fn swap(&mut self, _model: &Transformer, _layout: Option<Box<CpuModel>>) -> Result<Option<Box<CpuModel>>> {
        Ok(None)
    }
}

impl CandleStep {
    /// Prefills the newcomers as one ragged batch (each into its own cache), samples their
    /// first tokens, and joins the unfinished ones to the batch cache as rows.
    fn prefill(&mut self, core: &mut Core, mut seqs: Vec<Seq>, events: &mut Vec<Event>) -> Result<()> {
        let dev = core.model.device().clone();
        let b = seqs.len();
        let t = seqs.iter().map(|s| s.prompt.len()).max().unwrap_or(1);
        let mut tokens = vec![0u32; b * t];
        let mut positions = vec![0u32; b * t];
        let mut mask = vec![MASKED; b * t * t];
        let lens: Vec<usize> = seqs.iter().map(|s| s.prompt.len()).collect();
        for (r, s) in seqs.iter().enumerate() {
            for (i, &tok) in s.prompt.iter().enumerate() {
                tokens[r * t + i] = tok;
                positions[r * t + i] = i as u32;
            }
            for i in 0..t {
                for j in 0..=i.min(lens[r] - 1) {
                    mask[(r * t + i) * t + j] = 0.0;
                }
            }
        }
        let ctx = core.model.config().max_positions;
        let mut caches: Vec<KvCache> = seqs.iter().map(|s| core.model.new_cache(s.budget().min(ctx))).collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let logits = core.model.forward_ragged(
            &Tensor::from_vec(tokens, (b, t), &dev)?,
            &Tensor::from_vec(positions, (b, t), &dev)?,
            &Tensor::from_vec(mask, (b, 1, t, t), &dev)?,
            &mut refs,
            &lens,
        )?;
        let idx = Tensor::from_vec(
            lens.iter()
                .enumerate()
                .map(|(r, l)| (r * t + l - 1) as u32)
                .collect::<Vec<_>>(),
            b,
            &dev,
        )?;
        let v = core.model.config().vocab;
        let last = logits.reshape((b * t, v))?.index_select(&idx, 0)?.to_vec2::<f32>()?;
        let started = now_ms();
        core.stats.prefilled += lens.iter().sum::<usize>() as u64;
        for (s, c) in seqs.iter_mut().zip(caches) {
            s.cache = Some(c);
            s.started_at = started;
        }
        let mut joined = core.advance(seqs, last, events)?;
        let cap = core
            .running
            .iter()
            .chain(joined.iter().map(|(_, s)| s))
            .map(|s| s.budget().min(ctx))
            .max()
            .unwrap_or(1);
        {
            let caches: Vec<&KvCache> = joined
                .iter()
                .map(|(_, s)| s.cache.as_ref().expect("prefilled sequences have a cache"))
                .collect();
            self.batch.push(&caches, cap)?;
        }
        for (_, s) in joined.iter_mut() {
            s.cache = None;
        }
        core.running.extend(joined.into_iter().map(|(_, s)| s));
        Ok(())
    }

    /// One decode step of every running sequence over the batch cache; the rows of the
    /// sequences that finished leave it.
    fn decode(&mut self, core: &mut Core, events: &mut Vec<Event>) -> Result<()> {
        let dev = core.model.device().clone();
        let seqs = std::mem::take(&mut core.running);
        let b = seqs.len();
        // Row r's newest token sits at position prompt + generated − 1; its keys and values
        // are written there now.
        let positions: Vec<u32> = seqs
            .iter()
            .map(|s| (s.prompt.len() + s.tokens.len() - 1) as u32)
            .collect();
        let width = positions.iter().map(|p| *p as usize + 1).max().unwrap_or(1);
        let tokens: Vec<u32> = seqs
            .iter()
            .map(|s| *s.tokens.last().expect("running sequences have a token"))
            .collect();
        let mut mask = vec![MASKED; b * width];
        for (r, p) in positions.iter().enumerate() {
            mask[r * width..r * width + *p as usize + 1].fill(0.0);
        }
        let logits = core.model.forward_batched(
            &Tensor::from_vec(tokens, (b, 1), &dev)?,
            &Tensor::from_vec(positions, (b, 1), &dev)?,
            &Tensor::from_vec(mask, (b, 1, 1, width), &dev)?,
            &self.batch,
            width,
        )?;
        let rows = logits.squeeze(1)?.to_vec2::<f32>()?;
        core.stats.decode_steps += 1;
        core.stats.batch_rows += b as u64;
        let kept = core.advance(seqs, rows, events)?;
        let idx: Vec<u32> = kept.iter().map(|(r, _)| *r as u32).collect();
        self.batch.keep(&idx)?;
        core.running = kept.into_iter().map(|(_, s)| s).collect();
        Ok(())
    }
}

//! Activation checkpointing: a training forward that keeps only each layer's input and a
//! backward that recomputes one layer at a time.

use super::*;

/// Adds the weights' gradients of `from` (the backward of `root`) into `into` and drops
/// the rest, so that only weight gradients outlive a pass.
pub(crate) fn move_weight_grads(
    into: &mut candle_core::backprop::GradStore,
    mut from: candle_core::backprop::GradStore,
    root: &Tensor,
) -> Result<()> {
    for node in root.sorted_nodes() {
        if !node.is_variable() {
            continue;
        }
        if let Some(g) = from.remove(node) {
            let sum = match into.get(node) {
                Some(old) => (old + g)?,
                None => g,
            };
            into.insert(node, sum);
        }
    }
    Ok(())
}

impl Transformer {
    /// Training forward and backward with activation checkpointing: only each layer's
    /// input is kept during the forward; the backward recomputes one layer at a time and
    /// backpropagates through it, so peak memory holds one layer's activations instead of
    /// all of them (at the cost of a second forward).
    ///
    /// `head_loss` turns the logits into the scalar loss: (B, T, V) from every position,
    /// or with `at` (flat positions, as [`Transformer::forward_at`]) (1, `at.len()`, V)
    /// from those only. Each MoE layer's load-balance loss is added with weight
    /// `balance_coef`. Returns the gradients of every weight (equal to `forward` or
    /// `forward_at` + `backward` of the same loss), the logits (detached) and the
    /// auxiliaries.
    pub fn backward_checkpointed(
        &self,
        batch: &Packed,
        at: Option<&[u32]>,
        balance_coef: f64,
        head_loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(candle_core::backprop::GradStore, Tensor, Aux)> {
        let at = at.map(|at| self.positions_at(batch, at)).transpose()?;
        let (b, t) = batch.tokens.dims2()?;
        let max_pos = batch.positions.max_all()?.to_scalar::<u32>()? as usize;
        if max_pos >= self.cfg.max_positions {
            return Err(Error::Shape(format!(
                "position {max_pos} exceeds max_position_embeddings {}",
                self.cfg.max_positions
            )));
        }
        let x0 = self
            .embed
            .index_select(&batch.tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        let fx = self.fused_ctx(&batch.positions, &batch.mask)?;
        let (inputs, balance, moe) = self.forward_keeping_inputs(&x0, batch, fx.as_ref())?;
        let missing = |what: &str| Error::Shape(format!("activation checkpointing: no gradient reached {what}"));
        // The head: final norm, logits, loss.
        let top = candle_core::Var::from_tensor(inputs.last().expect("pushed"))?;
        let h = self.head_input(top.as_tensor(), at.as_ref(), fx.is_some())?;
        let logits = self.logits(&h, fx.is_some())?;
        // Only the weights' gradients are kept across the passes (a backward also leaves
        // gradients for constants such as masks and rotary tables).
        let mut grads = {
            let z = Tensor::zeros((), DType::F32, &self.device)?;
            let mut empty = z.backward()?;
            empty.remove(&z);
            empty
        };
        let loss = head_loss(&logits)?;
        let mut gh = loss.backward()?;
        let mut g = gh.remove(top.as_tensor()).ok_or_else(|| missing("the last layer"))?;
        move_weight_grads(&mut grads, gh, &loss)?;
        drop(loss);
        // Backward, one layer at a time: recompute it, push the incoming gradient through.
        for (i, blk) in self.blocks.iter().enumerate().rev() {
            let x = candle_core::Var::from_tensor(&inputs[i])?;
            let mut aux = Vec::new();
            let y = self.block_forward(blk, x.as_tensor(), batch, fx.as_ref(), &mut aux)?;
            let mut surrogate = (y * &g)?.sum_all()?;
            for (a, _) in &aux {
                surrogate = (surrogate + (a * balance_coef)?)?;
            }
            let mut gi = surrogate.backward()?;
            g = gi.remove(x.as_tensor()).ok_or_else(|| missing(&format!("layer {i}")))?;
            move_weight_grads(&mut grads, gi, &surrogate)?;
        }
        let surrogate = (x0 * &g)?.sum_all()?;
        let ge = surrogate.backward()?;
        move_weight_grads(&mut grads, ge, &surrogate)?;
        Ok((
            grads,
            logits.detach(),
            Aux {
                balance_loss: balance,
                moe,
            },
        ))
    }

    /// The forward that keeps each layer's input, detached, and nothing else: the inputs
    /// (the last one the top layer's output), the summed MoE balance loss (detached) and
    /// the routing statistics.
    fn forward_keeping_inputs(
        &self,
        x0: &Tensor,
        batch: &Packed,
        fx: Option<&FusedCtx>,
    ) -> Result<(Vec<Tensor>, Tensor, Vec<MoeStats>)> {
        let mut inputs = Vec::with_capacity(self.blocks.len() + 1);
        inputs.push(x0.detach());
        let mut moe = Vec::new();
        let mut balance = Tensor::zeros((), DType::F32, &self.device)?;
        for blk in &self.blocks {
            let mut aux = Vec::new();
            let y = self.block_forward(blk, inputs.last().expect("pushed"), batch, fx, &mut aux)?;
            for (a, st) in aux {
                balance = (balance + a.detach())?;
                moe.push(st);
            }
            inputs.push(y.detach());
        }
        Ok((inputs, balance, moe))
    }

    /// One layer's training forward (no cache) over the packed batch.
    fn block_forward(
        &self,
        blk: &Block,
        x: &Tensor,
        batch: &Packed,
        fx: Option<&FusedCtx>,
        aux: &mut Vec<(Tensor, MoeStats)>,
    ) -> Result<Tensor> {
        blk.forward(x, &batch.positions, &batch.mask, &self.rope, LayerCache::None, aux, fx)
    }
}

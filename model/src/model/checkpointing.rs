//! Layer-by-layer training passes: activation checkpointing (a forward that keeps only
//! each layer's input and a backward that recomputes one layer at a time) and activation
//! offloading (what is kept leaves the device until the backward needs it).

use super::*;

/// One layer's kept autograd graph: its input (a variable), output and weighted router
/// losses.
type LayerGraph = (candle_core::Var, Tensor, Vec<Tensor>);

/// The router losses of a layer-by-layer forward, summed and detached, and the routing
/// statistics of its MoE layers.
pub(crate) struct RouterSums {
    balance: Tensor,
    z: Tensor,
    moe: Vec<MoeStats>,
}

impl RouterSums {
    fn new(device: &Device) -> Result<Self> {
        let zero = Tensor::zeros((), DType::F32, device)?;
        Ok(RouterSums {
            balance: zero.clone(),
            z: zero,
            moe: Vec::new(),
        })
    }

    fn add(&mut self, a: RouterAux) -> Result<()> {
        self.balance = (&self.balance + a.balance.detach())?;
        self.z = (&self.z + a.z.detach())?;
        self.moe.push(a.stats);
        Ok(())
    }
}

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

/// How a layer-by-layer training pass keeps what its backward needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerMemory {
    /// Keep only each layer's input and recompute the layer in the backward.
    pub checkpoint: bool,
    /// Move what is kept (each layer's saved activations; with `checkpoint`, its input)
    /// off the device until the backward needs it ([`crate::offload`]).
    pub offload: bool,
}

impl Transformer {
    /// Training forward and backward with activation checkpointing: only each layer's
    /// input is kept during the forward; the backward recomputes one layer at a time and
    /// backpropagates through it, so peak memory holds one layer's activations instead of
    /// all of them (at the cost of a second forward).
    ///
    /// `head_loss` turns the logits into the scalar loss: (B, T, V) from every position,
    /// or with `at` (flat positions, as [`Transformer::forward_at`]) (1, `at.len()`, V)
    /// from those only. Each MoE layer's router losses are added with the weights of
    /// `router` (a plain number: the load-balance loss's alone). Returns the gradients of every weight (equal to `forward` or
    /// `forward_at` + `backward` of the same loss), the logits (detached) and the
    /// auxiliaries.
    pub fn backward_checkpointed(
        &self,
        batch: &Packed,
        at: Option<&[u32]>,
        router: impl Into<RouterCoefs>,
        head_loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(candle_core::backprop::GradStore, Tensor, Aux)> {
        let memory = LayerMemory {
            checkpoint: true,
            offload: false,
        };
        let (g, logits, aux, _) = self.backward_by_layer(batch, at, router, memory, head_loss)?;
        Ok((g, logits, aux))
    }

    /// Training forward and backward one layer at a time, keeping what the backward
    /// needs as `memory` says: with `checkpoint`, as [`Transformer::backward_checkpointed`];
    /// without, every layer's autograd graph is kept (as a plain `forward` + `backward`);
    /// with `offload`, what is kept leaves the device during the forward and comes back a
    /// layer ahead of the backward ([`crate::offload`]), which also says what moved.
    /// Same arguments and gradients as `backward_checkpointed`.
    pub fn backward_by_layer(
        &self,
        batch: &Packed,
        at: Option<&[u32]>,
        router: impl Into<RouterCoefs>,
        memory: LayerMemory,
        head_loss: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(
        candle_core::backprop::GradStore,
        Tensor,
        Aux,
        crate::offload::OffloadStats,
    )> {
        let router = router.into();
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
        let mut off = match memory.offload {
            true => Some(crate::offload::Offloader::new(&self.device)?),
            false => None,
        };
        let kept = self.forward_by_layer(&x0, batch, fx.as_ref(), router, memory.checkpoint, off.as_mut())?;
        let (inputs, mut graphs, sums) = kept;
        let missing = |what: &str| Error::Shape(format!("layer-by-layer backward: no gradient reached {what}"));
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
        if let Some(off) = off.as_mut() {
            off.prefetch(self.blocks.len() - 1)?;
        }
        let loss = head_loss(&logits)?;
        let mut gh = loss.backward()?;
        let mut g = gh.remove(top.as_tensor()).ok_or_else(|| missing("the last layer"))?;
        move_weight_grads(&mut grads, gh, &loss)?;
        drop(loss);
        // Backward, one layer at a time: bring its activations back (the layer below's
        // start coming back meanwhile) or recompute it, push the incoming gradient through.
        for (i, blk) in self.blocks.iter().enumerate().rev() {
            if let Some(off) = off.as_mut() {
                off.fetch(i)?;
                if i > 0 {
                    off.prefetch(i - 1)?;
                }
            }
            let (x, y, aux) = match graphs.get_mut(i).and_then(Option::take) {
                Some(kept) => kept,
                None => {
                    let x = candle_core::Var::from_tensor(&inputs[i])?;
                    let mut aux = Vec::new();
                    let y = self.block_forward((i, blk), x.as_tensor(), batch, fx.as_ref(), &mut aux)?;
                    let losses = aux.iter().map(|a| a.weighted(router)).collect::<Result<_>>()?;
                    (x, y, losses)
                }
            };
            let mut surrogate = (y * &g)?.sum_all()?;
            for a in &aux {
                surrogate = (surrogate + a)?;
            }
            let mut gi = surrogate.backward()?;
            g = gi.remove(x.as_tensor()).ok_or_else(|| missing(&format!("layer {i}")))?;
            move_weight_grads(&mut grads, gi, &surrogate)?;
        }
        let surrogate = (x0 * &g)?.sum_all()?;
        let ge = surrogate.backward()?;
        move_weight_grads(&mut grads, ge, &surrogate)?;
        let stats = off.map(|o| o.stats()).unwrap_or_default();
        Ok((
            grads,
            logits.detach(),
            Aux {
                balance_loss: sums.balance,
                z_loss: sums.z,
                moe: sums.moe,
            },
            stats,
        ))
    }

    /// The forward of [`Transformer::backward_by_layer`]: each layer's input, detached
    /// (the last one the top layer's output); without `checkpoint`, each layer's graph
    /// (its input as a variable, its output, its router losses weighted by `router`); the
    /// summed router losses (detached) and the routing statistics. With `off`, what is kept
    /// leaves the device.
    #[allow(clippy::type_complexity)]
    fn forward_by_layer(
        &self,
        x0: &Tensor,
        batch: &Packed,
        fx: Option<&FusedCtx>,
        router: RouterCoefs,
        checkpoint: bool,
        mut off: Option<&mut crate::offload::Offloader>,
    ) -> Result<(Vec<Tensor>, Vec<Option<LayerGraph>>, RouterSums)> {
        if checkpoint {
            let (inputs, sums) = self.forward_keeping_inputs(x0, batch, fx, off)?;
            return Ok((inputs, Vec::new(), sums));
        }
        let mut inputs = Vec::with_capacity(self.blocks.len() + 1);
        let mut graphs = Vec::with_capacity(self.blocks.len());
        inputs.push(x0.detach());
        let mut sums = RouterSums::new(&self.device)?;
        for (i, blk) in self.blocks.iter().enumerate() {
            let x = candle_core::Var::from_tensor(inputs.last().expect("pushed"))?;
            let mut aux = Vec::new();
            let y = self.block_forward((i, blk), x.as_tensor(), batch, fx, &mut aux)?;
            let mut losses = Vec::with_capacity(aux.len());
            for a in aux {
                losses.push(a.weighted(router)?);
                sums.add(a)?;
            }
            inputs.push(y.detach());
            if let Some(off) = off.as_deref_mut() {
                let roots: Vec<&Tensor> = std::iter::once(&y).chain(&losses).collect();
                off.stash_graph(i, &roots)?;
            }
            graphs.push(Some((x, y, losses)));
        }
        Ok((inputs, graphs, sums))
    }

    /// The forward that keeps each layer's input, detached, and nothing else: the inputs
    /// (the last one the top layer's output), and the summed router losses (detached) with
    /// the routing statistics.
    fn forward_keeping_inputs(
        &self,
        x0: &Tensor,
        batch: &Packed,
        fx: Option<&FusedCtx>,
        mut off: Option<&mut crate::offload::Offloader>,
    ) -> Result<(Vec<Tensor>, RouterSums)> {
        let mut inputs = Vec::with_capacity(self.blocks.len() + 1);
        inputs.push(x0.detach());
        let mut sums = RouterSums::new(&self.device)?;
        for (i, blk) in self.blocks.iter().enumerate() {
            let mut aux = Vec::new();
            let y = self.block_forward((i, blk), inputs.last().expect("pushed"), batch, fx, &mut aux)?;
            for a in aux {
                sums.add(a)?;
            }
            inputs.push(y.detach());
            // Layer i's input is needed again only in the backward (recomputing layer i).
            if let (Some(off), Some(input)) = (off.as_deref_mut(), inputs.len().checked_sub(2))
                && input > 0
            {
                off.stash_tensors(input, &[&inputs[input]])?;
            }
        }
        Ok((inputs, sums))
    }

    /// Layer `i`'s training forward (no cache) over the packed batch, replaying the
    /// batch's recorded routes for the layer where it has them.
    fn block_forward(
        &self,
        (i, blk): (usize, &Block),
        x: &Tensor,
        batch: &Packed,
        fx: Option<&FusedCtx>,
        aux: &mut Vec<RouterAux>,
    ) -> Result<Tensor> {
        let replay = batch.routes.as_deref().and_then(|r| r.layer(i));
        blk.forward(
            x,
            &batch.positions,
            &batch.mask,
            &self.rope,
            LayerCache::None,
            aux,
            fx,
            replay,
        )
    }
}

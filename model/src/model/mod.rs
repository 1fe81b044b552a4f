//! The policy: a decoder-only transformer written only from differentiable candle ops
//! (candle-nn's fused softmax/rms_norm/rope have no backward), reading top to bottom.
//! Weight names mirror Hugging Face checkpoints through `vb.pp(...)`.

//!
//! The layers are in `layers`, `attention` and `moe`; this file assembles them into
//! blocks and the transformer and runs the forward. Packing (`packing`), key/value
//! caches (`cache`), activation checkpointing (`checkpointing`) and the logprob and
//! entropy helpers (`logprobs`) have their own files.

mod attention;
mod cache;
mod checkpointing;
mod layers;
mod logprobs;
mod moe;
mod packing;

use std::sync::Arc;

use candle_core::{D, DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Init, VarBuilder};
use streamrl_kernels::bf16::Products;

use crate::config::{Config, Family, MoeConfig, RopeLayout, RouterScore};
use crate::{Error, Result};

pub(crate) use attention::Attention;
pub use cache::{BatchKv, KvCache};
use cache::{CacheArg, LayerCache};
pub use checkpointing::LayerMemory;
pub use layers::{Linear, RmsNorm};
pub(crate) use layers::{Mlp, Rope, matmul_t};
pub use logprobs::{
    entropy_unfused, last_logits, masked_entropy, token_logprobs, token_logprobs_entropy, token_logprobs_unfused,
};
pub(crate) use moe::Moe;
pub use moe::{MoeStats, RouterAux};
pub use packing::{MASKED, NO_ROUTE, Packed, Routes, SampleRoutes};

#[derive(Debug, Clone)]
pub(crate) enum FeedForward {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) attn_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) ff_norm: RmsNorm,
    pub(crate) ff: FeedForward,
}

impl Block {
    fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let ff = match (&cfg.moe, cfg.family) {
            (Some(m), Family::Mixtral) => {
                FeedForward::Moe(Moe::load(&vb.pp("block_sparse_moe"), cfg.d_model, m, cfg.family)?)
            }
            (Some(m), _) => FeedForward::Moe(Moe::load(&vb.pp("mlp"), cfg.d_model, m, cfg.family)?),
            (None, _) => FeedForward::Dense(Mlp::load(
                &vb.pp("mlp"),
                cfg.d_model,
                cfg.d_ff,
                ["gate_proj", "up_proj", "down_proj"],
                cfg.mlp_bias,
            )?),
        };
        Ok(Block {
            attn_norm: RmsNorm::load(&vb.pp("input_layernorm"), cfg.d_model, cfg.eps)?,
            attn: Attention::load(&vb.pp("self_attn"), cfg)?,
            ff_norm: RmsNorm::load(&vb.pp("post_attention_layernorm"), cfg.d_model, cfg.eps)?,
            ff,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        rope: &Rope,
        cache: LayerCache<'_>,
        aux: &mut Vec<RouterAux>,
        fused: Option<&FusedCtx>,
        recorded: Option<(&[u8], bool)>,
    ) -> Result<Tensor> {
        let on = fused.is_some();
        let a = self.attn_norm.apply(x, on)?;
        let h = match (fused, cache) {
            (Some(f), LayerCache::None) => self.attn.forward_fused(&a, f, x)?,
            (_, cache) => (x + self.attn.forward(&a, positions, mask, rope, cache)?)?,
        };
        let n = self.ff_norm.apply(&h, on)?;
        let f = match &self.ff {
            FeedForward::Dense(m) if on => return Ok(m.forward_fused(&n, &h)?),
            FeedForward::Dense(m) => m.apply(&n, on)?,
            FeedForward::Moe(m) => {
                let (b, t, d) = n.dims3()?;
                let (y, a) = m.forward(&n.reshape((b * t, d))?, recorded)?;
                aux.push(a);
                y.reshape((b, t, d))?
            }
        };
        Ok((h + f)?)
    }
}

/// What the fused ops of one training forward share across layers: host copies of the
/// attention mask and of the rotary tables and positions.
pub(crate) struct FusedCtx {
    mask: Arc<Vec<f32>>,
    rope: crate::fused::RopeTables,
}

/// What a training forward returns besides logits.
#[derive(Debug)]
pub struct Aux {
    /// Sum of the MoE load-balance losses (zero for dense models).
    pub balance_loss: Tensor,
    /// Sum of the MoE router z-losses (zero for dense models).
    pub z_loss: Tensor,
    /// Routing statistics per MoE layer.
    pub moe: Vec<MoeStats>,
}

impl Aux {
    /// The router losses weighted as `coefs` say (a scalar; zero for dense models).
    pub fn router_loss(&self, coefs: RouterCoefs) -> Result<Tensor> {
        coefs.weigh(&self.balance_loss, &self.z_loss)
    }
}

/// The weights of the MoE router losses in a training objective.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RouterCoefs {
    /// Weight of the load-balance loss.
    pub balance: f64,
    /// Weight of the router z-loss.
    pub z: f64,
}

impl RouterCoefs {
    /// `balance · self.balance + z · self.z`.
    fn weigh(&self, balance: &Tensor, z: &Tensor) -> Result<Tensor> {
        Ok(((balance * self.balance)? + (z * self.z)?)?)
    }
}

impl From<f64> for RouterCoefs {
    /// The load-balance weight alone (no z-loss).
    fn from(balance: f64) -> Self {
        RouterCoefs { balance, z: 0.0 }
    }
}

impl RouterAux {
    /// This layer's router losses weighted as `coefs` say.
    pub(crate) fn weighted(&self, coefs: RouterCoefs) -> Result<Tensor> {
        coefs.weigh(&self.balance, &self.z)
    }
}

/// The decoder-only transformer.
#[derive(Debug, Clone)]
pub struct Transformer {
    pub(crate) cfg: Config,
    pub(crate) embed: Tensor,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: RmsNorm,
    pub(crate) head: Option<Linear>,
    pub(crate) rope: Rope,
    pub(crate) device: Device,
    /// Run the training forward through [`crate::fused`] (f32 on the CPU only).
    pub(crate) fused: bool,
    /// The number type of the matrix products on the CPU (the fused ops' and the CPU
    /// inference kernels'): see [`Transformer::set_products`].
    pub(crate) products: Products,
}

impl Transformer {
    /// Builds the model, taking (or creating, with random init) every weight from `vb`.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let m = vb.pp("model");
        let embed = m.pp("embed_tokens").get_with_hints(
            (cfg.vocab, cfg.d_model),
            "weight",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let blocks = (0..cfg.n_layers)
            .map(|i| Block::load(&m.pp("layers").pp(i), cfg))
            .collect::<Result<Vec<_>>>()?;
        let head = if cfg.tie_embeddings {
            None
        } else {
            Some(Linear::load(&vb.pp("lm_head"), cfg.vocab, cfg.d_model, false)?)
        };
        Ok(Transformer {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm: RmsNorm::load(&m.pp("norm"), cfg.d_model, cfg.eps)?,
            head,
            rope: Rope::new(cfg, vb.device())?,
            device: vb.device().clone(),
            fused: vb.device().is_cpu() && vb.dtype() == DType::F32,
            products: Products::F32,
        })
    }

    /// The resolved configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The dtype the weights have (logits are f32 whatever it is).
    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// The device weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the training forward runs through the fused ops of [`crate::fused`] (on by
    /// default for f32 weights on the CPU) or op by op, as on every other device.
    pub fn fused_ops(&self) -> bool {
        self.fused
    }

    /// Turns the fused training ops on or off; on takes effect only for f32 weights on the
    /// CPU. Both paths compute the same function (the tests compare their gradients).
    pub fn set_fused_ops(&mut self, on: bool) {
        self.fused = on && self.device.is_cpu() && self.embed.dtype() == DType::F32;
    }

    /// Sets the number type of the matrix products on the CPU: bf16 (with f32 sums) runs
    /// them on the CPU's matrix units (`streamrl_kernels::bf16`) while the weights, norms,
    /// softmax, logprobs and losses stay f32. Applies to the fused training ops and to the
    /// CPU inference kernels ([`crate::infer::CpuModel`]); other devices and dtypes ignore
    /// it. Every product of a dense model's training forward and of both backward passes
    /// takes it.
    pub fn set_products(&mut self, p: Products) {
        self.products = p;
        let mut set = |l: &mut Linear| l.products = p;
        if let Some(h) = &mut self.head {
            set(h);
        }
        for b in &mut self.blocks {
            for l in [&mut b.attn.q, &mut b.attn.k, &mut b.attn.v, &mut b.attn.o] {
                set(l);
            }
            match &mut b.ff {
                FeedForward::Dense(m) => [&mut m.gate, &mut m.up, &mut m.down].into_iter().for_each(&mut set),
                // The training forward runs MoE layers op by op in candle (f32 products);
                // the CPU inference kernels take the model's setting for them too.
                FeedForward::Moe(_) => {}
            }
        }
    }

    /// The number type of the matrix products on the CPU ([`Transformer::set_products`]).
    pub fn products(&self) -> Products {
        self.products
    }

    /// The precision this model runs in: bf16 for bf16 weights, or for f32 weights with
    /// bf16 products (what `dtype: bf16` means on the CPU).
    pub fn precision(&self) -> crate::device::Precision {
        if self.dtype() == DType::BF16 || self.products == Products::Bf16 {
            crate::device::Precision::Bf16
        } else {
            crate::device::Precision::F32
        }
    }

    /// The head over the final normalised hidden states: the LM head, or the tied
    /// embedding; fused when `fused`. Logits are f32 whatever the weights' dtype (the
    /// logprobs the losses compare come from them).
    fn logits(&self, h: &Tensor, fused: bool) -> Result<Tensor> {
        Ok(match (&self.head, fused) {
            (Some(head), on) => head.apply(h, on)?,
            (None, true) => crate::fused::linear(h, &self.embed, self.products)?,
            (None, false) => matmul_t(h, &self.embed)?,
        }
        .to_dtype(DType::F32)?)
    }

    /// The fused ops' shared state for a forward over `positions` with `mask` and no cache.
    fn fused_ctx(&self, positions: &Tensor, mask: &Tensor) -> Result<Option<FusedCtx>> {
        if !self.fused {
            return Ok(None);
        }
        Ok(Some(FusedCtx {
            mask: Arc::new(mask.flatten_all()?.to_vec1::<f32>()?),
            rope: crate::fused::RopeTables {
                cos: self.rope.cos_host.clone(),
                sin: self.rope.sin_host.clone(),
                interleaved: self.rope.layout == RopeLayout::Interleaved,
                positions: Arc::new(positions.flatten_all()?.to_vec1::<u32>()?),
            },
        }))
    }

    /// The head's input: the final hidden states `x` (B, T, D) normalised, at every
    /// position, or only at the flat positions `at` (row · T + column), then as (1, n, D)
    /// in `at`'s order. The norm is per position, so either way a position's logits are
    /// the same bits.
    fn head_input(&self, x: &Tensor, at: Option<&Tensor>, fused: bool) -> Result<Tensor> {
        let x = match at {
            None => x.clone(),
            Some(at) => {
                let (b, t, d) = x.dims3()?;
                x.reshape((b * t, d))?.index_select(at, 0)?.unsqueeze(0)?
            }
        };
        Ok(self.norm.apply(&x, fused)?)
    }

    /// `at` as a tensor of flat positions of `batch`, refused when one lies outside it.
    fn positions_at(&self, batch: &Packed, at: &[u32]) -> Result<Tensor> {
        let n = batch.tokens.elem_count();
        if let Some(&bad) = at.iter().find(|&&p| p as usize >= n) {
            return Err(Error::Shape(format!(
                "logits asked at flat position {bad} of a packed batch of {n} positions ({} rows of {})",
                n / batch.width.max(1),
                batch.width
            )));
        }
        Ok(Tensor::new(at, &self.device)?)
    }

    fn run(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        mut cache: CacheArg<'_, '_>,
        at: Option<&Tensor>,
        routes: Option<&Routes>,
    ) -> Result<(Tensor, Aux)> {
        let (b, t) = tokens.dims2()?;
        let max_pos = positions.max_all()?.to_scalar::<u32>()? as usize;
        if max_pos >= self.cfg.max_positions {
            return Err(Error::Shape(format!(
                "position {max_pos} exceeds max_position_embeddings {}",
                self.cfg.max_positions
            )));
        }
        let mut x = self
            .embed
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, self.cfg.d_model))?;
        let mut aux = Vec::new();
        let fx = match &cache {
            CacheArg::None => self.fused_ctx(positions, mask)?,
            _ => None,
        };
        for (i, blk) in self.blocks.iter().enumerate() {
            let c = cache.layer(i);
            let replay = routes.and_then(|r| r.layer(i));
            x = blk.forward(&x, positions, mask, &self.rope, c, &mut aux, fx.as_ref(), replay)?;
        }
        let x = self.head_input(&x, at, fx.is_some())?;
        let logits = self.logits(&x, fx.is_some())?;
        let zero = Tensor::zeros((), DType::F32, &self.device)?;
        let balance_loss = aux.iter().try_fold(zero.clone(), |acc, a| acc + &a.balance)?;
        let z_loss = aux.iter().try_fold(zero, |acc, a| acc + &a.z)?;
        Ok((
            logits,
            Aux {
                balance_loss,
                z_loss,
                moe: aux.into_iter().map(|a| a.stats).collect(),
            },
        ))
    }

    /// Training forward over a packed batch: logits (B, T, V) plus MoE auxiliaries.
    pub fn forward(&self, batch: &Packed) -> Result<(Tensor, Aux)> {
        let routes = batch.routes.as_deref();
        self.run(
            &batch.tokens,
            &batch.positions,
            &batch.mask,
            CacheArg::None,
            None,
            routes,
        )
    }

    /// [`Transformer::forward`] with the head applied only at the flat positions `at`
    /// (row · width + column) of `batch`: logits (1, `at.len()`, V), in `at`'s order, equal
    /// to [`Transformer::forward`]'s at those positions. A trainer asks for the positions
    /// whose next token it scores (the completions'), and skips the head's product, and
    /// the logits' memory, over the prompts and the padding.
    pub fn forward_at(&self, batch: &Packed, at: &[u32]) -> Result<(Tensor, Aux)> {
        let at = self.positions_at(batch, at)?;
        let routes = batch.routes.as_deref();
        self.run(
            &batch.tokens,
            &batch.positions,
            &batch.mask,
            CacheArg::None,
            Some(&at),
            routes,
        )
    }
}

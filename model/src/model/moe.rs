//! The mixture-of-experts feed-forward: router, top-k experts per token, optional shared
//! expert, and the routing statistics of one forward.

use super::*;

/// Routing statistics of one MoE layer for one forward.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeStats {
    /// Tokens routed to each expert.
    pub tokens_per_expert: Vec<usize>,
    /// `(max tokens per expert − mean) / mean`.
    pub imbalance: f32,
}

/// Mixture-of-experts feed-forward: router, top-k experts per token, optional shared expert.
#[derive(Debug, Clone)]
pub(crate) struct Moe {
    pub(crate) router: Linear,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared: Option<(Mlp, Linear)>,
    pub(crate) cfg: MoeConfig,
}

impl Moe {
    pub(crate) fn load(vb: &VarBuilder, d: usize, cfg: &MoeConfig, family: Family) -> Result<Self> {
        let (router_name, expert_names) = match family {
            Family::Mixtral => ("gate", ["w1", "w3", "w2"]),
            _ => ("gate", ["gate_proj", "up_proj", "down_proj"]),
        };
        let router = Linear::load(&vb.pp(router_name), cfg.n_experts, d, false)?;
        let experts = (0..cfg.n_experts)
            .map(|e| Mlp::load(&vb.pp("experts").pp(e), d, cfg.expert_ff, expert_names, false))
            .collect::<Result<Vec<_>>>()?;
        let shared = match cfg.shared_ff {
            Some(ff) => Some((
                Mlp::load(
                    &vb.pp("shared_expert"),
                    d,
                    ff,
                    ["gate_proj", "up_proj", "down_proj"],
                    false,
                )?,
                Linear::load(&vb.pp("shared_expert_gate"), 1, d, false)?,
            )),
            None => None,
        };
        Ok(Moe {
            router,
            experts,
            shared,
            cfg: cfg.clone(),
        })
    }

    /// x: (N, d) → (out (N, d), aux load-balance loss (scalar), stats).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor, MoeStats)> {
        let (n, _d) = x.dims2()?;
        let e = self.cfg.n_experts;
        // Routing in f32 whatever the weights' dtype (the balance loss is f32).
        let logits = self.router.forward(x)?.to_dtype(DType::F32)?;
        let scores = match self.cfg.score {
            RouterScore::Softmax => candle_nn::ops::softmax(&logits, D::Minus1)?,
            RouterScore::Sigmoid => candle_nn::ops::sigmoid(&logits)?,
        };
        // Selection is discrete (no gradient); the weights of the chosen experts carry it.
        let host = scores.to_vec2::<f32>()?;
        let mut onehot = vec![0f32; n * e];
        let mut routed: Vec<Vec<u32>> = vec![Vec::new(); e];
        for (i, row) in host.iter().enumerate() {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &j in &order[..self.cfg.top_k] {
                onehot[i * e + j] = 1.0;
                routed[j].push(i as u32);
            }
        }
        let onehot = Tensor::from_vec(onehot, (n, e), x.device())?;
        let mut combine = (&scores * &onehot)?;
        if self.cfg.renormalize {
            combine = combine.broadcast_div(&(combine.sum_keepdim(D::Minus1)? + 1e-20)?)?;
        }
        let mut out = x.zeros_like()?;
        for (j, idx) in routed.iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let idx_t = Tensor::new(idx.as_slice(), x.device())?;
            let xe = x.index_select(&idx_t, 0)?;
            let w = combine.index_select(&idx_t, 0)?.narrow(1, j, 1)?.to_dtype(x.dtype())?;
            let ye = self.experts[j].forward(&xe)?.broadcast_mul(&w)?;
            out = out.index_add(&idx_t, &ye, 0)?;
        }
        if let Some((mlp, gate)) = &self.shared {
            let g = candle_nn::ops::sigmoid(&gate.forward(x)?.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
            out = (out + mlp.forward(x)?.broadcast_mul(&g)?)?;
        }
        // Switch-style balance loss: E · Σ_e f_e · P_e (f: routed fraction, P: mean score).
        let counts: Vec<usize> = routed.iter().map(Vec::len).collect();
        let total = (n * self.cfg.top_k).max(1) as f32;
        let f: Vec<f32> = counts.iter().map(|&c| c as f32 / total).collect();
        let f = Tensor::from_vec(f, e, x.device())?;
        let p = scores.mean(0)?;
        let aux = ((f * p)?.sum_all()? * (e as f64 * self.cfg.aux_loss_coef))?;
        let mean = total / e as f32;
        let max = counts.iter().copied().max().unwrap_or(0) as f32;
        let stats = MoeStats {
            imbalance: if mean > 0.0 { (max - mean) / mean } else { 0.0 },
            tokens_per_expert: counts,
        };
        Ok((out, aux, stats))
    }
}

//! The mixture-of-experts feed-forward: router, top-k experts per token, optional shared
//! expert, and the routing statistics of one forward.

use super::*;

/// Routing statistics of one MoE layer for one forward.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MoeStats {
    /// Tokens routed to each expert.
    pub tokens_per_expert: Vec<usize>,
    /// `(max tokens per expert − mean) / mean`.
    pub imbalance: f32,
    /// Mean entropy (nats) of the router's distribution over experts per token (its
    /// softmax; for sigmoid scores, the scores normalised to sum to 1).
    pub router_entropy: f32,
    /// The router z-loss: mean over tokens of `logsumexp(router logits)²`.
    pub z_loss: f32,
    /// Tokens with recorded routes (routing replay): routed as recorded when replaying,
    /// else only compared.
    pub recorded: usize,
    /// Of the tokens with recorded routes, those this forward sent to other experts than
    /// the recorded ones (as a set: the order of the top-k does not count): every one of
    /// [`disagreed`](Self::disagreed) when routing afresh, none when replaying.
    pub mismatched: usize,
    /// Of the tokens with recorded routes, those whose experts this forward's own router
    /// chooses differently, replayed or not: how far the trainer's routing has drifted
    /// from the sampler's.
    pub disagreed: usize,
}

impl MoeStats {
    /// The largest expert's load over the mean load (1 is perfectly balanced).
    pub fn max_load_ratio(&self) -> f32 {
        self.imbalance + 1.0
    }

    /// `(max − mean) / mean` of tokens per expert (0 without tokens).
    fn imbalance_of(counts: &[usize]) -> f32 {
        let mean = counts.iter().sum::<usize>() as f32 / counts.len().max(1) as f32;
        let max = counts.iter().copied().max().unwrap_or(0) as f32;
        if mean > 0.0 { (max - mean) / mean } else { 0.0 }
    }

    /// Adds the statistics of the same layer over more tokens: tokens per expert summed,
    /// imbalance recomputed from the sums, router entropy and z-loss averaged by routed
    /// tokens.
    pub fn merge(&mut self, other: &MoeStats) {
        let (a, b) = (
            self.tokens_per_expert.iter().sum::<usize>() as f32,
            other.tokens_per_expert.iter().sum::<usize>() as f32,
        );
        let w = if a + b > 0.0 { b / (a + b) } else { 0.0 };
        self.router_entropy += w * (other.router_entropy - self.router_entropy);
        self.z_loss += w * (other.z_loss - self.z_loss);
        for (x, y) in self.tokens_per_expert.iter_mut().zip(&other.tokens_per_expert) {
            *x += y;
        }
        self.recorded += other.recorded;
        self.mismatched += other.mismatched;
        self.disagreed += other.disagreed;
        self.imbalance = Self::imbalance_of(&self.tokens_per_expert);
    }
}

/// What one MoE layer adds to a training forward: its load-balance loss (scaled by the
/// config's `aux_loss_coef`), its router z-loss (unscaled) and its statistics.
#[derive(Debug, Clone)]
pub struct RouterAux {
    /// Switch-style load-balance loss, `E · Σ_e f_e · P_e · aux_loss_coef`.
    pub balance: Tensor,
    /// Router z-loss, `mean(logsumexp(logits)²)` (ST-MoE): keeps router logits small.
    pub z: Tensor,
    /// Routing statistics.
    pub stats: MoeStats,
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

    /// x: (N, d) → (out (N, d), the router's losses and statistics). With `recorded`
    /// routes (`top_k` expert ids per token, [`NO_ROUTE`](super::NO_ROUTE) where none was
    /// recorded) and `replay`, a token goes to its recorded experts instead of its top-k:
    /// the output combines those experts with the router's scores for them, so gradients
    /// still reach the router through its logits. The statistics count the recorded
    /// tokens routed elsewhere than recorded (none when replaying) and those whose own
    /// top-k differs (replayed or not).
    pub(crate) fn forward(&self, x: &Tensor, recorded: Option<(&[u8], bool)>) -> Result<(Tensor, RouterAux)> {
        let replay = recorded.map(|(r, _)| r);
        let replaying = recorded.is_some_and(|(_, on)| on);
        let (n, _d) = x.dims2()?;
        let (e, k) = (self.cfg.n_experts, self.cfg.top_k);
        if let Some(r) = replay
            && r.len() != n * k
        {
            return Err(Error::Shape(format!(
                "routes to replay: {} expert ids for {n} tokens × top-{k}",
                r.len()
            )));
        }
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
        let (mut with_routes, mut mismatched, mut disagreed) = (0, 0, 0);
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for (i, row) in host.iter().enumerate() {
            order.clear();
            order.extend(0..e);
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let own = &order[..k];
            let chosen: Vec<usize> = match replay.map(|r| &r[i * k..(i + 1) * k]) {
                Some(rec) if rec[0] != super::NO_ROUTE => {
                    with_routes += 1;
                    let rec: Vec<usize> = rec.iter().map(|&j| j as usize).collect();
                    if let Some(&bad) = rec.iter().find(|&&j| j >= e) {
                        return Err(Error::Shape(format!(
                            "routes to replay: expert {bad} of a layer with {e} experts"
                        )));
                    }
                    if (1..k).any(|a| rec[..a].contains(&rec[a])) {
                        return Err(Error::Shape(format!(
                            "routes to replay: token {i} names an expert twice: {rec:?}"
                        )));
                    }
                    if own.iter().any(|j| !rec.contains(j)) {
                        disagreed += 1;
                        if !replaying {
                            mismatched += 1;
                        }
                    }
                    if replaying { rec } else { own.to_vec() }
                }
                _ => own.to_vec(),
            };
            for j in chosen {
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
        // Router z-loss: mean over tokens of logsumexp(logits)², differentiable.
        let lse = logits.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let z = lse.sqr()?.mean_all()?;
        // Router entropy per token, of the scores normalised to a distribution.
        let entropy = {
            let mut sum = 0f64;
            for row in &host {
                let total: f32 = row.iter().sum();
                if total > 0.0 {
                    sum -= row
                        .iter()
                        .map(|&p| p / total)
                        .filter(|&p| p > 0.0)
                        .map(|p| (p * p.ln()) as f64)
                        .sum::<f64>();
                }
            }
            (sum / n.max(1) as f64) as f32
        };
        let stats = MoeStats {
            imbalance: MoeStats::imbalance_of(&counts),
            tokens_per_expert: counts,
            router_entropy: entropy,
            z_loss: z.to_scalar::<f32>()?,
            recorded: with_routes,
            mismatched,
            disagreed,
        };
        Ok((out, RouterAux { balance: aux, z, stats }))
    }
}

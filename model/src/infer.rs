//! Inference on the CPU: the same transformer as [`Transformer`], evaluated over plain
//! `f32` buffers with the kernels of `streamrl_kernels::cpu` (the `gemm` crate's matrix
//! products, the ones candle calls, and row-wise loops for the rest).
//!
//! Why it exists: a decode step of a small model is dozens of tiny tensor ops, and on the
//! CPU candle spends more time allocating and dispatching them than computing. Here one
//! forward takes a *mixed* batch — decode tokens of running sequences and whole prompts
//! of newcomers together — as rows of the same matrix products; every sequence keeps its
//! own growing key/value buffer ([`SeqKv`]), so sequences join and leave a batch without
//! any copying, and attention covers exactly each sequence's own positions (no padding,
//! no masks). The weights are copied out of the candle model once ([`CpuModel::new`]).
//!
//! The results equal the candle forward up to float summation order (tested to 1e-4 on
//! logits for every family, dense and MoE).
//!
//! ```
//! use streamrl_model::infer::{CpuModel, SeqKv};
//! use streamrl_model::{checkpoint, config};
//!
//! let hf = config::preset("tiny", 32).unwrap();
//! let model = checkpoint::init(&hf, &candle_core::Device::Cpu).unwrap().model;
//! let cpu = CpuModel::new(&model).unwrap();
//! let (mut a, mut b) = (cpu.new_kv(16), cpu.new_kv(16));
//! // One forward: a's 3-token prompt and b's 2-token prompt; one logits row each.
//! let logits = cpu.forward(&mut [(&mut a, &[1, 2, 3][..]), (&mut b, &[4, 5][..])]).unwrap();
//! assert_eq!(logits.len(), 2 * 32);
//! assert_eq!((a.len(), b.len()), (3, 2));
//! // Next step: one new token each, attending to what is cached.
//! cpu.forward(&mut [(&mut a, &[7][..]), (&mut b, &[8][..])]).unwrap();
//! assert_eq!((a.len(), b.len()), (4, 3));
//! ```

use candle_core::{DType, Device, Tensor};

use streamrl_kernels::bf16::{self, Products};
use streamrl_kernels::cpu::{Cached, KvLayout};
use streamrl_kernels::{cores, cpu};

use crate::config::{Config, MoeConfig, RopeLayout, RouterScore};
use crate::model::{FeedForward, Linear, Mlp, Transformer};
use crate::{Error, Result};

/// A dense weight matrix, plus an optional bias.
#[derive(Debug, Clone)]
struct Mat {
    w: Weights,
    b: Option<Vec<f32>>,
    out: usize,
    inp: usize,
}

/// A weight as the products read it.
#[derive(Debug, Clone)]
enum Weights {
    /// Transposed, `(in, out)` row-major: the layout [`cpu::matmul`] reads fastest, for
    /// [`bf16::gemm_f32`].
    F32(Vec<f32>),
    /// Converted to bf16 once, for [`bf16::gemm_prepared`].
    Bf16(Box<bf16::Matrix>),
}

impl Weights {
    /// A checkpoint's `(out, inp)` weight laid out for products of type `p`.
    fn new(w: &[f32], out: usize, inp: usize, p: Products) -> Weights {
        match p {
            // Read transposed in place: the conversion keeps its memory order.
            Products::Bf16 if bf16::path() != bf16::Path::F32 => {
                Weights::Bf16(Box::new(bf16::Matrix::new(cpu::View::rows(w, out, inp).t())))
            }
            // f32, or bf16 on the fallback path: the f32 kernels as they are.
            _ => Weights::F32(cpu::transpose(w, out, inp)),
        }
    }
}

impl Mat {
    /// Linear layers with the same input width, their outputs side by side, for products
    /// of type `p`.
    fn of(parts: &[&Linear], p: Products) -> Result<Mat> {
        let inp = parts[0].w.dim(1)?;
        let any_bias = parts.iter().any(|l| l.b.is_some());
        let (mut w, mut b, mut out) = (Vec::new(), Vec::new(), 0);
        for l in parts {
            let (o, i) = l.w.dims2()?;
            if i != inp {
                return Err(Error::Shape(format!(
                    "stacking linear layers of input widths {inp} and {i}"
                )));
            }
            w.extend(host(&l.w)?);
            if any_bias {
                b.extend(match &l.b {
                    Some(bias) => host(bias)?,
                    None => vec![0.0; o],
                });
            }
            out += o;
        }
        Ok(Mat {
            w: Weights::new(&w, out, inp, p),
            b: any_bias.then_some(b),
            out,
            inp,
        })
    }

    /// `dst (n, out) (+)= x (n, in) @ w^T (+ b)`.
    fn apply(&self, x: &[f32], n: usize, dst: &mut [f32], accumulate: bool, threads: usize) {
        match &self.w {
            Weights::F32(wt) => bf16::gemm_f32(
                cpu::ViewMut::rows(&mut dst[..n * self.out], n, self.out),
                cpu::View::rows(&x[..n * self.inp], n, self.inp),
                cpu::View::rows(wt, self.inp, self.out),
                accumulate,
                1.0,
                threads,
            ),
            Weights::Bf16(w) => {
                let dst = cpu::ViewMut::rows(&mut dst[..n * self.out], n, self.out);
                let x = cpu::View::rows(&x[..n * self.inp], n, self.inp);
                bf16::gemm_prepared(dst, x, w, accumulate, 1.0, threads)
            }
        }
        if let Some(b) = &self.b {
            for row in dst.chunks_exact_mut(self.out) {
                for (y, b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            }
        }
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

#[derive(Debug, Clone)]
struct Swiglu {
    /// gate and up stacked: (2·ff, d).
    gate_up: Mat,
    down: Mat,
    ff: usize,
}

impl Swiglu {
    fn from(m: &Mlp, p: Products) -> Result<Swiglu> {
        let gate_up = Mat::of(&[&m.gate, &m.up], p)?;
        Ok(Swiglu {
            ff: gate_up.out / 2,
            gate_up,
            down: Mat::of(&[&m.down], p)?,
        })
    }

    /// `dst (n, d) (+)= down(silu(gate(x)) · up(x))`.
    fn apply(&self, x: &[f32], n: usize, dst: &mut [f32], accumulate: bool, threads: usize) {
        let ff = self.ff;
        let mut gu = vec![0f32; n * 2 * ff];
        self.gate_up.apply(x, n, &mut gu, false, threads);
        let mut a = vec![0f32; n * ff];
        for (row, out) in gu.chunks_exact(2 * ff).zip(a.chunks_exact_mut(ff)) {
            let (g, u) = row.split_at(ff);
            cpu::silu_mul(g, u, out);
        }
        self.down.apply(&a, n, dst, accumulate, threads);
    }
}

#[derive(Debug, Clone)]
enum Ff {
    Dense(Swiglu),
    Moe(Box<Moe>),
}

/// A mixture-of-experts feed-forward: router, experts, optional gated shared expert.
#[derive(Debug, Clone)]
struct Moe {
    router: Mat,
    experts: Vec<Swiglu>,
    shared: Option<(Swiglu, Mat)>,
    cfg: MoeConfig,
}

#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Vec<f32>,
    /// q, k and v stacked: ((heads + 2·kv_heads)·head_dim, d).
    qkv: Mat,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o: Mat,
    ff_norm: Vec<f32>,
    ff: Ff,
}

/// The keys and values of one sequence, per layer, written in place as the sequence
/// grows; for a mixture of experts, also the experts every position was routed to.
#[derive(Debug, Clone)]
pub struct SeqKv {
    /// Per layer, the keys and values laid out for [`cpu::attend`].
    cache: Cache,
    /// Where each layer's keys and values lie (room for `layout.cap` positions; it grows,
    /// doubling, when a sequence runs past it).
    layout: KvLayout,
    len: usize,
    /// Per position, per layer, the `top_k` experts chosen (empty for a dense model).
    routes: Vec<u8>,
}

impl SeqKv {
    /// The experts chosen for positions `from..` (per position, per layer, `top_k` ids, as
    /// [`Packed::with_routes`](crate::Packed::with_routes) reads them): what routing
    /// replay records. Empty for a dense model.
    pub fn routes_from(&self, from: usize, per_position: usize) -> &[u8] {
        self.routes.get(from * per_position..).unwrap_or(&[])
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Room for `need` positions in every layer: the cached ones move to buffers of at
    /// least twice the old room.
    fn reserve(&mut self, need: usize) {
        if need <= self.layout.cap {
            return;
        }
        let old = self.layout;
        let new = KvLayout::with_room(old.kv_heads, old.hd, need.max(2 * old.cap));
        match &mut self.cache {
            Cache::F32(l) => l.grow(old, new, self.len),
            Cache::Bf16(l) => l.grow(old, new, self.len),
        }
        self.layout = new;
    }
}

/// The number type a sequence's cache holds: f32, or bf16 where the model's products are
/// bf16 (attention then reads its inputs rounded to bf16, as the training forward's bf16
/// products do, and a decode step reads half the bytes).
#[derive(Debug, Clone)]
enum Cache {
    F32(Layers<f32>),
    Bf16(Layers<u16>),
}

/// Per layer, the keys ([`KvLayout`]: per kv head, blocks of 16 positions) and values (per
/// kv head, position-major).
#[derive(Debug, Clone)]
struct Layers<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
}

impl<T: Cached> Layers<T> {
    fn new(layers: usize, layout: KvLayout) -> Layers<T> {
        Layers {
            k: (0..layers).map(|_| vec![T::default(); layout.size()]).collect(),
            v: (0..layers).map(|_| vec![T::default(); layout.size()]).collect(),
        }
    }

    fn grow(&mut self, old: KvLayout, new: KvLayout, len: usize) {
        for (k, v) in self.k.iter_mut().zip(&mut self.v) {
            (*k, *v) = old.grow(new, k, v, len);
        }
    }
}

/// The model's weights as plain buffers, ready for [`CpuModel::forward`].
#[derive(Debug, Clone)]
pub struct CpuModel {
    cfg: Config,
    embed: Vec<f32>,
    head: Mat,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    /// Rotary tables (max_positions, head_dim / 2), the candle model's own values.
    cos: Vec<f32>,
    sin: Vec<f32>,
    threads: usize,
    /// Whether sequences cache keys and values in bf16 (the products are bf16 on a bf16
    /// unit).
    bf16_cache: bool,
}

impl CpuModel {
    /// Copies the weights of a model that lives on the CPU in f32 (converted to bf16 once
    /// when the model's products are bf16: [`Transformer::set_products`]); any other
    /// device or dtype is an error (use the candle forward there).
    pub fn new(m: &Transformer) -> Result<CpuModel> {
        let p = m.products;
        if !matches!(m.device, Device::Cpu) || m.embed.dtype() != DType::F32 {
            return Err(Error::Shape(format!(
                "the CPU kernels need f32 weights on the CPU (this model: {:?} on {:?})",
                m.embed.dtype(),
                m.device
            )));
        }
        let layers = m
            .blocks
            .iter()
            .map(|b| {
                let a = &b.attn;
                Ok(Layer {
                    attn_norm: host(&b.attn_norm.w)?,
                    qkv: Mat::of(&[&a.q, &a.k, &a.v], p)?,
                    q_norm: a.q_norm.as_ref().map(|n| host(&n.w)).transpose()?,
                    k_norm: a.k_norm.as_ref().map(|n| host(&n.w)).transpose()?,
                    o: Mat::of(&[&a.o], p)?,
                    ff_norm: host(&b.ff_norm.w)?,
                    ff: match &b.ff {
                        FeedForward::Dense(mlp) => Ff::Dense(Swiglu::from(mlp, p)?),
                        FeedForward::Moe(moe) => Ff::Moe(Box::new(Moe {
                            // Routing stays f32: a rounded score can flip an expert choice.
                            router: Mat::of(&[&moe.router], Products::F32)?,
                            experts: moe.experts.iter().map(|e| Swiglu::from(e, p)).collect::<Result<_>>()?,
                            shared: moe
                                .shared
                                .as_ref()
                                .map(|(mlp, gate)| {
                                    Ok::<_, Error>((Swiglu::from(mlp, p)?, Mat::of(&[gate], Products::F32)?))
                                })
                                .transpose()?,
                            cfg: moe.cfg.clone(),
                        })),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = host(&m.embed)?;
        Ok(CpuModel {
            cfg: m.cfg.clone(),
            head: match &m.head {
                Some(h) => Mat::of(&[h], p)?,
                // Tied: the embedding (vocab, d) is the head's weight.
                None => Mat {
                    w: Weights::new(&embed, m.cfg.vocab, m.cfg.d_model, p),
                    b: None,
                    out: m.cfg.vocab,
                    inp: m.cfg.d_model,
                },
            },
            embed,
            norm: host(&m.norm.w)?,
            layers,
            cos: host(&m.rope.cos)?,
            sin: host(&m.rope.sin)?,
            threads: candle_core::utils::get_num_threads(),
            bf16_cache: p == Products::Bf16 && bf16::path() != bf16::Path::F32,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// An empty cache with room reserved for `capacity` positions.
    pub fn new_kv(&self, capacity: usize) -> SeqKv {
        let c = &self.cfg;
        let layout = KvLayout::with_room(c.n_kv_heads, c.head_dim, capacity.min(c.max_positions));
        SeqKv {
            cache: if self.bf16_cache {
                Cache::Bf16(Layers::new(c.n_layers, layout))
            } else {
                Cache::F32(Layers::new(c.n_layers, layout))
            },
            layout,
            len: 0,
            routes: Vec::new(),
        }
    }

    /// One forward over a mixed batch: each entry appends its `tokens` (a whole prompt, or
    /// the one newest token of a running sequence) after what its cache holds, and gets
    /// the logits of its last token. Returns (entries, vocab) logits, row-major.
    pub fn forward(&self, seqs: &mut [(&mut SeqKv, &[u32])]) -> Result<Vec<f32>> {
        self.check_batch(seqs)?;
        for (kv, toks) in seqs.iter_mut() {
            kv.reserve(kv.len + toks.len());
        }
        let c = &self.cfg;
        let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
        let n: usize = seqs.iter().map(|(_, t)| t.len()).sum();
        let mut x = Vec::with_capacity(n * d);
        for (_, toks) in seqs.iter() {
            for &t in *toks {
                x.extend_from_slice(&self.embed[t as usize * d..(t as usize + 1) * d]);
            }
        }
        let qkv_w = (nh + 2 * nkv) * hd;
        let mut h = vec![0f32; n * d];
        let mut qkv = vec![0f32; n * qkv_w];
        let mut att = vec![0f32; n * nh * hd];
        // Per layer, the experts each token went to (a mixture of experts).
        let mut chosen: Vec<Vec<u8>> = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            cpu::rms_norm(&x, &layer.attn_norm, c.eps as f32, &mut h);
            layer.qkv.apply(&h, n, &mut qkv, false, self.threads);
            self.attend(li, layer, &mut qkv, seqs, &mut att);
            layer.o.apply(&att, n, &mut x, true, self.threads);
            cpu::rms_norm(&x, &layer.ff_norm, c.eps as f32, &mut h);
            match &layer.ff {
                Ff::Dense(mlp) => mlp.apply(&h, n, &mut x, true, self.threads),
                Ff::Moe(m) => chosen.push(m.apply(&h, n, d, &mut x, self.threads)),
            }
        }
        let k = c.moe.as_ref().map_or(0, |m| m.top_k);
        let mut row = 0;
        for (kv, toks) in seqs.iter_mut() {
            kv.len += toks.len();
            for i in row..row + toks.len() {
                for layer in &chosen {
                    kv.routes.extend_from_slice(&layer[i * k..(i + 1) * k]);
                }
            }
            row += toks.len();
        }
        Ok(self.last_logits(&x, seqs))
    }

    /// Every problem of a batch at once: empty entries, positions past the model's
    /// maximum, tokens outside the vocabulary.
    fn check_batch(&self, seqs: &[(&mut SeqKv, &[u32])]) -> Result<()> {
        let c = &self.cfg;
        let mut problems = Vec::new();
        for (i, (kv, toks)) in seqs.iter().enumerate() {
            if toks.is_empty() {
                problems.push(format!("entry {i} has no tokens"));
            }
            if kv.len + toks.len() > c.max_positions {
                problems.push(format!(
                    "entry {i} would reach position {} (max_position_embeddings {})",
                    kv.len + toks.len() - 1,
                    c.max_positions
                ));
            }
            if let Some(t) = toks.iter().find(|t| **t as usize >= c.vocab) {
                problems.push(format!("entry {i}: token {t} is outside the vocabulary of {}", c.vocab));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Shape(problems.join("; ")))
        }
    }

    /// Per token of layer `li`, of one sequence whose `n` new tokens are the rows of `qkv`:
    /// q/k norms, rotary embedding, then the keys and values join the sequence's cache.
    fn append_kv(&self, li: usize, layer: &Layer, kv: &mut SeqKv, n: usize, qkv: &mut [f32]) {
        let c = &self.cfg;
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        for (i, r) in qkv.chunks_exact_mut((nh + 2 * nkv) * hd).take(n).enumerate() {
            let pos = kv.len + i;
            let (q, rest) = r.split_at_mut(nh * hd);
            let (k, v) = rest.split_at_mut(nkv * hd);
            for (heads, norm) in [(&mut *q, &layer.q_norm), (&mut *k, &layer.k_norm)] {
                for head in heads.chunks_exact_mut(hd) {
                    if let Some(w) = norm {
                        cpu::rms_norm_in_place(head, w, c.eps as f32);
                    }
                    self.rope(head, pos);
                }
            }
            match &mut kv.cache {
                Cache::F32(l) => kv.layout.write(&mut l.k[li], &mut l.v[li], pos, k, v),
                Cache::Bf16(l) => kv.layout.write(&mut l.k[li], &mut l.v[li], pos, k, v),
            }
        }
    }

    /// Layer `li`'s attention into `att`: each sequence's new tokens join its cache
    /// ([`Self::append_kv`]), then token i of a sequence sees that sequence's positions
    /// 0..=pos. Sequences are independent items: inside [`cores::spread`] they spread over
    /// the cores the products use (each computed as alone: the same bits).
    fn attend(&self, li: usize, layer: &Layer, qkv: &mut [f32], seqs: &mut [(&mut SeqKv, &[u32])], att: &mut [f32]) {
        let c = &self.cfg;
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        let qkv_w = (nh + 2 * nkv) * hd;
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let mut items = Vec::with_capacity(seqs.len());
        let (mut rows, mut rest) = (qkv, att);
        for (kv, toks) in seqs.iter_mut() {
            let n = toks.len();
            let (mine, tail) = std::mem::take(&mut rows).split_at_mut(n * qkv_w);
            rows = tail;
            let (out, tail) = std::mem::take(&mut rest).split_at_mut(n * nh * hd);
            rest = tail;
            items.push((&mut **kv, n, mine, out));
        }
        cores::each(items, |(kv, n, qkv, att)| {
            self.append_kv(li, layer, kv, n, qkv);
            let mut scratch = vec![0f32; (nh / nkv) * (kv.len + n)];
            for (i, (row, out)) in qkv.chunks_exact(qkv_w).zip(att.chunks_exact_mut(nh * hd)).enumerate() {
                let q = &row[..nh * hd];
                let len = kv.len + i + 1;
                match &kv.cache {
                    Cache::F32(l) => cpu::attend(q, &l.k[li], &l.v[li], kv.layout, len, scale, &mut scratch, out),
                    Cache::Bf16(l) => cpu::attend(q, &l.k[li], &l.v[li], kv.layout, len, scale, &mut scratch, out),
                }
            }
        });
    }

    /// The logits of every entry's last token: final norm, then the head.
    fn last_logits(&self, x: &[f32], seqs: &[(&mut SeqKv, &[u32])]) -> Vec<f32> {
        let c = &self.cfg;
        let d = c.d_model;
        let mut last = Vec::with_capacity(seqs.len() * d);
        let mut row = 0;
        for (_, toks) in seqs.iter() {
            row += toks.len();
            last.extend_from_slice(&x[(row - 1) * d..row * d]);
        }
        let m = seqs.len();
        let mut hn = vec![0f32; m * d];
        cpu::rms_norm(&last, &self.norm, c.eps as f32, &mut hn);
        let mut logits = vec![0f32; m * c.vocab];
        self.head.apply(&hn, m, &mut logits, false, self.threads);
        logits
    }

    /// Rotates one head's vector in place to position `pos`.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = x.len() / 2;
        cpu::rope(
            x,
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
            self.cfg.rope_layout == RopeLayout::Interleaved,
        );
    }
}

impl Moe {
    /// Adds the feed-forward of `x` (n, d) into `dst` with the candle model's routing
    /// (scores, top-k with ties to the lower index, optional renormalisation, shared expert);
    /// returns the experts each token went to, `top_k` per token in the order chosen.
    fn apply(&self, x: &[f32], n: usize, d: usize, dst: &mut [f32], threads: usize) -> Vec<u8> {
        let Moe {
            router,
            experts,
            shared,
            cfg,
        } = self;
        let e = cfg.n_experts;
        let mut scores = vec![0f32; n * e];
        router.apply(x, n, &mut scores, false, threads);
        for row in scores.chunks_exact_mut(e) {
            match cfg.score {
                RouterScore::Softmax => cpu::softmax_in_place(row),
                RouterScore::Sigmoid => {
                    for s in row.iter_mut() {
                        *s = 1.0 / (1.0 + (-*s).exp());
                    }
                }
            }
        }
        // Tokens (and their weights) per expert.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        let mut chosen = Vec::with_capacity(n * cfg.top_k);
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for (i, row) in scores.chunks_exact(e).enumerate() {
            order.clear();
            order.extend(0..e);
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let top = &order[..cfg.top_k];
            let norm = if cfg.renormalize {
                top.iter().map(|&j| row[j]).sum::<f32>() + 1e-20
            } else {
                1.0
            };
            for &j in top {
                routed[j].push((i, row[j] / norm));
                // At most 255 experts (the config refuses more): one byte each.
                chosen.push(j as u8);
            }
        }
        let mut xe = Vec::new();
        let mut ye = Vec::new();
        for (j, toks) in routed.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            xe.clear();
            for &(i, _) in toks {
                xe.extend_from_slice(&x[i * d..(i + 1) * d]);
            }
            ye.clear();
            ye.resize(toks.len() * d, 0.0);
            experts[j].apply(&xe, toks.len(), &mut ye, false, threads);
            for (r, &(i, w)) in toks.iter().enumerate() {
                for (o, y) in dst[i * d..(i + 1) * d].iter_mut().zip(&ye[r * d..(r + 1) * d]) {
                    *o += y * w;
                }
            }
        }
        if let Some((mlp, gate)) = shared {
            let mut g = vec![0f32; n];
            gate.apply(x, n, &mut g, false, threads);
            let mut y = vec![0f32; n * d];
            mlp.apply(x, n, &mut y, false, threads);
            for i in 0..n {
                let g = 1.0 / (1.0 + (-g[i]).exp());
                for (o, y) in dst[i * d..(i + 1) * d].iter_mut().zip(&y[i * d..(i + 1) * d]) {
                    *o += y * g;
                }
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{checkpoint, config};

    #[test]
    fn bad_entries_are_refused_with_every_problem_named() {
        let m = checkpoint::init(&config::preset("tiny", 40).unwrap(), &Device::Cpu)
            .unwrap()
            .model;
        let cpu = CpuModel::new(&m).unwrap();
        let (mut a, mut b) = (cpu.new_kv(4), cpu.new_kv(4));
        let err = cpu
            .forward(&mut [(&mut a, &[][..]), (&mut b, &[1, 99][..])])
            .unwrap_err()
            .to_string();
        assert!(err.contains("entry 0 has no tokens"), "{err}");
        assert!(err.contains("token 99 is outside the vocabulary of 40"), "{err}");
        assert_eq!(b.len(), 0, "a refused forward caches nothing");
    }
}

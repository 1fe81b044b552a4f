//! Key/value caches and the inference forwards that use them.

use super::*;

impl Transformer {
    /// Inference forward of `tokens` (B, t) at `positions`, appending their keys and values
    /// to `cache`; `mask` is additive (B, 1, t, cached + t).
    pub fn forward_cached(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Ok(self
            .run(tokens, positions, mask, CacheArg::Shared(cache), None, None)?
            .0)
    }

    /// Inference forward of a ragged batch: row `r` of `tokens` (B, t) holds
    /// `new_lens[r]` new tokens (right-padded to t) of a sequence whose keys and values so
    /// far are in `caches[r]`; each row's new keys and values are appended to its own
    /// cache. `mask` is additive (B, 1, t, S) with S the longest cache after appending;
    /// row r may attend only to key positions `< caches[r].len()` (after appending). This
    /// is what lets sequences of different lengths join and leave a running batch.
    pub fn forward_ragged(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        caches: &mut [&mut KvCache],
        new_lens: &[usize],
    ) -> Result<Tensor> {
        let b = tokens.dim(0)?;
        if caches.len() != b || new_lens.len() != b {
            return Err(Error::Shape(format!(
                "ragged forward of {b} rows got {} caches and {} lengths",
                caches.len(),
                new_lens.len()
            )));
        }
        Ok(self
            .run(tokens, positions, mask, CacheArg::Ragged(caches, new_lens), None, None)?
            .0)
    }

    /// Decode one token per row of the running batch whose keys and values are the rows of
    /// `kv`: row r's token sits at `positions[r]` (B, 1), its keys and values are written
    /// there in place, and attention covers the first `width` positions under the additive
    /// `mask` (B, 1, 1, width).
    pub fn forward_batched(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: &Tensor,
        kv: &BatchKv,
        width: usize,
    ) -> Result<Tensor> {
        let b = tokens.dim(0)?;
        if kv.rows != b || width > kv.cap {
            return Err(Error::Shape(format!(
                "batched decode of {b} rows (width {width}) over a cache of {} rows × {} positions",
                kv.rows, kv.cap
            )));
        }
        let index = positions
            .reshape((b, 1, 1, 1))?
            .broadcast_as((b, self.cfg.n_kv_heads, 1, self.cfg.head_dim))?
            .contiguous()?;
        Ok(self
            .run(
                tokens,
                positions,
                mask,
                CacheArg::Batched(kv, &index, width),
                None,
                None,
            )?
            .0)
    }

    /// A preallocated key/value cache for `max_len` positions.
    pub fn new_cache(&self, max_len: usize) -> KvCache {
        KvCache {
            layers: (0..self.cfg.n_layers)
                .map(|_| candle_nn::kv_cache::KvCache::new(2, max_len))
                .collect(),
        }
    }
}

/// How one forward uses key/value caches.
pub(crate) enum CacheArg<'a, 'b> {
    None,
    Batched(&'a BatchKv, &'a Tensor, usize),
    Shared(&'a mut KvCache),
    Ragged(&'a mut [&'b mut KvCache], &'a [usize]),
}

impl<'a, 'b> CacheArg<'a, 'b> {
    /// Layer `i`'s view.
    pub(crate) fn layer(&mut self, i: usize) -> LayerCache<'_> {
        match self {
            CacheArg::None => LayerCache::None,
            CacheArg::Batched(kv, index, width) => LayerCache::Batched {
                k: &kv.k[i],
                v: &kv.v[i],
                index,
                width: *width,
            },
            CacheArg::Shared(c) => LayerCache::Shared(&mut c.layers[i]),
            CacheArg::Ragged(cs, lens) => LayerCache::Ragged {
                caches: cs.iter_mut().map(|c| &mut c.layers[i]).collect(),
                new_lens: lens,
            },
        }
    }
}

/// One layer's view of [`CacheArg`].
pub(crate) enum LayerCache<'a> {
    None,
    /// The running batch's cache rows (B, kv, cap, hd): write the new position of every row
    /// with one scatter, attend over the first `width` positions.
    Batched {
        k: &'a Tensor,
        v: &'a Tensor,
        index: &'a Tensor,
        width: usize,
    },
    Shared(&'a mut candle_nn::kv_cache::KvCache),
    Ragged {
        caches: Vec<&'a mut candle_nn::kv_cache::KvCache>,
        new_lens: &'a [usize],
    },
}

/// Per-layer key/value caches, preallocated (grown in place, never re-concatenated).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.current_seq_len())
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl KvCache {
    /// Keys and values of layer `i` so far, (1, kv, len, hd) each.
    pub(crate) fn layer(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let l = &self.layers[i];
        match (l.k()?, l.v()?) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(Error::Shape(format!("layer {i} of the cache is empty"))),
        }
    }
}

/// The running batch's key/value cache: per layer one (rows, kv, cap, hd) tensor whose row r
/// belongs to the r-th running sequence. Rows join (a prefilled sequence) and leave (a
/// finished one) between steps; a decode step writes every row's new position with one
/// scatter instead of one copy per row.
#[derive(Debug, Clone, Default)]
pub struct BatchKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    rows: usize,
    cap: usize,
}

impl BatchKv {
    /// Rows (running sequences).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Positions per row.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Appends the sequences cached in `caches` as new rows, growing every row to at least
    /// `cap` positions.
    pub fn push(&mut self, caches: &[&KvCache], cap: usize) -> Result<()> {
        if caches.is_empty() {
            return Ok(());
        }
        let layers = caches[0].layers.len();
        let cap = cap.max(self.cap);
        let grow = |t: &Tensor, to: usize| -> Result<Tensor> {
            let have = t.dim(2)?;
            Ok(if have < to {
                t.pad_with_zeros(2, 0, to - have)?
            } else {
                t.clone()
            })
        };
        let (mut ks, mut vs) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
        for i in 0..layers {
            let mut kparts = Vec::with_capacity(caches.len() + 1);
            let mut vparts = Vec::with_capacity(caches.len() + 1);
            if self.rows > 0 {
                kparts.push(grow(&self.k[i], cap)?);
                vparts.push(grow(&self.v[i], cap)?);
            }
            for c in caches {
                let (k, v) = c.layer(i)?;
                kparts.push(grow(&k, cap)?);
                vparts.push(grow(&v, cap)?);
            }
            ks.push(Tensor::cat(&kparts, 0)?.contiguous()?);
            vs.push(Tensor::cat(&vparts, 0)?.contiguous()?);
        }
        self.k = ks;
        self.v = vs;
        self.rows += caches.len();
        self.cap = cap;
        Ok(())
    }

    /// Keeps only the rows at `keep` (in that order).
    pub fn keep(&mut self, keep: &[u32]) -> Result<()> {
        if keep.len() == self.rows {
            return Ok(());
        }
        if keep.is_empty() {
            *self = BatchKv::default();
            return Ok(());
        }
        let dev = self.k[0].device().clone();
        let idx = Tensor::new(keep, &dev)?;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.index_select(&idx, 0)?.contiguous()?;
        }
        self.rows = keep.len();
        Ok(())
    }
}

//! Packed training batches.

use super::*;

/// Large negative additive mask value (not -inf: an all-masked padding row stays finite);
/// the CPU attention kernels skip positions masked with it.
pub const MASKED: f32 = streamrl_kernels::train::MASKED;

/// A packed training batch: several samples concatenated per row, positions restarting
/// per sample, attention confined to each sample.
#[derive(Debug, Clone)]
pub struct Packed {
    /// Token ids (B, T), u32.
    pub tokens: Tensor,
    /// Position ids (B, T), u32, restarting at 0 for every sample.
    pub positions: Tensor,
    /// Additive attention mask (B, 1, T, T).
    pub mask: Tensor,
    /// Row, start offset and length of every sample, in input order.
    pub spans: Vec<(usize, usize, usize)>,
    /// Columns per row.
    pub width: usize,
    /// Expert choices recorded by the sampler, which the training forward replays instead
    /// of routing itself, or compares its own routing with ([`Packed::with_routes`]);
    /// `None` routes every position afresh.
    pub routes: Option<Arc<Routes>>,
}

/// Marks a position, in recorded routes, whose experts were not recorded: the training
/// forward routes it itself.
pub const NO_ROUTE: u8 = u8::MAX;

/// The experts a sampler chose, to replay in a training forward: per MoE layer, the
/// `top_k` experts of every position of a packed batch (`B·T·top_k` ids, row-major), or
/// [`NO_ROUTE`] where none was recorded (prompts, padding, a dense model's sampler).
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    /// Route positions as recorded (routing replay); false: route them afresh and only
    /// count where the router differs from the record.
    pub replay: bool,
    /// Experts per position.
    pub top_k: usize,
    /// One entry per layer of the model (empty for a dense layer).
    pub layers: Vec<Vec<u8>>,
}

impl Routes {
    /// Layer `layer`'s choices for every position, `top_k` apiece, when it has any, and
    /// whether to replay them.
    pub(crate) fn layer(&self, layer: usize) -> Option<(&[u8], bool)> {
        let ids = self.layers.get(layer).map(Vec::as_slice).filter(|l| !l.is_empty())?;
        Some((ids, self.replay))
    }
}

/// One sample's recorded routes, for [`Packed::with_routes`]: from position `from` of the
/// sample on, `layers × top_k` expert ids per position (position-major, then layer), as
/// the rollout engine records them; positions past the end are routed afresh.
#[derive(Debug, Clone, Copy)]
pub struct SampleRoutes<'a> {
    /// The sample's position the first recorded one is.
    pub from: usize,
    /// `layers × top_k` expert ids per position.
    pub ids: &'a [u8],
}

impl Packed {
    /// Packs `rows`: each row is a list of samples (token sequences) laid end to end; rows
    /// are right-padded to the longest.
    pub fn new(rows: &[Vec<Vec<u32>>], device: &Device) -> Result<Packed> {
        let width = rows
            .iter()
            .map(|r| r.iter().map(Vec::len).sum::<usize>())
            .max()
            .unwrap_or(0)
            .max(1);
        let b = rows.len().max(1);
        let mut tokens = vec![0u32; b * width];
        let mut positions = vec![0u32; b * width];
        let mut segment = vec![u32::MAX; b * width];
        let mut spans = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let mut at = 0;
            for (s, sample) in row.iter().enumerate() {
                for (i, &tok) in sample.iter().enumerate() {
                    tokens[r * width + at + i] = tok;
                    positions[r * width + at + i] = i as u32;
                    segment[r * width + at + i] = s as u32;
                }
                spans.push((r, at, sample.len()));
                at += sample.len();
            }
        }
        let mut mask = vec![MASKED; b * width * width];
        for r in 0..b {
            for i in 0..width {
                for j in 0..=i {
                    let (si, sj) = (segment[r * width + i], segment[r * width + j]);
                    // Padding attends to itself only, so its row stays well defined.
                    if (si == sj && si != u32::MAX) || i == j {
                        mask[(r * width + i) * width + j] = 0.0;
                    }
                }
            }
        }
        Ok(Packed {
            tokens: Tensor::from_vec(tokens, (b, width), device)?,
            positions: Tensor::from_vec(positions, (b, width), device)?,
            mask: Tensor::from_vec(mask, (b, 1, width, width), device)?,
            spans,
            width,
            routes: None,
        })
    }

    /// This batch with `samples`' recorded routes (one entry per sample, in input order;
    /// `None` for a sample without), for a model of `cfg`'s shape: replayed by the training
    /// forward when `replay`, else only compared with its own routing. Refused,
    /// naming every problem, when the routes do not fit the model or the samples: an
    /// expert id outside the model's experts, a length that is not whole positions, routes
    /// past a sample's end. Without any routes, or for a dense model, the batch is returned
    /// as it is.
    pub fn with_routes(mut self, cfg: &Config, samples: &[Option<SampleRoutes<'_>>], replay: bool) -> Result<Packed> {
        let Some(moe) = &cfg.moe else {
            return Ok(self);
        };
        if samples.iter().all(Option::is_none) {
            return Ok(self);
        }
        let (k, layers) = (moe.top_k, cfg.n_layers);
        let per = layers * k;
        let mut problems = Vec::new();
        if samples.len() != self.spans.len() {
            problems.push(format!(
                "{} samples' routes for a batch of {} samples",
                samples.len(),
                self.spans.len()
            ));
        }
        let positions = self.tokens.elem_count();
        let mut ids = vec![vec![NO_ROUTE; positions * k]; layers];
        for (s, (&(row, at, len), r)) in self.spans.iter().zip(samples).enumerate() {
            let Some(r) = r else { continue };
            if !r.ids.len().is_multiple_of(per) {
                problems.push(format!(
                    "sample {s}: {} route ids are not whole positions of {layers} layers × top-{k}",
                    r.ids.len()
                ));
                continue;
            }
            let n = r.ids.len() / per;
            if r.from + n > len {
                problems.push(format!(
                    "sample {s}: routes for positions {}..{} of a sample of {len}",
                    r.from,
                    r.from + n
                ));
                continue;
            }
            if let Some(&bad) = r.ids.iter().find(|&&e| e != NO_ROUTE && e as usize >= moe.n_experts) {
                problems.push(format!(
                    "sample {s}: expert {bad} of a model with {} experts",
                    moe.n_experts
                ));
                continue;
            }
            for (i, pos) in r.ids.chunks_exact(per).enumerate() {
                let flat = row * self.width + at + r.from + i;
                for (l, choice) in pos.chunks_exact(k).enumerate() {
                    ids[l][flat * k..(flat + 1) * k].copy_from_slice(choice);
                }
            }
        }
        if !problems.is_empty() {
            return Err(Error::Shape(format!("routes to replay: {}", problems.join("; "))));
        }
        self.routes = Some(Arc::new(Routes {
            replay,
            top_k: k,
            layers: ids,
        }));
        Ok(self)
    }
}

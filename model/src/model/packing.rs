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
        })
    }
}

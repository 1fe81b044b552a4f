//! Summaries of repeated measurements, shared by the benches.

/// The value at quantile `p` (0 to 1) of `sorted` (ascending), by nearest rank: index
/// `round((n − 1) · p)`. Panics on an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The median of `v` (the upper one of an even count: `percentile(sorted, 0.5)`).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        // The upper median of an even count, as `v[n / 2]` of the sorted values.
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!((percentile(&sorted, 0.5), percentile(&sorted, 0.99)), (51.0, 99.0));
        assert_eq!((percentile(&sorted, 0.0), percentile(&sorted, 1.0)), (1.0, 100.0));
    }
}

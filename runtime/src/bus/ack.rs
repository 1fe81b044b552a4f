//! Acknowledgement bookkeeping shared by every backend: which delivered offsets of a
//! partition are still unacknowledged, and the offset that is safe to commit.

use std::collections::BTreeSet;

/// Per-partition delivered-but-unacknowledged offsets.
#[derive(Debug, Default, Clone)]
pub(crate) struct PartitionAcks {
    pending: BTreeSet<u64>,
    /// One past the highest offset delivered.
    next: u64,
}

impl PartitionAcks {
    /// Starts tracking at `position` (the next offset that will be delivered).
    pub fn at(position: u64) -> Self {
        PartitionAcks {
            pending: BTreeSet::new(),
            next: position,
        }
    }

    pub fn delivered(&mut self, offset: u64) {
        self.pending.insert(offset);
        self.next = self.next.max(offset + 1);
    }

    /// Acknowledges `offset`; returns the new commit position (next offset to read after
    /// a restart) if the offset was pending. Acks may arrive out of order: the position
    /// never passes an offset that is still unacknowledged.
    pub fn ack(&mut self, offset: u64) -> Option<u64> {
        self.pending.remove(&offset).then(|| self.watermark())
    }

    pub fn watermark(&self) -> u64 {
        self.pending.first().copied().unwrap_or(self.next)
    }

    /// Drops pending offsets below `committed` (another member already committed them).
    pub fn skip_to(&mut self, committed: u64) {
        self.pending.retain(|&o| o >= committed);
        self.next = self.next.max(committed);
    }

    pub fn next(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_order_acks_never_commit_past_a_gap() {
        let mut p = PartitionAcks::at(10);
        for o in 10..15 {
            p.delivered(o);
        }
        assert_eq!(p.ack(12), Some(10));
        assert_eq!(p.ack(10), Some(11));
        assert_eq!(p.ack(11), Some(13));
        assert_eq!(p.ack(11), None, "double ack is ignored");
        assert_eq!(p.ack(14), Some(13));
        assert_eq!(p.ack(13), Some(15));
    }

    #[test]
    fn gaps_in_offsets_are_fine() {
        let mut p = PartitionAcks::at(0);
        p.delivered(3);
        p.delivered(7);
        assert_eq!(p.ack(3), Some(7));
        assert_eq!(p.ack(7), Some(8));
    }
}

//! Recomputing activations: where to cut a graph into segments whose activations are dropped
//! after the forward and made again just before their backward.
//!
//! Every segment but the last runs first without autograd, keeping only the values later
//! segments read (its *boundary*); from the last segment back, each runs again with autograd
//! and its backward follows at once. The peak is then about the boundaries plus one segment's
//! activations, instead of every activation; the price is a second forward of every segment
//! but the last. Cuts go where the fewest bytes cross them, near equal shares of the
//! activations: a chain of layers is cut between layers, a residual block's skip is carried.

use super::compiled::Compiled;
use crate::lazy::cost::Work;

/// A value held to the end of its segment's run (read by a later segment, or the output).
pub(crate) const HELD: u32 = u32::MAX;

/// A graph cut into segments for a recomputing backward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segments {
    /// The first node of each segment; the last segment runs to the end.
    pub(crate) starts: Vec<u32>,
    /// Each value's last reader in its own segment, or [`HELD`] when a later segment reads it
    /// (the output too).
    pub(crate) held: Vec<u32>,
    /// The first later segment that reads each value ([`HELD`]: none does). Backward runs the
    /// segments last to first, so that reader is the last to need the value kept.
    pub(crate) first_reader: Vec<u32>,
}

impl Segments {
    pub(crate) fn new(c: &Compiled, starts: Vec<u32>) -> Segments {
        let n = c.len();
        let mut seg_of = vec![0u32; n];
        for (s, w) in starts.windows(2).enumerate() {
            seg_of[w[0] as usize..w[1] as usize].fill(s as u32);
        }
        let last = *starts.last().expect("at least one segment") as usize;
        seg_of[last..].fill((starts.len() - 1) as u32);
        let mut held = c.last_use.clone();
        let mut first_reader = vec![HELD; n];
        for i in 0..n {
            for j in c.inputs(i) {
                if seg_of[j] != seg_of[i] {
                    held[j] = HELD;
                    first_reader[j] = first_reader[j].min(seg_of[i]);
                }
            }
        }
        held[n - 1] = HELD;
        Segments { starts, held, first_reader }
    }

    /// How many segments.
    pub(crate) fn count(&self) -> usize {
        self.starts.len()
    }

    /// The nodes of segment `s`.
    pub(crate) fn range(&self, s: usize, n: usize) -> std::ops::Range<usize> {
        let end = self.starts.get(s + 1).map_or(n, |&e| e as usize);
        self.starts[s] as usize..end
    }

    /// The ops that run twice: every op before the last segment.
    pub(crate) fn recomputed<'a>(&'a self, c: &'a Compiled) -> impl Iterator<Item = usize> + 'a {
        (0..*self.starts.last().expect("at least one segment") as usize).filter(|&i| !c.flags[i].leaf)
    }
}

/// What cutting needs of a graph, computed once for every count of segments tried.
pub(crate) struct Cuts {
    /// Activation bytes per sample of the nodes before each position (`n + 1` entries).
    prefix: Vec<u64>,
    /// Bytes per sample of the values made before each position and read at or after it.
    cross: Vec<u64>,
}

impl Cuts {
    pub(crate) fn new(c: &Compiled) -> Cuts {
        let n = c.len();
        let per = |i: usize| {
            if c.flags[i].allocates {
                Work::from(c.nodes[i].cost.out).per
            } else {
                0
            }
        };
        let mut prefix = Vec::with_capacity(n + 1);
        prefix.push(0);
        for i in 0..n {
            prefix.push(prefix[i] + per(i));
        }
        // A storage lives from its node to the last reader of it or of any view of it.
        let mut until = vec![0u32; n];
        for i in 0..n {
            let r = c.root[i] as usize;
            until[r] = until[r].max(c.last_use[i].min(n as u32));
        }
        let mut diff = vec![0i64; n + 2];
        for j in 0..n {
            let bytes = per(j) as i64;
            if bytes > 0 && until[j] as usize > j {
                diff[j + 1] += bytes;
                diff[until[j] as usize + 1] -= bytes;
            }
        }
        let mut cross = Vec::with_capacity(n + 1);
        let mut live = 0i64;
        for d in diff.iter().take(n + 1) {
            live += d;
            cross.push(live.max(0) as u64);
        }
        Cuts { prefix, cross }
    }

    /// Starts of `count` segments of about equal activations, the last `last` times as large
    /// (it is the one segment that does not run twice), each cut (within half a share of its
    /// target) where the fewest bytes cross; fewer when the graph has too few places.
    pub(crate) fn starts(&self, count: usize, last: f64) -> Vec<u32> {
        let n = self.prefix.len() - 1;
        let total = self.prefix[n];
        let mut starts = vec![0u32];
        if total == 0 || count < 2 {
            return starts;
        }
        let share = total as f64 / (count as f64 - 1.0 + last.max(1.0));
        for k in 1..count {
            let target = share * k as f64;
            let (lo, hi) = (target - share / 2.0, target + share / 2.0);
            let from = self.prefix.partition_point(|&p| (p as f64) < lo).max(*starts.last().expect("one") as usize + 1);
            let to = self.prefix.partition_point(|&p| (p as f64) <= hi).min(n);
            let best = (from..to).min_by(|&a, &b| {
                let dist = |p: usize| (self.prefix[p] as f64 - target).abs();
                self.cross[a].cmp(&self.cross[b]).then(dist(a).total_cmp(&dist(b)))
            });
            if let Some(p) = best {
                starts.push(p as u32);
            }
        }
        starts
    }
}

//! What an op declares about itself, once, when it is recorded: what autograd keeps for its
//! backward, how gradients reach its inputs, what it updates in place, and how a split run
//! weights it. The planner, the cost layer and the executor read these facts as data; no one
//! asks the op again.
//!
//! An op states them in its `Operation::facts`, starting from [`OpFacts::new`] (an op that
//! saves nothing, makes fresh gradients and updates nothing):
//!
//! ```text
//! fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
//!     OpFacts::new(inputs.len()).saves(|i| i == 0).saves_output(true)
//! }
//! ```

use std::ops::Range;

/// A set of an op's input positions, as many as the op has (`cat` of a thousand tensors).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct InputSet {
    /// Positions below 64, one bit each: what almost every op needs, without an allocation.
    low: u64,
    /// Positions from 64 on, ascending.
    high: Vec<usize>,
}

impl InputSet {
    /// The positions below `n` for which `f` holds.
    fn of(n: usize, mut f: impl FnMut(usize) -> bool) -> InputSet {
        let mut set = InputSet::default();
        // Ascending: `high` stays sorted.
        for k in (0..n).filter(|&k| f(k)) {
            if k < 64 {
                set.low |= 1 << k;
            } else {
                set.high.push(k);
            }
        }
        set
    }

    pub(crate) fn contains(&self, k: usize) -> bool {
        if k < 64 {
            self.low >> k & 1 == 1
        } else {
            self.high.binary_search(&k).is_ok()
        }
    }

    /// The positions, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..64).filter(|&k| self.low >> k & 1 == 1).chain(self.high.iter().copied())
    }

    fn clear(&mut self) {
        self.low = 0;
        self.high.clear();
    }
}

/// How an op's backward takes its output's gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GradReshape {
    /// As it comes.
    AsItComes,
    /// Viewed in its first input's shape (a `view`'s backward): named, not copied, so that
    /// recording a view allocates nothing more.
    AsInput,
    /// Viewed in this shape (a product's result viewed as its output).
    As(Vec<i64>),
}

impl GradReshape {
    /// The shape, for an op whose first input is shaped `first_input` (`None`: as it comes).
    pub(crate) fn shape<'a>(&'a self, first_input: Option<&'a [i64]>) -> Option<&'a [i64]> {
        match self {
            GradReshape::AsItComes => None,
            GradReshape::AsInput => first_input,
            GradReshape::As(shape) => Some(shape),
        }
    }
}

/// Everything the planner and the executor know about a recorded op besides its output's
/// `Meta` and the device's kernels. Built with the methods below; [`new`](Self::new)
/// describes an op that saves nothing, makes a fresh gradient for each input and updates none.
#[derive(Clone, Debug)]
pub(crate) struct OpFacts {
    /// Inputs autograd keeps alive until the op's backward (none when the output requires no
    /// gradient).
    pub(crate) saved: InputSet,
    /// Whether autograd keeps the output until the op's backward (never when it requires no
    /// gradient).
    pub(crate) saves_output: bool,
    /// Inputs whose gradient is a view of the output's (no allocation).
    pub(crate) grad_alias: InputSet,
    /// Inputs whose gradient is a view of a tensor the backward made (`linear`'s weight
    /// gradient: a product, transposed). A parameter whose first gradient (in the backward's
    /// order) is a view, of either kind, is summed out of place when a second arrives: autograd
    /// adds into its buffer in place only when it holds the tensor's last reference and its
    /// storage's.
    pub(crate) grad_view: InputSet,
    /// The shape the backward views the output's gradient as before its kernels run. A
    /// gradient that arrives permuted (through a transpose downstream) cannot always be viewed
    /// so: libtorch copies it.
    pub(crate) grad_reshape: GradReshape,
    /// Whether the backward reads the output's gradient densely: one that arrives broadcast (a
    /// `sum`'s backward expands the loss's gradient, stride 0) is copied first, as large as the
    /// output. Elementwise backward kernels read it as it is (libtorch 2.11, CPU).
    pub(crate) grad_dense: bool,
    /// Whether the backward reads the output's gradient contiguous: one that arrives permuted
    /// (through a transpose or permute downstream) is copied beside it while the backward runs.
    pub(crate) grad_contiguous: bool,
    /// The inputs the op updates in place when it runs (batch norm's running statistics in
    /// training). In a split step the executor restores them before each micro-batch and
    /// applies the micro-batches' updates once, weighted by their shares, as one step over the
    /// whole batch does.
    pub(crate) updated: Range<usize>,
    /// Whether the op adds its operands, so that a fixed operand of a sum over micro-batches
    /// must be weighted by each micro-batch's share.
    pub(crate) adds_fixed: bool,
    /// For a mean over counted targets (input 1, weighted by input 2 when there is one): the
    /// ignored index. A split run divides every share by the full batch's count.
    pub(crate) counted_targets: Option<i64>,
    /// What the plan depends on beyond the op's name and its output's kind, shape and strides
    /// (which the graph's fingerprint holds already): settings that size its buffers without
    /// showing in the output (`ctc_loss`'s longest target). 0 for most ops.
    pub(crate) sizing: u64,
    /// Whether the op's kernel calls say all it takes: false for ops whose kernels nobody read
    /// (a user's own function), which a calibrating plan measures.
    pub(crate) kernels_known: bool,
    /// How many inputs the op has.
    n: usize,
}

impl OpFacts {
    /// The facts in one word: equal facts give equal words, and unequal ones, but by chance,
    /// unequal words. Each fact is multiplied by a constant of its own and the products
    /// summed: independent multiplications, where a chain of mixes made finding a step's form
    /// again slower than comparing the facts whole (each node's, every step).
    pub(crate) fn fingerprint(&self) -> u64 {
        use crate::hash::weigh;
        let flags = u64::from(self.saves_output)
            | u64::from(self.grad_dense) << 1
            | u64::from(self.grad_contiguous) << 2
            | u64::from(self.adds_fixed) << 3
            | u64::from(self.kernels_known) << 4
            | u64::from(self.counted_targets.is_some()) << 5;
        let mut h = weigh(&[
            flags,
            self.saved.low,
            self.grad_alias.low,
            self.grad_view.low,
            self.n as u64,
            self.updated.start as u64,
            self.updated.end as u64,
            self.sizing,
            self.counted_targets.unwrap_or(0) as u64,
        ]);
        // Inputs from 64 on (rare), each set's with its place among the sets.
        for (i, set) in [&self.saved, &self.grad_alias, &self.grad_view].into_iter().enumerate() {
            if !set.high.is_empty() {
                let of_set = set.high.iter().fold(i as u64 + 1, |h, &k| crate::hash::mix(h ^ k as u64));
                h = h.wrapping_add(crate::hash::mix(of_set ^ (set.high.len() as u64) << 32));
            }
        }
        match &self.grad_reshape {
            GradReshape::AsItComes => h,
            GradReshape::AsInput => h.wrapping_add(crate::hash::mix(1)),
            GradReshape::As(shape) => {
                h.wrapping_add(shape.iter().fold(crate::hash::mix(2), |h, &d| crate::hash::mix(h ^ d as u64)))
            }
        }
    }

    /// Whether anything here holds memory of its own: inputs from 64 on, a reshape's sizes.
    pub(crate) fn owns_memory(&self) -> bool {
        [&self.saved, &self.grad_alias, &self.grad_view].iter().any(|set| set.high.capacity() != 0)
            || matches!(self.grad_reshape, GradReshape::As(_))
    }

    /// An op of `n` inputs that saves nothing, makes a fresh gradient for each input and
    /// updates none.
    pub(crate) fn new(n: usize) -> OpFacts {
        OpFacts {
            saved: InputSet::default(),
            saves_output: false,
            grad_alias: InputSet::default(),
            grad_view: InputSet::default(),
            grad_reshape: GradReshape::AsItComes,
            grad_dense: false,
            grad_contiguous: false,
            updated: n..n,
            adds_fixed: false,
            counted_targets: None,
            sizing: 0,
            kernels_known: true,
            n,
        }
    }

    /// Autograd keeps input `i` when `saved(i)`, given which inputs require a gradient (it
    /// keeps nothing when the output requires none).
    pub(crate) fn saves(mut self, saved: impl FnMut(usize) -> bool) -> Self {
        self.saved = InputSet::of(self.n, saved);
        self
    }

    pub(crate) fn saves_output(mut self, saves: bool) -> Self {
        self.saves_output = saves;
        self
    }

    /// Input `i`'s gradient is a view of the output's when `alias(i)`.
    pub(crate) fn grad_aliases(mut self, alias: impl FnMut(usize) -> bool) -> Self {
        self.grad_alias = InputSet::of(self.n, alias);
        self
    }

    /// Input `i`'s gradient is a view of a tensor the backward made when `view(i)`.
    pub(crate) fn grad_views(mut self, view: impl FnMut(usize) -> bool) -> Self {
        self.grad_view = InputSet::of(self.n, view);
        self
    }

    pub(crate) fn grad_reshape(mut self, reshape: GradReshape) -> Self {
        self.grad_reshape = reshape;
        self
    }

    pub(crate) fn grad_dense(mut self, dense: bool) -> Self {
        self.grad_dense = dense;
        self
    }

    pub(crate) fn grad_contiguous(mut self, contiguous: bool) -> Self {
        self.grad_contiguous = contiguous;
        self
    }

    pub(crate) fn updates(mut self, inputs: Range<usize>) -> Self {
        self.updated = inputs;
        self
    }

    pub(crate) fn adds_fixed(mut self, adds: bool) -> Self {
        self.adds_fixed = adds;
        self
    }

    pub(crate) fn counted_targets(mut self, ignore_index: Option<i64>) -> Self {
        self.counted_targets = ignore_index;
        self
    }

    pub(crate) fn sizing(mut self, hash: u64) -> Self {
        self.sizing = hash;
        self
    }

    pub(crate) fn kernels_unknown(mut self) -> Self {
        self.kernels_known = false;
        self
    }

    /// Autograd's engine casts each input's gradient to that input's kind once the backward
    /// returns it: where `cast(k)` (an input of another floating kind than the output, as
    /// `f32 + bf16` under autocast promotes), input `k`'s gradient is a new tensor, never the
    /// output's own nor a view of what the backward made.
    pub(crate) fn grads_cast(mut self, cast: impl Fn(usize) -> bool) -> Self {
        let n = self.n;
        let (alias, view) = (&self.grad_alias, &self.grad_view);
        (self.grad_alias, self.grad_view) =
            (InputSet::of(n, |k| alias.contains(k) && !cast(k)), InputSet::of(n, |k| view.contains(k) && !cast(k)));
        self
    }

    /// The facts of an op whose output requires a gradient or not: autograd saves nothing
    /// for one that does not.
    pub(crate) fn recorded(mut self, requires_grad: bool) -> Self {
        if !requires_grad {
            self.saved.clear();
            self.saves_output = false;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::InputSet;

    #[test]
    fn an_input_set_has_no_cap() {
        let set = InputSet::of(1000, |k| k % 3 == 0 || k == 63);
        for k in 0..1000 {
            assert_eq!(set.contains(k), k % 3 == 0 || k == 63, "position {k}");
        }
        assert_eq!(set.iter().count(), 334);
        assert!(!set.contains(5000));
        assert_eq!(InputSet::of(70, |_| false), InputSet::default());
    }

    /// Sets and reshapes compare by value, past 64 inputs too.
    #[test]
    fn sets_and_reshapes_compare_by_value() {
        let of = |n, every| InputSet::of(n, move |k| k % every == 0);
        assert_eq!(of(200, 3), of(200, 3));
        assert_ne!(of(200, 3), of(200, 4));
        // Alike below 64, apart above.
        assert_ne!(of(66, 65), of(64, 65));
        assert_ne!(InputSet::of(200, |k| k == 100), InputSet::of(200, |k| k == 101));
        use super::GradReshape::{As, AsInput, AsItComes};
        assert_eq!(As(vec![2, 3]), As(vec![2, 3]));
        assert_ne!(As(vec![2, 3]), As(vec![3, 2]));
        assert_ne!(As(vec![2]), As(vec![2, 1]));
        assert_ne!(As(vec![]), AsItComes);
        assert_ne!(AsInput, AsItComes);
        assert_eq!(AsInput, AsInput);
    }

    /// A step's form is told by its nodes' fingerprints: any one fact that differs tells two
    /// nodes apart, and equal facts are alike.
    #[test]
    fn a_fingerprint_tells_apart_each_fact() {
        use super::{GradReshape, OpFacts};
        let base = || OpFacts::new(3);
        let variants = [
            base(),
            OpFacts::new(2),
            base().saves(|k| k == 1),
            base().saves_output(true),
            base().grad_aliases(|k| k == 0),
            base().grad_views(|k| k == 2),
            base().grad_reshape(GradReshape::AsInput),
            base().grad_reshape(GradReshape::As(vec![2, 3])),
            base().grad_reshape(GradReshape::As(vec![3, 2])),
            base().grad_dense(true),
            base().grad_contiguous(true),
            base().updates(1..3),
            base().updates(0..1),
            base().adds_fixed(true),
            base().counted_targets(Some(-100)),
            base().counted_targets(Some(0)),
            base().sizing(7),
            base().kernels_unknown(),
            OpFacts::new(200).saves(|k| k == 100),
            OpFacts::new(200).saves(|k| k == 101),
        ];
        for (i, a) in variants.iter().enumerate() {
            for (j, b) in variants.iter().enumerate() {
                assert_eq!(a.fingerprint() == b.fingerprint(), i == j, "variants {i} and {j}");
            }
        }
        assert_eq!(base().saves(|k| k == 1).fingerprint(), base().saves(|k| k == 1).fingerprint());
    }
}

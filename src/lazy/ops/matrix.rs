//! Products: `matmul`, `linear`, `baddbmm`, and the embedding lookup (a one-hot product).

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::layout::{adopt_batch_broadcasts, Rearrange, View};
use super::record::IntoLazy;
use super::record::{combine_flows, same_device, Linearity, Record};
use super::{arg, floating, kind_err, requires, same_kind, shape_err};
use crate::dims::Dims;
use crate::lazy::error::LazyError;
use crate::lazy::error::OrPanic;
use crate::lazy::facts::{GradReshape, OpFacts};
use crate::lazy::graph::inputs_of;
use crate::lazy::graph::{BatchDim, Flow, KernelCall, Meta, Node, Operation, Product, Run, RunCx};
use crate::lazy::int_list::IntListOption;
use crate::lazy::shape;
use crate::lazy::size::Elements;
use crate::lazy::LazyTensor;

/// Each of two factors is kept for the other's gradient.
fn factors_saved(i: usize, a: usize, b: usize, inputs: &[Rc<Node>]) -> bool {
    (i == a && requires(inputs, b)) || (i == b && requires(inputs, a))
}

/// A matrix product with `torch.matmul`'s rules, or `bmm` (`[B, n, m] @ [B, m, p]`).
/// Operands: a, b. The path libtorch takes, and what it takes, depend only on the operands'
/// shapes, strides and gradients: worked out once, when the op is recorded.
pub(crate) struct Matmul {
    bmm: bool,
    path: MatmulPath,
    /// Each operand's copy, and the other temporaries forward and backward.
    copies: [Elements; 2],
    forward: Elements,
    backward: Elements,
}

impl Matmul {
    fn bmm() -> Matmul {
        Matmul {
            bmm: true,
            path: MatmulPath::Direct,
            copies: [Elements::ZERO; 2],
            forward: Elements::ZERO,
            backward: Elements::ZERO,
        }
    }

    fn product(a: &Meta, b: &Meta) -> Matmul {
        let path =
            MatmulPath::choose((&a.shape, &a.strides, a.requires_grad), (&b.shape, &b.strides, b.requires_grad), None);
        // Elements at one and two samples give the line (every count is a product of sizes,
        // at most one of them the batch's).
        let (one, two) = (path.elements(&a.shape_at(1), &b.shape_at(1)), path.elements(&a.shape_at(2), &b.shape_at(2)));
        let line = |f: &dyn Fn(&MatmulElements) -> u64| {
            let per = f(&two).saturating_sub(f(&one));
            Elements::line(per, f(&one).saturating_sub(per))
        };
        let grads = [a.requires_grad, b.requires_grad];
        Matmul {
            bmm: false,
            path,
            copies: [line(&|e| e.copy[0]), line(&|e| e.copy[1])],
            forward: line(&|e| e.forward),
            backward: line(&|e| (0..2).filter(|&i| grads[i]).map(|i| e.expanded[i]).sum::<u64>()),
        }
    }
}

impl Matmul {
    /// `bmm`'s or `mm`'s result was viewed as the output: its gradient is viewed back.
    fn grad_shape(&self, inputs: &[Rc<Node>], meta: &Meta) -> Option<Vec<i64>> {
        let (a, b) = (&inputs[0].meta.shape, &inputs[1].meta.shape);
        let (out, p) = (&meta.shape, *meta.shape.last()?);
        match self.path {
            MatmulPath::Fold { transposed: false, squeezed, .. } if b.len() - usize::from(squeezed == Some(1)) == 2 => {
                Some(vec![shape::numel(out) / p.max(1), p])
            }
            MatmulPath::Batched { .. } if a.len() >= 2 && b.len() >= 2 => {
                let n = out[out.len() - 2];
                Some(vec![shape::numel(&out[..out.len() - 2]), n, p])
            }
            _ => None,
        }
    }
}

impl Operation for Matmul {
    fn name(&self) -> &'static str {
        if self.bmm {
            "bmm"
        } else {
            "matmul"
        }
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // A copy is what `bmm` or `mm` saves for the other operand's gradient.
        for (i, &elements) in self.copies.iter().enumerate().filter(|(_, e)| **e != Elements::ZERO) {
            if requires(inputs, 1 - i) && meta.requires_grad {
                calls.push(KernelCall::SavedCopy { elements, kind: meta.kind });
            } else {
                calls.push(KernelCall::Temporaries { forward: elements, backward: Elements::ZERO });
            }
        }
        if self.forward != Elements::ZERO || self.backward != Elements::ZERO {
            calls.push(KernelCall::Temporaries { forward: self.forward, backward: self.backward });
        }
        // The product itself: one `mm` (operands as they are, or the larger folded), or a
        // `bmm`. Vectors (`mv`, `dot`) and a matrix times a batch (run transposed) are not
        // priced.
        let (a, b) = (&inputs[0].meta, &inputs[1].meta);
        let batched = match self.path {
            _ if a.shape.len() < 2 || b.shape.len() < 2 => return,
            _ if self.bmm => true,
            MatmulPath::Direct => false,
            MatmulPath::Fold { folded: 0, .. } => false,
            MatmulPath::Fold { .. } => return,
            MatmulPath::Batched { .. } => true,
        };
        let k = a.shape[a.shape.len() - 1];
        let column_major = b.shape.len() == 2 && b.strides[0] == 1 && b.strides[1] == b.shape[0] && b.shape[1] > 1;
        calls.push(KernelCall::Product(Product {
            out: meta,
            k,
            batched,
            b_column_major: column_major,
            grads: [requires(inputs, 0), requires(inputs, 1)],
        }));
    }

    fn facts(&self, inputs: &[Rc<Node>], meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| {
                // An operand copied for the kernel is saved as its copy (see `kernels`), not itself.
                factors_saved(i, 0, 1, inputs) && !self.path.copies(i)
            })
            .grad_views(|i| {
                // `mm` hands a column-major matrix (`w.tr()`) its gradient column-major: a product,
                // transposed. Its operands: both matrices as they are, or a batch folded and `b`.
                let mm = match self.path {
                    _ if self.bmm => false,
                    MatmulPath::Direct => inputs.iter().all(|x| x.meta.shape.len() == 2),
                    MatmulPath::Fold { folded: 0, transposed: false, squeezed: None, .. } => i == 1,
                    _ => false,
                };
                let m = &inputs[i].meta;
                mm && m.shape.len() == 2 && m.strides[0] == 1 && m.strides[1] == m.shape[0] && m.shape[1] > 1
            })
            .grad_reshape(self.grad_shape(inputs, meta).map_or(GradReshape::AsItComes, GradReshape::As))
            .grad_dense(true)
    }
}

impl Run for Matmul {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        if self.bmm {
            ins[0].f_bmm(ins[1])
        } else {
            ins[0].f_matmul(ins[1])
        }
    }
}

/// Which of `torch.matmul`'s paths libtorch takes on two operands (its `_matmul_impl`), as far
/// as memory goes: which operand it copies, and which gradient it sums from a broadcast.
#[derive(Clone, Copy, Debug, PartialEq)]
enum MatmulPath {
    /// `dot`, `mv` or `mm` on the operands as they are.
    Direct,
    /// The operand of more dimensions (`folded`) folded into a matrix for one `mm` (`copy`: its
    /// strides allow no view). `transposed`: a matrix times a batch, run as `(bᵀ aᵀ)ᵀ` on
    /// `b.mT()`, the result copied back contiguous. `squeezed`: an operand's leading 1 dropped
    /// first.
    Fold { copy: bool, folded: usize, transposed: bool, squeezed: Option<usize> },
    /// Both operands expanded to the broadcast batch and reshaped to `[E, n, m]` for `bmm`:
    /// which reshapes copy, and which operands are broadcast (their gradients are the whole
    /// `[E, n, m]` summed back).
    Batched { copy: [bool; 2], broadcast: [bool; 2] },
}

/// What a [`MatmulPath`] takes, in elements: each operand's copy, the forward's other
/// temporaries, and each operand's expanded gradient beyond its own (when it is broadcast).
#[derive(Default)]
struct MatmulElements {
    copy: [u64; 2],
    forward: u64,
    expanded: [u64; 2],
}

/// Operands as `_matmul_impl` sees them: shape, strides, whether it requires a gradient.
type Operand<'a> = (&'a [i64], &'a [i64], bool);

/// An operand's shape and strides with its last two dimensions swapped, as `mT()`.
fn mt((shape, strides, _): Operand<'_>) -> (Dims, Dims) {
    let (mut sh, mut st) = (Dims::from(shape), Dims::from(strides));
    let d = sh.len();
    sh.swap(d - 2, d - 1);
    st.swap(d - 2, d - 1);
    (sh, st)
}

/// The dimensions before an operand's matrix (none for a vector).
fn leading(shape: &[i64]) -> &[i64] {
    &shape[..shape.len().saturating_sub(2)]
}

impl MatmulPath {
    fn choose(a: Operand<'_>, b: Operand<'_>, squeezed: Option<usize>) -> MatmulPath {
        let (da, db) = (a.0.len(), b.0.len());
        if da <= 2 && db <= 2 {
            return MatmulPath::Direct;
        }
        if let Some(transposed) = Self::folds(a, b) {
            let (t1_shape, t1_strides) = if transposed { mt(b) } else { (Dims::from(a.0), Dims::from(a.1)) };
            let rows = shape::numel(&t1_shape[..t1_shape.len() - 1]);
            let last = t1_shape[t1_shape.len() - 1];
            let copy = shape::view_strides(&t1_shape, &t1_strides, &[rows, last]).is_none();
            let folded = usize::from(transposed);
            return MatmulPath::Fold { copy, folded, transposed: transposed && da == 2, squeezed };
        }
        // Two batches of three dimensions that differ, one of them 1 and requiring a gradient:
        // that one is squeezed first.
        if squeezed.is_none() && da == 3 && db == 3 && a.0[0] != b.0[0] {
            if a.0[0] == 1 && a.2 {
                return Self::choose((&a.0[1..], &a.1[1..], a.2), b, Some(0));
            }
            if b.0[0] == 1 && b.2 {
                return Self::choose(a, (&b.0[1..], &b.1[1..], b.2), Some(1));
            }
        }
        let Ok(batch) = shape::broadcast(leading(a.0), leading(b.0)) else {
            return MatmulPath::Direct;
        };
        let mut copy = [false; 2];
        let mut broadcast = [false; 2];
        for (i, (sh, st, _)) in [a, b].into_iter().enumerate() {
            // The operand expanded to the batch (its matrix, or a vector's length, kept).
            let own = if sh.len() >= 2 { 2 } else { 1 };
            let (own_shape, own_strides) = (&sh[sh.len() - own..], &st[st.len() - own..]);
            let lead_shape = &sh[..sh.len() - own];
            let lead_strides = &st[..st.len() - own];
            let offset = batch.len() - lead_shape.len();
            let strides: Dims = (0..batch.len())
                .map(|d| match d.checked_sub(offset) {
                    Some(k) if lead_shape[k] == batch[d] => lead_strides[k],
                    _ => 0,
                })
                .chain(own_strides.iter().copied())
                .collect();
            let expanded: Dims = batch.iter().chain(own_shape).copied().collect();
            let folded: Dims = std::iter::once(shape::numel(&batch)).chain(own_shape.iter().copied()).collect();
            copy[i] = shape::view_strides(&expanded, &strides, &folded).is_none();
            broadcast[i] = shape::numel(lead_shape) < shape::numel(&batch);
        }
        MatmulPath::Batched { copy, broadcast }
    }

    /// `Some(transposed)` when libtorch folds the operand of more dimensions into a matrix:
    /// it has three or more and the other two or fewer, and the other requires a gradient (a
    /// fold spares it a batch-sized gradient) or the fold is a view.
    fn folds(a: Operand<'_>, b: Operand<'_>) -> Option<bool> {
        let a_larger = a.0.len() >= b.0.len();
        let (t1, t2) = if a_larger { (a, b) } else { (b, a) };
        if t1.0.len() < 3 || t2.0.len() > 2 {
            return None;
        }
        if t2.2 {
            return Some(!a_larger);
        }
        if a.0.len() == 2 {
            return None;
        }
        let (sh, st) = if a_larger { (Dims::from(t1.0), Dims::from(t1.1)) } else { mt(t1) };
        if shape::numel(&sh) == 0 {
            return Some(!a_larger);
        }
        (0..sh.len() - 2).all(|i| st[i] == st[i + 1] * sh[i + 1]).then_some(!a_larger)
    }

    /// Whether operand `i` is copied (and so saved as its copy).
    fn copies(self, i: usize) -> bool {
        match self {
            MatmulPath::Direct => false,
            MatmulPath::Fold { copy, folded, .. } => copy && i == folded,
            MatmulPath::Batched { copy, .. } => copy[i],
        }
    }

    /// What the path takes on operands of these shapes.
    fn elements(self, a: &[i64], b: &[i64]) -> MatmulElements {
        let mut e = MatmulElements::default();
        let n = |s: &[i64]| shape::numel(s).max(0) as u64;
        match self {
            MatmulPath::Direct => {}
            MatmulPath::Fold { copy, folded, transposed, squeezed } => {
                let (a, b) = match squeezed {
                    Some(0) if a.first() == Some(&1) => (&a[1..], b),
                    Some(1) if b.first() == Some(&1) => (a, &b[1..]),
                    _ => (a, b),
                };
                if copy {
                    e.copy[folded] = n([a, b][folded]);
                }
                if transposed {
                    // `mm`'s result, before its transposed copy (the output).
                    e.forward = shape::matmul(a, b).map_or(0, |o| n(&o));
                }
            }
            MatmulPath::Batched { copy, broadcast } => {
                let batch = shape::broadcast(leading(a), leading(b)).unwrap_or_default();
                for (i, s) in [a, b].into_iter().enumerate() {
                    let own = if s.len() >= 2 { n(&s[s.len() - 2..]) } else { n(s) };
                    let expanded = n(&batch) * own;
                    if copy[i] {
                        e.copy[i] = expanded;
                    }
                    // Its gradient is summed out of the expanded one: beside the sum, the rest.
                    if broadcast[i] {
                        e.expanded[i] = expanded.saturating_sub(n(s));
                    }
                }
            }
        }
        e
    }
}

/// `x @ weightᵀ + bias`. Operands: x, weight, optional bias. `copy`: the input's copy, where
/// libtorch folds it into a matrix by one ([`Linear::input_copy`]).
pub(crate) struct Linear {
    copy: Elements,
}

impl Linear {
    /// The copy `linear` makes of an input of three or more dimensions. A contiguous one with
    /// a bias is flattened for one `addmm`, a view; anything else runs `matmul(x, weightᵀ)`,
    /// which folds the input into a matrix, copied where its strides allow no view (a
    /// transposed convolution's output read as tokens), and saves the copy rather than the
    /// input. A frozen weight with such an input takes `matmul`'s batched path, not priced here.
    fn input_copy(x: &Meta, w: &Meta, bias: bool) -> Elements {
        if x.shape.len() < 3 || w.shape.len() != 2 || (bias && shape::is_contiguous(&x.shape, &x.strides)) {
            return Elements::ZERO;
        }
        let (wt_shape, wt_strides) = ([w.shape[1], w.shape[0]], [w.strides[1], w.strides[0]]);
        let path = MatmulPath::choose(
            (&x.shape, &x.strides, x.requires_grad),
            (&wt_shape, &wt_strides, w.requires_grad),
            None,
        );
        if !matches!(path, MatmulPath::Fold { copy: true, folded: 0, .. }) {
            return Elements::ZERO;
        }
        let n = |b: i64| shape::numel(&x.shape_at(b)).max(0) as u64;
        let per = n(2).saturating_sub(n(1));
        Elements::line(per, n(1).saturating_sub(per))
    }
}

impl Operation for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // The folded copy is what `mm` saves for the weight's gradient.
        if self.copy != Elements::ZERO {
            if requires(inputs, 1) && meta.requires_grad {
                calls.push(KernelCall::SavedCopy { elements: self.copy, kind: meta.kind });
            } else {
                calls.push(KernelCall::Temporaries { forward: self.copy, backward: Elements::ZERO });
            }
        }
        // The bias gradient: the output gradient summed over every dimension but the last.
        if requires(inputs, 2) && meta.requires_grad && !meta.shape.is_empty() {
            let mask = shape::dims_mask(0..meta.shape.len() - 1);
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
        // One `addmm` (or `mm`) of the input's rows by `weightᵀ`, a column-major view.
        let x = &inputs[0].meta;
        if x.shape.len() >= 2 {
            calls.push(KernelCall::Product(Product {
                out: meta,
                k: x.shape[x.shape.len() - 1],
                batched: false,
                b_column_major: true,
                grads: [requires(inputs, 0), requires(inputs, 1)],
            }));
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| factors_saved(i, 0, 1, inputs) && !(i == 0 && self.copy != Elements::ZERO))
            .grad_views(|i| {
                // The product runs on `weight.t()`: its gradient is transposed back, a view.
                i == 1
            })
            // Inputs of three or more dimensions are folded into a matrix for one product, whose
            // result is viewed as the output.
            .grad_reshape(match meta.shape.last() {
                Some(&p) if inputs[0].meta.shape.len() >= 3 => {
                    GradReshape::As(vec![shape::numel(&meta.shape) / p.max(1), p])
                }
                _ => GradReshape::AsItComes,
            })
            .grad_dense(true)
    }
}

impl Run for Linear {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        ins[0].f_linear(ins[1], ins.get(2).copied())
    }
}

/// `beta * input + alpha * (batch1 @ batch2)`. Operands: input, batch1, batch2.
pub(crate) struct Baddbmm {
    beta: f64,
    alpha: f64,
}

impl Operation for Baddbmm {
    fn name(&self) -> &'static str {
        "baddbmm"
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // A broadcast input's gradient: the output gradient summed to its shape.
        if requires(inputs, 0) && inputs[0].meta.shape != meta.shape {
            let mask = shape::broadcast_mask(&inputs[0].meta.shape, &meta.shape);
            calls.push(KernelCall::Reduction { of: meta, mask, backward: true });
        }
    }

    fn facts(&self, inputs: &[Rc<Node>], meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|i| factors_saved(i, 1, 2, inputs))
            .grad_aliases(|i| {
                // autograd hands `input` the output's gradient itself when it is not scaled or summed.
                i == 0 && self.beta == 1.0 && inputs[0].meta.shape == meta.shape
            })
            .grad_dense(true)
    }
}

impl Run for Baddbmm {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (input, batch1, batch2) = (ins[0], ins[1], ins[2]);
        input.f_baddbmm(batch1, batch2, self.beta, self.alpha)
    }
}

/// Rows of a weight picked by indices (a one-hot product). Operands: weight, indices.
pub(crate) struct Embedding {
    padding_idx: i64,
    scale_grad_by_freq: bool,
}

impl Operation for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len()).saves(|i| {
            // The indices, to scatter the gradient back.
            i == 1
        })
    }
}

impl Run for Embedding {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let (weight, indices) = (ins[0], ins[1]);
        Tensor::f_embedding(weight, indices, self.padding_idx, self.scale_grad_by_freq, false)
    }
}

/// libtorch's subscripts: `A`-`Z` are 0..26, `a`-`z` 26..52; an ellipsis is [`ELLIPSIS`].
const LETTERS: usize = 52;
const ELLIPSIS: usize = LETTERS;

/// An einsum equation read against its operands' ranks, laid out as libtorch's `einsum` lays
/// it out: one position per letter (and per dimension an ellipsis covers), the output's
/// first (`out` of them, in the output's order), then the contracted ones (an ellipsis left
/// out of the output first, then letters in subscript order).
struct Equation {
    /// Each operand's dimensions, as positions.
    dims: Vec<Vec<usize>>,
    /// How many positions the output has.
    out: usize,
    /// All positions.
    width: usize,
    /// Each position's name, for messages: its letter, or `...` and an index.
    names: Vec<String>,
}

fn subscript(c: u8) -> usize {
    if c.is_ascii_uppercase() {
        (c - b'A') as usize
    } else {
        (c - b'a') as usize + 26
    }
}

fn letter(s: usize) -> char {
    if s < 26 {
        (b'A' + s as u8) as char
    } else {
        (b'a' + (s - 26) as u8) as char
    }
}

impl Equation {
    /// Reads `equation` as libtorch does (its errors, as far as they are the equation's; a
    /// letter repeated within one operand, a diagonal, is refused as `Unsupported`).
    fn parse(equation: &str, ranks: &[usize]) -> Result<Equation, LazyError> {
        let name = "einsum";
        let err = |reason: String| LazyError::Argument { op: name.into(), shape: Vec::new(), reason };
        let bytes = equation.as_bytes();
        let arrow = equation.find("->");
        let lhs = &bytes[..arrow.unwrap_or(bytes.len())];
        let n = ranks.len();
        let mut labels: Vec<Vec<usize>> = vec![Vec::new(); n];
        let (mut current, mut ellipsis_here) = (0usize, false);
        let mut i = 0;
        while i < lhs.len() {
            match lhs[i] {
                b' ' => {}
                b'.' => {
                    if ellipsis_here {
                        return Err(err(format!(
                            "found '.' for operand {current} for which an ellipsis was already found"
                        )));
                    }
                    if !(i + 2 < lhs.len() && lhs[i + 1] == b'.' && lhs[i + 2] == b'.') {
                        return Err(err(format!("found '.' for operand {current} that is not part of any ellipsis")));
                    }
                    i += 2;
                    labels[current].push(ELLIPSIS);
                    ellipsis_here = true;
                }
                b',' => {
                    current += 1;
                    if current >= n {
                        return Err(err("fewer operands were provided than specified in the equation".into()));
                    }
                    ellipsis_here = false;
                }
                c if c.is_ascii_alphabetic() => labels[current].push(subscript(c)),
                _ => {
                    return Err(err(format!(
                        "invalid subscript given at index {i} in the equation string, subscripts must be in [a-zA-Z]"
                    )))
                }
            }
            i += 1;
        }
        if current != n - 1 {
            return Err(err("more operands were provided than specified in the equation".into()));
        }
        let mut count = [0usize; LETTERS];
        let mut ellipsis = 0usize;
        for (k, ls) in labels.iter().enumerate() {
            let has = ls.contains(&ELLIPSIS);
            let named = ls.len() - usize::from(has);
            for &l in ls.iter().filter(|&&l| l < LETTERS) {
                count[l] += 1;
            }
            if has && named <= ranks[k] {
                ellipsis = ellipsis.max(ranks[k] - named);
            }
            if (has && named > ranks[k]) || (!has && named != ranks[k]) {
                return Err(err(format!(
                    "the number of subscripts in the equation ({named}) {} the number of dimensions ({}) for operand {k}{}",
                    if has { "is more than" } else { "does not match" },
                    ranks[k],
                    if has { "" } else { " and no ellipsis was given" }
                )));
            }
        }
        let mut pos = [usize::MAX; LETTERS];
        let (mut width, mut ellipsis_at, mut ellipsis_out) = (0usize, 0usize, false);
        match arrow {
            None => {
                // The output: the ellipsis, then the letters seen once, in subscript order.
                width = ellipsis;
                ellipsis_out = true;
                for l in (0..LETTERS).filter(|&l| count[l] == 1) {
                    pos[l] = width;
                    width += 1;
                }
            }
            Some(a) => {
                let rhs = &bytes[a + 2..];
                let mut i = 0;
                while i < rhs.len() {
                    match rhs[i] {
                        b' ' => {}
                        b'.' => {
                            if ellipsis_out {
                                return Err(err("found '.' for output but an ellipsis (...) was already found".into()));
                            }
                            if !(i + 2 < rhs.len() && rhs[i + 1] == b'.' && rhs[i + 2] == b'.') {
                                return Err(err("found '.' for output that is not part of any ellipsis (...)".into()));
                            }
                            i += 2;
                            ellipsis_at = width;
                            width += ellipsis;
                            ellipsis_out = true;
                        }
                        c if c.is_ascii_alphabetic() => {
                            let l = subscript(c);
                            if count[l] == 0 || pos[l] != usize::MAX {
                                return Err(err(format!(
                                    "output subscript {} {}",
                                    c as char,
                                    if pos[l] != usize::MAX {
                                        "appears more than once in the output"
                                    } else {
                                        "does not appear in the equation for any input operand"
                                    }
                                )));
                            }
                            pos[l] = width;
                            width += 1;
                        }
                        _ => {
                            return Err(err(format!(
                                "invalid subscript given at index {} in the equation string, subscripts must be in [a-zA-Z]",
                                lhs.len() + 2 + i
                            )))
                        }
                    }
                    i += 1;
                }
            }
        }
        let out = width;
        if !ellipsis_out {
            ellipsis_at = width;
            width += ellipsis;
        }
        for l in 0..LETTERS {
            if count[l] > 0 && pos[l] == usize::MAX {
                pos[l] = width;
                width += 1;
            }
        }
        let mut names = vec![String::new(); width];
        for l in (0..LETTERS).filter(|&l| pos[l] != usize::MAX) {
            names[pos[l]] = letter(l).to_string();
        }
        for j in 0..ellipsis {
            names[ellipsis_at + j] = format!("... (dimension {j} of {ellipsis})");
        }
        let mut dims = Vec::with_capacity(n);
        for (k, ls) in labels.iter().enumerate() {
            let mut d = Vec::with_capacity(ranks[k]);
            for &l in ls {
                if l == ELLIPSIS {
                    let covered = ranks[k] + 1 - ls.len();
                    d.extend((ellipsis - covered..ellipsis).map(|j| ellipsis_at + j));
                } else {
                    if d.contains(&pos[l]) {
                        return Err(LazyError::Unsupported {
                            op: name.into(),
                            reason: format!(
                                "subscript {} is repeated in operand {k} (a diagonal), which is not recorded; take \
                                 the diagonal first or write it out with other ops",
                                letter(l)
                            ),
                        });
                    }
                    d.push(pos[l]);
                }
            }
            dims.push(d);
        }
        Ok(Equation { dims, out, width, names })
    }

    /// Each position's size (1 where every operand has 1 there: sizes of 1 broadcast), or why
    /// the operands' sizes do not fit.
    fn sizes(&self, nodes: &[&Rc<Node>]) -> Result<Vec<i64>, LazyError> {
        let mut size = vec![1i64; self.width];
        for (k, n) in nodes.iter().enumerate() {
            for (d, &p) in self.dims[k].iter().enumerate() {
                let s = n.meta.shape[d];
                if s != 1 {
                    if size[p] != 1 && size[p] != s {
                        return Err(shape_err(
                            "einsum",
                            &nodes[0].meta.shape,
                            &n.meta.shape,
                            format!(
                                "subscript {} has size {s} for operand {k} which does not broadcast with previously \
                                 seen size {}",
                                self.names[p], size[p]
                            ),
                        ));
                    }
                    size[p] = s;
                }
            }
        }
        Ok(size)
    }

    /// The einsum's batch rule: where the batch lands in the output, or why it mixes samples.
    fn flow(&self, nodes: &[&Rc<Node>]) -> Result<(Flow, Option<String>), LazyError> {
        let name = "einsum";
        let batch_err = |j: usize, k: usize, reason: String| LazyError::Batch {
            op: name.into(),
            lhs: nodes[j].meta.shape.to_vec(),
            rhs: nodes[k].meta.shape.to_vec(),
            reason,
        };
        // The first batched operand, its batch's position, and its batch.
        let mut first: Option<(usize, usize, BatchDim)> = None;
        let (mut sums, mut maxes, mut opaque, mut apart) = (0, 0, false, None);
        for (k, n) in nodes.iter().enumerate() {
            match n.meta.flow {
                Flow::PerSample(bd) => {
                    let p = self.dims[k][bd.dim];
                    match first {
                        None => first = Some((k, p, bd)),
                        Some((j, q, f)) => {
                            if (f.size, f.factor) != (bd.size, bd.factor) {
                                return Err(batch_err(
                                    j,
                                    k,
                                    format!(
                                        "batch sizes {} and {} differ (inputs wrapped by different lazy() calls?)",
                                        f.size, bd.size
                                    ),
                                ));
                            }
                            if p != q && apart.is_none() {
                                apart = Some(format!(
                                    "pairs the samples of operand {j} (along subscript {}) with those of operand {k} \
                                     (along {}): each result mixes samples",
                                    self.names[q], self.names[p]
                                ));
                            }
                        }
                    }
                }
                Flow::Sum => sums += 1,
                Flow::Max => maxes += 1,
                Flow::Opaque => opaque = true,
                Flow::Fixed => {}
            }
        }
        if opaque {
            return Ok((Flow::Opaque, None));
        }
        let Some((j, p, bd)) = first else {
            return Ok(if maxes > 0 {
                (Flow::Opaque, Some("is applied to a maximum over the batch".into()))
            } else if sums > 1 {
                (Flow::Opaque, Some("multiplies values reduced over the batch, which is not linear".into()))
            } else if sums == 1 {
                (Flow::Sum, None)
            } else {
                (Flow::Fixed, None)
            });
        };
        // A fixed operand with the batch's size along the batch's subscript would meet every
        // micro-batch whole: almost surely per-sample data that was not wrapped.
        let full = bd.size * bd.factor;
        for (k, n) in nodes.iter().enumerate().filter(|(_, n)| n.meta.flow == Flow::Fixed) {
            if full > 1 && self.dims[k].iter().zip(&n.meta.shape).any(|(&q, &s)| q == p && s == full) {
                return Err(batch_err(
                    j,
                    k,
                    format!(
                        "operand {k} is not batched but has the batch's size {full} along subscript {}; wrap it \
                         with toma::lazy::lazy(.., dim) so it is split with the batch",
                        self.names[p]
                    ),
                ));
            }
        }
        if let Some(reason) = apart {
            return Ok((Flow::Opaque, Some(reason)));
        }
        if p >= self.out {
            let reason = format!(
                "sums the batch's subscript {} away (it is not in the output): each result mixes every sample",
                self.names[p]
            );
            return Ok((Flow::Opaque, Some(reason)));
        }
        let flow = Flow::PerSample(BatchDim { dim: p, ..bd });
        if sums + maxes > 0 {
            return Ok((flow, Some("combines per-sample values with a value reduced over the batch".into())));
        }
        Ok((flow, None))
    }
}

/// The flow of an internal step of `einsum` from its operands' (`kept`: where the batch lands,
/// when it does): once the batch is contracted or two batches meet, the step depends on the
/// batch as a whole (the einsum's own node says why).
fn step_flow(inputs: &[&Rc<Node>], kept: Option<BatchDim>) -> Flow {
    let flows = || inputs.iter().map(|n| n.meta.flow);
    if flows().any(|f| matches!(f, Flow::Opaque | Flow::Max)) {
        return Flow::Opaque;
    }
    if let Some(bd) = kept {
        return Flow::PerSample(bd);
    }
    let sums = flows().filter(|f| *f == Flow::Sum).count();
    if flows().any(|f| matches!(f, Flow::PerSample(_))) || sums > 1 {
        Flow::Opaque
    } else if sums == 1 {
        Flow::Sum
    } else {
        Flow::Fixed
    }
}

/// `t` permuted (nothing recorded for the identity).
fn permuted(t: &LazyTensor, dims: &[usize]) -> Result<LazyTensor, LazyError> {
    if dims.iter().enumerate().all(|(i, &d)| i == d) {
        return Ok(t.clone());
    }
    t.f_permute(dims.iter().map(|&d| d as i64).collect::<Vec<_>>())
}

/// libtorch's reshape of a permuted operand into `bmm`'s three dimensions, each the product of
/// a group of `groups[g]` dimensions (a view where the strides allow, else a copy). The batch
/// lands in its group's dimension: outermost there when the dimensions before it in the group
/// have size 1, interleaved otherwise (`[i, N] -> [i * N]`). Either way only the sizes at a
/// micro-batch are read of this value, and they are `b` times the group's other sizes. An
/// interleaved batch is always copied: a micro-batch narrowed out of the batch keeps the full
/// batch's strides, which no view merges across.
fn folded(t: &LazyTensor, to: [i64; 3], groups: [usize; 3]) -> LazyTensor {
    let n = t.node();
    let m = &n.meta;
    let mut interleaved = false;
    let flow = match m.flow {
        Flow::PerSample(bd) => {
            let starts = [0, groups[0], groups[0] + groups[1]];
            let g = if bd.dim < starts[1] {
                0
            } else if bd.dim < starts[2] {
                1
            } else {
                2
            };
            interleaved = shape::numel(&m.shape[starts[g]..bd.dim]) != 1;
            if bd.size > 0 && to[g] % bd.size == 0 {
                Flow::PerSample(BatchDim { dim: g, size: bd.size, factor: to[g] / bd.size })
            } else {
                Flow::Opaque
            }
        }
        other => other,
    };
    let (inputs, shape) = (vec![n.clone()], to.to_vec());
    match shape::view_strides(&m.shape, &m.strides, &to).filter(|_| !interleaved) {
        Some(strides) => {
            Record::new(View("view"), inputs, shape, m.kind, m.device).flow((flow, None)).view(strides).finish()
        }
        None => Record::new(Rearrange::Reshape, inputs, shape, m.kind, m.device).flow((flow, None)).finish(),
    }
}

/// libtorch's `sumproduct_pair` (keeping every dimension): `(left * right)` summed over
/// `sum_dims`, both operands laid out on the same positions. Without dimensions to sum, a
/// broadcast `mul`; else both permuted and reshaped for one `bmm` (`[lro, lo, sum] @ [lro,
/// sum, ro]`: the positions in both, in `left` only, in `right` only), its result viewed back
/// and permuted into place.
fn sum_product(left: &LazyTensor, right: &LazyTensor, sum_dims: &[usize]) -> Result<LazyTensor, LazyError> {
    if sum_dims.is_empty() {
        return left.f_mul(right);
    }
    let (mut left, mut right) = (left.clone(), right.clone());
    let dim = left.dim();
    let (mut lro, mut lo, mut ro) = (Vec::new(), Vec::new(), Vec::new());
    let (mut lro_size, mut lo_size, mut ro_size, mut sum_size) = (1i64, 1i64, 1i64, 1i64);
    for i in 0..dim {
        let (l, r) = (left.size()[i], right.size()[i]);
        if sum_dims.contains(&i) {
            // A dimension in one operand only is summed right away.
            if l != 1 && r != 1 {
                sum_size *= l;
            } else if l != 1 {
                left = left.f_sum_dim_intlist([i as i64], true, None)?;
            } else if r != 1 {
                right = right.f_sum_dim_intlist([i as i64], true, None)?;
            }
        } else if l != 1 && r != 1 {
            lro.push(i);
            lro_size *= l;
        } else if l != 1 {
            lo.push(i);
            lo_size *= l;
        } else {
            ro.push(i);
            ro_size *= r;
        }
    }
    let (ls, rs) = (left.size(), right.size());
    let mut out_size: Vec<i64> = lro.iter().chain(&lo).map(|&d| ls[d]).collect();
    out_size.extend(sum_dims.iter().map(|_| 1));
    out_size.extend(ro.iter().map(|&d| rs[d]));
    let order: Vec<usize> = lro.iter().chain(&lo).chain(sum_dims).chain(&ro).copied().collect();
    let left_order = order.clone();
    let right_order: Vec<usize> = lro.iter().chain(sum_dims).chain(&ro).chain(&lo).copied().collect();
    // Where the batch is before the product (positions are shared by both operands).
    let batch_at = left.meta().batch().or(right.meta().batch());
    let a = folded(&permuted(&left, &left_order)?, [lro_size, lo_size, sum_size], [lro.len(), lo.len(), 0]);
    let b = folded(&permuted(&right, &right_order)?, [lro_size, sum_size, ro_size], [lro.len(), sum_dims.len(), 0]);
    let (an, bn) = (a.node(), b.node());
    let kept = match (an.meta.batch(), bn.meta.batch()) {
        (Some(x), None) if x.dim < 2 => Some(x),
        (None, Some(y)) if y.dim != 1 => Some(y),
        (Some(x), Some(y)) if x.dim == 0 && x == y => Some(x),
        _ => None,
    };
    let product =
        Record::new(Matmul::bmm(), inputs_of([an, bn]), [lro_size, lo_size, ro_size], an.meta.kind, an.meta.device)
            .flow((step_flow(&[an, bn], kept), None))
            .finish();
    // Viewed as `[lro, lo, 1 per summed dimension, ro]`: the batch at its own position again.
    let p = product.node();
    let unfold_flow = match (p.meta.flow, batch_at) {
        (Flow::PerSample(_), Some(bd)) => match order.iter().position(|&d| d == bd.dim) {
            Some(at) => Flow::PerSample(BatchDim { dim: at, ..bd }),
            None => Flow::Opaque,
        },
        (flow, _) => flow,
    };
    let strides = shape::view_strides(&p.meta.shape, &p.meta.strides, &out_size).expect("a contiguous product views");
    let unfolded = Record::new(View("view"), inputs_of([p]), out_size, p.meta.kind, p.meta.device)
        .flow((unfold_flow, None))
        .view(strides)
        .finish();
    let mut back = vec![0usize; dim];
    for (i, &d) in order.iter().enumerate() {
        back[d] = i;
    }
    permuted(&unfolded, &back)
}

#[toma_macros::tensor_methods(
    MatrixOps,
    "Matrix products and linear layers (a family of [`TensorOps`](crate::lazy::TensorOps))."
)]
impl LazyTensor {
    /// The outer product of two vectors, as tch's `outer`: `self[i] * other[j]` (libtorch's
    /// composite: `self` as a column, times `other`).
    ///
    /// # Errors
    /// [`LazyError::Shape`] unless both are 1-D.
    pub fn f_outer(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node().meta.shape, &other.node().meta.shape);
        if a.len() != 1 || b.len() != 1 {
            return Err(LazyError::Shape {
                op: "outer".into(),
                lhs: a.to_vec(),
                rhs: b.to_vec(),
                reason: "both operands must be vectors (1-D)".into(),
            });
        }
        self.f_unsqueeze(1)?.f_mul(&other)
    }

    /// The product of two matrices, as tch's `mm`: both operands 2-D.
    ///
    /// # Errors
    /// [`LazyError::Shape`] unless both are 2-D and fit; as [`f_matmul`](Self::f_matmul).
    pub fn f_mm(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let (a, b) = (&self.node().meta.shape, &other.node().meta.shape);
        if a.len() != 2 || b.len() != 2 {
            return Err(LazyError::Shape {
                op: "mm".into(),
                lhs: a.to_vec(),
                rhs: b.to_vec(),
                reason: "both operands must be matrices (2-D); use matmul for others".into(),
            });
        }
        self.f_matmul(&other)
    }

    /// Matrix product with `torch.matmul`'s rules: 1-D operands, batched and broadcast
    /// leading dimensions.
    ///
    /// A batch dimension among the leading dimensions, the rows of `self` or the columns of
    /// `other` stays per-sample. One contracted over (both operands per-sample along the
    /// contracted dimension, as in `xᵀ y`) is a sum over the batch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the shapes cannot be multiplied, [`LazyError::Kind`] for
    /// different kinds, [`LazyError::Device`].
    pub fn f_matmul(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let mut pair = [self.node().clone(), other.node().clone()];
        if pair.iter().all(|n| n.meta.shape.len() >= 3) {
            // A parameter expanded to the batch (cross-attention's learned queries) meets
            // batched values here: per sample, as in `+` and `cat`.
            let out_len = pair[0].meta.shape.len().max(pair[1].meta.shape.len());
            adopt_batch_broadcasts(&mut pair, out_len, true);
        }
        let (a, b) = (&pair[0], &pair[1]);
        let name = "matmul";
        let device = same_device(name, &[a, b])?;
        let (sa, sb) = (&a.meta.shape, &b.meta.shape);
        let out = shape::matmul(sa, sb).map_err(|r| shape_err(name, sa, sb, r))?;
        same_kind(name, a, b)?;
        let lhs_nd = sa.len().max(2);
        let rhs_nd = sb.len().max(2);
        let out_batch_nd = lhs_nd.max(rhs_nd) - 2;
        // Where each operand's batch dimension lands: Ok(Some(dim)), or Err(()) when contracted.
        let role = |n: &Node, lhs: bool| -> Option<Result<usize, ()>> {
            let bd = n.meta.batch()?;
            let nd = n.meta.shape.len();
            Some(if nd == 1 {
                Err(())
            } else if bd.dim < nd - 2 {
                Ok(out_batch_nd - (nd - 2) + bd.dim)
            } else if lhs {
                if bd.dim == nd - 2 {
                    Ok(out_batch_nd)
                } else {
                    Err(())
                }
            } else if bd.dim == nd - 1 {
                Ok(out.len() - 1)
            } else {
                Err(())
            })
        };
        let roles = [role(a, true), role(b, false)];
        let contracted: Vec<usize> = (0..2).filter(|&i| matches!(roles[i], Some(Err(())))).collect();
        let per_sample = (0..2).filter(|&i| roles[i].is_some()).count();
        let inputs = [a, b];
        let flow = if !contracted.is_empty() && contracted.len() == per_sample {
            // xᵀ y over the batch: a sum of per-sample products.
            if per_sample == 1 {
                let i = contracted[0];
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.to_vec(),
                    rhs: sb.to_vec(),
                    reason: format!(
                        "operand {} contracts over its batch dimension against a fixed operand; wrap both with lazy(..)",
                        i + 1
                    ),
                });
            }
            let (ba, bb) = (a.meta.batch().expect("per-sample"), b.meta.batch().expect("per-sample"));
            if ba.size != bb.size || ba.factor != bb.factor {
                return Err(LazyError::Batch {
                    op: name.into(),
                    lhs: sa.to_vec(),
                    rhs: sb.to_vec(),
                    reason: format!("batch sizes {} and {} differ", ba.size * ba.factor, bb.size * bb.factor),
                });
            }
            if [a, b].iter().any(|n| matches!(n.meta.flow, Flow::Sum | Flow::Max | Flow::Opaque)) {
                (Flow::Opaque, Some("`matmul` contracts the batch of a value already reduced over it".to_string()))
            } else {
                (Flow::Sum, None)
            }
        } else {
            let mapped: Vec<Option<usize>> = roles.iter().map(|r| r.and_then(|r| r.ok())).collect();
            let flow = combine_flows(name, &inputs, &mapped, &out, Linearity::Scaling { divisor: None }, false)?;
            // A fixed operand broadcast against the batch along the leading dimensions.
            if let Flow::PerSample(bd) = flow.0 {
                if bd.dim < out_batch_nd {
                    for n in inputs.iter().filter(|n| n.meta.flow == Flow::Fixed) {
                        let nd = n.meta.shape.len().max(2) - 2;
                        let at = bd.dim as i64 - (out_batch_nd as i64 - nd as i64);
                        if at >= 0 && n.meta.shape[at as usize] == bd.size * bd.factor && bd.size * bd.factor > 1 {
                            return Err(LazyError::Batch {
                                op: name.into(),
                                lhs: sa.to_vec(),
                                rhs: sb.to_vec(),
                                reason: super::NOT_WRAPPED.into(),
                            });
                        }
                    }
                }
            }
            flow
        };
        Ok(Record::new(Matmul::product(&a.meta, &b.meta), inputs_of([a, b]), out, a.meta.kind, device)
            .flow(flow)
            .finish())
    }

    /// Batched matrix product, as tch's `bmm`: `self` `[B, n, m]` by `other` `[B, m, p]`. The
    /// batch may be `B`, the rows of `self` or the columns of `other`; contracting over it
    /// mixes samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for other shapes, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_bmm(&self, other: impl IntoLazy) -> Result<LazyTensor, LazyError> {
        let other = other.into_lazy();
        let mut pair = [self.node().clone(), other.node().clone()];
        if pair.iter().all(|n| n.meta.shape.len() == 3) {
            adopt_batch_broadcasts(&mut pair, 3, true);
        }
        let (a, b) = (&pair[0], &pair[1]);
        let name = "bmm";
        let device = same_device(name, &[a, b])?;
        let (sa, sb) = (&a.meta.shape, &b.meta.shape);
        if sa.len() != 3 || sb.len() != 3 || sa[0] != sb[0] || sa[2] != sb[1] {
            return Err(shape_err(name, sa, sb, "expected [B, n, m] and [B, m, p]"));
        }
        same_kind(name, a, b)?;
        let out = vec![sa[0], sa[1], sb[2]];
        let mapped = [
            a.meta.batch().and_then(|bd| (bd.dim < 2).then_some(bd.dim)),
            b.meta.batch().and_then(|bd| (bd.dim != 1).then_some(bd.dim)),
        ];
        let along_b = mapped.iter().flatten().any(|&d| d == 0);
        let flow = combine_flows(name, &[a, b], &mapped, &out, Linearity::Nonlinear, along_b)?;
        Ok(Record::new(Matmul::bmm(), inputs_of([a, b]), out, a.meta.kind, device).flow(flow).finish())
    }

    /// `self @ weightᵀ + bias`, as tch's `linear`: `self` is `[.., in]`, `weight` `[out, in]`,
    /// `bias` `[out]`.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not match, [`LazyError::Kind`], [`LazyError::Device`].
    pub fn f_linear(
        &self,
        #[fixed] weight: impl IntoLazy,
        #[fixed] bias: Option<impl IntoLazy>,
    ) -> Result<LazyTensor, LazyError> {
        let (w, b) = (weight.into_lazy(), bias.map(IntoLazy::into_lazy));
        let x = self.node();
        let name = "linear";
        // The most common op: its operands listed without an allocation.
        let (wn, bn) = (w.node(), b.as_ref().map(LazyTensor::node));
        let all = [x, wn, bn.unwrap_or(wn)];
        let nodes = &all[..if bn.is_some() { 3 } else { 2 }];
        let device = same_device(name, nodes)?;
        let (sx, sw) = (&x.meta.shape, &wn.meta.shape);
        if sx.is_empty() || sw.len() != 2 || sx[sx.len() - 1] != sw[1] {
            return Err(shape_err(name, sx, sw, "expected input [.., in] and weight [out, in]"));
        }
        if let Some(b) = &b {
            if b.node().meta.shape != [sw[0]] {
                return Err(shape_err(name, sw, &b.node().meta.shape, format!("bias must have shape [{}]", sw[0])));
            }
            same_kind(name, x, b.node())?;
        }
        same_kind(name, x, w.node())?;
        floating(name, x)?;
        let mut out = sx.clone();
        *out.last_mut().expect("non-empty") = sw[0];
        // Only the input's batch maps to the output (a batched weight mixes samples).
        let mut mapped = [None; 3];
        mapped[0] = x.meta.batch().filter(|bd| bd.dim + 1 < sx.len()).map(|bd| bd.dim);
        let flow = combine_flows(name, nodes, &mapped[..nodes.len()], &out, Linearity::Nonlinear, false)?;
        let inputs = inputs_of(nodes.iter().copied());
        let linear = Linear { copy: Linear::input_copy(&x.meta, &wn.meta, bn.is_some()) };
        Ok(Record::new(linear, inputs, out, x.meta.kind, device).flow(flow).finish())
    }

    /// `beta * self + alpha * (batch1 @ batch2)`, as tch's `baddbmm`: `batch1` is `[B, n, m]`,
    /// `batch2` `[B, m, p]`, and `self` broadcasts to `[B, n, p]`. The batch may be the
    /// product's `B`, the rows of `batch1` or the columns of `batch2`; contracting over it mixes
    /// samples.
    ///
    /// # Errors
    /// [`LazyError::Shape`] when the sizes do not fit, [`LazyError::Kind`] for different or
    /// non-floating kinds, [`LazyError::Device`].
    pub fn f_baddbmm(
        &self,
        batch1: impl IntoLazy,
        batch2: impl IntoLazy,
        beta: f64,
        alpha: f64,
    ) -> Result<LazyTensor, LazyError> {
        let (b1, b2) = (batch1.into_lazy(), batch2.into_lazy());
        let (x, m1, m2) = (self.node(), b1.node(), b2.node());
        let name = "baddbmm";
        let nodes = [x, m1, m2];
        let device = same_device(name, &nodes)?;
        let (s1, s2) = (&m1.meta.shape, &m2.meta.shape);
        if s1.len() != 3 || s2.len() != 3 {
            return Err(shape_err(name, s1, s2, "batch1 and batch2 must be 3-D"));
        }
        if s1[0] != s2[0] || s1[2] != s2[1] {
            return Err(shape_err(name, s1, s2, "expected batch1 [B, n, m] and batch2 [B, m, p]"));
        }
        let out = vec![s1[0], s1[1], s2[2]];
        match shape::broadcast(&x.meta.shape, &out) {
            Ok(b) if b == out => {}
            _ => return Err(shape_err(name, &x.meta.shape, &out, format!("the input must broadcast to {out:?}"))),
        }
        floating(name, m1)?;
        same_kind(name, m1, m2)?;
        same_kind(name, m1, x)?;
        let offset = 3 - x.meta.shape.len();
        let mapped = [
            x.meta.batch().map(|bd| bd.dim + offset),
            m1.meta.batch().and_then(|bd| (bd.dim < 2).then_some(bd.dim)),
            m2.meta.batch().and_then(|bd| (bd.dim != 1).then_some(bd.dim)),
        ];
        // A fixed operand the size of the batch is checked where the batch is the product's B.
        let along_b = mapped.iter().flatten().any(|&d| d == 0);
        let flow = combine_flows(name, &nodes, &mapped, &out, Linearity::Nonlinear, along_b)?;
        let inputs = inputs_of(nodes);
        Ok(Record::new(Baddbmm { beta, alpha }, inputs, out, m1.meta.kind, device).flow(flow).finish())
    }

    /// Rows of `weight` (`[V, D]`) picked by the integer `indices` (`self`'s role in tch is the
    /// weight: this is `Tensor::embedding(weight, indices, ..)`); the output is
    /// `indices.size() + [D]`. A static method, as in tch.
    ///
    /// # Errors
    /// [`LazyError::Shape`] for a weight that is not 2-D, [`LazyError::Kind`] for non-integer
    /// indices, [`LazyError::Device`]; [`LazyError::Unsupported`] for `sparse` gradients (not
    /// planned: use dense ones).
    #[lazy_only]
    #[no_twin]
    pub fn f_embedding(
        #[fixed] weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> Result<LazyTensor, LazyError> {
        let name = "embedding";
        if sparse {
            return Err(LazyError::Unsupported {
                op: name.into(),
                reason: "sparse gradients are not planned; use dense ones (sparse = false)".into(),
            });
        }
        // Indices computed at once (a closure on a `Tensor`): what the recorded op would run.
        if let (Some(w), Some(i)) = (weight.eager_operand(), indices.eager_operand()) {
            if weight.computed_at_once() || indices.computed_at_once() {
                return super::eager(name, Tensor::f_embedding(w, i, padding_idx, scale_grad_by_freq, false));
            }
        }
        let (w, i) = (weight.into_lazy(), indices.into_lazy());
        let (wn, inn) = (w.node(), i.node());
        let device = same_device(name, &[wn, inn])?;
        if wn.meta.shape.len() != 2 {
            return Err(shape_err(name, &wn.meta.shape, &inn.meta.shape, "the weight must be 2-D"));
        }
        if !matches!(inn.meta.kind, Kind::Int64 | Kind::Int) {
            return Err(kind_err(name, inn.meta.kind, &inn.meta.shape, "indices must be Int64 or Int"));
        }
        let mut out = inn.meta.shape.clone();
        out.push(wn.meta.shape[1]);
        let mapped = [None, inn.meta.batch().map(|bd| bd.dim)];
        let (flow, mut mixes) = combine_flows(name, &[wn, inn], &mapped, &out, Linearity::Nonlinear, false)?;
        if scale_grad_by_freq && inn.meta.batch().is_some() {
            mixes = Some("with scale_grad_by_freq scales gradients by counts over the batch".into());
        }
        let op = Embedding { padding_idx, scale_grad_by_freq };
        Ok(Record::new(op, inputs_of([wn, inn]), out, wn.meta.kind, device).flow((flow, mixes)).finish())
    }

    /// A sum of products over subscripts, as tch's `Tensor::einsum` (a static method, as in
    /// tch): recorded as libtorch computes it, each operand permuted into place, then pairs
    /// contracted by `bmm` (left to right, or in `path`'s order), so its memory is its parts'
    /// (the table shows the last part, a view of the product).
    ///
    /// Explicit (`"bij,jk->bik"`) and implicit (`"bij,jk"`) outputs, ellipses (`"...ij,jk"`)
    /// and subscripts of size 1 that broadcast, as in libtorch. A `Tensor` operand enters as
    /// [`LazyTensor::fixed`]; all operands share one kind.
    ///
    /// Micro-batches: the batch's subscript (the one at a batched operand's batch dimension)
    /// kept in the output makes the result per sample, its batch dimension where that
    /// subscript lands; batched operands must agree on that subscript. Summed away, or two
    /// batches on different subscripts, the result mixes samples and a split is refused.
    ///
    /// # Errors
    /// [`LazyError::Argument`] for an equation that does not fit the operands or a bad `path`,
    /// [`LazyError::Shape`] for sizes that do not broadcast, [`LazyError::Kind`] for operands of
    /// different kinds, [`LazyError::Device`], [`LazyError::Batch`] for a fixed operand with the
    /// batch's size along its subscript; [`LazyError::Unsupported`] for a subscript repeated in
    /// one operand (a diagonal).
    #[lazy_only]
    #[no_twin]
    pub fn f_einsum<T: Borrow<LazyTensor>>(
        equation: &str,
        tensors: &[T],
        path: impl IntListOption,
    ) -> Result<LazyTensor, LazyError> {
        let name = "einsum";
        if let Some(values) = super::eager_values(tensors) {
            return super::eager(name, Tensor::f_einsum(equation, &values, path.as_option()));
        }
        let operands: Vec<LazyTensor> = tensors.iter().map(|t| t.borrow().clone()).collect();
        if operands.is_empty() {
            return Err(arg(name, &[], "must provide at least one operand"));
        }
        let nodes: Vec<&Rc<Node>> = operands.iter().map(|t| t.node()).collect();
        let device = same_device(name, &nodes)?;
        for n in &nodes[1..] {
            same_kind(name, nodes[0], n)?;
        }
        let ranks: Vec<usize> = nodes.iter().map(|n| n.meta.shape.len()).collect();
        let eq = Equation::parse(equation, &ranks).map_err(|e| match e {
            LazyError::Argument { op, reason, .. } => {
                LazyError::Argument { op, shape: nodes[0].meta.shape.to_vec(), reason }
            }
            other => other,
        })?;
        let sizes = eq.sizes(&nodes)?;
        let path = path.as_option().map(<[i64]>::to_vec);
        if let Some(p) = &path {
            let expected = if nodes.len() == 1 { 1 } else { 2 * (nodes.len() - 1) };
            if p.len() != expected {
                return Err(arg(
                    name,
                    &nodes[0].meta.shape,
                    format!(
                        "expected contraction path given in path parameter to have size {expected} but got {}",
                        p.len()
                    ),
                ));
            }
        }
        let flow = eq.flow(&nodes)?;
        let out_shape = sizes[..eq.out].to_vec();
        // Each operand unsqueezed to every position and permuted into place; how many
        // operands have each position at a size other than 1.
        let mut counts = vec![0usize; eq.width];
        let mut ops = VecDeque::with_capacity(operands.len());
        for (k, t) in operands.iter().enumerate() {
            let mut permutation = vec![usize::MAX; eq.width];
            for (d, &p) in eq.dims[k].iter().enumerate() {
                permutation[p] = d;
                counts[p] += usize::from(t.size()[d] != 1);
            }
            // Missing positions: new dimensions of size 1 at the end, in order.
            let mut t = t.clone();
            for (dim, v) in (ranks[k]..).zip(permutation.iter_mut().filter(|v| **v == usize::MAX)) {
                t = t.f_unsqueeze(dim as i64)?;
                *v = dim;
            }
            ops.push_back(permuted(&t, &permutation)?);
        }
        // Contract pairs: positions left in one operand only are summed first.
        let mut steps = path.as_deref().unwrap_or(&[]).chunks(2);
        while ops.len() > 1 {
            let (mut i, mut j) = (0usize, 1usize);
            if let Some(step) = steps.next() {
                let (a, b) = (step[0].min(step[1]), step[0].max(step[1]));
                if a == b || a < 0 || b >= ops.len() as i64 {
                    let why = if a == b {
                        "cannot contract an operand with itself"
                    } else {
                        "operand index is out of bounds"
                    };
                    return Err(arg(name, &nodes[0].meta.shape, format!("invalid contraction ({a}, {b}): {why}")));
                }
                (i, j) = (a as usize, b as usize);
            }
            let b = ops.remove(j).expect("in range");
            let a = ops.remove(i).expect("in range");
            let (sa, sb) = (a.size(), b.size());
            let (mut sum_dims, mut a_sum, mut b_sum) = (Vec::new(), Vec::new(), Vec::new());
            for d in eq.out..eq.width {
                if sa[d] != 1 && sb[d] != 1 {
                    counts[d] -= 1;
                    if counts[d] == 1 {
                        sum_dims.push(d);
                        counts[d] = 0;
                    }
                } else if counts[d] == 1 {
                    if sa[d] != 1 {
                        a_sum.push(d as i64);
                        counts[d] = 0;
                    } else if sb[d] != 1 {
                        b_sum.push(d as i64);
                        counts[d] = 0;
                    }
                }
            }
            let a = if a_sum.is_empty() { a } else { a.f_sum_dim_intlist(a_sum.as_slice(), true, None)? };
            let b = if b_sum.is_empty() { b } else { b.f_sum_dim_intlist(b_sum.as_slice(), true, None)? };
            let product = sum_product(&a, &b, &sum_dims)?;
            if path.is_some() {
                ops.push_back(product);
            } else {
                ops.push_front(product);
            }
        }
        let mut last = ops.pop_front().expect("one left");
        if eq.width > eq.out && operands.len() == 1 {
            let dims: Vec<i64> = (eq.out..eq.width).map(|d| d as i64).collect();
            last = last.f_sum_dim_intlist(dims.as_slice(), false, None)?;
        }
        // The contracted positions, all of size 1 now, viewed away.
        let n = last.node();
        let strides = shape::view_strides(&n.meta.shape, &n.meta.strides, &out_shape).expect("only ones are dropped");
        // libtorch's last step: the product viewed without its contracted dimensions (all of
        // size 1 by then), or itself; named `einsum`, it carries the einsum's batch rule.
        Ok(Record::new(View("einsum"), inputs_of([n]), out_shape, n.meta.kind, device)
            .flow(flow)
            .view(strides)
            .finish())
    }

    /// Like [`f_einsum`](Self::f_einsum), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn einsum<T: Borrow<LazyTensor>>(equation: &str, tensors: &[T], path: impl IntListOption) -> LazyTensor {
        Self::f_einsum(equation, tensors, path).or_panic()
    }

    /// Like [`f_embedding`](Self::f_embedding), panicking with its error.
    ///
    /// # Panics
    /// When the op cannot be recorded.
    #[track_caller]
    pub fn embedding(
        weight: impl IntoLazy,
        indices: impl IntoLazy,
        padding_idx: i64,
        scale_grad_by_freq: bool,
        sparse: bool,
    ) -> LazyTensor {
        Self::f_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse).or_panic()
    }
}

#[cfg(test)]
mod tests {
    use super::MatmulPath;
    use crate::lazy::shape::contiguous_strides;

    fn path(a: &[i64], b: &[i64], grads: (bool, bool)) -> MatmulPath {
        let (sa, sb) = (contiguous_strides(a), contiguous_strides(b));
        MatmulPath::choose((a, &sa, grads.0), (b, &sb, grads.1), None)
    }

    /// The paths libtorch's `_matmul_impl` takes, each checked against the allocator by
    /// `tests/lazy_peak.rs::one_matmul_at_a_time`.
    #[test]
    fn matmul_takes_libtorchs_paths() {
        assert_eq!(path(&[8, 16], &[16, 4], (true, true)), MatmulPath::Direct);
        // A batch times a weight: one `mm` on a view.
        let fold = MatmulPath::Fold { copy: false, folded: 0, transposed: false, squeezed: None };
        assert_eq!(path(&[8, 32, 16], &[16, 4], (true, true)), fold);
        // A matrix times a batch whose matrix requires a gradient: `(bᵀ aᵀ)ᵀ`, `b.mT()` copied.
        let transposed = MatmulPath::Fold { copy: true, folded: 1, transposed: true, squeezed: None };
        assert_eq!(path(&[32, 16], &[8, 16, 4], (true, true)), transposed);
        // ... and without: a batched product on a broadcast view.
        let batched = MatmulPath::Batched { copy: [false, false], broadcast: [true, false] };
        assert_eq!(path(&[32, 16], &[8, 16, 4], (false, true)), batched);
        // A leading 1 that requires a gradient is squeezed, then folded.
        let squeezed = MatmulPath::Fold { copy: false, folded: 0, transposed: false, squeezed: Some(1) };
        assert_eq!(path(&[8, 32, 16], &[1, 16, 4], (true, true)), squeezed);
        // Broadcast over two leading dimensions: the operand without them is copied; one
        // broadcast along its own size-1 dimensions is a view (its strides are 0).
        let copied = MatmulPath::Batched { copy: [true, false], broadcast: [true, false] };
        assert_eq!(path(&[1, 4, 8, 8], &[16, 4, 8, 2], (true, true)), copied);
        let viewed = MatmulPath::Batched { copy: [false, false], broadcast: [false, true] };
        assert_eq!(path(&[16, 4, 8, 8], &[1, 1, 8, 2], (true, true)), viewed);
    }

    /// Attention's heads, split by a transpose, cannot be viewed as a batch of matrices.
    #[test]
    fn transposed_heads_are_copied() {
        let (q, q_strides) = (vec![8i64, 4, 32, 16], vec![2048i64, 16, 64, 1]);
        let (k, k_strides) = (vec![8i64, 4, 16, 32], vec![2048i64, 16, 1, 64]);
        let p = MatmulPath::choose((&q, &q_strides, true), (&k, &k_strides, true), None);
        assert_eq!(p, MatmulPath::Batched { copy: [true, true], broadcast: [false, false] });
        assert!(p.copies(0) && p.copies(1));
        let e = p.elements(&q, &k);
        assert_eq!(e.copy, [8 * 4 * 32 * 16, 8 * 4 * 16 * 32]);
    }
}

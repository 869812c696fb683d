//! One micro-batch's forward: each node run on its inputs' values, a split sum weighted by
//! its share, each value dropped after its last use.

use tch::{Kind, TchError, Tensor};

use super::{torch, Chunk, TracedOp};
use crate::lazy::cost::CostModel;
use crate::lazy::error::LazyError;
use crate::lazy::graph::{Flow, RunCx, Share, Source};
use crate::lazy::plan::Compiled;

/// Whether `out`'s data lies inside `input`'s (a view of it).
pub(super) fn shares_storage(out: &Tensor, input: &Tensor) -> bool {
    let (o, i) = (out.data_ptr() as usize, input.data_ptr() as usize);
    if i == 0 || o == 0 {
        return false;
    }
    let span: i64 = input.size().iter().zip(input.stride()).map(|(s, st)| (s - 1).max(0) * st).sum::<i64>() + 1;
    let bytes = span as usize * input.kind().elt_size_in_bytes();
    o >= i && o < i + bytes.max(1)
}

/// Runs node `i` on the micro-batch, weighting what a split sum needs weighted.
pub(super) fn run_node(c: &Compiled, i: usize, ins: &[&Tensor], chunk: &Chunk<'_>) -> Result<Tensor, LazyError> {
    let node = &c.nodes[i];
    let err = torch(i, node.name());
    if let Some(Some(stand_in)) = chunk.stand_ins.get(i) {
        return match node.source() {
            // A whole input's stand-in is narrowed; a micro-batch's own slice already is.
            Some(Source::Input { dim, .. }) if stand_in.size().get(*dim) != Some(&node.rows(chunk.b)) => {
                stand_in.f_narrow(*dim as i64, node.rows(chunk.start), node.rows(chunk.b)).map_err(err)
            }
            Some(Source::Input { .. }) => Ok(stand_in.shallow_clone()),
            _ => Ok(stand_in.shallow_clone()),
        };
    }
    let cx = RunCx { meta: &node.meta, start: chunk.start, b: chunk.b };
    if chunk.split && c.global[i] {
        // A value summed over micro-batches: the op's own rewrite, if it has one.
        let share = Share {
            cx,
            frac: chunk.frac,
            den: chunk.dens.get(i).copied().flatten(),
            reduces_batch: node.inputs.iter().any(|x| x.meta.batch().is_some()),
        };
        if let Some(result) = node.op().and_then(|op| op.run_share(ins, node, &share)) {
            return result.map_err(err);
        }
        // `sum + fixed`: the fixed part must count once over all micro-batches.
        if node.facts.adds_fixed && node.inputs.iter().any(|x| x.meta.flow == Flow::Fixed) {
            let scaled: Vec<Tensor> = node
                .inputs
                .iter()
                .zip(ins)
                .map(
                    |(x, t)| {
                        if x.meta.flow == Flow::Fixed {
                            t.f_mul_scalar(chunk.frac)
                        } else {
                            Ok(t.shallow_clone())
                        }
                    },
                )
                .collect::<Result<_, _>>()
                .map_err(&err)?;
            let refs: Vec<&Tensor> = scaled.iter().collect();
            return node.run(&refs, &share.cx).map_err(err);
        }
        return node.run(ins, &share.cx).map_err(err);
    }
    node.run(ins, &cx).map_err(err)
}

/// A tensor the executor holds: a leaf's own, borrowed from the graph (a parameter is read in
/// place, as eager code reads it, and differentiated as itself), or one it made (an op's
/// output, a detached stand-in, an input's slice). Borrowing saves a handle and its release
/// per parameter and step.
pub(super) enum Held<'a> {
    Leaf(&'a Tensor),
    Owned(Tensor),
}

impl Held<'_> {
    pub(super) fn get(&self) -> &Tensor {
        match self {
            Held::Leaf(t) => t,
            Held::Owned(t) => t,
        }
    }

    /// The same tensor, for a micro-batch's own list.
    pub(super) fn share(&self) -> Held<'_> {
        match self {
            Held::Leaf(t) => Held::Leaf(t),
            Held::Owned(t) => Held::Owned(t.shallow_clone()),
        }
    }
}

impl std::ops::Deref for Held<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        self.get()
    }
}

impl std::borrow::Borrow<Tensor> for Held<'_> {
    fn borrow(&self) -> &Tensor {
        self.get()
    }
}

thread_local! {
    /// Graphs (structure, micro-batch) whose every output this thread saw match its shape rule.
    /// A graph of the same structure has the same shapes (its hash covers every node's), so
    /// later runs need not ask libtorch for each output's sizes.
    static SHAPES_CHECKED: std::cell::RefCell<Vec<(u64, i64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How many graphs [`SHAPES_CHECKED`] remembers.
pub(super) const SHAPES_CHECKED_MAX: usize = 64;

/// Runs the forward pass of one micro-batch, dropping each value after its last use.
pub(super) fn forward_chunk(
    c: &Compiled,
    chunk: &Chunk<'_>,
    mut trace: Option<&mut Vec<TracedOp>>,
) -> Result<Tensor, LazyError> {
    let n = c.len();
    let graph = (c.structure, chunk.b);
    let check = trace.is_some() || !SHAPES_CHECKED.with(|s| s.borrow().contains(&graph));
    let mut values: Vec<Option<Held<'_>>> = (0..n).map(|_| None).collect();
    // One list of inputs for every node, not one allocation each.
    let mut spare: Vec<&Tensor> = Vec::new();
    for i in 0..n {
        let node = &c.nodes[i];
        if trace.is_none() && chunk.stand_ins.get(i).is_none_or(Option::is_none) {
            // A fixed leaf, or an input whole: its own tensor, as a plain step reads it.
            if let Some(tensor) = node.whole(chunk.start, chunk.b) {
                values[i] = Some(Held::Leaf(tensor));
                continue;
            }
        }
        let out = {
            let mut ins = spare;
            ins.extend(c.inputs(i).map(|j| values[j].as_ref().expect("held until its last use").get()));
            let out = run_node(c, i, &ins, chunk)?;
            if check {
                let actual = out.size();
                if !node.meta.matches_at(chunk.b, &actual) {
                    let expected = node.meta.shape_at(chunk.b).to_vec();
                    return Err(LazyError::ShapeRule { node: i, op: node.name().into(), expected, actual });
                }
                if let Some(t) = trace.as_deref_mut() {
                    let leaf = node.is_source();
                    let view = leaf || ins.first().is_some_and(|x| shares_storage(&out, x));
                    let bytes = if view {
                        0
                    } else {
                        let block = CostModel::of(out.device()).block();
                        (out.numel() as u64 * out.kind().elt_size_in_bytes() as u64).div_ceil(block) * block
                    };
                    t.push(TracedOp { node: i, name: node.name().into(), shape: actual, bytes, held: Vec::new() });
                }
            }
            spare = recycle(ins);
            out
        };
        values[i] = Some(Held::Owned(out));
        for j in c.inputs(i) {
            if c.last_use[j] as usize == i {
                values[j] = None;
            }
        }
        if let Some(t) = trace.as_deref_mut() {
            t.last_mut().expect("pushed above").held = (0..n).filter(|&j| values[j].is_some()).collect();
        }
    }
    if check {
        SHAPES_CHECKED.with(|s| {
            let mut s = s.borrow_mut();
            if s.len() >= SHAPES_CHECKED_MAX {
                s.remove(0);
            }
            s.push(graph);
        });
    }
    Ok(match values[n - 1].take().expect("the output is held") {
        Held::Leaf(t) => t.shallow_clone(),
        Held::Owned(t) => t,
    })
}

/// An emptied list of borrows, its allocation kept for borrows of another lifetime (the
/// in-place collect reuses it: same size and alignment).
pub(super) fn recycle<'b>(mut list: Vec<&Tensor>) -> Vec<&'b Tensor> {
    list.clear();
    list.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// A loss's value as `f64`: a scalar read as it is (no kernel, as tch's `double_value`),
/// anything larger summed in `Double`.
pub(super) fn value_of(loss: &Tensor) -> Result<f64, TchError> {
    // A scalar in one question to libtorch (`numel` asks two and allocates the sizes).
    if loss.dim() == 0 || loss.numel() == 1 {
        return loss.f_double_value(&[]);
    }
    loss.f_sum(Kind::Double)?.f_double_value(&[])
}

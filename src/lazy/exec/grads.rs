//! Where gradients go: what a backward asks for, stand-ins of non-leaf operands, and the
//! sums into `.grad` or sent back through a value's own graph once.

use tch::{Kind, TchError, Tensor};

use super::forward::Held;

use crate::lazy::graph::Source;
use crate::lazy::plan::Compiled;

/// What a backward asks gradients of: one tensor per parameter, however many leaves hold it,
/// then the inputs that require a gradient.
///
/// A fixed operand computed eagerly from parameters (`&w * 2.0`; a view such as `w.tr()` is
/// recorded as an op on `w` instead) is not a leaf: micro-batches see a detached stand-in, whose
/// gradient is summed and sent back through the operand's own graph
/// once at the end (differentiating through it per micro-batch would count the parameters
/// behind it again). An input that requires a gradient (the user's own, or one computed from
/// parameters and wrapped with `lazy`) is asked per micro-batch for the gradient of its own
/// slice (a detached leaf in its place), not of the whole input, which would be the batch's
/// size, mostly zeros, for every micro-batch.
pub(super) struct Wrt<'a> {
    /// What autograd differentiates: a leaf parameter itself, a detached stand-in of another;
    /// the inputs whole (each micro-batch slices them: [`Wrt::sliced`]).
    pub(super) params: Vec<Held<'a>>,
    /// The tensors as the user holds them, where they are not `params`' own: the parameters
    /// that are not leaves.
    pub(super) originals: Vec<Option<&'a Tensor>>,
    /// By node: the stand-in a leaf reads instead of its tensor (empty when there is none).
    pub(super) stand_ins: Vec<Option<Tensor>>,
    /// `params[..n_params]` are the parameters.
    pub(super) n_params: usize,
    /// The inputs that require a gradient.
    pub(super) inputs: Vec<InputGrad>,
    /// The graph's nodes.
    pub(super) nodes: usize,
    /// Whether each original is a leaf (its gradient lands in its `.grad`).
    pub(super) leaf: Vec<bool>,
}

impl<'a> Wrt<'a> {
    pub(super) fn of(c: &'a Compiled) -> Wrt<'a> {
        // Sized once: each list would otherwise grow four times for a dozen parameters.
        let count = c.param.iter().enumerate().filter(|&(i, first)| *first == Some(i as u32)).count();
        let mut originals: Vec<Option<&Tensor>> = Vec::with_capacity(count);
        let mut params: Vec<Held<'a>> = Vec::with_capacity(count);
        // Whether each original is a leaf: as recorded (one question to libtorch a parameter).
        let mut leaf: Vec<bool> = Vec::with_capacity(count);
        let mut stand_ins: Vec<Option<Tensor>> = Vec::new();
        // Each parameter's position in `params`, at its first leaf.
        let mut slot: Vec<Option<usize>> = vec![None; c.len()];
        for (i, first) in c.param.iter().enumerate() {
            let Some(first) = first.map(|f| f as usize) else { continue };
            if first == i {
                let Some(Source::Leaf { tensor, param: Some(p), .. }) = c.nodes[i].source() else {
                    unreachable!("parameters are leaves")
                };
                slot[i] = Some(params.len());
                // As recorded (the plan read the same).
                let is_leaf = p.is_leaf;
                if is_leaf {
                    params.push(Held::Leaf(tensor));
                    originals.push(None);
                } else {
                    params.push(Held::Owned(tensor.detach().set_requires_grad(true)));
                    originals.push(Some(tensor));
                }
                leaf.push(is_leaf);
            }
            let k = slot[first].expect("a parameter's first leaf comes before its other leaves");
            if !leaf[k] {
                if stand_ins.is_empty() {
                    stand_ins = (0..c.len()).map(|_| None).collect();
                }
                stand_ins[i] = Some(params[k].shallow_clone());
            }
        }
        let n_params = params.len();
        let mut inputs: Vec<InputGrad> = Vec::new();
        for (i, node) in c.nodes.iter().enumerate() {
            if let Some(Source::Input { tensor, dim }) = node.source() {
                // As recorded (the plan read the same).
                if node.meta.requires_grad {
                    let (dim, rows) = (*dim as i64, node.rows(1));
                    inputs.push(InputGrad { node: i, dim, rows, total: node.meta.shape[dim as usize] });
                    params.push(Held::Leaf(tensor));
                    originals.push(None);
                    leaf.push(tensor.is_leaf());
                }
            }
        }
        Wrt { params, originals, stand_ins, n_params, inputs, nodes: c.len(), leaf }
    }

    /// The tensor as the user holds it at `params[k]`.
    pub(super) fn original(&self, k: usize) -> &Tensor {
        self.originals[k].unwrap_or(&self.params[k])
    }

    /// The stand-ins and tensors of the micro-batch of `b` samples from `start`, where inputs
    /// require a gradient (each its own slice); `None`: the step's own serve.
    #[allow(clippy::type_complexity)]
    pub(super) fn sliced(&self, start: i64, b: i64) -> Result<Option<(Vec<Option<Tensor>>, Vec<Held<'_>>)>, TchError> {
        if self.inputs.is_empty() {
            return Ok(None);
        }
        let mut stand_ins: Vec<Option<Tensor>> = if self.stand_ins.is_empty() {
            (0..self.nodes).map(|_| None).collect()
        } else {
            self.stand_ins.iter().map(|t| t.as_ref().map(Tensor::shallow_clone)).collect()
        };
        let mut params: Vec<Held<'_>> = self.params.iter().map(Held::share).collect();
        for (j, input) in self.inputs.iter().enumerate() {
            let original = self.original(self.n_params + j);
            // The whole input needs no view of itself.
            let slice = if input.covers(start, b) {
                original.detach()
            } else {
                original.f_narrow(input.dim, start * input.rows, b * input.rows)?.detach()
            };
            let slice = slice.set_requires_grad(true);
            stand_ins[input.node] = Some(slice.shallow_clone());
            params[self.n_params + j] = Held::Owned(slice);
        }
        Ok(Some((stand_ins, params)))
    }

    /// Adds a micro-batch's gradients (`grads`, by position in `params`) into the sums: the
    /// parameters' and, for inputs, their slice's rows.
    pub(super) fn add(
        &self,
        grads: &[Tensor],
        through: &mut [Option<Tensor>],
        start: i64,
        b: i64,
    ) -> Result<(), TchError> {
        if grads.is_empty() {
            // Autograd accumulated into `.grad` itself.
            return Ok(());
        }
        let k = self.n_params.min(grads.len());
        accumulate(&self.params[..k], &self.leaf[..k], &grads[..k], &mut through[..k])?;
        if grads.len() > self.n_params {
            let originals = (self.n_params..self.params.len()).map(|k| self.original(k));
            let slices =
                self.inputs.iter().zip(&grads[self.n_params..]).zip(originals).zip(&mut through[self.n_params..]);
            accumulate_slices(slices, start, b)?;
        }
        Ok(())
    }

    /// Sends the gradients summed for stand-ins back through their tensors' own graphs, once.
    pub(super) fn send_through(&self, through: &[Option<Tensor>]) -> Result<(), TchError> {
        if through.iter().all(Option::is_none) {
            return Ok(());
        }
        let (roots, seeds): (Vec<&Tensor>, Vec<&Tensor>) =
            through.iter().enumerate().filter_map(|(k, g)| Some((self.original(k), g.as_ref()?))).unzip();
        match tch::with_grad(|| crate::memory::backward(&roots, &seeds)) {
            Ok(()) => return Ok(()),
            Err(crate::memory::AllocatorError::NotBuilt) => {}
            Err(err) => return Err(TchError::Torch(err.to_string())),
        }
        tch::with_grad(|| -> Result<(), TchError> {
            let mut sum: Option<Tensor> = None;
            for (k, g) in through.iter().enumerate() {
                if let Some(g) = g {
                    let p = self.original(k);
                    // d/dp sum(p * g) = g: autograd carries g on through p's own graph.
                    let term = p.f_mul(g)?.f_sum(Kind::Double)?;
                    sum = Some(match sum {
                        None => term,
                        Some(s) => s.f_add(&term)?,
                    });
                }
            }
            sum.expect("some gradient").f_backward()
        })
    }

    /// Every rank's share is in its own `.grad`: their sum is the union's gradient, and the
    /// losses' sum the union's loss. Parameters only: an input's gradient is the rank's own.
    #[cfg(feature = "dist")]
    pub(super) fn all_reduce(&self, group: &crate::dist::Group, total: f64) -> Result<f64, crate::lazy::LazyError> {
        let grads: Vec<Tensor> = self
            .params
            .iter()
            .zip(&self.leaf)
            .take(self.n_params)
            .filter(|&(_, &l)| l)
            .map(|(p, _)| p.grad())
            .collect();
        let defined: Vec<&Tensor> = grads.iter().filter(|g| g.defined()).collect();
        group.all_reduce_sum(&defined)?;
        Ok(group.all_reduce_f64("toma.lazy/loss", crate::dist::Reduce::Sum, &[total])?[0])
    }
}

/// An input that requires a gradient: its node, batch dimension, rows a sample, and rows.
pub(super) struct InputGrad {
    node: usize,
    dim: i64,
    rows: i64,
    total: i64,
}

impl InputGrad {
    /// Whether the micro-batch of `b` samples from `start` is all of it.
    fn covers(&self, start: i64, b: i64) -> bool {
        start == 0 && b * self.rows == self.total
    }
}

/// Adds each input's micro-batch gradient (its slice's) into rows `start..start + b` of the
/// input's `.grad()` (a leaf without one first gets a zero gradient of the batch's size) or of
/// a buffer sent back through a non-leaf input's own graph at the end.
pub(super) fn accumulate_slices<'a>(
    slices: impl Iterator<Item = (((&'a InputGrad, &'a Tensor), &'a Tensor), &'a mut Option<Tensor>)>,
    start: i64,
    b: i64,
) -> Result<(), TchError> {
    for (((input, g), original), through) in slices {
        if !g.defined() {
            continue;
        }
        if through.is_none() && !original.is_leaf() && input.covers(start, b) {
            // The whole input's gradient, as autograd returned it: only sent on, never added to.
            *through = Some(g.shallow_clone());
            continue;
        }
        let _no_grad = tch::no_grad_guard();
        let whole = if original.is_leaf() {
            if !crate::memory::grad_defined(original) {
                // As for parameters: autograd allocates `.grad` for a backward of `0 * sum(x)`.
                tch::with_grad(|| original.f_sum(None)?.f_mul_scalar(0.0)?.f_backward())?;
            }
            original.grad()
        } else {
            through.get_or_insert_with(|| original.zeros_like()).shallow_clone()
        };
        let _ = whole.f_narrow(input.dim, start * input.rows, b * input.rows)?.f_add_(g)?;
    }
    Ok(())
}

/// Adds a micro-batch's gradients into `.grad()` (leaves; a parameter without one first gets a
/// zero gradient) or into `through` (non-leaves). Only called once the micro-batch's backward
/// completed: a retried micro-batch never counts twice.
pub(super) fn accumulate(
    params: &[Held<'_>],
    leaf: &[bool],
    grads: &[Tensor],
    through: &mut [Option<Tensor>],
) -> Result<(), TchError> {
    let undefined: Vec<&Tensor> = params
        .iter()
        .zip(grads)
        .zip(leaf)
        .filter(|((p, g), is_leaf)| **is_leaf && g.defined() && !crate::memory::grad_defined(p))
        .map(|((p, _), _)| &**p)
        .collect();
    if !undefined.is_empty() {
        // tch cannot assign `.grad`; a backward of `0 * sum(p)` makes autograd allocate it.
        tch::with_grad(|| -> Result<(), TchError> {
            let mut zero: Option<Tensor> = None;
            for p in &undefined {
                let term = p.f_sum(None)?.f_mul_scalar(0.0)?;
                zero = Some(match zero {
                    None => term,
                    Some(z) => z.f_add(&term)?,
                });
            }
            zero.expect("non-empty").f_backward()
        })?;
    }
    let _no_grad = tch::no_grad_guard();
    for (k, (p, g)) in params.iter().zip(grads).enumerate() {
        if !g.defined() {
            continue;
        }
        if leaf[k] {
            let mut grad = p.grad();
            let _ = grad.f_add_(g)?;
        } else {
            through[k] = Some(match through[k].take() {
                None => g.shallow_clone(),
                Some(sum) => sum.f_add(g)?,
            });
        }
    }
    Ok(())
}

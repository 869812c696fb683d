//! A micro-batch run segment by segment: every segment but the last without autograd, then
//! each again with autograd from its first run's generator state, last to first.

use tch::{TchError, Tensor};

use super::chunks::updated_tensors;
use super::forward::{run_node, value_of, Held};
use super::{torch, Chunk};
use crate::lazy::error::LazyError;
use crate::lazy::plan::{cuda_ordinal, Compiled, Segments};

/// The device's random generator state, for a recomputed segment to draw what its first run
/// drew (dropout's masks).
pub(super) fn generator_state(device: Option<usize>) -> Result<Vec<u8>, LazyError> {
    crate::memory::generator_state(device).map_err(|e| LazyError::Torch {
        node: None,
        op: "recompute".into(),
        source: TchError::Torch(format!("saving the random generator's state to replay it: {e}")),
    })
}

pub(super) fn set_generator_state(device: Option<usize>, state: &[u8]) -> Result<(), LazyError> {
    crate::memory::set_generator_state(device, state).map_err(|e| LazyError::Torch {
        node: None,
        op: "recompute".into(),
        source: TchError::Torch(format!("restoring the random generator's state: {e}")),
    })
}

/// Adds a gradient autograd returned into a sum. Out of place: autograd may hand one buffer to
/// two inputs (the backward of `a + b`) or a broadcast view (the backward of `sum`), so adding
/// into it would change another gradient, or fail.
pub(super) fn add_out_of_place(sum: &mut Option<Tensor>, g: Tensor) -> Result<(), TchError> {
    if g.defined() {
        *sum = Some(match sum.take() {
            Some(s) => s.f_add(&g)?,
            None => g,
        });
    }
    Ok(())
}

/// Runs one micro-batch's forward and backward segment by segment (see `plan::Segments`):
/// every segment but the last runs without autograd, keeping what later segments read; then,
/// last to first, each runs again with autograd from the generator state of its first run,
/// and its backward follows from the gradients later segments sent to its values (as the
/// backward of `sum(value · gradient)`, whose gradient is exactly that one). Running
/// statistics and the generator end as after one forward. Returns the loss and, unless
/// `direct` (autograd accumulated into `.grad`), the parameters' gradients.
pub(super) fn recompute_chunk(
    c: &Compiled,
    segs: &Segments,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let device = cuda_ordinal(c.device());
    // A step that fails leaves the generator as it found it (a retry draws the same masks).
    let start = generator_state(device)?;
    let result = recompute_segments(c, segs, chunk, params, direct, device);
    if result.is_err() {
        let _ = set_generator_state(device, &start);
    }
    result
}

/// [`recompute_chunk`]'s work.
pub(super) fn recompute_segments(
    c: &Compiled,
    segs: &Segments,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
    device: Option<usize>,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let n = c.len();
    let count = segs.count();
    let err = torch(n - 1, "recompute");
    let run = |values: &[Option<Tensor>], i: usize, extra: &dyn Fn(usize) -> Option<Tensor>| {
        let owned: Vec<Option<Tensor>> = c.inputs(i).map(extra).collect();
        let ins: Vec<&Tensor> = c
            .inputs(i)
            .zip(&owned)
            .map(|(j, o)| o.as_ref().unwrap_or_else(|| values[j].as_ref().expect("held until its last use")))
            .collect();
        let out = run_node(c, i, &ins, chunk)?;
        let actual = out.size();
        let node = &c.nodes[i];
        if !node.meta.matches_at(chunk.b, &actual) {
            let expected = node.meta.shape_at(chunk.b).to_vec();
            return Err(LazyError::ShapeRule { node: i, op: node.name().into(), expected, actual });
        }
        Ok(out)
    };
    let mut values: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
    let mut states = Vec::with_capacity(count);
    tch::no_grad(|| -> Result<(), LazyError> {
        for s in 0..count - 1 {
            states.push(generator_state(device)?);
            for i in segs.range(s, n) {
                values[i] = Some(run(&values, i, &|_| None)?);
                for j in c.inputs(i) {
                    if segs.held[j] as usize == i {
                        values[j] = None;
                    }
                }
            }
        }
        Ok(())
    })?;
    let stats = updated_tensors(c);
    let mut after_forward: Option<(Vec<u8>, Vec<Tensor>)> = None;
    let mut grads_out: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
    let mut acc: Vec<Option<Tensor>> = params.iter().map(|_| None).collect();
    // Read once every segment's backward is queued, as a plain step reads its loss.
    let mut loss_held: Option<Tensor> = None;
    for s in (0..count).rev() {
        let range = segs.range(s, n);
        if s + 1 < count {
            set_generator_state(device, &states[s])?;
        }
        // Values of earlier segments, as leaves of this segment's graph (sources as they are).
        let mut boundary: std::collections::HashMap<usize, Tensor> = std::collections::HashMap::new();
        let surrogate = tch::with_grad(|| -> Result<Option<Tensor>, LazyError> {
            for i in range.clone() {
                for j in c.inputs(i) {
                    if j < range.start && !c.nodes[j].is_source() && !boundary.contains_key(&j) {
                        let kept = values[j].as_ref().expect("kept for later segments");
                        let leaf = kept.detach();
                        let leaf = if c.nodes[j].meta.requires_grad { leaf.set_requires_grad(true) } else { leaf };
                        boundary.insert(j, leaf);
                    }
                }
                let out = run(&values, i, &|j| boundary.get(&j).map(Tensor::shallow_clone))?;
                values[i] = Some(out);
                for j in c.inputs(i) {
                    if j >= range.start && segs.held[j] as usize == i {
                        values[j] = None;
                    }
                }
            }
            if s + 1 == count {
                let _no_grad = tch::no_grad_guard();
                after_forward = Some((generator_state(device)?, stats.iter().map(Tensor::copy).collect()));
                let loss = values[n - 1].take().expect("the output is held");
                // Detached: holding its graph would keep what branches the backward skips saved.
                loss_held = Some(loss.detach());
                return Ok(loss.requires_grad().then_some(loss));
            }
            let mut sum: Option<Tensor> = None;
            for o in range.clone() {
                let (Some(v), Some(g)) = (values[o].take(), grads_out[o].take()) else { continue };
                if !v.requires_grad() {
                    continue;
                }
                // Summed in the value's own kind: a wider kind would copy the product first.
                let term = v.f_mul(&g).and_then(|t| t.f_sum(None)).map_err(&err)?;
                sum = Some(match sum {
                    None => term,
                    Some(a) => a.f_add(&term).map_err(&err)?,
                });
            }
            Ok(sum)
        })?;
        for v in &mut values[range.clone()] {
            *v = None;
        }
        if let Some(surrogate) = surrogate {
            let leaves: Vec<(usize, Tensor)> = boundary.into_iter().filter(|(_, t)| t.requires_grad()).collect();
            let grads = if direct {
                tch::with_grad(|| surrogate.f_backward()).map_err(&err)?;
                leaves.iter().map(|(_, t)| t.grad()).collect::<Vec<_>>()
            } else {
                let mut wrt: Vec<&Tensor> = params.iter().map(|p| &**p).collect();
                wrt.extend(leaves.iter().map(|(_, t)| t));
                let mut grads =
                    tch::with_grad(|| Tensor::f_run_backward(&[&surrogate], &wrt, false, false)).map_err(&err)?;
                let boundary_grads = grads.split_off(params.len());
                let _no_grad = tch::no_grad_guard();
                for (sum, g) in acc.iter_mut().zip(grads) {
                    add_out_of_place(sum, g).map_err(&err)?;
                }
                boundary_grads
            };
            let _no_grad = tch::no_grad_guard();
            for ((j, _), g) in leaves.iter().zip(grads) {
                add_out_of_place(&mut grads_out[*j], g).map_err(&err)?;
            }
        }
        // Kept values whose first reader (the last to run again) this segment was.
        for (value, &reader) in values[..range.start].iter_mut().zip(&segs.first_reader) {
            if reader == s as u32 {
                *value = None;
            }
        }
    }
    if let Some((state, stats_after)) = after_forward {
        // The recomputed forwards drew again and updated running statistics again: both end
        // as one forward left them.
        set_generator_state(device, &state)?;
        let _no_grad = tch::no_grad_guard();
        for (mut t, after) in stats.into_iter().zip(stats_after) {
            t.f_copy_(&after).map_err(&err)?;
        }
    }
    let loss = loss_held.expect("the last segment holds the output");
    let loss_value = value_of(&loss).map_err(&err)?;
    let grads = if direct { Vec::new() } else { acc.into_iter().map(|g| g.unwrap_or_else(Tensor::new)).collect() };
    Ok((loss_value, grads))
}

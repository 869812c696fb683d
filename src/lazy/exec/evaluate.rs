//! Values: a graph run whole as eager code would, a value computed in micro-batches without
//! gradients, and a traced micro-batch.

use tch::Tensor;

use super::chunks::{denominators, prepare, run_chunks};
use super::forward::forward_chunk;
use super::{torch, Chunk, TracedOp};
use crate::lazy::error::LazyError;
use std::rc::Rc;

use crate::lazy::graph::{Flow, LazyTensor, Node, RunCx, Source};
use crate::lazy::options::Options;
use crate::lazy::plan::{self, Mode};
use crate::oom::OutOfMemory;

/// Runs a recorded graph once, whole, as the ops would have run eagerly (autograd included):
/// how a lazy-only step of a `Sequential` applies to a `Tensor`. Nothing is planned or split, so
/// the graph is walked directly (a step records a handful of ops; compiling a plan would cost
/// more than running them).
pub(crate) fn run_eagerly(output: &LazyTensor) -> Result<Tensor, LazyError> {
    Ok(run_whole(output, None)?.expect("run whatever it records"))
}

/// Reads `output` while a step may still be recording: where autograd records (grad mode on),
/// computes it as eager code would, whole and with autograd, and keeps the value of every node
/// a later op could still take ([`Node::keep_computed`]): the step continues from those values,
/// so nothing before them runs again and no random draw (dropout's masks) is made twice. The
/// value is the full batch's, whatever a later step's plan. Without grad mode (inference),
/// as [`evaluate`]: planned, in micro-batches where the batch does not fit.
///
/// `read` names the reading call for the plan's messages (`i64::try_from`, `double_value`).
pub(crate) fn read(output: &LazyTensor, read: &str) -> Result<Tensor, LazyError> {
    // A loss read after its step is the step's value ([`evaluate`]), not computed again.
    let node = output.node();
    if output.eager_value().is_none()
        && !node.is_source()
        && node.stepped.get().is_none()
        && crate::lazy::tch_compat::grad_enabled()
    {
        match run_whole(output, Some(read)) {
            // Nothing in the graph records a gradient: no step continues from it.
            Ok(None) => {}
            Ok(Some(value)) => return Ok(value),
            // Too large whole: computed as planned instead, in micro-batches. A step taking it
            // then computes it again.
            Err(err) if err.is_out_of_memory() => tracing::warn!(
                op = output.op_name(),
                read,
                error = %err,
                "toma::lazy: a value read while recording ran out of memory whole; it is computed in micro-batches, and a step that takes it computes it again"
            ),
            Err(err) => return Err(err),
        }
    }
    evaluate(output, &Options::default())
}

/// [`run_eagerly`], and with `keep` ([`read`]) each value later ops may take kept on its node;
/// `None` then where no node of the graph requires a gradient (nothing is run).
fn run_whole(output: &LazyTensor, keep: Option<&str>) -> Result<Option<Tensor>, LazyError> {
    if let Some(value) = output.eager_value() {
        return Ok(Some(value.shallow_clone()));
    }
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    // Node ids are counters: a mixer hashes them in a few instructions where SipHash took a
    // third of this walk's own time (a decoder reading every token walks ~50 nodes a read).
    type HashMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<crate::hash::Mixer>>;
    // Inputs have smaller ids: visiting by id runs every input before its users. A node a read
    // computed is its value's source (the same id).
    let mut nodes: Vec<&Rc<Node>> = vec![output.node()];
    let mut seen: HashMap<u64, usize> = HashMap::default();
    seen.insert(output.node().id, 0);
    let mut k = 0;
    let mut batch = None;
    while k < nodes.len() {
        let node = nodes[k];
        if let Some(Source::Input { .. }) = node.source() {
            batch = node.meta.batch().map(|bd| bd.size);
        }
        for input in &node.inputs {
            let input = input.resolved();
            if let std::collections::hash_map::Entry::Vacant(slot) = seen.entry(input.id) {
                slot.insert(nodes.len());
                nodes.push(input);
            }
        }
        k += 1;
    }
    if keep.is_some() && !nodes.iter().any(|n| n.meta.requires_grad) {
        return Ok(None);
    }
    nodes.sort_unstable_by_key(|n| n.id);
    let b = batch.unwrap_or(1);
    // Uses left per value, so each is dropped after its last use, as eager code would.
    let mut uses: HashMap<u64, usize> = HashMap::with_capacity_and_hasher(nodes.len(), Default::default());
    for node in &nodes {
        for input in &node.inputs {
            *uses.entry(input.id).or_default() += 1;
        }
    }
    if let Some(read) = keep {
        tracing::debug!(
            op = output.op_name(),
            read,
            nodes = nodes.len(),
            "toma::lazy: a value read while recording is computed now, whole; the step continues from it"
        );
    }
    let mut values: HashMap<u64, Tensor> = HashMap::with_capacity_and_hasher(nodes.len(), Default::default());
    for (i, node) in nodes.iter().enumerate() {
        let ins: Vec<&Tensor> = node.inputs.iter().map(|x| &values[&x.id]).collect();
        let cx = RunCx { meta: &node.meta, start: 0, b };
        let out = node.run(&ins, &cx).map_err(torch(i, node.name()))?;
        for input in &node.inputs {
            let left = uses.get_mut(&input.id).expect("counted");
            *left -= 1;
            if *left == 0 {
                values.remove(&input.id);
            }
        }
        // Kept where something beyond this graph holds the node (a user's handle, an op
        // recorded apart): it may be taken again. The rest only served the graph just run.
        if let Some(read) = keep.filter(|_| !node.is_source()) {
            // Its users run later (ids are topological): its uses are all still counted.
            let within = uses.get(&node.id).copied().unwrap_or(0);
            if Rc::ptr_eq(node, output.node()) || Rc::strong_count(node) > within {
                node.keep_computed(out.shallow_clone(), read);
            }
        }
        values.insert(node.id, out);
    }
    Ok(Some(values.remove(&output.node().id).expect("the output ran")))
}

/// Computes the value of `output` (no gradients recorded).
pub(crate) fn evaluate(output: &LazyTensor, options: &Options) -> Result<Tensor, LazyError> {
    if let Some(value) = output.eager_value() {
        return Ok(value.shallow_clone());
    }
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    // An input or a constant is its own value: nothing to plan or run (the denominators of a
    // split loss ask for the targets this way).
    if let Some(Source::Input { tensor, .. } | Source::Leaf { tensor, .. }) = output.node().source() {
        return Ok(tensor.shallow_clone());
    }
    // A loss read after its step: the value the step computed, nothing run again.
    if let Some(value) = output.node().stepped.get() {
        let meta = &output.node().meta;
        return Tensor::f_from_slice(&[value])
            .and_then(|t| t.f_to_kind(meta.kind)?.f_to_device(meta.device)?.f_reshape(meta.shape.as_slice()))
            .map_err(|source| LazyError::Torch { node: None, op: "stepped value".into(), source });
    }
    let span = tracing::info_span!("toma.lazy", mode = "forward", op = output.op_name());
    let _entered = span.enter();
    let p = prepare(output, Mode::Forward, options)?;
    let _no_grad = tch::no_grad_guard();
    let n = p.c.batch;
    let mut dens: Option<Vec<Option<f64>>> = None;
    let flow = p.c.output().meta.flow;
    let mut parts: Vec<Tensor> = Vec::new();
    let mut acc: Option<Tensor> = None;
    let out = p.c.len() - 1;
    let err = torch(out, "combine");
    run_chunks(&p, options, false, |start, b| {
        let split = b < n;
        if split && dens.is_none() {
            dens = Some(denominators(&p.c, true, options)?);
        }
        let chunk = Chunk {
            start,
            b,
            split,
            frac: b as f64 / n as f64,
            dens: dens.as_deref().unwrap_or_default(),
            stand_ins: &[],
        };
        let value = forward_chunk(&p.c, &chunk, None)?;
        match flow {
            // A view (the last position of each sequence, say) would hold its whole base until
            // the parts are concatenated: a copy lets the base go now (the plan counts it so).
            Flow::PerSample(_) if split && p.c.output().meta.alias => {
                let mut own = Tensor::f_empty_like(&value).map_err(&err)?;
                own.f_copy_(&value).map_err(&err)?;
                parts.push(own)
            }
            Flow::PerSample(_) if split => parts.push(value),
            Flow::Sum if split => {
                acc = Some(match acc.take() {
                    None => value,
                    Some(a) => a.f_add(&value).map_err(&err)?,
                })
            }
            Flow::Max if split => {
                acc = Some(match acc.take() {
                    None => value,
                    Some(a) => a.f_maximum(&value).map_err(&err)?,
                })
            }
            _ => acc = Some(value),
        }
        Ok(())
    })?;
    match flow {
        Flow::PerSample(bd) if !parts.is_empty() => {
            if parts.len() == 1 {
                return Ok(parts.pop().expect("one part"));
            }
            Tensor::f_cat(&parts, bd.dim as i64).map_err(err)
        }
        _ => Ok(acc.expect("at least one micro-batch ran")),
    }
}

/// Runs the first micro-batch of `micro_batch` samples and reports, per op, what the executor
/// produced and held.
pub(crate) fn trace(output: &LazyTensor, mode: Mode, micro_batch: usize) -> Result<Vec<TracedOp>, LazyError> {
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    let c = plan::compile(output)?;
    let n = c.batch;
    let b = (micro_batch.max(1) as i64).min(n.max(1));
    let split = b < n;
    let options = Options::default();
    let dens = tch::no_grad(|| denominators(&c, split, &options))?;
    let chunk = Chunk { start: 0, b, split, frac: b as f64 / n as f64, dens: &dens, stand_ins: &[] };
    let mut steps = Vec::with_capacity(c.len());
    let run = || forward_chunk(&c, &chunk, Some(&mut steps)).map(drop);
    match mode {
        Mode::Forward => tch::no_grad(run)?,
        Mode::Backward => tch::with_grad(run)?,
    }
    Ok(steps)
}

//! The executor: runs a compiled graph on consecutive micro-batches under the retry engine,
//! and puts the full-batch result (value, or accumulated gradients) together.

use tch::{Kind, TchError, Tensor};

use super::cost::CostModel;
use super::error::LazyError;
use super::graph::{Flow, LazyTensor, RunCx, Share, Source};
use super::options::Options;
use super::plan::{self, cuda_ordinal, Compiled, Corrections, Decision, Measure, Mode, Segments};
use crate::oom::OutOfMemory;
use crate::retry::Range;

/// One micro-batch: where it starts, its size, and whether the batch is split at all.
struct Chunk<'a> {
    start: i64,
    b: i64,
    split: bool,
    /// The micro-batch's share of the batch, `b / N`.
    frac: f64,
    /// Full-batch denominators of mean-reduced class losses, by node position.
    dens: &'a [Option<f64>],
    /// Tensors that replace fixed leaves (detached stand-ins of non-leaf operands).
    stand_ins: &'a [Option<Tensor>],
}

/// What the executor did at one op of a traced micro-batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracedOp {
    /// Position of the op (as in [`Plan::ops`](super::Plan::ops)).
    pub node: usize,
    /// The op's name.
    pub name: String,
    /// The shape of the value it produced.
    pub shape: Vec<i64>,
    /// Bytes of a new allocation for the value (rounded to 512 B); 0 for a view of its input
    /// or for inputs and parameters.
    pub bytes: u64,
    /// Positions of the values the executor holds after the op.
    pub held: Vec<usize>,
}

fn torch(node: usize, op: &str) -> impl Fn(TchError) -> LazyError + '_ {
    move |source| LazyError::Torch { node: Some(node), op: op.into(), source }
}

/// Whether `out`'s data lies inside `input`'s (a view of it).
fn shares_storage(out: &Tensor, input: &Tensor) -> bool {
    let (o, i) = (out.data_ptr() as usize, input.data_ptr() as usize);
    if i == 0 || o == 0 {
        return false;
    }
    let span: i64 = input.size().iter().zip(input.stride()).map(|(s, st)| (s - 1).max(0) * st).sum::<i64>() + 1;
    let bytes = span as usize * input.kind().elt_size_in_bytes();
    o >= i && o < i + bytes.max(1)
}

/// Runs node `i` on the micro-batch, weighting what a split sum needs weighted.
fn run_node(c: &Compiled, i: usize, ins: &[&Tensor], chunk: &Chunk<'_>) -> Result<Tensor, LazyError> {
    let node = &c.nodes[i];
    let err = torch(i, node.name());
    if let Some(Some(stand_in)) = chunk.stand_ins.get(i) {
        return match node.source() {
            // A whole input's stand-in is narrowed; a micro-batch's own slice already is.
            Some(Source::Input { dim, .. }) if stand_in.size().get(*dim) != Some(&chunk.b) => {
                stand_in.f_narrow(*dim as i64, chunk.start, chunk.b).map_err(err)
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
            den: chunk.dens[i],
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
enum Held<'a> {
    Leaf(&'a Tensor),
    Owned(Tensor),
}

impl Held<'_> {
    fn get(&self) -> &Tensor {
        match self {
            Held::Leaf(t) => t,
            Held::Owned(t) => t,
        }
    }

    /// The same tensor, for a micro-batch's own list.
    fn share(&self) -> Held<'_> {
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
const SHAPES_CHECKED_MAX: usize = 64;

/// Runs the forward pass of one micro-batch, dropping each value after its last use.
fn forward_chunk(c: &Compiled, chunk: &Chunk<'_>, mut trace: Option<&mut Vec<TracedOp>>) -> Result<Tensor, LazyError> {
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
fn recycle<'b>(mut list: Vec<&Tensor>) -> Vec<&'b Tensor> {
    list.clear();
    list.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// The tensors the graph's ops update in place (batch norm's running statistics).
fn updated_tensors(c: &Compiled) -> Vec<Tensor> {
    let mut tensors = Vec::new();
    for node in &c.nodes {
        for k in node.facts.updated.clone() {
            if let Some(Source::Leaf { tensor, .. }) = node.inputs[k].source() {
                tensors.push(tensor.shallow_clone());
            }
        }
    }
    tensors
}

/// The device's random generator state, for a recomputed segment to draw what its first run
/// drew (dropout's masks).
fn generator_state(device: Option<usize>) -> Result<Vec<u8>, LazyError> {
    crate::memory::generator_state(device).map_err(|e| LazyError::Torch {
        node: None,
        op: "recompute".into(),
        source: TchError::Torch(format!("saving the random generator's state to replay it: {e}")),
    })
}

fn set_generator_state(device: Option<usize>, state: &[u8]) -> Result<(), LazyError> {
    crate::memory::set_generator_state(device, state).map_err(|e| LazyError::Torch {
        node: None,
        op: "recompute".into(),
        source: TchError::Torch(format!("restoring the random generator's state: {e}")),
    })
}

/// Adds a gradient autograd returned into a sum. Out of place: autograd may hand one buffer to
/// two inputs (the backward of `a + b`) or a broadcast view (the backward of `sum`), so adding
/// into it would change another gradient, or fail.
fn add_out_of_place(sum: &mut Option<Tensor>, g: Tensor) -> Result<(), TchError> {
    if g.defined() {
        *sum = Some(match sum.take() {
            Some(s) => s.f_add(&g)?,
            None => g,
        });
    }
    Ok(())
}

/// A loss's value as `f64`: a scalar read as it is (no kernel, as tch's `double_value`),
/// anything larger summed in `Double`.
fn value_of(loss: &Tensor) -> Result<f64, TchError> {
    // A scalar in one question to libtorch (`numel` asks two and allocates the sizes).
    if loss.dim() == 0 || loss.numel() == 1 {
        return loss.f_double_value(&[]);
    }
    loss.f_sum(Kind::Double)?.f_double_value(&[])
}

/// Runs one micro-batch's forward and backward at once: returns the loss and, unless `direct`
/// (autograd accumulated into `.grad`), the parameters' gradients.
fn plain_chunk(
    c: &Compiled,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let err = torch(c.len() - 1, "backward");
    tch::with_grad(|| -> Result<(f64, Vec<Tensor>), LazyError> {
        let loss = forward_chunk(c, chunk, None)?;
        // The value is read after the backward, as a plain step reads it: on a GPU, reading
        // it first would wait for the forward before the backward's kernels are queued.
        if direct && !params.is_empty() && loss.requires_grad() {
            loss.f_backward().map_err(&err)?;
            return Ok((value_of(&loss).map_err(&err)?, Vec::new()));
        }
        let grads = if params.is_empty() || !loss.requires_grad() {
            Vec::new()
        } else {
            Tensor::f_run_backward(&[&loss], params, false, false).map_err(&err)?
        };
        Ok((value_of(&loss).map_err(&err)?, grads))
    })
}

/// Runs one micro-batch's forward and backward segment by segment (see `plan::Segments`):
/// every segment but the last runs without autograd, keeping what later segments read; then,
/// last to first, each runs again with autograd from the generator state of its first run,
/// and its backward follows from the gradients later segments sent to its values (as the
/// backward of `sum(value · gradient)`, whose gradient is exactly that one). Running
/// statistics and the generator end as after one forward. Returns the loss and, unless
/// `direct` (autograd accumulated into `.grad`), the parameters' gradients.
fn recompute_chunk(
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
fn recompute_segments(
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

/// A compiled graph, and what planning decided for one run of it.
struct Prepared {
    c: Compiled,
    d: Decision,
}

fn prepare(output: &LazyTensor, mode: Mode, options: &Options) -> Result<Prepared, LazyError> {
    let c = plan::compile(output)?;
    let d = plan::decide(&c, mode, options, Measure::Now)?;
    let chunks = (c.batch as usize).div_ceil(d.micro_batch);
    let calibration = d.evidence.calibration();
    tracing::info!(
        mode = ?mode,
        op = c.output().name(),
        batch = c.batch,
        micro_batch = d.micro_batch,
        chunks,
        segments = d.segments.as_ref().map_or(0, Segments::count),
        why = %d.why,
        peak = d.peak,
        full_batch_peak = d.full_peak,
        budget = d.budget,
        nodes = c.len(),
        calibrated = calibration.measured,
        calibration_ms = calibration.elapsed.as_secs_f64() * 1e3,
        uncalibrated = calibration.unmeasured,
        "toma::lazy: plan"
    );
    Ok(Prepared { c, d })
}

/// Full-batch denominators of the mean-reduced class losses that a split must divide by.
fn denominators(c: &Compiled, split: bool, options: &Options) -> Result<Vec<Option<f64>>, LazyError> {
    let mut dens = vec![None; c.len()];
    if !split {
        return Ok(dens);
    }
    for (i, node) in c.nodes.iter().enumerate() {
        let Some(ignore) = node.facts.counted_targets else {
            continue;
        };
        if !c.global[i] {
            continue;
        }
        // The targets are usually an input: evaluating them costs a narrow per micro-batch.
        let targets = LazyTensor::from_node(node.inputs[1].clone()).to_tensor_with(options)?;
        let err = torch(i, "nll_loss denominator");
        let counted = targets.f_ne(ignore).map_err(&err)?;
        let den = match node.inputs.get(2) {
            Some(w) => {
                let w = LazyTensor::from_node(w.clone()).to_tensor_with(options)?;
                let picked = w.f_index_select(0, &targets.f_clamp_min(0).map_err(&err)?).map_err(&err)?;
                picked
                    .f_mul(&counted.f_to_kind(w.kind()).map_err(&err)?)
                    .map_err(&err)?
                    .f_sum(Kind::Double)
                    .map_err(&err)?
            }
            None => counted.f_sum(Kind::Double).map_err(&err)?,
        };
        dens[i] = Some(den.f_double_value(&[]).map_err(&err)?);
    }
    Ok(dens)
}

/// Calls `body(start, end)` over the batch in micro-batches of `micro_batch`, halving on
/// out-of-memory when the result allows it.
fn run_chunks(
    p: &Prepared,
    options: &Options,
    restart: bool,
    mut body: impl FnMut(i64, i64) -> Result<(), LazyError>,
) -> Result<(), LazyError> {
    // Each micro-batch is measured against its plan where an allocator counts: on the CPU by
    // this thread's own count, so that another thread's step is not taken for this one's.
    let own = crate::memory::PeakCounter::own(cuda_ordinal(p.c.device()));
    let counter = own.as_ref().map(|(c, _)| *c);
    let mut body = |start: i64, b: i64| -> Result<(), LazyError> {
        let Some(counter) = counter else { return body(start, b) };
        let mark = counter.mark();
        let Some((before, outer_peak)) = counter.start() else { return body(start, b) };
        let result = body(start, b);
        let peak = counter.peak();
        counter.end(outer_peak);
        result?;
        // What another thread's work reached says nothing of this plan.
        let peak = peak.filter(|_| !counter.interfered(mark));
        if let Some(peak) = peak {
            let measured = peak.saturating_sub(before);
            let planned = p.d.peak_at(&p.c, b as u64);
            if let Some(reserve) = Corrections::process().record(
                &p.c,
                (p.d.mode, p.d.evidence.calibrated_any()),
                b as u64,
                planned,
                measured,
            ) {
                tracing::warn!(
                    micro_batch = b,
                    planned,
                    measured,
                    reserve,
                    "toma::lazy: a micro-batch peaked above its plan; later plans of this graph hold the excess in reserve"
                );
            }
        }
        Ok(())
    };
    let n = p.c.batch.max(1) as usize;
    let mut updated = Updated::of(p);
    let result = run_chunk_loop(p, options, n, restart, |start: i64, b: i64| -> Result<(), LazyError> {
        if start == 0 {
            // The first micro-batch, or the step started again.
            updated.clear();
        }
        updated.restore();
        body(start, b)?;
        updated.add(b as f64 / n as f64);
        Ok(())
    });
    // A failed step leaves them as they were.
    if result.is_ok() {
        updated.apply();
    } else {
        updated.restore();
    }
    result
}

/// Tensors the graph's ops update in place (batch norm's running statistics), kept so that a
/// split step updates them once: each micro-batch starts from the values before the step, and
/// the micro-batches' updates are summed by share. A micro-batch that fails and is retried
/// leaves nothing behind. One micro-batch of the whole batch is the plain update.
struct Updated {
    /// Each tensor, its value before the step, and the weighted sum of the updates so far.
    tensors: Vec<(Tensor, Tensor, Option<Tensor>)>,
    /// Whether the last micro-batch was the whole batch: its update is the step's, as is.
    whole: bool,
}

impl Updated {
    fn of(p: &Prepared) -> Updated {
        let updated = updated_tensors(&p.c);
        if updated.is_empty() {
            return Updated { tensors: Vec::new(), whole: false };
        }
        let _guard = tch::no_grad_guard();
        let tensors = updated.into_iter().map(|t| (t.copy(), t, None)).map(|(b, t, s)| (t, b, s)).collect();
        Updated { tensors, whole: false }
    }

    fn restore(&mut self) {
        if self.tensors.is_empty() {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, _) in &mut self.tensors {
            t.copy_(before);
        }
    }

    /// Forgets the updates summed so far.
    fn clear(&mut self) {
        for (_, _, sum) in &mut self.tensors {
            *sum = None;
        }
    }

    fn add(&mut self, share: f64) {
        self.whole = share >= 1.0;
        if self.whole || self.tensors.is_empty() {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, sum) in &mut self.tensors {
            let update = (&*t - &*before) * share;
            *sum = Some(match sum.take() {
                Some(s) => s + update,
                None => update,
            });
        }
    }

    fn apply(&mut self) {
        if self.whole {
            return;
        }
        let _guard = tch::no_grad_guard();
        for (t, before, sum) in &mut self.tensors {
            match sum {
                Some(s) => t.copy_(&(&*before + &*s)),
                None => t.copy_(before),
            }
        }
    }
}

/// [`run_chunks`]'s loop: fixed micro-batches, or the retry engine's. With `restart`, a
/// micro-batch that runs out of memory after the first starts the whole range again (at the
/// smaller size) instead of going on from where it failed.
fn run_chunk_loop(
    p: &Prepared,
    options: &Options,
    n: usize,
    restart: bool,
    mut body: impl FnMut(i64, i64) -> Result<(), LazyError>,
) -> Result<(), LazyError> {
    if !p.d.splittable || !options.retry {
        let step = if p.d.splittable { p.d.micro_batch } else { n };
        let mut start = 0;
        while start < n {
            let end = (start + step).min(n);
            body(start as i64, (end - start) as i64)?;
            start = end;
        }
        return Ok(());
    }
    // Keyed by the graph's shape: the size one graph's micro-batches settled on is its own.
    let mut range = Range::new(0, n, p.d.micro_batch).identity(p.c.fingerprint, "toma::lazy").planned();
    if let Some(kind) = options.cache {
        range = range.cache(kind);
    }
    let mut attempts = range.start();
    while let Some((start, end)) = attempts.next_range() {
        tracing::debug!(start, end, "toma::lazy: micro-batch");
        let outcome = attempts.attempt(|| body(start as i64, (end - start) as i64));
        attempts.finish(outcome)?;
        let retried = attempts.next_range().is_some_and(|(at, _)| at == start);
        if restart && retried && start > 0 {
            // Micro-batches accumulate into `.grad` in place: a failed one spoiled the sum, so
            // the step starts again from no gradients, at the smaller size.
            tracing::info!(
                failed_at = start,
                micro_batch = attempts.step(),
                "toma::lazy: a micro-batch ran out of memory; the step starts again from its first sample"
            );
            attempts.restart();
        }
    }
    Ok(())
}

/// Runs a recorded graph once, whole, as the ops would have run eagerly (autograd included):
/// how a lazy-only step of a `Sequential` applies to a `Tensor`. Nothing is planned or split, so
/// the graph is walked directly (a step records a handful of ops; compiling a plan would cost
/// more than running them).
pub(crate) fn run_eagerly(output: &LazyTensor) -> Result<Tensor, LazyError> {
    if let Some(value) = output.eager_value() {
        return Ok(value.shallow_clone());
    }
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    use std::collections::HashMap;
    // Inputs have smaller ids: visiting by id runs every input before its users.
    let mut nodes: Vec<&std::rc::Rc<super::graph::Node>> = vec![output.node()];
    let mut seen: HashMap<u64, usize> = HashMap::new();
    seen.insert(output.node().id, 0);
    let mut k = 0;
    let mut batch = None;
    while k < nodes.len() {
        let node = nodes[k];
        if let Some(Source::Input { .. }) = node.source() {
            batch = node.meta.batch().map(|bd| bd.size);
        }
        for input in &node.inputs {
            if let std::collections::hash_map::Entry::Vacant(slot) = seen.entry(input.id) {
                slot.insert(nodes.len());
                nodes.push(input);
            }
        }
        k += 1;
    }
    nodes.sort_unstable_by_key(|n| n.id);
    let b = batch.unwrap_or(1);
    // Uses left per value, so each is dropped after its last use, as eager code would.
    let mut uses: HashMap<u64, usize> = HashMap::with_capacity(nodes.len());
    for node in &nodes {
        for input in &node.inputs {
            *uses.entry(input.id).or_default() += 1;
        }
    }
    let mut values: HashMap<u64, Tensor> = HashMap::with_capacity(nodes.len());
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
        values.insert(node.id, out);
    }
    Ok(values.remove(&output.node().id).expect("the output ran"))
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
    let unsplit = vec![None; p.c.len()];
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
            dens: dens.as_deref().unwrap_or(&unsplit),
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

/// Plans of a step that may not be split, tried after a real out-of-memory: each under 3/4 of
/// the last one's peak, or the lowest peak any plan reaches.
const REPLANS: usize = 3;

/// Runs forward and backward in micro-batches, accumulating parameter gradients.
///
/// A real out-of-memory in a step whose batch may not be split (its samples mix, so the retry
/// engine has no micro-batch to halve) plans the step again under 3/4 of the failed plan's
/// peak (or the lowest peak any plan reaches, where that is higher), recomputing more, up to
/// [`REPLANS`] times. On a GPU the caching allocator can refuse a
/// large block while enough memory is free in pieces; on any device the budget may have been
/// read before other work took memory. The failed attempt leaves nothing behind: what it filled
/// into `.grad` is zeroed, running statistics and the generator are as they were. When no lower
/// plan exists or runs, the first error is returned.
pub(crate) fn backward(output: &LazyTensor, options: &Options) -> Result<f64, LazyError> {
    // The graph carries its casts: libtorch's autocast must not cast again while it runs.
    let _suspended = crate::autocast::Suspended::new();
    let first = match backward_once(output, options) {
        Err(err) if options.retry && err.is_out_of_memory() => err,
        other => return other,
    };
    let mut options = options.clone();
    for attempt in 1..=REPLANS {
        let Ok(p) = prepare(output, Mode::Backward, &options) else { break };
        if p.d.splittable {
            // The retry engine halved its micro-batches down to one sample already.
            break;
        }
        // 3/4 of the peak, or the lowest peak any plan reaches where that is above it.
        let mut budget = p.d.peak / 4 * 3;
        if let Err(LazyError::DoesNotFit { peak: lowest, .. }) =
            prepare(output, Mode::Backward, &options.clone().budget(budget))
        {
            if lowest >= p.d.peak {
                break;
            }
            budget = lowest;
        }
        tracing::warn!(
            attempt,
            peak = p.d.peak,
            budget,
            error = %first,
            "toma::lazy: a step that cannot be split ran out of memory; planning it again under 3/4 of its peak or the lowest any plan reaches"
        );
        options = options.budget(budget);
        match backward_once(output, &options) {
            Err(err) if err.is_out_of_memory() => continue,
            // No plan reaches that low: the first error says what ran out.
            Err(LazyError::DoesNotFit { .. }) => break,
            other => return other,
        }
    }
    Err(first)
}

fn backward_once(output: &LazyTensor, options: &Options) -> Result<f64, LazyError> {
    if output.numel() != 1 {
        return Err(LazyError::NotScalar { op: output.op_name().into(), shape: output.size() });
    }
    let span = tracing::info_span!("toma.lazy", mode = "backward", op = output.op_name());
    let _entered = span.enter();
    let p = prepare(output, Mode::Backward, options)?;
    let n = p.c.batch;
    let wrt = Wrt::of(&p.c);
    // Where `.grad` starts as none, the micro-batches need no second copy of the gradients:
    // autograd accumulates straight into `.grad`, as plain tch does (the plan counts it so). A
    // micro-batch that fails leaves a sum that cannot be undone: `.grad` is set back to none
    // and the step starts again from its first sample, at the smaller size.
    let direct = p.c.accumulates_in_place();
    let mut through: Vec<Option<Tensor>> = wrt.params.iter().map(|_| None).collect();
    let unsplit = vec![None; p.c.len()];
    let err = torch(p.c.len() - 1, "backward");
    let mut total = 0.0;
    // One rank of several: every share is of the global batch, every denominator global.
    let global = group_weights(&p.c, options)?;
    let n_all = global.as_ref().map_or(n, |g| g.batch);
    let mut dens: Option<Vec<Option<f64>>> = global.map(|g| g.dens);
    let started = std::time::Instant::now();
    run_chunks(&p, options, direct, |start, b| {
        if start == 0 {
            total = 0.0;
        }
        if b < n && dens.is_none() {
            dens = Some(tch::no_grad(|| denominators(&p.c, true, options))?);
        }
        let dens = dens.as_deref().unwrap_or(&unsplit);
        let sliced = wrt.sliced(start, b).map_err(&err)?;
        let (stand_ins, params) = sliced.as_ref().map_or((&wrt.stand_ins, &wrt.params), |(s, p)| (s, p));
        let chunk = Chunk { start, b, split: b < n_all, frac: b as f64 / n_all as f64, dens, stand_ins };
        let (value, grads) = micro_batch(&p, &chunk, params, direct)?;
        wrt.add(&grads, &mut through, start, b).map_err(&err)?;
        total += value;
        Ok(())
    })?;
    record_time(&p, started);
    wrt.send_through(&through).map_err(&err)?;
    #[cfg(feature = "dist")]
    if let Some(group) = options.group.as_ref().filter(|g| g.world_size() > 1) {
        total = wrt.all_reduce(group, total)?;
    }
    // The micro-batches' sum, in the loss's kind: what reading the loss gives, and what one
    // whole-batch step computes.
    let total = in_kind(total, output.node().meta.kind).map_err(&err)?;
    output.node().stepped.set(Some(total));
    Ok(total)
}

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
struct Wrt<'a> {
    /// What autograd differentiates: a leaf parameter itself, a detached stand-in of another;
    /// the inputs whole (each micro-batch slices them: [`Wrt::sliced`]).
    params: Vec<Held<'a>>,
    /// The tensors as the user holds them, where they are not `params`' own: the parameters
    /// that are not leaves.
    originals: Vec<Option<&'a Tensor>>,
    /// By node: the stand-in a leaf reads instead of its tensor (empty when there is none).
    stand_ins: Vec<Option<Tensor>>,
    /// `params[..n_params]` are the parameters.
    n_params: usize,
    /// The inputs that require a gradient: node and batch dimension.
    inputs: Vec<(usize, i64)>,
    /// The graph's nodes.
    nodes: usize,
    /// Whether each original is a leaf (its gradient lands in its `.grad`).
    leaf: Vec<bool>,
}

impl<'a> Wrt<'a> {
    fn of(c: &'a Compiled) -> Wrt<'a> {
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
        let mut inputs: Vec<(usize, i64)> = Vec::new();
        for (i, node) in c.nodes.iter().enumerate() {
            if let Some(Source::Input { tensor, dim }) = node.source() {
                // As recorded (the plan read the same).
                if node.meta.requires_grad {
                    inputs.push((i, *dim as i64));
                    params.push(Held::Leaf(tensor));
                    originals.push(None);
                    leaf.push(tensor.is_leaf());
                }
            }
        }
        Wrt { params, originals, stand_ins, n_params, inputs, nodes: c.len(), leaf }
    }

    /// The tensor as the user holds it at `params[k]`.
    fn original(&self, k: usize) -> &Tensor {
        self.originals[k].unwrap_or(&self.params[k])
    }

    /// The stand-ins and tensors of the micro-batch of `b` samples from `start`, where inputs
    /// require a gradient (each its own slice); `None`: the step's own serve.
    #[allow(clippy::type_complexity)]
    fn sliced(&self, start: i64, b: i64) -> Result<Option<(Vec<Option<Tensor>>, Vec<Held<'_>>)>, TchError> {
        if self.inputs.is_empty() {
            return Ok(None);
        }
        let mut stand_ins: Vec<Option<Tensor>> = if self.stand_ins.is_empty() {
            (0..self.nodes).map(|_| None).collect()
        } else {
            self.stand_ins.iter().map(|t| t.as_ref().map(Tensor::shallow_clone)).collect()
        };
        let mut params: Vec<Held<'_>> = self.params.iter().map(Held::share).collect();
        for (j, &(i, dim)) in self.inputs.iter().enumerate() {
            let slice = self.original(self.n_params + j).f_narrow(dim, start, b)?.detach().set_requires_grad(true);
            stand_ins[i] = Some(slice.shallow_clone());
            params[self.n_params + j] = Held::Owned(slice);
        }
        Ok(Some((stand_ins, params)))
    }

    /// Adds a micro-batch's gradients (`grads`, by position in `params`) into the sums: the
    /// parameters' and, for inputs, their slice's rows.
    fn add(&self, grads: &[Tensor], through: &mut [Option<Tensor>], start: i64, b: i64) -> Result<(), TchError> {
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
    fn send_through(&self, through: &[Option<Tensor>]) -> Result<(), TchError> {
        if through.iter().all(Option::is_none) {
            return Ok(());
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
    fn all_reduce(&self, group: &crate::dist::Group, total: f64) -> Result<f64, LazyError> {
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

/// One micro-batch's forward and backward, as planned (plain or recomputing): its loss share
/// and the gradients not accumulated into `.grad`.
fn micro_batch(
    p: &Prepared,
    chunk: &Chunk<'_>,
    params: &[Held<'_>],
    direct: bool,
) -> Result<(f64, Vec<Tensor>), LazyError> {
    let result = match &p.d.segments {
        Some(segs) => recompute_chunk(&p.c, segs, chunk, params, direct),
        None => plain_chunk(&p.c, chunk, params, direct),
    };
    if result.is_err() && direct {
        // `.grad` was none when the step began: so it is again, its memory freed for the
        // smaller micro-batches.
        clear_grads(params);
    }
    result
}

/// The step's time against its estimate, as evidence: later choices between splitting and
/// recomputing for this graph follow what this machine measured.
fn record_time(p: &Prepared, started: std::time::Instant) {
    let choice = match (&p.d.segments, p.d.micro_batch < p.c.batch as usize) {
        (Some(_), _) => plan::Choice::Recompute,
        (None, true) => plan::Choice::Split,
        (None, false) => return,
    };
    plan::Timings::process().record(&p.c, choice, started.elapsed().as_secs_f64(), p.d.seconds.0);
}

/// Sets the parameters' `.grad` back to none (zeroes it where the shim is missing).
fn clear_grads(params: &[Held<'_>]) {
    let _no_grad = tch::no_grad_guard();
    for param in params {
        let mut grad = param.grad();
        if grad.defined() && crate::memory::clear_grad(param).is_err() {
            let _ = grad.f_zero_();
        }
    }
}

/// `value` rounded to `kind`, as a scalar tensor of that kind holds it.
fn in_kind(value: f64, kind: Kind) -> Result<f64, TchError> {
    match kind {
        Kind::Double => Ok(value),
        Kind::Float => Ok(value as f32 as f64),
        _ => Tensor::f_from_slice(&[value])?.f_to_kind(kind)?.f_double_value(&[]),
    }
}

/// The global batch and denominators of a step run as one rank of [`Options::group`].
struct Global {
    batch: i64,
    dens: Vec<Option<f64>>,
}

#[cfg(feature = "dist")]
fn group_weights(c: &Compiled, options: &Options) -> Result<Option<Global>, LazyError> {
    let Some(group) = options.group.as_ref().filter(|g| g.world_size() > 1) else { return Ok(None) };
    let mut dens = tch::no_grad(|| denominators(c, true, options))?;
    let mut local: Vec<f64> = vec![c.batch as f64];
    local.extend(dens.iter().flatten());
    let sums = group.all_reduce_f64("toma.lazy/weights", crate::dist::Reduce::Sum, &local)?;
    for (d, sum) in dens.iter_mut().flatten().zip(&sums[1..]) {
        *d = *sum;
    }
    Ok(Some(Global { batch: sums[0].round() as i64, dens }))
}

#[cfg(not(feature = "dist"))]
fn group_weights(_: &Compiled, _: &Options) -> Result<Option<Global>, LazyError> {
    Ok(None)
}

/// Adds each input's micro-batch gradient (its slice's) into rows `start..start + b` of the
/// input's `.grad()` (a leaf without one first gets a zero gradient of the batch's size) or of
/// a buffer sent back through a non-leaf input's own graph at the end.
fn accumulate_slices<'a>(
    slices: impl Iterator<Item = (((&'a (usize, i64), &'a Tensor), &'a Tensor), &'a mut Option<Tensor>)>,
    start: i64,
    b: i64,
) -> Result<(), TchError> {
    for (((&(_, dim), g), original), through) in slices {
        if !g.defined() {
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
        let _ = whole.f_narrow(dim, start, b)?.f_add_(g)?;
    }
    Ok(())
}

/// Adds a micro-batch's gradients into `.grad()` (leaves; a parameter without one first gets a
/// zero gradient) or into `through` (non-leaves). Only called once the micro-batch's backward
/// completed: a retried micro-batch never counts twice.
fn accumulate(
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

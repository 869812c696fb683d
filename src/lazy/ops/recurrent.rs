//! A recurrent layer over a whole sequence as one op that runs libtorch's fused kernel (`lstm`,
//! `gru`: oneDNN's on a CPU in `Float` and `BFloat16`, cuDNN's on CUDA), recorded by
//! [`nn::lstm`](crate::lazy::nn::lstm) and [`nn::gru`](crate::lazy::nn::gru).
//!
//! A graph node has one output, and the kernel has two or three (the output and the final
//! states), so the node's value packs them along the time dimension, `[time + layers * states,
//! batch, directions * hidden]` (the final states of each layer as one more "step" each, its
//! directions side by side), and the layer hands out views of it. What the kernel keeps for its
//! backward (its own output, gates, oneDNN's workspace) is nobody's rule to read: a calibrating
//! plan measures it, as for a user's op; before that, a prior of the gates and states of every
//! step.

use std::rc::Rc;

use tch::{Kind, TchError, Tensor};

use super::record::{combine_flows, same_device, Linearity, Record};
use crate::lazy::error::LazyError;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::{KernelCall, LazyTensor, Meta, Node, Operation, Run, RunCx};
use crate::lazy::size::Elements;

/// Which recurrence: the gates per hidden unit, the states it carries and libtorch's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Cell {
    Lstm,
    Gru,
}

impl Cell {
    pub(crate) fn gates(self) -> i64 {
        match self {
            Cell::Lstm => 4,
            Cell::Gru => 3,
        }
    }

    /// The state tensors carried from step to step: `h` (and `c` for an LSTM).
    pub(crate) fn states(self) -> i64 {
        match self {
            Cell::Lstm => 2,
            Cell::Gru => 1,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Cell::Lstm => "lstm",
            Cell::Gru => "gru",
        }
    }
}

/// The settings of libtorch's `lstm` / `gru`, and whether the initial states are inputs (else
/// zeros of each micro-batch's size).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Recurrent {
    pub(crate) cell: Cell,
    pub(crate) layers: i64,
    pub(crate) hidden: i64,
    pub(crate) bidirectional: bool,
    pub(crate) batch_first: bool,
    pub(crate) has_biases: bool,
    pub(crate) dropout: f64,
    pub(crate) train: bool,
    pub(crate) given_state: bool,
    /// The lower precision of the autocast region it was recorded in: it runs in libtorch's
    /// autocast, which casts what it casts for this op (on a CPU, `lstm`'s oneDNN layers in
    /// `BFloat16`), so a step equals eager autocast's bit for bit.
    pub(crate) autocast: Option<Kind>,
}

impl Recurrent {
    fn directions(&self) -> i64 {
        if self.bidirectional {
            2
        } else {
            1
        }
    }

    /// Every setting, hashed: what tells one call's measurements and kinds from another's.
    fn settings_hash(&self) -> u64 {
        let settings = (self.cell, self.layers, self.hidden, self.bidirectional, self.batch_first, self.has_biases);
        let run = (self.dropout.to_bits(), self.train, self.given_state, self.autocast);
        crate::hash::hash_of(&(settings, run))
    }

    /// How many inputs are initial states.
    fn state_inputs(&self) -> usize {
        if self.given_state {
            self.cell.states() as usize
        } else {
            0
        }
    }

    /// Records the sequence: `input` (`[batch, time, features]`, or time first), the initial
    /// states (none for zeros) and libtorch's flat weights. Gives the packed value, `[time +
    /// layers * states, batch, directions * hidden]`; `time` is the input's.
    pub(crate) fn record(
        self,
        input: &LazyTensor,
        states: &[LazyTensor],
        weights: &[LazyTensor],
    ) -> Result<LazyTensor, LazyError> {
        let name = self.cell.name();
        debug_assert_eq!(states.len(), self.state_inputs());
        let nodes: Vec<Rc<Node>> =
            std::iter::once(input).chain(states).chain(weights).map(|t| t.node().clone()).collect();
        let device = same_device(name, &nodes.iter().collect::<Vec<_>>())?;
        let shape = &input.node().meta.shape;
        let (batch_dim, time_dim) = if self.batch_first { (0, 1) } else { (1, 0) };
        let packed =
            vec![shape[time_dim] + self.layers * self.cell.states(), shape[batch_dim], self.directions() * self.hidden];
        // Samples land on dimension 1 of the packed value: the input's from its batch
        // dimension, the states' from theirs (1). A batch found elsewhere mixes samples.
        let mapped: Vec<Option<usize>> = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let at = if i == 0 { batch_dim } else { 1 };
                n.meta.batch().and_then(|bd| (bd.dim == at && bd.factor == 1).then_some(1))
            })
            .collect();
        let refs: Vec<&Rc<Node>> = nodes.iter().collect();
        let flow = combine_flows(name, &refs, &mapped, &packed, Linearity::Nonlinear, false)?;
        let kind = match self.autocast {
            // Where libtorch's autocast cannot run the kernel (a CPU without oneDNN's
            // `BFloat16` LSTM: eager autocast fails there too), the caller records steps.
            Some(_) => self.kind_in_autocast(&nodes).map_err(|err| LazyError::Unsupported {
                op: name.into(),
                reason: format!("libtorch's autocast cannot run the fused kernel here: {err}"),
            })?,
            None => input.node().meta.kind,
        };
        Ok(Record::new(self, nodes, packed, kind, device).flow(flow).finish())
    }

    /// The kind libtorch's autocast gives the packed value: asked of the kernel itself on one
    /// sample and one step (once per settings and kinds in a thread), not read from a rule.
    fn kind_in_autocast(&self, nodes: &[Rc<Node>]) -> Result<Kind, TchError> {
        thread_local! {
            static KINDS: std::cell::RefCell<Vec<(u64, Kind)>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let kinds: Vec<Kind> = nodes.iter().map(|n| n.meta.kind).collect();
        let key = crate::hash::hash_of(&(self.settings_hash(), &kinds));
        if let Some(kind) = KINDS.with(|k| k.borrow().iter().find(|(at, _)| *at == key).map(|(_, kind)| *kind)) {
            return Ok(kind);
        }
        let _no_grad = tch::no_grad_guard();
        let device = nodes[0].meta.device;
        let mut sample: Vec<Tensor> = Vec::with_capacity(nodes.len());
        for (i, n) in nodes.iter().enumerate() {
            let mut shape = n.meta.shape.to_vec();
            // One step of one sample: the input's batch and time, the states' batch.
            if i == 0 {
                shape[0] = 1;
                shape[1] = 1;
            } else if i <= self.state_inputs() {
                shape[1] = 1;
            }
            sample.push(Tensor::f_zeros(shape.as_slice(), (n.meta.kind, device))?);
        }
        let refs: Vec<&Tensor> = sample.iter().collect();
        let kind = self.run(&refs, &RunCx { meta: &nodes[0].meta, start: 0, b: 1 })?.kind();
        KINDS.with(|k| k.borrow_mut().push((key, kind)));
        Ok(kind)
    }

    /// The kernel's outputs as one value: the output time first, then each state tensor's
    /// `[layers, batch, directions * hidden]`.
    fn pack(&self, output: Tensor, states: &[Tensor]) -> Result<Tensor, TchError> {
        let output = if self.batch_first { output.f_transpose(0, 1)? } else { output };
        let mut parts = vec![output];
        let (l, d, h) = (self.layers, self.directions(), self.hidden);
        for s in states {
            let b = s.size()[1];
            parts.push(s.f_view([l, d, b, h])?.f_permute([0, 2, 1, 3])?.f_reshape([l, b, d * h])?);
        }
        Tensor::f_cat(&parts, 0)
    }
}

impl Operation for Recurrent {
    fn name(&self) -> &'static str {
        self.cell.name()
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        // The backward reads the input, the states and the weights; what else the kernel keeps
        // (its own output, gates, a workspace) is measured.
        OpFacts::new(inputs.len()).saves(|_| true).sizing(self.settings_hash()).kernels_unknown()
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // A prior until measured: each step's gates and states, per layer and direction.
        let time = (meta.shape[0] - self.layers * self.cell.states()).max(0) as u64;
        let per_sample = time * (self.layers * meta.shape[2] * (self.cell.gates() + self.cell.states())) as u64;
        let elements = match meta.batch() {
            Some(_) => Elements::line(per_sample, 0),
            None => Elements::line(0, per_sample * meta.shape[1].max(0) as u64),
        };
        calls.push(KernelCall::Keeps { elements, kind: inputs[0].meta.kind });
    }
}

impl Run for Recurrent {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        // The graph runs with libtorch's autocast off (it carries its own casts): this op
        // turns it on again for its own call.
        let _region = match self.autocast {
            Some(kind) => Some(
                crate::autocast::AutocastGuard::new(ins[0].device(), kind)
                    .map_err(|e| TchError::Torch(format!("autocast for `{}`: {e}", self.cell.name())))?,
            ),
            None => None,
        };
        let x = ins[0];
        let weights = &ins[1 + self.state_inputs()..];
        let b = x.size()[if self.batch_first { 0 } else { 1 }];
        let zeros = || Tensor::f_zeros([self.layers * self.directions(), b, self.hidden], (x.kind(), x.device()));
        let (l, drop, train, bi, bf) = (self.layers, self.dropout, self.train, self.bidirectional, self.batch_first);
        match self.cell {
            Cell::Lstm => {
                let (h, c) = if self.given_state {
                    (ins[1].shallow_clone(), ins[2].shallow_clone())
                } else {
                    (zeros()?, zeros()?)
                };
                let (out, h, c) = x.f_lstm(&[&h, &c], weights, self.has_biases, l, drop, train, bi, bf)?;
                self.pack(out, &[h, c])
            }
            Cell::Gru => {
                let h = if self.given_state { ins[1].shallow_clone() } else { zeros()? };
                let (out, h) = x.f_gru(&h, weights, self.has_biases, l, drop, train, bi, bf)?;
                self.pack(out, &[h])
            }
        }
    }
}

/// One step of a one-layer, one-direction GRU as libtorch's `gru_cell`: what eager tch runs for
/// a user's `step` (a sequence of one, whose kernel calls the same cell), as one node with one
/// output, the new state `[batch, hidden]`. Inputs: the step's input `[batch, features]`, the
/// state (absent for zeros), `w_ih`, `w_hh`, and the two biases where the layer has them. What
/// the cell keeps for its backward (its gates) is measured by a calibrating plan, as for the
/// whole sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GruCell {
    pub(crate) hidden: i64,
    pub(crate) given_state: bool,
    pub(crate) has_biases: bool,
}

impl GruCell {
    /// Records the step: `input` `[batch, features]`, `state` `[batch, hidden]` (`None` for
    /// zeros), the layer's weights in libtorch's order.
    pub(crate) fn record(
        self,
        input: &LazyTensor,
        state: Option<&LazyTensor>,
        weights: &[LazyTensor],
    ) -> Result<LazyTensor, LazyError> {
        let nodes: Vec<Rc<Node>> =
            std::iter::once(input).chain(state).chain(weights).map(|t| t.node().clone()).collect();
        let device = same_device("gru_cell", &nodes.iter().collect::<Vec<_>>())?;
        let shape = vec![input.node().meta.shape[0], self.hidden];
        // The input's and the state's samples land on dimension 0; a batch found elsewhere
        // mixes samples.
        let mapped: Vec<Option<usize>> =
            nodes.iter().map(|n| n.meta.batch().and_then(|bd| (bd.dim == 0 && bd.factor == 1).then_some(0))).collect();
        let refs: Vec<&Rc<Node>> = nodes.iter().collect();
        let flow = combine_flows("gru_cell", &refs, &mapped, &shape, Linearity::Nonlinear, false)?;
        let kind = input.node().meta.kind;
        Ok(Record::new(self, nodes, shape, kind, device).flow(flow).finish())
    }
}

impl Operation for GruCell {
    fn name(&self) -> &'static str {
        "gru_cell"
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        // The backward reads the input, the state and the weights; the gates it keeps are
        // measured.
        OpFacts::new(inputs.len()).saves(|_| true).sizing(crate::hash::hash_of(self)).kernels_unknown()
    }

    fn kernels<'a>(&'a self, inputs: &'a [Rc<Node>], meta: &'a Meta, calls: &mut Vec<KernelCall<'a>>) {
        // A prior until measured: both products' three gates, and the reset, update and new
        // gates with the difference they multiply.
        let per_sample = (2 * 3 + 4) * self.hidden.max(0) as u64;
        let elements = match meta.batch() {
            Some(_) => Elements::line(per_sample, 0),
            None => Elements::line(0, per_sample * meta.shape[0].max(0) as u64),
        };
        calls.push(KernelCall::Keeps { elements, kind: inputs[0].meta.kind });
    }
}

impl Run for GruCell {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        let x = ins[0];
        let zeros;
        let (h, weights) = if self.given_state {
            (ins[1], &ins[2..])
        } else {
            zeros = Tensor::f_zeros([x.size()[0], self.hidden], (x.kind(), x.device()))?;
            (&zeros, &ins[1..])
        };
        let (b_ih, b_hh) = if self.has_biases { (Some(weights[2]), Some(weights[3])) } else { (None, None) };
        x.f_gru_cell(h, weights[0], weights[1], b_ih, b_hh)
    }
}

//! tch's recurrent layers, `nn::lstm` and `nn::gru`, for both kinds of tensor.
//!
//! tch keeps an LSTM's weights private, so these layers create the same variables tch does
//! (same names, shapes, initializers and order: a checkpoint of either loads into the other)
//! and keep them. On a `Tensor` they call libtorch's
//! fused `lstm`/`gru`, exactly as tch's layers do. On a [`LazyTensor`] a sequence (`seq`,
//! `seq_init`) is one op that runs the same fused kernel on each micro-batch, its memory
//! measured by calibration (the kernel's workspace and what it keeps for its backward); the
//! output and final states are views of its value. A recurrence mixes time steps, never
//! samples, so it splits by batch like any per-sample op. A GRU's step the user takes
//! (`step`: one layer, one direction, batch first) is one op on libtorch's `gru_cell`, the cell
//! eager tch's step runs, measured so too. Other steps are recorded from small ops (per step a
//! linear map of the input and of the hidden state, the gates, the new state), and so is a
//! sequence in an autocast region, whose products autocast casts one by one.

use std::borrow::Borrow;

use tch::nn::{self as tnn, Init, Path, RNNConfig};
use tch::{Device, Kind, Tensor};

use super::error::{LazyError, OrPanic};
use super::ops::recurrent::{Cell, GruCell, Recurrent};
use super::LazyTensor;

/// A recurrent layer over tensors of type `T` (`Tensor` or [`LazyTensor`]): tch's `RNN`
/// trait, generic in the tensor so that one model serves both (its `zero_state` is the layers'
/// own method: `zero_state` for tensors, `lazy_zero_state` for a lazy recurrence, so that tch's
/// `lstm.zero_state(1)` needs no annotation). [`lstm`] and [`gru`] make
/// layers that implement it for both (and tch's own `RNN` for `Tensor`): `rnn.seq(&xs)` takes
/// either, so a model written over [`TensorOps`](super::TensorOps) runs eagerly and lazily.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, nn, nn::RNN};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let lstm = nn::lstm(vs.root() / "lstm", 5, 8, Default::default());
/// let xs = Tensor::randn([4, 7, 5], (Kind::Float, Device::Cpu)); // [batch, time, features]
/// let (eager, _) = lstm.seq(&xs);
/// let (lazily, state) = lstm.seq(&lazy(&xs, 0));
/// assert_eq!(state.h().size(), [1, 4, 8]);
/// assert!(eager.allclose(&lazily.to_tensor()?, 1e-5, 1e-5, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
///
/// Lazily, `seq` and `seq_init` record one op on libtorch's fused kernel, however long the
/// sequence (its memory measured by calibration: call
/// [`track_cpu_allocations`](crate::memory::track_cpu_allocations) on a CPU; until measured it is
/// priced by a prior of each step's gates and states). A GRU's `step` (one layer, one
/// direction, batch first, outside an autocast region) records one `gru_cell` op, libtorch's
/// cell, as eager tch runs it: the same values bit for bit, and one autograd node a step.
/// Other steps record small ops (about 12 per layer and direction). Either way a loop of steps
/// makes a graph as long as the loop. As in tch, a `batch_first` output is a transposed view
/// (libtorch runs time first).
#[allow(clippy::upper_case_acronyms)]
pub trait RNN<T = Tensor> {
    /// The state carried from step to step.
    type State;

    /// One step: `input` is `[batch, features]`.
    fn step(&self, input: &T, state: &Self::State) -> Self::State;

    /// The whole sequence from the zero state: `input` is `[batch, time, features]`
    /// (`[time, batch, features]` when the layer is not `batch_first`).
    fn seq(&self, input: &T) -> (T, Self::State);

    /// The whole sequence from `state`.
    fn seq_init(&self, input: &T, state: &Self::State) -> (T, Self::State);
}

/// The recurrent states that go with a tensor kind: tch's `GRUState` and `LSTMState` for
/// `Tensor`, [`LazyGRUState`] and [`LazyLSTMState`] for [`LazyTensor`]. `#[toma::lazy::module]`
/// names a method's states through it, so that `fn step(&self, xs: &Tensor, state: &GRUState)
/// -> GRUState` serves both kinds.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a kind of tensor: a `#[toma::lazy::module]` method takes `&Tensor` or `&LazyTensor`",
    label = "a `&{Self}` here",
    note = "a generic argument is not dereferenced: where the value is already a reference, pass it as it is (`x`, not `&x`)"
)]
pub trait RecurrentState {
    /// The state of a GRU.
    type GRU;
    /// The state of an LSTM.
    type LSTM;
}

impl RecurrentState for Tensor {
    type GRU = tnn::GRUState;
    type LSTM = tnn::LSTMState;
}

impl RecurrentState for LazyTensor {
    type GRU = LazyGRUState;
    type LSTM = LazyLSTMState;
}

/// The weights of one layer and direction.
struct Direction {
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Option<Tensor>,
    b_hh: Option<Tensor>,
}

/// What LSTM and GRU share: their variables and settings.
struct Weights {
    cell: Cell,
    /// Per layer, then per direction (forward first), as libtorch flattens them.
    dirs: Vec<Direction>,
    in_dim: i64,
    hidden: i64,
    config: RNNConfig,
    device: Device,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(self.cell.name())
            .field("in_dim", &self.in_dim)
            .field("hidden", &self.hidden)
            .field("config", &self.config)
            .finish()
    }
}

impl Weights {
    /// The variables tch's `nn::lstm`/`nn::gru` create, in the same order with the same
    /// initializers.
    fn new(vs: &Path, cell: Cell, in_dim: i64, hidden: i64, config: RNNConfig) -> Weights {
        let gate_dim = cell.gates() * hidden;
        let directions = if config.bidirectional { 2 } else { 1 };
        let mut dirs = Vec::new();
        for layer in 0..config.num_layers {
            for d in 0..directions {
                let layer_in = if layer == 0 { in_dim } else { hidden * directions };
                let suffix = if d == 1 { "_reverse" } else { "" };
                let w_ih = vs.var(&format!("weight_ih_l{layer}{suffix}"), &[gate_dim, layer_in], config.w_ih_init);
                let w_hh = vs.var(&format!("weight_hh_l{layer}{suffix}"), &[gate_dim, hidden], config.w_hh_init);
                let (b_ih, b_hh) = if config.has_biases {
                    let init = |i: Option<Init>| i.unwrap_or(Init::Const(0.));
                    let b_ih = vs.var(&format!("bias_ih_l{layer}{suffix}"), &[gate_dim], init(config.b_ih_init));
                    let b_hh = vs.var(&format!("bias_hh_l{layer}{suffix}"), &[gate_dim], init(config.b_hh_init));
                    (Some(b_ih), Some(b_hh))
                } else {
                    (None, None)
                };
                dirs.push(Direction { w_ih, w_hh, b_ih, b_hh });
            }
        }
        let weights = Weights { cell, dirs, in_dim, hidden, config, device: vs.device() };
        weights.flatten_for_cudnn();
        weights
    }

    /// On CUDA, the weights moved into the one block cuDNN's kernel reads, as tch's layers do
    /// when created (otherwise cuDNN copies them on every call). A failure leaves them as they
    /// are: the kernel still runs, copying.
    fn flatten_for_cudnn(&self) {
        if !self.device.is_cuda() || !tch::Cuda::cudnn_is_available() {
            return;
        }
        let c = self.config;
        // libtorch's modes: 2 for an LSTM, 3 for a GRU; the stride counts each direction's tensors.
        let mode = match self.cell {
            Cell::Lstm => 2,
            Cell::Gru => 3,
        };
        let stride = if c.has_biases { 4 } else { 2 };
        let flat = self.flat();
        // In place on the parameters: outside autograd, as PyTorch's `flatten_parameters` does.
        let result = tch::no_grad(|| {
            Tensor::f_internal_cudnn_rnn_flatten_weight(
                &flat,
                stride,
                self.in_dim,
                mode,
                self.hidden,
                0,
                c.num_layers,
                c.batch_first,
                c.bidirectional,
            )
        });
        if let Err(error) = result {
            tracing::debug!(%error, "toma::lazy::nn: cuDNN could not flatten the recurrent weights");
        }
    }

    fn directions(&self) -> i64 {
        if self.config.bidirectional {
            2
        } else {
            1
        }
    }

    fn state_shape(&self, batch: i64) -> Vec<i64> {
        vec![self.config.num_layers * self.directions(), batch, self.hidden]
    }

    fn kind(&self) -> Kind {
        self.dirs[0].w_ih.kind()
    }

    /// libtorch's flat weight list.
    fn flat(&self) -> Vec<&Tensor> {
        self.dirs
            .iter()
            .flat_map(|d| [Some(&d.w_ih), Some(&d.w_hh), d.b_ih.as_ref(), d.b_hh.as_ref()])
            .flatten()
            .collect()
    }

    fn zeros(&self, batch: i64) -> Tensor {
        Tensor::zeros(self.state_shape(batch), (self.kind(), self.device))
    }

    fn time_dim(&self) -> i64 {
        if self.config.batch_first {
            1
        } else {
            0
        }
    }

    fn batch_dim(&self) -> usize {
        if self.config.batch_first {
            0
        } else {
            1
        }
    }

    /// Checks a lazy input's shape: `[batch, time, in_dim]` (or time first); gives `(batch,
    /// time)`.
    fn check_input(&self, input: &LazyTensor) -> Result<(i64, i64), LazyError> {
        let shape = input.size();
        let op = self.cell.name();
        let bad = |reason: String| LazyError::Argument { op: op.into(), shape: shape.clone(), reason };
        let layout = if self.config.batch_first { "[batch, time, features]" } else { "[time, batch, features]" };
        if shape.len() != 3 {
            return Err(bad(format!("expected a 3-D input {layout}, got {} dimensions", shape.len())));
        }
        if shape[2] != self.in_dim {
            return Err(bad(format!(
                "input.size(-1) must be equal to input_size: expected {}, got {}",
                self.in_dim, shape[2]
            )));
        }
        let (batch, time) = (shape[self.batch_dim()], shape[self.time_dim() as usize]);
        if time == 0 {
            return Err(bad("the sequence is empty (no time steps)".into()));
        }
        if input.kind() != self.kind() {
            return Err(LazyError::Kind {
                op: op.into(),
                kind: input.kind(),
                shape: shape.clone(),
                reason: format!("the layer's weights are {:?}: convert the input with to_kind", self.kind()),
            });
        }
        Ok((batch, time))
    }

    /// The initial hidden state of layer-and-direction `index`, `None` for zeros.
    fn initial(&self, h: &Hidden, index: i64, batch: i64) -> Result<Option<LazyTensor>, LazyError> {
        let want = self.state_shape(batch);
        match h {
            Hidden::Zero { shape, .. } if *shape == want => Ok(None),
            Hidden::Given(t) if t.size() == want => Ok(Some(t.f_select(0, index)?)),
            other => Err(LazyError::Shape {
                op: self.cell.name().into(),
                lhs: other.shape(),
                rhs: want,
                reason: "the state must be [layers * directions, batch, hidden] for this input".into(),
            }),
        }
    }

    /// The sequence as one op on libtorch's fused kernel, or step by step where an autocast
    /// region would cast the steps' products (the fused kernel's casts are libtorch's own).
    fn record(&self, input: &LazyTensor, h0: &Hidden, c0: Option<&Hidden>) -> Result<Recorded, LazyError> {
        match self.autocast(input) {
            Some(kind) => self.record_in_autocast(input, h0, c0, kind),
            None => self.record_fused(input, h0, c0, None),
        }
    }

    /// The fused kernel in libtorch's autocast; where libtorch cannot run it so (eager autocast
    /// fails there too), the steps from small ops, each product cast as autocast casts it.
    fn record_in_autocast(
        &self,
        input: &LazyTensor,
        h0: &Hidden,
        c0: Option<&Hidden>,
        kind: Kind,
    ) -> Result<Recorded, LazyError> {
        match self.record_fused(input, h0, c0, Some(kind)) {
            Err(LazyError::Unsupported { reason, .. }) => {
                tracing::debug!(%reason, "toma::lazy: recurrent steps recorded from small ops in this autocast region");
                self.record_steps(input, h0, c0)
            }
            other => other,
        }
    }

    /// A user's steps: from small ops, or in an autocast region on the fused kernel (as eager
    /// tch runs a step: a sequence of one), so that libtorch casts as it casts eagerly.
    fn record_user_steps(&self, input: &LazyTensor, h0: &Hidden, c0: Option<&Hidden>) -> Result<Recorded, LazyError> {
        match self.autocast(input) {
            Some(kind) => self.record_in_autocast(input, h0, c0, kind),
            None => self.record_steps(input, h0, c0),
        }
    }

    /// A user's step `[batch, features]` of a one-layer, one-direction, batch-first GRU outside
    /// an autocast region as one `gru_cell` op: the cell eager tch's step runs (its sequence of
    /// one calls it), with one autograd node where the small ops took some twenty, and the
    /// gates' views its backward would fill with zeros. `None` where the step is recorded
    /// otherwise (an input or state that does not fit is named there).
    fn record_cell_step(&self, input: &LazyTensor, h0: &Hidden) -> Result<Option<LazyTensor>, LazyError> {
        let c = self.config;
        if self.cell != Cell::Gru || c.num_layers != 1 || c.bidirectional || !c.batch_first {
            return Ok(None);
        }
        let shape = input.size();
        if shape.len() != 2 || shape[1] != self.in_dim || input.kind() != self.kind() || self.autocast(input).is_some()
        {
            return Ok(None);
        }
        let Ok(state) = self.initial(h0, 0, shape[0]) else { return Ok(None) };
        let w = LazyWeights::of(&self.dirs[0]);
        let weights: Vec<LazyTensor> = [Some(w.w_ih), Some(w.w_hh), w.b_ih, w.b_hh].into_iter().flatten().collect();
        let op = GruCell { hidden: self.hidden, given_state: state.is_some(), has_biases: c.has_biases };
        op.record(input, state.as_ref(), &weights).map(Some)
    }

    /// The autocast region's lower precision where it casts `input` for this layer's products.
    /// The fused kernel then runs in libtorch's autocast, as eager code runs it: libtorch casts
    /// what it casts for `lstm` / `gru` (on a CPU, oneDNN's layers in `BFloat16`).
    fn autocast(&self, input: &LazyTensor) -> Option<Kind> {
        let kind = input.kind();
        let cast = super::ops::autocast::target(self.device, "linear", std::iter::once(kind));
        cast.filter(|&k| k != kind).and_then(|_| crate::autocast::active(self.device))
    }

    /// The sequence as one node running libtorch's `lstm` / `gru`, whose packed value the
    /// output and the final states are views of.
    fn record_fused(
        &self,
        input: &LazyTensor,
        h0: &Hidden,
        c0: Option<&Hidden>,
        autocast: Option<Kind>,
    ) -> Result<Recorded, LazyError> {
        let (batch, time) = self.check_input(input)?;
        let want = self.state_shape(batch);
        let mut states = Vec::new();
        for h in std::iter::once(h0).chain(c0) {
            match h {
                Hidden::Zero { shape, .. } if *shape == want => {}
                Hidden::Given(t) if t.size() == want => states.push(t.clone()),
                other => {
                    return Err(LazyError::Shape {
                        op: self.cell.name().into(),
                        lhs: other.shape(),
                        rhs: want,
                        reason: "the state must be [layers * directions, batch, hidden] for this input".into(),
                    })
                }
            }
        }
        // Both states given, or both zero (an LSTM's come in pairs).
        if !states.is_empty() && states.len() != self.cell.states() as usize {
            states = std::iter::once(h0).chain(c0).map(Hidden::value).collect();
        }
        let c = self.config;
        let op = Recurrent {
            cell: self.cell,
            layers: c.num_layers,
            hidden: self.hidden,
            bidirectional: c.bidirectional,
            batch_first: c.batch_first,
            has_biases: c.has_biases,
            dropout: c.dropout,
            train: c.train,
            given_state: !states.is_empty(),
            autocast,
        };
        let weights: Vec<LazyTensor> = self.flat().into_iter().map(LazyTensor::fixed).collect();
        let packed = op.record(input, &states, &weights)?;
        let output = packed.f_narrow(0, 0, time)?;
        let output = if c.batch_first { output.f_transpose(0, 1)? } else { output };
        let (layers, directions) = (c.num_layers, self.directions());
        let state = |k: i64| -> Result<LazyTensor, LazyError> {
            let s = packed.f_narrow(0, time + k * layers, layers)?;
            if directions == 1 {
                return Ok(s);
            }
            s.f_view([layers, batch, directions, self.hidden])?.f_permute([0, 2, 1, 3])?.f_reshape([
                layers * directions,
                batch,
                self.hidden,
            ])
        };
        let h = state(0)?;
        let c = if self.cell == Cell::Lstm { Some(state(1)?) } else { None };
        Ok(Recorded { output, h, c })
    }

    /// The recorded sequence, step by step from small ops: the output and each
    /// layer-and-direction's final states (one list per state tensor: `h`, and `c` for an
    /// LSTM).
    fn record_steps(&self, input: &LazyTensor, h0: &Hidden, c0: Option<&Hidden>) -> Result<Recorded, LazyError> {
        let (batch, time) = self.check_input(input)?;
        let time_dim = self.time_dim();
        let mut steps: Vec<LazyTensor> = (0..time).map(|t| input.f_select(time_dim, t)).collect::<Result<_, _>>()?;
        let directions = self.directions();
        let (mut h_n, mut c_n) = (Vec::new(), Vec::new());
        for layer in 0..self.config.num_layers {
            let mut outputs: Vec<Vec<LazyTensor>> = Vec::new();
            for d in 0..directions {
                let index = layer * directions + d;
                let w = LazyWeights::of(&self.dirs[index as usize]);
                let h = self.initial(h0, index, batch)?;
                let c = c0.map(|c| self.initial(c, index, batch)).transpose()?.flatten();
                let (out, h, c) = match self.cell {
                    Cell::Lstm => lstm_direction(&steps, &w, h, c, d == 1)?,
                    Cell::Gru => {
                        let (out, h) = gru_direction(&steps, &w, h, d == 1)?;
                        (out, h, None)
                    }
                };
                outputs.push(out);
                h_n.push(h);
                c_n.extend(c);
            }
            steps = if directions == 1 {
                outputs.pop().unwrap_or_default()
            } else {
                let (fwd, bwd) = (&outputs[0], &outputs[1]);
                fwd.iter().zip(bwd).map(|(f, b)| LazyTensor::f_cat(&[f, b], 1)).collect::<Result<_, _>>()?
            };
            let last = layer + 1 == self.config.num_layers;
            if !last && self.config.dropout > 0.0 && self.config.train {
                steps = steps.iter().map(|s| s.f_dropout(self.config.dropout, true)).collect::<Result<_, _>>()?;
            }
        }
        let output = LazyTensor::f_stack(&steps, time_dim)?;
        let h = LazyTensor::f_stack(&h_n, 0)?;
        let c = if c_n.is_empty() { None } else { Some(LazyTensor::f_stack(&c_n, 0)?) };
        Ok(Recorded { output, h, c })
    }
}

struct Recorded {
    output: LazyTensor,
    h: LazyTensor,
    c: Option<LazyTensor>,
}

/// One direction's weights as graph leaves, made once per recording.
struct LazyWeights {
    w_ih: LazyTensor,
    w_hh: LazyTensor,
    b_ih: Option<LazyTensor>,
    b_hh: Option<LazyTensor>,
}

impl LazyWeights {
    fn of(d: &Direction) -> LazyWeights {
        LazyWeights {
            w_ih: LazyTensor::fixed(&d.w_ih),
            w_hh: LazyTensor::fixed(&d.w_hh),
            b_ih: d.b_ih.as_ref().map(LazyTensor::fixed),
            b_hh: d.b_hh.as_ref().map(LazyTensor::fixed),
        }
    }

    /// The hidden state's contribution to the gates: `h W_hhᵀ + b_hh`, or the bias alone (or
    /// nothing) from the zero state, which is what the product would add exactly.
    fn hidden_part(&self, h: Option<&LazyTensor>) -> Result<Option<LazyTensor>, LazyError> {
        match h {
            Some(h) => Ok(Some(h.f_linear(&self.w_hh, self.b_hh.as_ref())?)),
            None => Ok(self.b_hh.clone()),
        }
    }
}

fn order(steps: usize, reverse: bool) -> Vec<usize> {
    if reverse {
        (0..steps).rev().collect()
    } else {
        (0..steps).collect()
    }
}

type DirectionOut = (Vec<LazyTensor>, LazyTensor, Option<LazyTensor>);

/// libtorch's LSTM cell, gates in its order (input, forget, cell, output):
/// `c' = f c + i g`, `h' = o tanh(c')`.
fn lstm_direction(
    xs: &[LazyTensor],
    w: &LazyWeights,
    mut h: Option<LazyTensor>,
    mut c: Option<LazyTensor>,
    reverse: bool,
) -> Result<DirectionOut, LazyError> {
    let mut out: Vec<Option<LazyTensor>> = vec![None; xs.len()];
    for t in order(xs.len(), reverse) {
        let gi = xs[t].f_linear(&w.w_ih, w.b_ih.as_ref())?;
        let gates = match w.hidden_part(h.as_ref())? {
            Some(gh) => gi.f_add(&gh)?,
            None => gi,
        };
        let g = gates.f_chunk(4, 1)?;
        let input_gate = g[0].f_sigmoid()?;
        let cell_gate = g[2].f_tanh()?;
        let output_gate = g[3].f_sigmoid()?;
        let fresh = input_gate.f_mul(&cell_gate)?;
        let c_new = match &c {
            Some(c) => g[1].f_sigmoid()?.f_mul(c)?.f_add(&fresh)?,
            None => fresh,
        };
        let h_new = output_gate.f_mul(&c_new.f_tanh()?)?;
        out[t] = Some(h_new.clone());
        h = Some(h_new);
        c = Some(c_new);
    }
    let out: Vec<LazyTensor> = out.into_iter().flatten().collect();
    let (Some(h), Some(c)) = (h, c) else { unreachable!("a sequence has at least one step (checked)") };
    Ok((out, h, Some(c)))
}

/// libtorch's GRU cell, gates in its order (reset, update, new):
/// `n = tanh(i_n + r (h W_hn + b_hn))`, `h' = n + z (h - n)`.
fn gru_direction(
    xs: &[LazyTensor],
    w: &LazyWeights,
    mut h: Option<LazyTensor>,
    reverse: bool,
) -> Result<(Vec<LazyTensor>, LazyTensor), LazyError> {
    let mut out: Vec<Option<LazyTensor>> = vec![None; xs.len()];
    for t in order(xs.len(), reverse) {
        let gi = xs[t].f_linear(&w.w_ih, w.b_ih.as_ref())?.f_chunk(3, 1)?;
        let gh = w.hidden_part(h.as_ref())?.map(|gh| gh.f_chunk(3, -1)).transpose()?;
        let (z, n) = match &gh {
            Some(gh) => {
                let r = gi[0].f_add(&gh[0])?.f_sigmoid()?;
                let z = gi[1].f_add(&gh[1])?.f_sigmoid()?;
                (z, gi[2].f_add(&gh[2].f_mul(&r)?)?)
            }
            // No bias and the zero state: the hidden part of every gate is zero.
            None => (gi[1].f_sigmoid()?, gi[2].clone()),
        };
        let n = n.f_tanh()?;
        let h_new = match &h {
            Some(h) => n.f_add(&z.f_mul(&h.f_sub(&n)?)?)?,
            None => n.f_sub(&z.f_mul(&n)?)?,
        };
        out[t] = Some(h_new.clone());
        h = Some(h_new);
    }
    let out: Vec<LazyTensor> = out.into_iter().flatten().collect();
    let Some(h) = h else { unreachable!("a sequence has at least one step (checked)") };
    Ok((out, h))
}

/// A lazy state tensor: given, or the zero state of `lazy_zero_state`, which the recurrence
/// starts from without multiplying zeros.
#[derive(Clone, Debug)]
enum Hidden {
    Zero { shape: Vec<i64>, kind: Kind, device: Device },
    Given(LazyTensor),
}

impl Hidden {
    fn shape(&self) -> Vec<i64> {
        match self {
            Hidden::Zero { shape, .. } => shape.clone(),
            Hidden::Given(t) => t.size(),
        }
    }

    /// The value: a zero state is zeros broadcast over the batch (dimension 1), so that each
    /// micro-batch sees its own size.
    fn value(&self) -> LazyTensor {
        match self {
            Hidden::Given(t) => t.clone(),
            Hidden::Zero { shape, kind, device } => {
                let one = Tensor::zeros([shape[0], 1, shape[2]], (*kind, *device));
                LazyTensor::fixed(&one).f_expand(shape.as_slice(), false).or_panic()
            }
        }
    }
}

/// An LSTM's lazy state, tch's `LSTMState` for a [`LazyTensor`]: `h` and `c`, each
/// `[layers * directions, batch, hidden]`.
#[derive(Clone, Debug)]
pub struct LazyLSTMState {
    h: Hidden,
    c: Hidden,
}

impl LazyLSTMState {
    /// A state from its hidden and cell tensors.
    pub fn new(h: LazyTensor, c: LazyTensor) -> LazyLSTMState {
        LazyLSTMState { h: Hidden::Given(h), c: Hidden::Given(c) }
    }

    /// The hidden state (the last step's output of every layer and direction).
    pub fn h(&self) -> LazyTensor {
        self.h.value()
    }

    /// The cell state.
    pub fn c(&self) -> LazyTensor {
        self.c.value()
    }
}

/// A GRU's lazy state, tch's `GRUState` for a [`LazyTensor`]: `[layers * directions, batch,
/// hidden]`.
#[derive(Clone, Debug)]
pub struct LazyGRUState(Hidden);

impl LazyGRUState {
    /// A state from its tensor.
    pub fn new(h: LazyTensor) -> LazyGRUState {
        LazyGRUState(Hidden::Given(h))
    }

    /// The hidden state, as tch's `GRUState::value`.
    pub fn value(&self) -> LazyTensor {
        self.0.value()
    }

    /// The hidden state (the same as [`value`](Self::value)).
    pub fn h(&self) -> LazyTensor {
        self.0.value()
    }
}

macro_rules! recurrent_layer {
    ($(#[$doc:meta])* $name:ident, $make:ident, $cell:expr, $tch_state:ident, $lazy_state:ident) => {
        $(#[$doc])*
        #[allow(clippy::upper_case_acronyms)]
        #[derive(Debug)]
        pub struct $name {
            weights: Weights,
        }

        $(#[$doc])*
        ///
        /// The variables are tch's (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, .., with
        /// `_reverse` for the second direction), created in tch's order.
        pub fn $make<'a, P: Borrow<Path<'a>>>(vs: P, in_dim: i64, hidden_dim: i64, config: RNNConfig) -> $name {
            $name { weights: Weights::new(vs.borrow(), $cell, in_dim, hidden_dim, config) }
        }

        impl $name {
            /// The weights, in libtorch's flat order (per layer and direction: `w_ih`, `w_hh`,
            /// then the biases).
            pub fn flat_weights(&self) -> Vec<&Tensor> {
                self.weights.flat()
            }
        }

        impl RNN<Tensor> for $name {
            type State = tnn::$tch_state;

            fn step(&self, input: &Tensor, state: &tnn::$tch_state) -> tnn::$tch_state {
                self.fused(&input.unsqueeze(1), state).1
            }

            fn seq(&self, input: &Tensor) -> (Tensor, tnn::$tch_state) {
                let batch = input.size()[self.weights.batch_dim()];
                self.fused(input, &self.zero_state(batch))
            }

            fn seq_init(&self, input: &Tensor, state: &tnn::$tch_state) -> (Tensor, tnn::$tch_state) {
                self.fused(input, state)
            }
        }

        impl tnn::RNN for $name {
            type State = tnn::$tch_state;

            fn zero_state(&self, batch_dim: i64) -> tnn::$tch_state {
                $name::zero_state(self, batch_dim)
            }

            fn step(&self, input: &Tensor, state: &tnn::$tch_state) -> tnn::$tch_state {
                <Self as RNN<Tensor>>::step(self, input, state)
            }

            fn seq_init(&self, input: &Tensor, state: &tnn::$tch_state) -> (Tensor, tnn::$tch_state) {
                <Self as RNN<Tensor>>::seq_init(self, input, state)
            }
        }

        impl RNN<LazyTensor> for $name {
            type State = $lazy_state;

            #[track_caller]
            fn step(&self, input: &LazyTensor, state: &$lazy_state) -> $lazy_state {
                // Steps the user takes are recorded as such: a GRU's as libtorch's cell where
                // it runs one, else from small ops (no packing of a one-step sequence's states).
                if let Some(state) = self.cell_step(input, state).or_panic() {
                    return state;
                }
                let input = input.f_unsqueeze(1).or_panic();
                self.recorded(&input, state, true).or_panic().1
            }

            #[track_caller]
            fn seq(&self, input: &LazyTensor) -> (LazyTensor, $lazy_state) {
                self.f_seq(input).or_panic()
            }

            #[track_caller]
            fn seq_init(&self, input: &LazyTensor, state: &$lazy_state) -> (LazyTensor, $lazy_state) {
                self.f_seq_init(input, state).or_panic()
            }
        }

        impl $name {
            /// The zero state of a lazy recurrence for a batch of `batch_dim` samples (tch's
            /// `zero_state` gives the tensors; this one starts [`RNN::seq_init`] on a lazy input
            /// without multiplying zeros, and is zeros broadcast over each micro-batch when read).
            pub fn lazy_zero_state(&self, batch_dim: i64) -> $lazy_state {
                let w = &self.weights;
                let zero = Hidden::Zero { shape: w.state_shape(batch_dim), kind: w.kind(), device: w.device };
                $lazy_state::zero(zero)
            }

            /// [`RNN::seq`] on a lazy input, with its recording error.
            ///
            /// # Errors
            /// [`LazyError::Argument`] for an input that is not 3-D, has another feature size or
            /// no time step; [`LazyError::Kind`] for an input of another kind than the weights.
            pub fn f_seq(&self, input: &LazyTensor) -> Result<(LazyTensor, $lazy_state), LazyError> {
                let batch = input.size().get(self.weights.batch_dim()).copied().unwrap_or(0);
                let zero = self.lazy_zero_state(batch);
                self.f_seq_init(input, &zero)
            }
        }
    };
}

recurrent_layer!(
    /// A long short-term memory layer, tch's `nn::LSTM` for both kinds of tensor.
    LSTM,
    lstm,
    Cell::Lstm,
    LSTMState,
    LazyLSTMState
);

recurrent_layer!(
    /// A gated recurrent unit layer, tch's `nn::GRU` for both kinds of tensor.
    GRU,
    gru,
    Cell::Gru,
    GRUState,
    LazyGRUState
);

impl LSTM {
    /// An LSTM's step is recorded from small ops (libtorch's cell gives two values).
    fn cell_step(&self, _input: &LazyTensor, _state: &LazyLSTMState) -> Result<Option<LazyLSTMState>, LazyError> {
        Ok(None)
    }
}

impl GRU {
    /// A step as one `gru_cell` op where [`Weights::record_cell_step`] records one.
    fn cell_step(&self, input: &LazyTensor, state: &LazyGRUState) -> Result<Option<LazyGRUState>, LazyError> {
        let h = self.weights.record_cell_step(input, &state.0)?;
        h.map(|h| Ok(LazyGRUState::new(h.f_unsqueeze(0)?))).transpose()
    }
}

impl LazyLSTMState {
    fn zero(h: Hidden) -> LazyLSTMState {
        LazyLSTMState { c: h.clone(), h }
    }
}

impl LazyGRUState {
    fn zero(h: Hidden) -> LazyGRUState {
        LazyGRUState(h)
    }
}

impl LSTM {
    /// tch's zero state: `h` and `c` zeros of `[layers * directions, batch_dim, hidden]`.
    pub fn zero_state(&self, batch_dim: i64) -> tnn::LSTMState {
        let zeros = self.weights.zeros(batch_dim);
        tnn::LSTMState((zeros.shallow_clone(), zeros))
    }
}

impl LSTM {
    /// libtorch's fused `lstm`, as tch's layer calls it.
    fn fused(&self, input: &Tensor, state: &tnn::LSTMState) -> (Tensor, tnn::LSTMState) {
        let w = &self.weights;
        let c = w.config;
        let (h, cell) = &state.0;
        let (output, h, cell) = input.lstm(
            &[h, cell],
            &w.flat(),
            c.has_biases,
            c.num_layers,
            c.dropout,
            c.train,
            c.bidirectional,
            c.batch_first,
        );
        (output, tnn::LSTMState((h, cell)))
    }
}

impl GRU {
    /// tch's zero state: zeros of `[layers * directions, batch_dim, hidden]`.
    pub fn zero_state(&self, batch_dim: i64) -> tnn::GRUState {
        tnn::GRUState(self.weights.zeros(batch_dim))
    }
}

impl GRU {
    /// libtorch's fused `gru`, as tch's layer calls it.
    fn fused(&self, input: &Tensor, state: &tnn::GRUState) -> (Tensor, tnn::GRUState) {
        let w = &self.weights;
        let c = w.config;
        let (output, h) = input.gru(
            &state.0,
            &w.flat(),
            c.has_biases,
            c.num_layers,
            c.dropout,
            c.train,
            c.bidirectional,
            c.batch_first,
        );
        (output, tnn::GRUState(h))
    }
}

impl LSTM {
    /// [`RNN::seq_init`] on a lazy input, with its recording error.
    ///
    /// # Errors
    /// As [`f_seq`](Self::f_seq); [`LazyError::Shape`] for a state that is not `[layers *
    /// directions, batch, hidden]`.
    pub fn f_seq_init(
        &self,
        input: &LazyTensor,
        state: &LazyLSTMState,
    ) -> Result<(LazyTensor, LazyLSTMState), LazyError> {
        self.recorded(input, state, false)
    }

    /// The sequence on the fused kernel, or step by step.
    fn recorded(
        &self,
        input: &LazyTensor,
        state: &LazyLSTMState,
        steps: bool,
    ) -> Result<(LazyTensor, LazyLSTMState), LazyError> {
        let r = if steps {
            self.weights.record_user_steps(input, &state.h, Some(&state.c))?
        } else {
            self.weights.record(input, &state.h, Some(&state.c))?
        };
        let c = r.c.unwrap_or_else(|| unreachable!("an LSTM records its cell state"));
        Ok((r.output, LazyLSTMState::new(r.h, c)))
    }
}

impl GRU {
    /// [`RNN::seq_init`] on a lazy input, with its recording error.
    ///
    /// # Errors
    /// As [`f_seq`](Self::f_seq); [`LazyError::Shape`] for a state that is not `[layers *
    /// directions, batch, hidden]`.
    pub fn f_seq_init(
        &self,
        input: &LazyTensor,
        state: &LazyGRUState,
    ) -> Result<(LazyTensor, LazyGRUState), LazyError> {
        self.recorded(input, state, false)
    }

    /// The sequence on the fused kernel, or step by step.
    fn recorded(
        &self,
        input: &LazyTensor,
        state: &LazyGRUState,
        steps: bool,
    ) -> Result<(LazyTensor, LazyGRUState), LazyError> {
        let r = if steps {
            self.weights.record_user_steps(input, &state.0, None)?
        } else {
            self.weights.record(input, &state.0, None)?
        };
        Ok((r.output, LazyGRUState::new(r.h)))
    }
}

//! Ops of your own: a shape rule and a tch function, planned and run like the built-in ones.

use std::collections::HashSet;
use std::fmt;
use std::rc::Rc;
use std::sync::Mutex;

use tch::{Device, Kind, TchError, Tensor};

use super::record::{same_device, Record};
use crate::lazy::error::LazyError;
use crate::lazy::facts::OpFacts;
use crate::lazy::graph::{BatchDim, Flow, LazyTensor, Meta, Node, Operation, Run, RunCx};

/// What autograd keeps alive for a custom op's backward; the planner counts it until the
/// backward of the op has run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Saves {
    /// The inputs (the default: what most ops need).
    #[default]
    Inputs,
    /// The output (as `relu`, `sigmoid`, `softmax` do).
    Output,
    /// Inputs and output.
    InputsAndOutput,
    /// Nothing (linear ops such as additions and views).
    Nothing,
}

/// What a shape rule sees of an input, and says of the output: sizes at the full batch, kind,
/// device, and where the batch dimension is (if the value is per-sample).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// The sizes, at the full batch.
    pub shape: Vec<i64>,
    /// The element kind.
    pub kind: Kind,
    /// The device.
    pub device: Device,
    /// The batch dimension, if the value has one.
    pub batch_dim: Option<usize>,
}

type ShapeRule = dyn Fn(&[TensorMeta]) -> Result<TensorMeta, String>;
type RunFn = dyn Fn(&[&Tensor]) -> Result<Tensor, TchError>;

/// An op of your own: a name, a shape rule, and the tch function that computes it.
///
/// The shape rule runs when the op is recorded (its error becomes a [`LazyError::Argument`]
/// naming the op); the function runs on each micro-batch. The output's `batch_dim` says where
/// the samples end up: each micro-batch's output is a slice of the full one along it. An op
/// that drops the batch dimension (a reduction over samples) cannot be split and is refused
/// when the batch must be split. The function's output shape is checked against the rule at
/// every run.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, CustomOp, Saves};
///
/// // swish(x) = x * sigmoid(x): same shape, same batch dimension.
/// let swish = CustomOp::new("swish", |ins| Ok(ins[0].clone()), |xs| xs[0].f_mul(&xs[0].f_sigmoid()?))
///     .saves(Saves::Inputs);
/// let x = Tensor::randn([6, 3], (Kind::Float, Device::Cpu));
/// let lx = lazy(&x, 0);
/// let y = swish.apply(&[&lx])?;
/// assert_eq!(y.size(), [6, 3]);
/// let eager = &x * x.sigmoid();
/// assert!(y.to_tensor()?.allclose(&eager, 1e-6, 1e-6, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
#[derive(Clone)]
pub struct CustomOp {
    name: &'static str,
    shape: Rc<ShapeRule>,
    run: Rc<RunFn>,
    saves: Saves,
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomOp").field("name", &self.name).field("saves", &self.saves).finish_non_exhaustive()
    }
}

impl CustomOp {
    /// Where the batch goes: the rule's `batch_dim`, with the factor its size implies.
    fn flow(&self, nodes: &[Rc<Node>], out: &TensorMeta) -> Result<(Flow, Option<String>), String> {
        let mut size = None;
        let (mut reduced, mut opaque) = (false, false);
        for n in nodes {
            match n.meta.flow {
                Flow::PerSample(bd) => match size {
                    Some(s) if s != bd.size => return Err(format!("batch sizes {s} and {} differ", bd.size)),
                    _ => size = Some(bd.size),
                },
                Flow::Sum | Flow::Max => reduced = true,
                Flow::Opaque => opaque = true,
                Flow::Fixed => {}
            }
        }
        if opaque {
            return Ok((Flow::Opaque, None));
        }
        let Some(n) = size else {
            let mixes = reduced.then(|| "is applied to a value reduced over the batch".to_string());
            return Ok((if reduced { Flow::Opaque } else { Flow::Fixed }, mixes));
        };
        let Some(d) = out.batch_dim else {
            return Ok((Flow::Opaque, Some("drops the batch dimension (its rule gives no batch_dim)".to_string())));
        };
        let len = out.shape[d];
        if n == 0 || len % n != 0 {
            return Err(format!("output dimension {d} has size {len}, not a multiple of the batch size {n}"));
        }
        let mixes = reduced.then(|| "combines per-sample values with a value reduced over the batch".to_string());
        Ok((Flow::PerSample(BatchDim { dim: d, size: n, factor: len / n }), mixes))
    }

    /// An op called `name`, with its shape rule and its function.
    pub fn new(
        name: impl Into<String>,
        shape_rule: impl Fn(&[TensorMeta]) -> Result<TensorMeta, String> + 'static,
        run: impl Fn(&[&Tensor]) -> Result<Tensor, TchError> + 'static,
    ) -> Self {
        CustomOp { name: intern(name.into()), shape: Rc::new(shape_rule), run: Rc::new(run), saves: Saves::default() }
    }

    /// What autograd keeps for the op's backward ([`Saves::Inputs`] unless told).
    pub fn saves(mut self, saves: Saves) -> Self {
        self.saves = saves;
        self
    }

    /// Records the op on `inputs`.
    ///
    /// # Errors
    /// [`LazyError::Argument`] when the shape rule refuses the inputs (with its reason) or puts
    /// the batch where it cannot be (a dimension whose size is not a multiple of the batch),
    /// [`LazyError::Device`] for inputs on different devices.
    pub fn apply(&self, inputs: &[&LazyTensor]) -> Result<LazyTensor, LazyError> {
        let nodes: Vec<_> = inputs.iter().map(|t| t.node().clone()).collect();
        if nodes.is_empty() {
            return Err(LazyError::Argument {
                op: self.name.to_string(),
                shape: Vec::new(),
                reason: "a custom op needs at least one input".into(),
            });
        }
        let device = same_device(self.name, &nodes.iter().collect::<Vec<_>>())?;
        let metas: Vec<TensorMeta> = nodes
            .iter()
            .map(|n| TensorMeta {
                shape: n.meta.shape.to_vec(),
                kind: n.meta.kind,
                device: n.meta.device,
                batch_dim: n.meta.batch().map(|bd| bd.dim),
            })
            .collect();
        let argument = |reason: String| LazyError::Argument {
            op: self.name.to_string(),
            shape: nodes[0].meta.shape.to_vec(),
            reason,
        };
        let out = (self.shape)(&metas).map_err(argument)?;
        if let Some(d) = out.batch_dim {
            if d >= out.shape.len() {
                return Err(argument(format!("batch_dim {d} is out of range for output shape {:?}", out.shape)));
            }
        }
        let (flow, mixes) = self.flow(&nodes, &out).map_err(argument)?;
        Ok(Record::new(self.clone(), nodes, out.shape, out.kind, device).flow((flow, mixes)).finish())
    }
}

/// Names live as long as the process, as built-in ops' do: each distinct name is kept once,
/// so plans and errors name custom ops without allocating.
fn intern(name: String) -> &'static str {
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let names = names.get_or_insert_with(HashSet::new);
    if let Some(&known) = names.get(name.as_str()) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.insert(leaked);
    leaked
}

impl Operation for CustomOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn facts(&self, inputs: &[Rc<Node>], _meta: &Meta) -> OpFacts {
        OpFacts::new(inputs.len())
            .saves(|_i| matches!(self.saves, Saves::Inputs | Saves::InputsAndOutput))
            .saves_output(matches!(self.saves, Saves::Output | Saves::InputsAndOutput))
            // A user's function: what it takes besides its output is not known until measured.
            .kernels_unknown()
    }
}

impl Run for CustomOp {
    fn run(&self, ins: &[&Tensor], _cx: &RunCx<'_>) -> Result<Tensor, TchError> {
        (self.run)(ins)
    }
}

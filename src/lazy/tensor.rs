//! The facade of [`LazyTensor`]: leaves, queries, evaluation, layers, operators and
//! printing. The ops themselves are recorded by their families in [`ops`](super::ops): every
//! op comes twice, as in tch: `f_op` returns a [`LazyError`] for inputs libtorch would refuse,
//! `op` panics with that error's message.

use std::fmt;

use tch::{Device, Kind, Tensor};

use super::cost::machine::CpuMachine;
use super::cost::{CostModel, Work};
use super::error::LazyError;
use super::exec::{self, TracedOp};
use super::graph::LazyTensor;
use super::ops::arg;
use super::ops::pointwise::Binary;
use super::ops::record::leaf;
use super::options::Options;
use super::plan::{self, Mode, Plan};
use super::shape;
use crate::lazy::error::OrPanic;

impl LazyTensor {
    // -----------------------------------------------------------------------------------------
    // Leaves and queries

    /// A fixed operand: a tensor without a batch dimension (a parameter, a constant). Its
    /// gradient is accumulated by [`backward`](Self::backward) when it requires one.
    pub fn fixed(tensor: &Tensor) -> LazyTensor {
        leaf(tensor, None)
    }

    /// `tensor` as the left operand of an operator whose right one is `other`: a fixed
    /// operand, or a value computed at once when `other` is one.
    pub(crate) fn operand_beside(tensor: &Tensor, other: &LazyTensor) -> LazyTensor {
        match other.eager_value() {
            Some(_) => LazyTensor::from_eager(tensor.shallow_clone()),
            None => leaf(tensor, None),
        }
    }

    /// Another handle to the same value, as tch's `Tensor::shallow_clone` (a clone: a reference
    /// count), so that tch code calling it compiles unchanged.
    pub fn shallow_clone(&self) -> LazyTensor {
        self.clone()
    }

    /// A batched input with its batch dimension `dim` (negative counts from the end).
    ///
    /// # Errors
    /// [`LazyError::Argument`] when the tensor has no such dimension.
    pub fn batched(tensor: &Tensor, dim: i64) -> Result<LazyTensor, LazyError> {
        // The rank alone: the leaf reads the sizes with its other facts.
        let rank = tensor.dim();
        let d = shape::wrap_dim(dim, rank).map_err(|r| arg("lazy", &tensor.size(), r))?;
        if rank == 0 {
            return Err(arg("lazy", &[], "a 0-dim tensor has no batch dimension"));
        }
        Ok(leaf(tensor, Some(d)))
    }

    /// The sizes, at the full batch. Runs nothing.
    pub fn size(&self) -> Vec<i64> {
        if let Some(t) = self.eager_value() {
            return t.size();
        }
        self.node().meta.shape.to_vec()
    }

    /// The sizes, borrowed where recorded.
    pub(crate) fn shape(&self) -> std::borrow::Cow<'_, [i64]> {
        match self.eager_value() {
            Some(t) => std::borrow::Cow::Owned(t.size()),
            None => std::borrow::Cow::Borrowed(&self.node().meta.shape),
        }
    }

    /// The number of dimensions. Runs nothing.
    pub fn dim(&self) -> usize {
        if let Some(t) = self.eager_value() {
            return t.dim();
        }
        self.node().meta.shape.len()
    }

    /// The number of elements at the full batch. Runs nothing.
    pub fn numel(&self) -> usize {
        shape::numel(&self.node().meta.shape) as usize
    }

    /// The element kind. Runs nothing.
    pub fn kind(&self) -> Kind {
        if let Some(t) = self.eager_value() {
            return t.kind();
        }
        self.node().meta.kind
    }

    /// The device. Runs nothing.
    pub fn device(&self) -> Device {
        if let Some(t) = self.eager_value() {
            return t.device();
        }
        self.node().meta.device
    }

    /// Whether the value will require a gradient (some operand is a parameter that requires
    /// one). Runs nothing.
    pub fn requires_grad(&self) -> bool {
        self.node().meta.requires_grad
    }

    /// The batch dimension of a per-sample value, if it has one. Runs nothing.
    pub fn batch_dim(&self) -> Option<usize> {
        self.node().meta.batch().map(|bd| bd.dim)
    }

    /// The full batch size this value was recorded with, when it is per-sample. Runs nothing.
    pub fn batch_size(&self) -> Option<usize> {
        self.node().meta.batch().map(|bd| bd.size as usize)
    }

    /// The name of the op that produces this value (`"relu"`, `"conv2d"`, ..).
    pub fn op_name(&self) -> &str {
        self.recorded().name()
    }

    /// What the planner's rules charge the op that produced this value on its device (this
    /// machine's CPU, or its CUDA card), at the recorded batch size, and how a split treats it.
    /// Runs nothing (calibration does not run: these are the rules' figures).
    pub fn op_costs(&self) -> OpCosts {
        self.costs_by(&CostModel::of(self.node().meta.device))
    }

    /// [`op_costs`](Self::op_costs) as the rules price a CPU op on `machine`, whatever this one
    /// is: `docs/ops.md` lists every op for [`CpuMachine::rules_read_on`], so that it reads the
    /// same wherever it is generated.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, CpuIsa, CpuMachine};
    ///
    /// let x = Tensor::zeros([8, 12, 16, 16], (Kind::Float, Device::Cpu));
    /// let w = Tensor::zeros([20, 12, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let y = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1);
    /// // oneDNN pads 20 output channels to blocks of 16 with AVX-512, of 8 with AVX2.
    /// let avx512 = y.op_costs_on(&CpuMachine::rules_read_on());
    /// let avx2 = y.op_costs_on(&CpuMachine::new(CpuIsa::Avx2, 2));
    /// assert!(avx512.scratch > avx2.scratch);
    /// ```
    pub fn op_costs_on(&self, machine: &CpuMachine) -> OpCosts {
        self.costs_by(&CostModel::Cpu(super::cost::cpu::Cpu::of(machine)))
    }

    fn costs_by(&self, model: &CostModel) -> OpCosts {
        use super::graph::Flow;
        let node = self.recorded();
        let (meta, cost) = (&node.meta, &node.cost);
        let price = model.price(node, &mut Vec::new());
        // Costs are kept per sample and fixed; the batch is the graph's (1 without one).
        let batch = std::iter::once(node)
            .chain(&node.inputs)
            .find_map(|n| n.meta.batch().map(|bd| bd.size as u64))
            .unwrap_or(1);
        let total = |b: &super::size::Bytes| b.at(batch);
        let priced = |w: &Work| w.per * batch + w.fixed;
        let split = match (&meta.mixes, meta.flow) {
            (Some(reason), _) => Split::Mixes(reason.clone()),
            (None, Flow::PerSample(_)) => Split::PerSample,
            (None, Flow::Sum) => Split::Summed,
            (None, Flow::Max) => Split::Maximum,
            (None, Flow::Fixed) => Split::Fixed,
            (None, Flow::Opaque) => Split::Mixes("depends on the batch as a whole".into()),
        };
        OpCosts {
            output: total(&cost.out),
            operands: self
                .node()
                .inputs
                .iter()
                .map(|x| shape::numel(&x.meta.shape).max(0) as u64 * x.meta.kind.elt_size_in_bytes() as u64)
                .collect(),
            saves_output: node.facts.saves_output,
            saved_inputs: node.facts.saved.iter().collect(),
            saved_extra: priced(&price.kept),
            scratch: priced(&price.forward),
            backward_scratch: priced(&price.backward),
            split,
        }
    }

    pub(crate) fn meta(&self) -> &super::graph::Meta {
        &self.node().meta
    }

    // -----------------------------------------------------------------------------------------
    // Evaluation

    /// Computes the value, in micro-batches when the batch does not fit the budget (outputs
    /// are concatenated along the batch dimension, reductions over the batch combined).
    /// Runs without recording gradients: for those, see [`backward`](Self::backward). (A
    /// number read while a step records is computed with them, once: `f64::try_from`,
    /// [`double_value`](Self::double_value); a value one computed is returned as it is.)
    ///
    /// A value that a [`backward`](Self::backward) pass (or an optimizer's `backward_step`)
    /// has computed is kept: evaluating it afterwards, here or through `f64::try_from`,
    /// `double_value` or `Display`, returns what the step computed and runs nothing, so a loss
    /// printed after its step is the step's, and draws no random numbers. A value recorded
    /// anew (the next step's loss) runs with the parameters as they are then.
    ///
    /// ```
    /// use tch::{nn, nn::Module, Device, Kind, Tensor};
    /// use toma::lazy::lazy;
    ///
    /// let vs = nn::VarStore::new(Device::Cpu);
    /// let fc = nn::linear(vs.root(), 4, 1, Default::default());
    /// let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    /// let loss = lazy(&x, 0).apply(&fc).square().mean(None);
    /// let stepped = loss.backward()?;
    /// // What a step does: the weights change in place.
    /// tch::no_grad(|| {
    ///     let _ = fc.ws.shallow_clone().zero_();
    /// });
    /// // The step's value, not one computed with the zeroed weights.
    /// assert_eq!(f64::try_from(&loss)?, stepped);
    /// assert_ne!(f64::try_from(&lazy(&x, 0).apply(&fc).square().mean(None))?, stepped);
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    ///
    /// # Errors
    /// A [`LazyError`] when the plan cannot be made or libtorch fails.
    pub fn to_tensor(&self) -> Result<Tensor, LazyError> {
        exec::evaluate(self, &Options::default())
    }

    /// [`to_tensor`](Self::to_tensor) with options (a budget, a forced micro-batch, ..).
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor).
    pub fn to_tensor_with(&self, options: &Options) -> Result<Tensor, LazyError> {
        exec::evaluate(self, options)
    }

    /// Runs forward and backward in micro-batches and accumulates the gradients of every
    /// parameter into its `.grad()`, exactly as one backward over the full batch would (a
    /// mean-reduced loss weighs each micro-batch by its share of the batch). Returns the
    /// full-batch value of the loss, which the loss then keeps: evaluating it afterwards returns
    /// this value and runs nothing ([`to_tensor`](Self::to_tensor)).
    ///
    /// Each micro-batch's gradients are added only once its backward has completed, so a
    /// micro-batch that runs out of memory is halved and redone without counting twice.
    ///
    /// # Errors
    /// [`LazyError::NotScalar`] when the value is not a scalar; [`LazyError::MixesBatch`] when
    /// the batch must be split but the computation mixes samples; any other [`LazyError`]
    /// from planning or running.
    pub fn backward(&self) -> Result<f64, LazyError> {
        exec::backward(self, &Options::default())
    }

    /// [`backward`](Self::backward) with options.
    ///
    /// # Errors
    /// As [`backward`](Self::backward).
    pub fn backward_with(&self, options: &Options) -> Result<f64, LazyError> {
        exec::backward(self, options)
    }

    /// The memory plan of computing this value ([`Mode::Forward`]) or of forward and backward
    /// ([`Mode::Backward`]). Runs nothing: kernel calls no rule read on this machine prices are
    /// priced by what [`calibrate`](Self::calibrate) or an earlier step measured; where no
    /// allocator counts (the CPU before [`track_cpu_allocations`](crate::memory::track_cpu_allocations)),
    /// or under [`Calibrate::Never`](crate::lazy::Calibrate::Never), by their rules, which the
    /// plan says ([`Plan::calibration`]). The same graph with the same measurements plans the
    /// same.
    ///
    /// # Errors
    /// [`LazyError::NotCalibrated`] where calls the plan needs measured were never measured
    /// though an allocator could measure them (call [`calibrate`](Self::calibrate) first);
    /// [`LazyError::DoesNotFit`] when even one sample exceeds the budget, and
    /// [`LazyError::MixesBatch`] / [`LazyError::NotSplittable`] as evaluation would report them.
    pub fn plan(&self, mode: Mode, options: &Options) -> Result<Plan, LazyError> {
        plan::plan(self, mode, options)
    }

    /// Measures the kernel calls of this value's plan (in `mode`) that no rule read on this
    /// machine prices, as the first step would ([`Options::calibrate`] says which): each alone,
    /// on stand-in inputs, where an allocator counts (on CUDA, or on the CPU after
    /// [`track_cpu_allocations`](crate::memory::track_cpu_allocations)). Later plans and steps
    /// of graphs with these calls find them measured. libtorch's random generator is left as
    /// it was.
    ///
    /// ```
    /// use tch::{Device, Kind, Tensor};
    /// use toma::lazy::{lazy, Mode, Options};
    ///
    /// let x = Tensor::randn([8, 3, 10, 10], (Kind::Float, Device::Cpu));
    /// let w = Tensor::randn([4, 3, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    /// let loss = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1).sum(Kind::Float);
    /// let measured = loss.calibrate(Mode::Backward, &Options::new())?;
    /// let plan = loss.plan(Mode::Backward, &Options::new())?;
    /// // What was measured now is found by the plan.
    /// assert_eq!(plan.calibration().remembered, measured.measured + measured.remembered);
    /// # Ok::<(), toma::lazy::LazyError>(())
    /// ```
    ///
    /// # Errors
    /// [`LazyError::NotScalar`] for [`Mode::Backward`] of a value that is not a scalar.
    pub fn calibrate(&self, mode: Mode, options: &Options) -> Result<crate::lazy::Calibration, LazyError> {
        // Calibration's kernels measure the graph's own kinds, not libtorch's casts of them.
        let _suspended = crate::autocast::Suspended::new();
        plan::calibrate(self, mode, options)
    }

    /// The first element's value as `f64`, computed (tch's `double_value`). While a step
    /// records, computed once and kept for the step
    /// ([reading a value while recording](crate::lazy#reading-a-value-while-recording)).
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor), and libtorch's error for a bad index.
    pub fn f_double_value(&self, index: &[i64]) -> Result<f64, LazyError> {
        let t = exec::read(self, "double_value")?;
        t.f_double_value(index).map_err(|source| LazyError::Torch { node: None, op: "double_value".into(), source })
    }

    /// Like [`f_double_value`](Self::f_double_value), panicking on error.
    #[track_caller]
    pub fn double_value(&self, index: &[i64]) -> f64 {
        self.f_double_value(index).or_panic()
    }

    /// An element's value as `i64`, computed (tch's `int64_value`), as
    /// [`f_double_value`](Self::f_double_value) computes it.
    ///
    /// # Errors
    /// As [`f_double_value`](Self::f_double_value).
    pub fn f_int64_value(&self, index: &[i64]) -> Result<i64, LazyError> {
        let t = exec::read(self, "int64_value")?;
        t.f_int64_value(index).map_err(|source| LazyError::Torch { node: None, op: "int64_value".into(), source })
    }

    /// Like [`f_int64_value`](Self::f_int64_value), panicking on error.
    #[track_caller]
    pub fn int64_value(&self, index: &[i64]) -> i64 {
        self.f_int64_value(index).or_panic()
    }

    // -----------------------------------------------------------------------------------------
    // Modules

    /// Applies a layer (tch's `apply`): `x.apply(&linear)`.
    ///
    /// # Errors
    /// The layer's recording error.
    pub fn f_apply<M: super::nn::LazyModule + ?Sized>(&self, module: &M) -> Result<LazyTensor, LazyError> {
        if let Some(out) = self.eager_value().and_then(|t| module.eager_forward(t)) {
            return Ok(LazyTensor::from_eager(out));
        }
        module.lazy_forward(self)
    }

    /// Applies a layer that behaves differently in training (tch's `apply_t`).
    ///
    /// # Errors
    /// The layer's recording error.
    pub fn f_apply_t<M: super::nn::LazyModuleT + ?Sized>(
        &self,
        module: &M,
        train: bool,
    ) -> Result<LazyTensor, LazyError> {
        if let Some(out) = self.eager_value().and_then(|t| module.eager_forward_t(t, train)) {
            return Ok(LazyTensor::from_eager(out));
        }
        module.lazy_forward_t(self, train)
    }
}

impl LazyTensor {
    /// Like [`f_apply`](Self::f_apply), panicking with its error.
    ///
    /// # Panics
    /// When the layer cannot be recorded.
    #[track_caller]
    pub fn apply<M: super::nn::LazyModule + ?Sized>(&self, module: &M) -> LazyTensor {
        self.f_apply(module).or_panic()
    }

    /// Like [`f_apply_t`](Self::f_apply_t), panicking with its error.
    ///
    /// # Panics
    /// When the layer cannot be recorded.
    #[track_caller]
    pub fn apply_t<M: super::nn::LazyModuleT + ?Sized>(&self, module: &M, train: bool) -> LazyTensor {
        self.f_apply_t(module, train).or_panic()
    }
}

// ---------------------------------------------------------------------------------------------
// Operators: panic on shape errors, as tch's operators do.

macro_rules! binary_operators {
    ($($trait:ident $method:ident $f:ident $fs:ident $rev:ident $op:ident $reversed:literal;)*) => {$(
        impl std::ops::$trait<i64> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: i64) -> LazyTensor {
                self.f_int_scalar(Binary::$op, rhs, false).or_panic()
            }
        }
        impl std::ops::$trait<i64> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: i64) -> LazyTensor {
                self.f_int_scalar(Binary::$op, rhs, false).or_panic()
            }
        }
        impl std::ops::$trait<&LazyTensor> for i64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                rhs.f_int_scalar(Binary::$op, self, $reversed).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for i64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                rhs.f_int_scalar(Binary::$op, self, $reversed).or_panic()
            }
        }
        impl std::ops::$trait<&LazyTensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                self.$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                self.$f(&rhs).or_panic()
            }
        }
        impl std::ops::$trait<&LazyTensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                self.$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                self.$f(&rhs).or_panic()
            }
        }
        impl std::ops::$trait<&Tensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> LazyTensor {
                self.$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<&Tensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> LazyTensor {
                self.$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<Tensor> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> LazyTensor {
                self.$f(&rhs).or_panic()
            }
        }
        impl std::ops::$trait<Tensor> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> LazyTensor {
                self.$f(&rhs).or_panic()
            }
        }
        // A tensor on the left (`pos_emb + tok_emb`) is a fixed operand, as on the right.
        impl std::ops::$trait<&LazyTensor> for &Tensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                LazyTensor::operand_beside(self, rhs).$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for &Tensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                LazyTensor::operand_beside(self, &rhs).$f(&rhs).or_panic()
            }
        }
        impl std::ops::$trait<&LazyTensor> for Tensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                LazyTensor::operand_beside(&self, rhs).$f(rhs).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for Tensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                LazyTensor::operand_beside(&self, &rhs).$f(&rhs).or_panic()
            }
        }
        impl std::ops::$trait<f64> for &LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> LazyTensor {
                self.$fs(rhs).or_panic()
            }
        }
        impl std::ops::$trait<f64> for LazyTensor {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: f64) -> LazyTensor {
                self.$fs(rhs).or_panic()
            }
        }
        impl std::ops::$trait<&LazyTensor> for f64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: &LazyTensor) -> LazyTensor {
                rhs.$rev(self).or_panic()
            }
        }
        impl std::ops::$trait<LazyTensor> for f64 {
            type Output = LazyTensor;
            #[track_caller]
            fn $method(self, rhs: LazyTensor) -> LazyTensor {
                rhs.$rev(self).or_panic()
            }
        }
    )*};
}

binary_operators! {
    Add add f_add f_add_scalar f_add_scalar Add false;
    Sub sub f_sub f_sub_scalar f_rsub_scalar Sub true;
    Mul mul f_mul f_mul_scalar f_mul_scalar Mul false;
    Div div f_div f_div_scalar f_rdiv_scalar Div true;
}

// `loss += term`, as tch writes it, of whatever `&lazy + term` takes. tch's adds into the
// tensor's storage, which its other handles see; a recorded value has no storage yet, so the
// name takes the new value, and other handles of the old one keep it.
macro_rules! assign_operators {
    ($($trait:ident $method:ident $op:ident $sym:tt;)*) => {$(
        impl<R> std::ops::$trait<R> for LazyTensor
        where
            for<'a> &'a LazyTensor: std::ops::$op<R, Output = LazyTensor>,
        {
            #[track_caller]
            fn $method(&mut self, rhs: R) {
                *self = &*self $sym rhs;
            }
        }
    )*};
}

assign_operators! {
    AddAssign add_assign Add +;
    SubAssign sub_assign Sub -;
    MulAssign mul_assign Mul *;
    DivAssign div_assign Div /;
}

impl std::ops::Neg for &LazyTensor {
    type Output = LazyTensor;
    fn neg(self) -> LazyTensor {
        LazyTensor::neg(self)
    }
}

impl std::ops::Neg for LazyTensor {
    type Output = LazyTensor;
    fn neg(self) -> LazyTensor {
        LazyTensor::neg(&self)
    }
}

// `terms.iter().map(..).sum()`, as tch sums tensors: each term added to the sum so far, and
// tch's `Tensor::from(0.)` (a double scalar, a constant here) for none.
impl std::iter::Sum for LazyTensor {
    #[track_caller]
    fn sum<I: Iterator<Item = LazyTensor>>(mut iter: I) -> LazyTensor {
        match iter.next() {
            None => LazyTensor::fixed(&Tensor::from(0.)),
            Some(first) => iter.fold(first, |sum, x| x + sum),
        }
    }
}

impl<'a> std::iter::Sum<&'a LazyTensor> for LazyTensor {
    #[track_caller]
    fn sum<I: Iterator<Item = &'a LazyTensor>>(iter: I) -> LazyTensor {
        iter.cloned().sum()
    }
}

// ---------------------------------------------------------------------------------------------
// Forcing evaluation: printing and conversions compute the value.

impl fmt::Display for LazyTensor {
    /// Computes the value and prints it as tch does; an error is printed in its place.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match exec::read(self, "Display") {
            Ok(t) => fmt::Display::fmt(&t, f),
            Err(e) => write!(f, "<{e}>"),
        }
    }
}

impl fmt::Debug for LazyTensor {
    /// The recorded facts: op, shape, kind, device and batch dimension. Evaluates nothing, so
    /// `dbg!`, `{:?}` in a log line or an assertion message never plans, allocates or runs out
    /// of memory; `Display` computes the value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.meta();
        write!(f, "LazyTensor[{}, {:?}, {:?}, {:?}", self.op_name(), m.shape, m.kind, m.device)?;
        if let Some(bd) = m.batch() {
            write!(f, ", batch dim {}", bd.dim)?;
        }
        f.write_str("]")
    }
}

macro_rules! try_from_lazy {
    ($($t:ty),*) => {$(
        impl TryFrom<&LazyTensor> for $t {
            type Error = LazyError;
            /// Computes the value and converts it as tch's `TryFrom<&Tensor>` does; while a
            /// step records, once, kept for the step (see [`LazyTensor::f_double_value`]).
            fn try_from(value: &LazyTensor) -> Result<Self, LazyError> {
                let t = exec::read(value, concat!(stringify!($t), "::try_from"))?;
                <$t>::try_from(&t).map_err(|source| LazyError::Torch { node: None, op: "try_from".into(), source })
            }
        }
        impl TryFrom<LazyTensor> for $t {
            type Error = LazyError;
            /// Computes the value and converts it as tch's `TryFrom<&Tensor>` does.
            fn try_from(value: LazyTensor) -> Result<Self, LazyError> {
                <$t>::try_from(&value)
            }
        }
    )*};
}

try_from_lazy!(f64, f32, i64, bool, Vec<f64>, Vec<f32>, Vec<i64>);

impl TryFrom<&LazyTensor> for Tensor {
    type Error = LazyError;
    /// Computes the value ([`LazyTensor::to_tensor`]).
    fn try_from(value: &LazyTensor) -> Result<Self, LazyError> {
        value.to_tensor()
    }
}

impl LazyTensor {
    /// The plan of the value's forward and backward, as a table: handy to print.
    ///
    /// # Errors
    /// As [`plan`](Self::plan).
    pub fn explain(&self, mode: Mode, options: &Options) -> Result<String, LazyError> {
        Ok(self.plan(mode, options)?.to_string())
    }
}

/// What the planner charges one op ([`LazyTensor::op_costs`]), in bytes at the recorded batch
/// size. The saved parts count only when gradients flow through the op.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpCosts {
    /// The output's new allocation (0 for a view, an input or a parameter).
    pub output: u64,
    /// Each operand's size.
    pub operands: Vec<u64>,
    /// Whether autograd keeps the output for the backward.
    pub saves_output: bool,
    /// The operands autograd keeps for the backward (by position).
    pub saved_inputs: Vec<usize>,
    /// What else autograd keeps (indices of maxima, statistics, intermediate values).
    pub saved_extra: u64,
    /// Temporaries while the op runs forward, and while its backward runs.
    pub scratch: u64,
    /// See [`scratch`](Self::scratch).
    pub backward_scratch: u64,
    /// How micro-batches treat the value.
    pub split: Split,
}

/// How micro-batches treat a value ([`OpCosts::split`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Split {
    /// Per-sample rows: each micro-batch computes its own, concatenated.
    PerSample,
    /// A sum over the batch (a mean is weighted by each micro-batch's share): added up.
    Summed,
    /// A maximum over the batch: combined by a maximum (forward only).
    Maximum,
    /// Independent of the batch.
    Fixed,
    /// Mixes samples: a split would change the result, so it is refused (the reason).
    Mixes(String),
}

impl LazyTensor {
    /// Runs the first micro-batch of `micro_batch` samples and reports, per op, the value the
    /// executor produced (shape, bytes allocated) and what it held afterwards: the facts the
    /// plan predicts, for checking a plan or debugging one.
    ///
    /// # Errors
    /// As [`to_tensor`](Self::to_tensor).
    pub fn trace(&self, mode: Mode, micro_batch: usize) -> Result<Vec<TracedOp>, LazyError> {
        exec::trace(self, mode, micro_batch)
    }
}

//! Plan memory up front, run in micro-batches, get the full batch's gradients.
//!
//! Wrap the inputs with [`lazy`]; every op on them (tch's names: `relu`, `matmul`, `conv2d`,
//! `cross_entropy_for_logits`, ..) is recorded, shape-checked at once, and run only when a
//! value is needed. Then:
//!
//! - [`LazyTensor::backward`] plans the peak memory of forward and backward, picks the largest
//!   micro-batch that fits (the whole batch when it fits: no split), runs forward and backward
//!   per micro-batch and accumulates parameter gradients — equal to one full-batch backward,
//!   mean-reduced losses included — and returns the full-batch loss;
//! - [`LazyTensor::to_tensor`] (and `Display`, `Debug`, `f64::try_from`, `double_value`)
//!   computes a value, concatenating micro-batch outputs along the batch dimension;
//! - [`LazyTensor::plan`] shows the plan without running anything; [`Plan`] prints as a table.
//!
//! ```
//! use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
//! use toma::lazy::{lazy, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let (l1, l2) = (nn::linear(vs.root() / "l1", 16, 32, Default::default()), nn::linear(vs.root() / "l2", 32, 4, Default::default()));
//! let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
//! let images = Tensor::randn([100, 16], (Kind::Float, Device::Cpu));
//! let labels = Tensor::randint(4, [100], (Kind::Int64, Device::Cpu));
//!
//! // The one line toma::lazy needs: the batch dimension of the inputs.
//! let (x, y) = lazy((&images, &labels), 0);
//! let loss = x.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&y);
//!
//! // A tiny budget forces micro-batches; the gradients are the full batch's all the same.
//! let options = Options::new().budget(40 << 10);
//! println!("{}", loss.plan(toma::lazy::Mode::Backward, &options)?);
//! opt.zero_grad();
//! let value = loss.backward_with(&options)?;
//! opt.step();
//! assert!(value > 0.0);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! # What splits, and what does not
//!
//! A value's samples are followed through every op: elementwise ops, products, convolutions,
//! pooling, normalizations over features, views that keep samples together (`[N, T, C] ->
//! [N * T, C]`) keep them per-sample. Sums and means over the batch (`sum`, `mean`, the losses)
//! add up over micro-batches, each weighted by its share, and so do linear combinations of them
//! (`loss + 0.01 * l2`). Ops that mix samples — batch norm in training mode, softmax or layer
//! norm over the batch dimension, a batch statistic used per sample — make splitting change
//! the result: when the batch does not fit, a backward recomputes activations instead and keeps
//! the whole batch together ([`Recompute`]); where that does not fit either, or a forward must
//! split, they are refused naming the op ([`LazyError::DoesNotFit`], [`LazyError::MixesBatch`]),
//! unless [`Options::allow_batch_mixing`] says otherwise. Nothing is ever run
//! eagerly on the full batch behind your back: an op the graph cannot plan is an error.
//!
//! # Plan, then verify
//!
//! Micro-batches run under the retry engine ([`Range`](crate::Range)): one that still runs out
//! of memory is halved, and the size that worked is remembered in toma's cache, per graph
//! shape. Nothing counts twice: where `.grad` was none when the step began (`zero_grad()`),
//! micro-batches add into it in place (one copy of the gradients, as plain tch accumulating)
//! and a failure sets it back to none and starts the step again at the smaller size; where it
//! held gradients, each micro-batch's are added only once its backward completed
//! ([`Plan::accumulates_in_place`]). A `tracing` info event reports each plan (peak, budget,
//! micro-batch, chunks).
//!
//! # Mixed precision
//!
//! Record the step inside [`toma::autocast`](crate::autocast()) (the CPU in `BFloat16` or
//! `Half`, CUDA in either; tch's own `tch::autocast` on CUDA is read too). Each op libtorch's
//! autocast lists for the device gets the casts it would insert, as `autocast` nodes: products
//! and convolutions in the lower precision, losses (and on CUDA norms, softmax, `exp`, ..) in
//! `Float`. The graph then runs at `backward()`, after the region, and computes what eager
//! autocast computes: an unsplit step is bit-identical to it. The plan counts the 16-bit copies
//! autograd saves (and prints `autocast: N casts to BFloat16`). In `Half`, scale the loss with
//! [`GradScaler`]:
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn, nn::GradScaler, nn::OptimizerConfig, Mode, Options};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let (l1, l2) = (nn::linear(vs.root() / "l1", 16, 64, Default::default()), nn::linear(vs.root() / "l2", 64, 4, Default::default()));
//! let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
//! let mut scaler = GradScaler::new();
//! let x = Tensor::randn([64, 16], (Kind::Float, Device::Cpu));
//! let y = Tensor::randint(4, [64], (Kind::Int64, Device::Cpu));
//! let loss = toma::autocast(Device::Cpu, Kind::Half, || {
//!     let (x, y) = lazy((&x, &y), 0);
//!     x.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&y)
//! });
//! assert!(loss.plan(Mode::Backward, &Options::new())?.to_string().contains("casts to Half"));
//! let step = scaler.backward_step(&mut opt, &loss)?; // the parameters stay Float
//! assert!(step.stepped && step.value.is_finite());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cost;
mod error;
mod exec;
mod graph;
mod index;
mod int_list;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
mod options;
mod plan;
mod rnn;
pub mod scaler;
mod shape;
mod tch_compat;
mod tensor;
mod tensor_ops;
pub mod vision;
mod wrap;

pub use cost::cuda::{round_block, BLOCK};
pub use cost::machine::{CpuIsa, CpuMachine};
pub use cost::measured::Calibration;
pub use error::LazyError;
pub use exec::TracedOp;
pub use graph::LazyTensor;
pub use index::{LazyIndexer, TensorIndex};
pub use int_list::{IntList, IntListOption};
pub use nn::{Layer, LayerT};
pub use ops::custom::{CustomOp, Saves, TensorMeta};
pub use ops::record::{IntoLazy, WeightOperand};
pub use ops::{Fallible, LayoutOps, LossOps, MatrixOps, NormOps, PointwiseOps, ReduceOps, WindowOps};
pub use optim::Loss;
pub use options::{Calibrate, Options, Recompute};
pub use plan::{remember_corrections, Mode, Phase, Plan, PlanOp, Step};
pub use scaler::{GradScaler, ScaledStep};
pub use tensor::{OpCosts, Split};
pub use tensor_ops::{Arithmetic, Operators, TensorOps};
pub use wrap::{lazy, try_lazy, BatchDimArg, Lazify};

/// One body for a custom layer, eagerly and lazily: on `impl Module for X` with `fn forward(&self,
/// xs: &Tensor) -> Tensor`, or `impl ModuleT for X` with `fn forward_t(&self, xs: &Tensor,
/// train: bool) -> Tensor`, it implements tch's trait with the body as written and
/// [`nn::LazyModule`] (or [`nn::LazyModuleT`]) with the same body over `xs: &LazyTensor`: tch's
/// tensor methods and operators have the same names there. A `Tensor` named inside the body's
/// own type annotations does not type-check lazily; the compiler points at it.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, nn, nn::Module};
///
/// // minGPT's linear layer, as tch's example writes it, plus the one attribute.
/// #[derive(Debug)]
/// struct Linear { ws: Tensor, bs: Tensor }
///
/// #[toma::lazy::module]
/// impl Module for Linear {
///     fn forward(&self, xs: &Tensor) -> Tensor {
///         xs.matmul(&self.ws.tr()) + &self.bs
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let l = Linear { ws: vs.root().randn("w", &[3, 4], 0.0, 1.0), bs: vs.root().zeros("b", &[3]) };
/// let x = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
/// let eager = x.apply(&l);
/// let lazily = lazy(&x, 0).apply(&l).to_tensor()?;
/// assert!(eager.allclose(&lazily, 1e-6, 1e-6, false));
/// // The method call, on either kind of tensor (`toma::lazy::nn::Module` in scope).
/// assert!(l.forward(&lazy(&x, 0)).to_tensor()?.allclose(&l.forward(&x), 1e-6, 1e-6, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
///
/// tch's impl is written with the types and trait path as the user wrote them, so a port's
/// `use tch::Tensor` and `use toma::lazy::nn::ModuleT` stay used (no warnings under
/// `-D warnings`).
///
/// # On a model's own methods and functions
///
/// On an inherent `impl` block (tch-rs's `impl VAE { fn encode(&self, xs: &Tensor) -> (Tensor,
/// Tensor) .. }`) or on a free `fn` over tensors (its `fn loss(..) -> Tensor`), each method or
/// function whose arguments or result name `Tensor` serves both kinds: its body, as written,
/// is compiled once for `Tensor` and once with `LazyTensor` in its place (in a hidden trait),
/// and the method becomes generic over the two, so `vae.forward(&lazy(&x, 0))` records and
/// `vae.decode(&noise)` on a `Tensor` runs eagerly, with the same method call. Methods that name
/// no `Tensor` (`new`) stay as they are.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, nn, nn::Module};
///
/// struct Vae { enc: nn::Linear, dec: nn::Linear }
///
/// #[toma::lazy::module]
/// impl Vae {
///     fn encode(&self, xs: &Tensor) -> Tensor {
///         self.enc.forward(xs).relu()
///     }
///     fn forward(&self, xs: &Tensor) -> (Tensor, Tensor) {
///         let h = self.encode(xs);
///         (self.dec.forward(&h).sigmoid(), h)
///     }
/// }
///
/// #[toma::lazy::module]
/// fn loss(recon: &Tensor, x: &Tensor) -> Tensor {
///     recon.mse_loss(x, tch::Reduction::Sum)
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let vae = Vae { enc: nn::linear(vs.root() / "e", 8, 4, Default::default()), dec: nn::linear(vs.root() / "d", 4, 8, Default::default()) };
/// let x = Tensor::rand([16, 8], (Kind::Float, Device::Cpu));
/// let eager = loss(&vae.forward(&x).0, &x);
/// let lx = lazy(&x, 0);
/// let lazily = loss(&vae.forward(&lx).0, &lx);
/// assert!((lazily.backward()? - eager.double_value(&[])).abs() < 1e-4);
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
pub use toma_macros::module;

//! Plan memory up front, run in micro-batches, get the full batch's gradients.
//!
//! The retry half of toma finds a batch size by failing; `toma::lazy` finds it before anything
//! runs. Wrap the inputs with [`lazy`]; every op on them (tch's names: `relu`, `matmul`,
//! `conv2d`, `cross_entropy_for_logits`, ..) is recorded, shape-checked at once, and run only
//! when a value is needed. Then:
//!
//! - [`LazyTensor::backward`] plans the peak memory of forward and backward, picks the largest
//!   micro-batch that fits (the whole batch when it fits: no split), runs forward and backward
//!   per micro-batch and accumulates parameter gradients — equal to one full-batch backward,
//!   mean-reduced losses included — and returns the full-batch loss;
//! - [`LazyTensor::to_tensor`] (and `Display`, `f64::try_from`, `double_value`) computes a
//!   value, concatenating micro-batch outputs along the batch dimension;
//! - [`LazyTensor::plan`] shows the plan without running anything; [`Plan`] prints as a table
//!   and draws itself ([`Plan::to_svg`]).
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
//! # What a plan counts
//!
//! A plan is the **peak** of a schedule of forward and backward, not a sum: tensor lifetimes,
//! what autograd saves, parameter gradients, the optimizer's step when toma's optimizer takes it
//! (below), and on CUDA the caching allocator's 512-byte blocks. Each op names the kernel calls it
//! makes, and a cost model of the device prices their scratch space (oneDNN's convolutions phase
//! by phase on x86, cuDNN's workspace and ATen's reduction staging on CUDA). When the whole batch
//! does not fit, the plan takes the largest power-of-two micro-batch whose peak fits the budget:
//! the device's free memory less [`Options::safety_margin`], or [`Options::budget`]. Planning a
//! 96-layer transformer graph (3,850 ops) takes under a millisecond on a 2-core CPU.
//!
//! On CUDA, what runs out is what libtorch's caching allocator must *reserve*: a request its
//! cached free pieces cannot serve needs a new segment, which the card may not have room for
//! though the tensors would fit (fragmentation). So a plan on a card is replayed through a model
//! of that allocator (libtorch 2.11's pools, segments, splitting, release-and-retry, expandable
//! segments), with its settings as libtorch parsed them, from the segments the card's allocator
//! holds as the step begins ([`memory::cuda_segments`](crate::memory::cuda_segments)), and
//! given only where every request of its step is placed within the budget. Where a cached
//! segment would be split for a small request and pin memory a larger one needs, the step
//! empties libtorch's cache first if that places it ([`Plan::emptied_cache_bytes`]), rather
//! than running smaller. Among recomputed cuts, the fastest the allocator
//! places is chosen; among micro-batches, the largest. Where the plan of the budget's tensors
//! is refused, [`Plan::unplaced`] says which request failed ([`UnplacedRequest`]: "the plan of
//! 3.6 GiB allocated (micro-batch 903, 3 recomputed segments) is not placed: op #9 `relu`
//! (recompute, micro-batch of 903): 903 MiB request: 1.5 GiB free in cached pieces, none ≥
//! 903 MiB; 70.41 MiB left on the card"). Where nothing is placed, [`LazyError::NotPlaced`]
//! says so, and whether expandable segments would place the same plan. The printed plan gives
//! both peaks, and [`Plan::reserved_bytes`] the reserved one. The allocator is held to the
//! budget: the safety margin stays in reserve for what the model does not see. Replayed
//! against the H200 run of 2026-11-27, the two steps that ran out of memory there are refused
//! for the request libtorch named, and the reserved peaks of those that ran are predicted
//! within 8% (`docs/gpu.md`).
//! [`Options::expandable_segments`] turns libtorch's expandable segments on without an
//! environment variable. [`Options::card`] plans for a card you do not have, on any machine
//! ([`CudaCard`]: its memory, multiprocessors, what is in use, its allocator settings).
//!
//! Reading a value does not re-run a step: a loss read after its `backward` or `backward_step` is
//! the step's value (no forward with the updated parameters, no random numbers drawn). Shape,
//! kind and device queries run nothing, and neither does `Debug` (it prints op, shape, kind,
//! device and batch dimension), so `dbg!` and `?x` in a log line are safe.
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
//! the whole batch together ([Recompute instead of split](#recompute-instead-of-split)); where
//! that does not fit either, or a forward must split, they are refused naming the op
//! ([`LazyError::DoesNotFit`], [`LazyError::MixesBatch`]), unless
//! [`Options::allow_batch_mixing`] says otherwise. Nothing is ever run eagerly on the full batch
//! behind your back: an op the graph cannot plan is an error, and [`CustomOp`] adds your own op
//! with a shape rule. `docs/ops.md` in the repository lists every op and layer, generated from
//! the code: how micro-batches treat it and what the planner charges it
//! ([`LazyTensor::op_costs`]).
//!
//! # Reading a value while recording
//!
//! Code that decides by a value — greedy decoding that feeds each prediction back and stops at
//! end-of-sentence — reads it while the step records: `i64::try_from(&x)`, `f64::try_from`,
//! `Vec::<i64>::try_from`, [`LazyTensor::double_value`], [`LazyTensor::int64_value`],
//! `Display`. Where autograd records (grad mode on) and the value depends on something that
//! requires a gradient, the read computes it as eager code would: once, whole, with autograd.
//! The step then continues from what it computed: nothing before it runs again, dropout draws
//! its masks once, and the gradients are eager's. The values later ops may still take are kept
//! until the graph is dropped, as eager autograd keeps them.
//!
//! ```
//! use tch::{nn, Device, Kind, Tensor};
//! use toma::lazy::lazy;
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let fc = nn::linear(vs.root(), 8, 3, Default::default());
//! let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
//! let logits = lazy(&x, 0).apply(&fc).dropout(0.5, true);
//! // Computed now, once: the dropout mask drawn here is the step's.
//! let predicted = Vec::<i64>::try_from(&logits.argmax(-1, false))?;
//! let loss = logits.log_softmax(-1, None).nll_loss(&lazy(&Tensor::from_slice(&predicted), 0));
//! loss.backward()?; // from the logits the read computed
//! assert_eq!(logits.op_name(), "dropout");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What a read computes is the full batch's, and its memory is spent when it is read, outside
//! any plan. A later step that splits slices each per-sample value the reads kept; one that
//! takes a sum over the batch a read kept (a loss read before its step) runs whole, and its
//! plan says why. Read the loss after its step, where the read costs nothing. A read that runs
//! out of memory whole is computed in micro-batches instead, and a step that takes it computes
//! it again. Under `tch::no_grad`, and through [`LazyTensor::to_tensor`], a value is computed
//! as planned, in micro-batches where the batch does not fit, without gradients, and kept
//! nowhere. An op *recorded* under `tch::no_grad` (a target network's estimate, `tch::no_grad(||
//! target.forward(&next_obs))`) is recorded detached: as eagerly, no gradient flows back
//! through it.
//!
//! # Plan, then verify
//!
//! Micro-batches run under the retry engine ([`Range`](crate::Range)): one that still runs out
//! of memory is halved, and the size that worked is remembered in toma's cache, per graph
//! shape. A step that may not be split is planned again under a lower budget, recomputing more.
//!
//! Nothing counts twice, and the gradients are held once. Where `.grad` was none when the step
//! began (the first step, or after `zero_grad()`, which sets it to none), micro-batches let
//! autograd add straight into it, as plain tch does when it accumulates; a micro-batch that runs
//! out of memory spoils that sum, so `.grad` is set back to none and the step starts again from
//! its first sample at half the size. Where `.grad` held gradients, each micro-batch's are kept
//! apart until its backward completed and then added, so a failure leaves them as they were
//! ([`Plan::accumulates_in_place`] says which). An unsplit step peaks like plain tch, within 5%.
//!
//! Where an allocator counts (CUDA, or the CPU after
//! [`track_cpu_allocations`](crate::memory::track_cpu_allocations)), every micro-batch's peak is
//! measured against its plan. A run that peaked above its plan (an op whose temporaries the
//! planner cannot see: a `CustomOp`, a kernel that changed) leaves its excess with the graph, and
//! the graph's later plans hold it in reserve ([`Plan::correction_bytes`], a `verified:` line in
//! the printed plan). An excess may be fixed (a workspace, gradient buffers) or per sample: each
//! measurement bounds it at every micro-batch (at most itself at fewer samples, at most in
//! proportion at more) and the reserve is the tightest bound, so a fixed excess is held whole when
//! the plan goes smaller, and a second size measured tells the parts apart.
//! [`remember_corrections`]`(path)` keeps the corrections and calibrations across processes: it
//! reads what the file holds for this machine (libtorch's release, its threads, the architecture,
//! the first CUDA card's multiprocessors) and appends every new measurement; once this machine's
//! lines pass 4096 and twice what they hold, the file is rewritten with what they hold. A
//! `tracing` info event reports each plan (peak, budget, micro-batch, chunks).
//!
//! # Measure first; rules are the prior
//!
//! The rules that price kernel calls were read on one machine
//! ([`CpuMachine::rules_read_on`]: libtorch 2.11 with oneDNN 3.10.2 on AVX-512 with BF16, 1 and 2
//! threads, in the kinds `docs/performance.md` names). The memory of a product or a convolution
//! depends on the kernel libtorch picks, and that depends on the CPU (with AVX2 oneDNN blocks
//! channels by 8, not 16; with AVX512-FP16 `Half` products go to oneDNN). So wherever an
//! allocator counts, a step measures every such call before it plans, and takes the rules only
//! where this machine has the key they were read on ([`CpuMachine::reads_rules_of`]: oneDNN's
//! instruction set, the CPU's features, libtorch's bf16 and fp16 checks, ATen's capability, the
//! release and at most the threads; `docs/cpu-dispatch.md` says which feature changes which
//! kernel). [`Options::calibrate`] chooses ([`Calibrate::Auto`] by default). Measured calls are:
//!
//! - products and convolutions of every kind, off the rules' key ([`CpuMachine::host`] reads
//!   oneDNN's instruction set as oneDNN does, `ONEDNN_MAX_CPU_ISA` included, and asks libtorch
//!   its own checks; the printed plan names both machines);
//! - on the rules' key too, `BFloat16` products and convolutions, whose rules do not price every
//!   form closely, and a `Float` convolution whose kernel covers its whole input (oneDNN's inner
//!   product);
//! - on CUDA, every convolution (cuDNN's workspace depends on the card, the engine and the
//!   library release). Products keep their rules there: cuBLAS takes its workspace once per
//!   handle, and a `linear`'s bias gradient stages a reduction buffer that grows with the rows
//!   unlike any line through the sizes measured;
//! - anything on another libtorch release, and ops no rule knows (a [`CustomOp`]);
//! - everything with a rule, where rules are off ([`trust_rules`]`(false)`, or
//!   `TOMA_TRUST_RULES=0` in the environment).
//!
//! Rules price the rest, plans for another machine ([`LazyTensor::op_costs_on`]), and plans
//! where no allocator counts.
//!
//! A measured call runs alone on stand-ins at 1, 2, 8, 32 and 128 samples (the sizes below its
//! batch, each power of two from 256 below it, and the batch itself; a micro-batch asked for and
//! the batch's remainder too) under the allocator counter: forward, and in a backward plan its
//! backward from a gradient of ones. The stand-ins are its real inputs and parameters where it
//! reads them, and ones, `true` or zeros of the recorded shape and stride order elsewhere.
//! Running statistics are copied first, and libtorch's generator is restored afterwards; without
//! toma's libtorch shim nothing is measured. What the node kept, its scratch and its backward's
//! scratch become its price: a line through the two largest sizes, raised so it is under none of
//! the sizes from two on; one sample is kept apart. Where that line misses a size by more than 2%,
//! every power of two between 2 and the largest size is measured too and the price follows the
//! measurements, so a budget gets the largest micro-batch that fits, not one lower. A call is
//! measured once per process for each op and settings, per-sample shapes, layouts, kinds,
//! device, mode and thread count.
//!
//! Measuring is part of the step and is held to its budget: a size whose stand-ins and run
//! would not fit what the budget leaves (foreseen along the two sizes before, or in proportion
//! to the samples after one) is not measured, and neither is any size above one that ran out of
//! memory; the line through the sizes measured prices the rest, and no micro-batch of that many
//! samples or more is planned where the batch may be split (one call alone would not fit). The
//! first step of a process holds its budget as the tenth does. On the CPU a measurement knows whether another thread allocated meanwhile
//! (the counting allocator keeps a scope per measuring thread): toma's own measurements take
//! turns, and one that another thread's work reached is made again. CUDA's allocator counts
//! a device, every thread's work: there a measurement stands when it repeats (as many
//! allocations and frees, the same figures), and after eight tries the smallest stands.
//!
//! Planning is a function of the graph, the machine and that evidence: the step gathers the
//! evidence (measuring), then plans with it. [`LazyTensor::plan`] runs nothing: it finds what
//! [`LazyTensor::calibrate`] or an earlier step measured. Where calls it needs were never
//! measured though an allocator could measure them, it refuses ([`LazyError::NotCalibrated`])
//! rather than price them by rules read elsewhere (a char-RNN's LSTM was 3.6× under that way).
//! To see the plan the first step will make, calibrate first:
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use toma::lazy::{lazy, Calibrate, LazyError, Mode, Options};
//!
//! toma::memory::track_cpu_allocations(); // the CPU's allocator counts from here
//! let x = Tensor::randn([16, 3, 12, 12], (Kind::Float, Device::Cpu));
//! let w = Tensor::randn([8, 3, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
//! let loss = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1).relu().sum(Kind::Float);
//! let options = Options::new().calibrate(Calibrate::Always);
//! // Nothing measured yet: a plan runs nothing, and says what it lacks.
//! match loss.plan(Mode::Backward, &options) {
//!     Err(LazyError::NotCalibrated { op, .. }) => assert_eq!(op, "conv2d"),
//!     other => panic!("{other:?}"),
//! }
//! loss.calibrate(Mode::Backward, &options)?; // measures it
//! let step = loss.plan(Mode::Backward, &options)?; // what the step will plan
//! assert_eq!(step.calibration().unmeasured, 0);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! [`Plan::calibration`] returns what calibration did, and the printed plan says it:
//! `calibrated: 3 kernel call(s) measured in 2.1 ms, 0 measured earlier, 2 priced by rules
//! trusted on this machine's key`, then `machine: oneDNN avx2 (none of avx512_fp16/bf16, amx, vnni), ATen AVX2,
//! ...; rules read on oneDNN avx512_core_bf16 (avx512_bf16+avx512_vnni), ATen AVX512, ...`. A
//! line `not calibrated: ...` says when calls needed measuring and were not: no allocator counts
//! on the CPU before `track_cpu_allocations()`, or a call failed on stand-ins.
//! [`Calibrate::Never`] keeps planning free of any run (a `CustomOp`'s function then runs only in
//! the step) and prices by rules read elsewhere; [`Calibrate::Always`] measures every call, which
//! shows what a plan would be where no rule was read.
//!
//! # Recompute instead of split
//!
//! When the whole batch does not fit, a backward plan may also drop saved activations after the
//! forward and compute them again just before their backward, segment by segment: the whole batch
//! stays together. That is the only way to fit a model that mixes samples — batch norm in
//! training (tch's own CIFAR ResNet), a contrastive loss over `z₁ · z₂ᵀ` — without changing what
//! it computes: batch statistics, running statistics and the loss stay the full batch's, where
//! splitting would change them. [`Options::recompute`] has an example; [`Plan::recomputes`],
//! [`Plan::segments`] and [`Plan::reason`] say what a plan chose.
//!
//! - **How**: the graph is cut into segments near equal shares of its activations, each cut where
//!   the fewest bytes cross it. Every segment but the last runs without autograd, keeping only the
//!   values later segments read; then, last to first, each runs again with autograd and its
//!   backward follows at once, from the gradients later segments sent to its values. The plan is
//!   the executor's schedule of exactly that (the `re-fwd` rows of the printed plan), so its peak
//!   is checked against the allocator like any other.
//! - **Bit for bit**: a recomputed segment first restores libtorch's random generator as it was
//!   when the segment first ran (dropout draws the same mask), and after the step the generator
//!   and every running statistic are as one forward left them. Recomputing is not thread-safe
//!   against other threads drawing random numbers during the step (PyTorch's checkpoint shares
//!   that limit).
//! - **Choosing**: [`Recompute::Auto`] keeps the whole batch when it fits; otherwise, where
//!   splitting is ruled out (an op mixes samples and `allow_batch_mixing` is off), it recomputes;
//!   where both fit, it takes the lower estimated step time (ops launched and bytes made, priced
//!   by the device's cost model: on a GPU many small micro-batches lose to a few recomputed
//!   segments; on a CPU splitting is rarely slower), scaled by what earlier steps of the same
//!   graph measured: every split or recomputing step is timed against its estimate, and once both
//!   kinds ran, the choice follows this machine's times. Where neither alone fits, it recomputes
//!   in micro-batches. [`Recompute::Always`] recomputes before it splits; [`Recompute::Never`]
//!   only splits. The printed plan says which and why (`why:`), with the estimate.
//! - **Errors that tell the truth**: when nothing fits, [`LazyError::DoesNotFit`] gives the
//!   lowest peak any allowed plan reaches, where, and how (micro-batch, segments), and the op that
//!   rules out splitting.
//!
//! Recomputing at half a step's peak costs 1.18× to 1.31× a plain step on a 2-core CPU
//! (`cargo bench --bench lazy_recompute`; `docs/performance.md` has the tables).
//!
//! # Write the model once
//!
//! [`TensorOps`] names tch's tensor methods (`f_` and panicking forms, tch's signatures), and
//! both `tch::Tensor` (plain delegation) and [`LazyTensor`] implement it; [`Layer`]/[`LayerT`] do
//! the same for tch's layers. One model definition then serves eager inference and planned
//! training, with the same `VarStore`:
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use toma::lazy::{lazy, nn, Layer, Options, TensorOps};
//!
//! fn loss<T: TensorOps>(l1: &nn::Linear, l2: &nn::Linear, x: &T, y: &T) -> T
//! where
//!     nn::Linear: Layer<T>,
//! {
//!     x.apply(l1).relu().apply(l2).cross_entropy_for_logits(y)
//! }
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let (l1, l2) = (nn::linear(vs.root() / "l1", 8, 16, Default::default()), nn::linear(vs.root() / "l2", 16, 4, Default::default()));
//! let (x, y) = (Tensor::randn([32, 8], (Kind::Float, Device::Cpu)), Tensor::randint(4, [32], (Kind::Int64, Device::Cpu)));
//! let eager = loss(&l1, &l2, &x, &y).double_value(&[]);        // a tch::Tensor, as ever
//! let (lx, ly) = lazy((&x, &y), 0);
//! let planned = loss(&l1, &l2, &lx, &ly).backward_with(&Options::new().micro_batch(8))?;
//! assert!((eager - planned).abs() < 1e-5);                     // 4 micro-batches, one loss
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```
//!
//! - **tch's idioms, with the import changed.** [`nn`] re-exports all of tch's `nn`, so `use
//!   toma::lazy::nn;` in place of `use tch::nn;` keeps `nn::linear`, `nn::VarStore`, `nn::AdamW`
//!   and the rest, and adds what runs lazily: [`nn::seq`] / [`nn::seq_t`] (tch's `Sequential`s for
//!   both tensor kinds), [`nn::func`] / [`nn::func_t`] (a closure over `&LazyTensor`),
//!   `nn::ModuleT` and `nn::Module` that name both kinds (so `fn block(p: nn::Path) -> impl
//!   nn::ModuleT` is unchanged), [`nn::lstm`] / [`nn::gru`] with tch's variables (a sequence one op on
//!   libtorch's fused kernel lazily too), and [`nn::OptimizerConfig`], whose `build` gives tch's
//!   optimizer wrapped so that `opt.backward_step_clip(&loss, 0.5)` takes a lazy loss.
//! - **The budget covers the whole step.** The plan of a step through toma's optimizer
//!   ([`nn::Optimizer::plan_step`]) includes the optimizer's step after the backward: every
//!   gradient, the state a first step creates and the step's temporaries (SGD with momentum,
//!   Nesterov and weight decay; Adam, AdamW, AMSGrad; RMSprop, centered or with momentum). A step
//!   that cannot fit is refused before anything runs, the error naming the step and what it
//!   needs.
//! - **A custom layer** keeps its one `impl Module for X { fn forward(&self, xs: &Tensor) ->
//!   Tensor { .. } }` with [`#[toma::lazy::module]`](macro@module) above it: the body serves
//!   tch's trait as written and the lazy one over `&LazyTensor`.
//! - **tch's argument forms** compile unchanged inside a generic function: tuple shapes
//!   (`x.view((b, -1))`), integer lists as tch's `IntList` (`-1`, `[0, 2, 1]`, `&dims`, `None` for
//!   "all dims"), `i(..)` indexing (`x.i((.., 1..3, -1))`), operators on `Tensor`s owned or
//!   borrowed on either side. Constants such as masks enter generic code through
//!   [`TensorOps::constant`]. A parameter expanded to the batch (a ViT's CLS token) is recorded as
//!   a per-sample broadcast: each micro-batch expands it to its own size, and its gradient sums
//!   over all of them.
//! - **Written-once models**: [`vision`] has tch's ResNets (18/34/50), VGGs (11/13/16/19, with
//!   and without batch norm), AlexNet, MobileNet-V2 and EfficientNet-B0 under tch's variable
//!   names (its weights load); [`models`] has a GPT-2 decoder block and an encoder block.
//! - A panicking op reports the user's line (`#[track_caller]` all the way through). On edition
//!   2024, a `-> impl ModuleT` built from a `nn::Path` captures its borrow unless written `->
//!   impl ModuleT + use<>`, with tch's types as with toma's.
//!
//! `docs/porting.md` in the repository walks an `nn::seq()` MLP, tch's resnet18, a transformer
//! block, and tch's own minGPT and fast-ResNet idioms over. `docs/tch-example-methods.csv` lists
//! every `Tensor` method tch-rs's own examples call (106) and says which run lazily: 68 do, 38 are
//! not graph ops by nature (reading values, in-place updates of parameters or optimizer state,
//! constructors of inputs; each with its reason), none is missing.
//!
//! # Mixed precision
//!
//! Record the step inside [`toma::autocast`](crate::autocast()) (the CPU in `BFloat16` or
//! `Half`, CUDA in either; tch's own `tch::autocast` on CUDA is read too). Each op libtorch's
//! autocast lists for the device gets the casts it would insert, as `autocast` nodes: products
//! and convolutions in the lower precision, losses (and on CUDA norms, softmax, `exp`, ..) in
//! `Float`. The graph then runs at `backward()`, after the region, and computes what eager
//! autocast computes: an unsplit step is bit-identical to it (libtorch's fused `lstm` and `gru`
//! run in libtorch's own autocast, which casts inside them); a split one equals the same
//! micro-batches run eagerly under autocast and summed. The plan counts the 16-bit copies
//! autograd saves (and prints `autocast: N casts to BFloat16`). An op on operands of two kinds
//! (a `Float` residual plus a 16-bit branch) copies one into the other's kind while it runs,
//! and autograd casts that operand's gradient back: a calibrating plan measures such an op, as
//! libtorch's formulas order their casts (its rule, where nothing is measured, errs high).
//! In `Half`, scale the loss with
//! [`GradScaler`] (tch has none); an overflow in one micro-batch skips the whole step:
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
//!
//! # What a step costs
//!
//! A step that fits runs the plain step's kernels, as one micro-batch; recording, planning and
//! running it add about 1.5–3 µs per recorded op on a 2-core CPU, and the plan of a graph
//! recorded again is reused (`cargo bench --bench lazy_tax`, `docs/performance.md`). Each
//! thread that records keeps the allocations of up to 256 dropped nodes (about 140 KiB) for its
//! next graph.
//!
//! # Over many ranks
//!
//! Under `Options::group` (feature `dist`) each rank plans its own micro-batch under its own
//! budget (mixed cards), mean losses are weighed by the *global* sample or target count, and the
//! parameters' gradients are summed across ranks: every rank ends with the gradient of one
//! backward over the union of all batches. See `toma::dist`.

mod card;
mod cost;
mod error;
mod exec;
mod facts;
mod graph;
mod index;
mod int_list;
pub mod models;
pub mod nn;
mod ops;
pub mod optim;
mod options;
mod phase;
mod plan;
mod rnn;
pub mod scaler;
mod shape;
mod size;
mod tch_compat;
mod tensor;
mod tensor_ops;
mod unplaced;
pub mod vision;
mod wrap;

pub use card::CudaCard;
pub use cost::cuda::{round_block, BLOCK};
pub use cost::machine::{rules_trusted, trust_rules, CpuFeatures, CpuIsa, CpuMachine};
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
pub use unplaced::UnplacedRequest;
#[doc(hidden)]
pub use wrap::{eager_wrap, try_eager_wrap, Arg, ArgOf};
pub use wrap::{lazy, try_lazy, BatchDimArg, Lazify};

/// One body for a custom layer, eagerly and lazily: on `impl Module for X` with `fn forward(&self,
/// xs: &Tensor) -> Tensor`, or `impl ModuleT for X` with `fn forward_t(&self, xs: &Tensor,
/// train: bool) -> Tensor`, it implements tch's trait with the body as written and
/// [`nn::LazyModule`] (or [`nn::LazyModuleT`]) with the same body over `xs: &LazyTensor`: tch's
/// tensor methods and operators have the same names there. In the lazy body the attribute
/// translates what goes with tensors: types it names (`Vec<Tensor>`, tch's `GRUState` and
/// `LSTMState`) are the lazy ones, `Tensor::cat` and `Tensor::stack` of lazy values are
/// [`LazyTensor::cat`] and [`LazyTensor::stack`], and a recurrent layer's `zero_state` is its
/// lazy one (`lazy_zero_state`). Expression paths such as `Tensor::zeros(..)` stay tch's
/// constants, and a turbofish (`::<Tensor>` of an absent weight) stays as written. Where the
/// body mixes the two, they meet as lazy operands ([`IntoLazy`]): the elements of
/// `Tensor::cat(&[&x, &zeros], 0)` written out, the branches of an `if` that gives a
/// constant on one side and a lazy value on another, and a `let mut` that starts from a
/// constant or a field's tensor and is then given other values (`let mut loss =
/// Tensor::from(0f32);` then `loss = loss + term` or `loss += term`; `let mut prev =
/// self.start.shallow_clone();` then `prev = if teacher { target } else { output }`, each
/// branch a lazy operand); `let pad: Tensor = Tensor::zeros(..)` keeps its annotation.
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
/// no `Tensor` (`new`) stay as they are; an `impl` where none does is a compile error that says
/// so, at its type (the attribute reads the name `Tensor`: an alias of it is not seen). tch's recurrent states in a signature (`fn forward(&self,
/// xs: &Tensor, state: &GRUState) -> (Tensor, GRUState)`) go with the kind
/// ([`nn::RecurrentState`]): `GRUState` eagerly, [`nn::LazyGRUState`] lazily. tch-rs's
/// `translation` example ports so, one attribute an `impl` (`tests/lazy/translation.rs`).
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
///
/// # Fixed tensors beside lazy ones
///
/// The first `&Tensor` argument picks the kind the body runs on, and the result's. Where a
/// method or function takes two or more `&Tensor`s (and no other argument names one), the later
/// ones may be `Tensor`s beside a lazy first one: tch-rs's style transfer calls
/// `style_loss(&input_layers[i], &style_layers[i])` with a recorded feature map and a fixed
/// target, which the lazy body takes as a fixed operand. A lazy value after a `Tensor` first is
/// a type error at that argument: put it first, or wrap the first (`lazy(&x, None)`). An
/// argument that is already a reference is passed as it is (`f(x)`, not `f(&x)`): a generic
/// argument is not dereferenced, and rustc says the `&Tensor` "is not a kind of tensor".
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::lazy;
///
/// #[toma::lazy::module]
/// fn gram_loss(m: &Tensor, target: &Tensor) -> Tensor {
///     let (c, hw) = m.size2().unwrap();
///     (m.matmul(&m.tr()) / (c * hw) as f64).mse_loss(target, tch::Reduction::Mean)
/// }
///
/// let features = Tensor::rand([4, 9], (Kind::Float, Device::Cpu));
/// let target = Tensor::rand([4, 4], (Kind::Float, Device::Cpu));
/// let eager = gram_loss(&features, &target);
/// let lazily = gram_loss(&lazy(&features, None), &target).to_tensor()?;
/// assert!(lazily.allclose(&eager, 1e-6, 1e-6, false));
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
///
/// # A method whose only `Tensor` is its result
///
/// tch-rs's `translation` trains from token lists: `fn train_loss(&self, input: &[usize], target:
/// &[usize]) -> Tensor` makes its tensors itself. Its arguments cannot tell which kind a call
/// wants, so the caller asks (`let loss: Tensor = m.train_loss(..)`, `let loss: LazyTensor =
/// ..`), or calls the lazy twin the attribute names: `m.lazy_train_loss(..)`, as a layer's
/// `zero_state` has `lazy_zero_state`. Without either, rustc says "type annotations needed"
/// where the value is first used. Inside the `impl`, `self.train_loss(..)` takes the calling
/// body's kind. The tensors such a method makes from its data are wrapped as the batch is
/// (`lazy(&Tensor::from_slice(&[token]), None)`): in the body compiled for `Tensor`, `lazy(..)`
/// and `try_lazy(..)` give the tensors as they are.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use toma::lazy::{lazy, nn, nn::Module, LazyTensor};
///
/// struct Scorer { emb: nn::Embedding, head: nn::Linear }
///
/// #[toma::lazy::module]
/// impl Scorer {
///     fn loss(&self, tokens: &[i64], label: i64) -> Tensor {
///         let xs = lazy(&Tensor::from_slice(tokens), None);
///         let logits = self.head.forward(&self.emb.forward(&xs).mean_dim(0, true, Kind::Float));
///         logits.cross_entropy_for_logits(&lazy(&Tensor::from_slice(&[label]), None))
///     }
/// }
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let m = Scorer { emb: nn::embedding(vs.root() / "e", 10, 4, Default::default()), head: nn::linear(vs.root() / "h", 4, 3, Default::default()) };
/// let eager: Tensor = m.loss(&[1, 2, 3], 2);
/// let lazily: LazyTensor = m.loss(&[1, 2, 3], 2);
/// assert!((m.lazy_loss(&[1, 2, 3], 2).backward()? - eager.double_value(&[])).abs() < 1e-6);
/// assert!((lazily.to_tensor()?.double_value(&[]) - eager.double_value(&[])).abs() < 1e-6);
/// # Ok::<(), toma::lazy::LazyError>(())
/// ```
pub use toma_macros::module;

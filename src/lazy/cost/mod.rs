//! The cost layer: what the kernels an op calls take besides its inputs and outputs, on one
//! device.
//!
//! Ops name their kernel calls ([`KernelCall`]: a convolution with its shapes and settings, a
//! reduction with its mask, a buffer autograd keeps). A [`CostModel`], chosen per plan from the
//! device, prices them: how many bytes each takes while the op runs forward, while its backward
//! runs, and until its backward. Device knowledge lives here and nowhere else:
//!
//! - [`cpu`]: libtorch's CPU kernels, and which convolutions it hands to oneDNN;
//! - [`onednn`]: oneDNN's x86 convolutions, phase by phase, for a given library version,
//!   vector width and thread count;
//! - [`cuda`]: the CUDA caching allocator's blocks, ATen's reduction kernel and cuDNN;
//! - [`caching`]: a replay model of libtorch 2.11's CUDA caching allocator (segments, pools,
//!   splitting, release-and-retry, expandable segments), for plans in reserved bytes.
//!
//! The models take the machine as explicit inputs ([`cpu::Cpu`], [`onednn::OneDnn`],
//! [`cuda::Cuda`]), so a plan can be priced, and tested, for a machine other than this one.

pub(crate) mod brgemm;
// The CUDA caching allocator's model; plans replay it (`plan::placement`). Its replay of
// recorded events and its snapshots serve the recorded traces' tests, which no card has made yet.
#[allow(dead_code)]
pub(crate) mod caching;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod machine;
pub(crate) mod measured;
pub(crate) mod onednn;
pub(crate) mod work;

use std::rc::Rc;

use tch::Device;

use super::graph::{KernelCall, Meta, Node};
use super::size::{Bytes, Elements};
use cuda::ReduceStaging;
use work::Scratch;
pub(crate) use work::Work;

/// What one node's kernel calls take, priced by a [`CostModel`].
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Price {
    /// Kept by autograd from the forward until the node's backward (when it requires a
    /// gradient).
    pub(crate) kept: Work,
    /// What of `kept` a run without autograd still makes, freed as the node returns.
    pub(crate) unsaved: Work,
    /// Scratch space while the node runs, and while its backward runs.
    pub(crate) forward: Work,
    pub(crate) backward: Work,
    /// Staging buffers of CUDA reductions, each with whether the backward takes it.
    pub(crate) staged: Vec<(bool, ReduceStaging)>,
}

/// How a plan prices kernel calls: by the device the graph runs on.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CostModel {
    Cpu(cpu::Cpu),
    Cuda(cuda::Cuda),
}

impl CostModel {
    /// The model of `device` on this machine: its library version, vector width and threads
    /// (CPU), or its multiprocessors (CUDA), read once.
    pub(crate) fn of(device: Device) -> CostModel {
        match device {
            Device::Cuda(index) => CostModel::Cuda(cuda::Cuda::of(index)),
            _ => CostModel::Cpu(cpu::Cpu::current()),
        }
    }

    /// Whether the rule that prices `call` was read on exactly this machine (device, library
    /// release, oneDNN's instruction set, threads, kind); where it was not, a calibrating plan
    /// measures the call ([`measured`]). On CUDA, convolutions are never taken on trust:
    /// cuDNN's workspace depends on the card, the engine and the library release. Products are:
    /// cuBLAS takes its workspace once per handle, and what a `linear` takes per call is ATen's
    /// reduction staging for the bias gradient, which grows with the rows unlike any line
    /// through the sizes calibration measures (an H200, 2026-11-27: measured, an MLP's plan was
    /// 22% and 33% under at 1024 and 4096 rows; by these rules it is exact on an H100 and the
    /// H200). The rules (the caching allocator's blocks, the staging) were read on one H100
    /// with libtorch 2.11. Under [`machine::trust_rules`]`(false)` none is trusted.
    pub(crate) fn validated(&self, call: &KernelCall<'_>) -> bool {
        match self {
            CostModel::Cpu(cpu) => cpu.validated(call),
            CostModel::Cuda(_) => {
                machine::rules_trusted()
                    && !matches!(call, KernelCall::Convolution(_))
                    && cpu::libtorch_version() == Some(onednn::READ_ON)
            }
        }
    }

    /// The machine a CPU model prices for (`None` on CUDA).
    pub(crate) fn cpu_machine(&self) -> Option<machine::CpuMachine> {
        match self {
            CostModel::Cpu(cpu) => Some(cpu.machine()),
            CostModel::Cuda(_) => None,
        }
    }

    /// The block the device's allocator counts in: CUDA's caching allocator rounds every
    /// allocation up to [`cuda::BLOCK`]; libtorch's CPU allocator, as toma counts it, takes
    /// bytes as asked.
    pub(crate) fn block(&self) -> u64 {
        match self {
            CostModel::Cpu(_) => 1,
            CostModel::Cuda(_) => cuda::BLOCK,
        }
    }

    /// A prior for the seconds an op takes on this device: a fixed cost per launch (dispatch on
    /// the CPU, a kernel launch and its tail on a GPU) and the bytes it writes at the device's
    /// sustained rate. It only ranks plans against each other (split, recompute, both): what
    /// they share cancels, and what differs is how many ops run and how many bytes they make.
    /// The figures are priors read off libtorch 2.11 on this project's machines (a 2-core x86
    /// CPU, an H100), not measurements of the current one.
    pub(crate) fn op_seconds(&self, launches: f64, bytes: f64) -> f64 {
        let (launch, rate) = match self {
            // ~6 µs through the dispatcher and oneDNN's primitive cache; ~4 GB/s written by
            // 2 threads in elementwise kernels and convolutions alike.
            CostModel::Cpu(_) => (6e-6, 4e9),
            // ~10 µs a kernel with its launch; HBM at ~1.5 TB/s sustained.
            CostModel::Cuda(_) => (10e-6, 1.5e12),
        };
        launches * launch + bytes / rate
    }

    /// What `node`'s kernel calls take on this device (`calls` is a buffer to reuse).
    pub(crate) fn price<'a>(&self, node: &'a Node, calls: &mut Vec<KernelCall<'a>>) -> Price {
        calls.clear();
        node.kernels(calls);
        self.price_calls(&node.inputs, &node.meta, calls)
    }

    /// The price of `calls`, made by an op on `inputs` whose output is `meta`.
    pub(crate) fn price_calls(&self, inputs: &[Rc<Node>], meta: &Meta, calls: &[KernelCall<'_>]) -> Price {
        let mut price = Price::default();
        if calls.is_empty() {
            return price;
        }
        // In elements of the op's first input's kind; what a convolution or a product takes
        // at one sample rides along in each size.
        let mut scratch = Scratch::default();
        let mut kept = Bytes::ZERO;
        let mut unsaved = Bytes::ZERO;
        for call in calls {
            match call {
                KernelCall::Keeps { elements, kind } => {
                    if meta.requires_grad {
                        kept = kept.plus(elements.bytes(*kind));
                    }
                }
                KernelCall::SavedCopy { elements, kind } => {
                    if meta.requires_grad {
                        kept = kept.plus(elements.bytes(*kind));
                    }
                    unsaved = unsaved.plus(elements.bytes(*kind));
                }
                KernelCall::Temporaries { forward, backward } => {
                    scratch = scratch.plus(Scratch { forward: *forward, backward: *backward });
                }
                KernelCall::Reduction { of, mask, backward } => {
                    if let CostModel::Cuda(gpu) = self {
                        if let Some(s) = gpu.reduction(of, *mask) {
                            price.staged.push((*backward, s));
                        }
                    }
                }
                KernelCall::ReducedPrecisionMean { elements } => {
                    if let CostModel::Cpu(_) = self {
                        // A `Float` copy: twice the elements of a 2-byte kind, forward only.
                        scratch.forward = scratch.forward.plus(elements.times(2));
                    }
                }
                KernelCall::Convolution(c) => {
                    let s = match self {
                        CostModel::Cpu(cpu) => cpu.convolution(c),
                        CostModel::Cuda(gpu) => gpu.convolution(c),
                    };
                    scratch = scratch.plus(s);
                }
                KernelCall::Product(p) => {
                    if let CostModel::Cpu(cpu) = self {
                        scratch = scratch.plus(cpu.product(p));
                    }
                }
                &KernelCall::FusedAttention { l, s, ev, kind } => {
                    if let CostModel::Cpu(cpu) = self {
                        let mut s = cpu.fused_attention(l, s, ev, kind);
                        if !meta.requires_grad {
                            s.backward = Elements::ZERO;
                        }
                        scratch = scratch.plus(s);
                    }
                }
            }
        }
        price.kept = kept.into();
        price.unsaved = unsaved.into();
        let in_kind = inputs.first().map_or(meta.kind, |x| x.meta.kind);
        price.forward = scratch.forward.bytes(in_kind).into();
        price.backward = scratch.backward.bytes(in_kind).into();
        price
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::cpu::Cpu;
    use super::cuda::{Cuda, BLOCK};
    use super::machine::{CpuIsa, CpuMachine};
    use super::onednn::READ_ON;
    use super::*;
    use crate::lazy::lazy;

    const H100: (u32, u32) = (132, 2048);
    const MIB: u64 = 1 << 20;

    fn zeros(shape: &[i64]) -> Tensor {
        Tensor::zeros(shape, (Kind::Float, Device::Cpu))
    }

    /// A convolution recorded on this machine, priced for others: the model takes the machine
    /// as inputs, and what it reads of this one is only the default.
    #[test]
    fn a_convolution_is_priced_for_the_machine_asked() {
        let x = zeros(&[8, 12, 16, 16]).set_requires_grad(true);
        let w = zeros(&[20, 12, 3, 3]).set_requires_grad(true);
        let y = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1);
        let price = |model: &CostModel| model.price(y.node(), &mut Vec::new());
        let machine = |isa, threads| CpuMachine { libtorch: Some(READ_ON), ..CpuMachine::new(isa, threads) };
        let avx512 = |threads| CostModel::Cpu(Cpu::of(&machine(CpuIsa::Avx512CoreBf16, threads)));
        let avx2 = CostModel::Cpu(Cpu::of(&machine(CpuIsa::Avx2, 2)));
        // Blocks of 16 pad 20 output channels to 32, blocks of 8 to 24.
        assert!(price(&avx512(2)).forward.per > price(&avx2).forward.per);
        // On 2 threads the weight gradient's scratchpad is held between 13 and 48 KiB (the
        // input's blocks divide among them, the output's do not); on one it is at most 48 KiB.
        assert_ne!(price(&avx512(1)).backward, price(&avx512(2)).backward);
        // The host's model is one of these, read once.
        assert_eq!(price(&CostModel::of(Device::Cpu)), price(&CostModel::Cpu(Cpu::host().clone())));
        // cuDNN's bound: input and output reordered, and a fixed workspace (2 MiB forward,
        // 16 MiB backward), the same whatever the CPU.
        let cuda = price(&CostModel::Cuda(Cuda { gpu: H100 }));
        let per_sample = (12 * 16 * 16 + 20 * 16 * 16) * 4;
        assert_eq!(cuda.forward, Work::line(per_sample, 2 * MIB));
        assert_eq!(cuda.backward, Work::line(per_sample, 16 * MIB));
    }

    /// A reduction stages partial sums on CUDA only: a linear layer's bias gradient at batch
    /// 1024 over 4096 outputs, as the H100 showed (`cuda.rs`'s tests hold the rest).
    #[test]
    fn reductions_stage_on_cuda_only() {
        let x = zeros(&[1024, 16]);
        let (w, b) = (zeros(&[4096, 16]).set_requires_grad(true), zeros(&[4096]).set_requires_grad(true));
        let y = lazy(&x, 0).linear(&w, Some(&b));
        let cuda = CostModel::Cuda(Cuda { gpu: H100 }).price(y.node(), &mut Vec::new());
        assert_eq!(cuda.staged.len(), 1);
        let (backward, staging) = &cuda.staged[0];
        assert!(*backward, "the bias gradient is summed in the backward");
        assert_eq!(staging.at(1024), 32 * MIB + BLOCK);
        let cpu = CostModel::Cpu(Cpu::host().clone()).price(y.node(), &mut Vec::new());
        assert!(cpu.staged.is_empty());
        assert_eq!((CostModel::Cuda(Cuda { gpu: H100 }).block(), CostModel::of(Device::Cpu).block()), (BLOCK, 1));
    }

    /// A rule is trusted only on the key it was read on: a machine one feature apart (AVX512-FP16,
    /// AMX) or with another answer to libtorch's fp16 check measures products and convolutions
    /// of every kind; on the rules' own key, the kinds read there are trusted.
    #[test]
    fn products_and_convolutions_are_trusted_only_on_the_rules_key() {
        let kinds = [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16];
        let nodes: Vec<(Kind, &str, crate::lazy::LazyTensor)> = kinds
            .iter()
            .flat_map(|&kind| {
                let x = Tensor::zeros([8, 12, 16, 16], (kind, Device::Cpu));
                let w = Tensor::zeros([20, 12, 3, 3], (kind, Device::Cpu)).set_requires_grad(true);
                let conv = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1);
                let a = Tensor::zeros([8, 64], (kind, Device::Cpu));
                let m = Tensor::zeros([32, 64], (kind, Device::Cpu)).set_requires_grad(true);
                let product = lazy(&a, 0).linear(&m, None::<&Tensor>);
                [(kind, "convolution", conv), (kind, "product", product)]
            })
            .collect();
        let trusted = |machine: &CpuMachine| -> Vec<(Kind, &str)> {
            let model = CostModel::Cpu(Cpu::of(machine));
            nodes
                .iter()
                .filter(|(_, _, y)| {
                    let mut calls = Vec::new();
                    y.node().kernels(&mut calls);
                    let ours: Vec<_> = calls
                        .iter()
                        .filter(|c| matches!(c, KernelCall::Convolution(_) | KernelCall::Product(_)))
                        .collect();
                    assert!(!ours.is_empty(), "{:?}", y.node().name());
                    ours.iter().all(|c| model.validated(c))
                })
                .map(|(k, what, _)| (*k, *what))
                .collect()
        };
        let read_on = CpuMachine::rules_read_on();
        let mut fp16 = read_on;
        fp16.features.avx512_fp16 = true;
        let mut amx = read_on;
        amx.features.amx_bf16 = true;
        let mut fp16_check = read_on;
        fp16_check.fp16_onednn = true;
        let amx_machine = CpuMachine { libtorch: Some(READ_ON), ..CpuMachine::new(CpuIsa::Avx512CoreAmx, 2) };
        let mut amd = read_on;
        amd.features.amd = true;
        for (name, machine) in [
            ("avx512_fp16", fp16),
            ("amx_bf16", amx),
            ("fp16 check", fp16_check),
            ("amx", amx_machine),
            ("an AMD CPU", amd),
        ] {
            assert_eq!(trusted(&machine), [], "{name}: every kind is measured");
        }
        if crate::lazy::rules_trusted() {
            let on_key = trusted(&read_on);
            for kind in [Kind::Float, Kind::Double, Kind::Half] {
                assert!(on_key.contains(&(kind, "convolution")) && on_key.contains(&(kind, "product")), "{on_key:?}");
            }
            assert!(!on_key.iter().any(|(k, _)| *k == Kind::BFloat16), "BFloat16 is always measured: {on_key:?}");
        }
    }

    #[test]
    fn work_rounds_to_the_block_and_prices_one_sample_apart() {
        let w = Work { single: 700, ..Work::line(100, 10) };
        assert_eq!(w.at(2, 1), 210);
        assert_eq!(w.at(2, 512), 512);
        assert_eq!(w.at(1, 1), 700, "one sample runs another kernel");
        assert_eq!(Work { single: 50, ..w }.at(1, 1), 50, "or takes less than the line says");
        assert_eq!(Work { single: 0, ..w }.at(1, 1), 110);
    }
}

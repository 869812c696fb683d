//! What planning reads besides the graph, gathered before it: the machine as it is now, and
//! the evidence measurement and earlier runs left. Gathering may run kernels (calibration) and
//! reads the process's stores; [`plan`](super::search::plan) reads only these values, so the
//! same graph with the same evidence plans the same.

use std::rc::Rc;

use tch::Device;

use super::compiled::Compiled;
use super::correction::{Corrections, Reserve};
use super::placement::Start;
use super::schedule::Mode;
use super::time::{Choice, Timings};
use crate::lazy::cost::caching::{BlockState, Card, Config, PoolKind, SegmentState, Stream};
use crate::lazy::cost::measured::{self, Calibrated, Calibration};
use crate::lazy::options::Options;
use crate::lazy::CudaCard;

/// The machine as a plan sees it: the budget it is held to, whether a recomputed segment can
/// replay libtorch's random generator, and on a CUDA card, the caching allocator the step's
/// blocks are placed by.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Machine {
    /// The user's budget, or the device's free memory less the margin, in bytes.
    pub(crate) budget: u64,
    /// Whether recomputing is possible (toma's shim can save and restore the generator).
    pub(crate) replays: bool,
    /// On CUDA, or for a described card: where the allocator starts (`None` on the CPU, whose
    /// allocator takes bytes as asked).
    pub(crate) allocator: Option<Start>,
}

impl Machine {
    /// The machine now, for `options` and the graph `c`: its device's free memory is read here
    /// (on a CPU, the system's figure from a reading up to 50 ms old); a described card
    /// ([`Options::card`]) stands in for the device.
    pub(crate) fn now(options: &Options, c: &Compiled) -> Machine {
        if let Some(card) = &options.card {
            return Machine::on_card(options, card, c);
        }
        let device = c.device();
        let budget = budget(options, device);
        let allocator = match device {
            Device::Cuda(i) => Some(Start {
                config: Config::libtorch().unwrap_or_default(),
                card: Card::new(card_total(i).map_or(budget, |total| total.max(budget)), budget),
                segments: Vec::new(),
                place_leaves: false,
                empty_cache: false,
            }),
            _ => None,
        };
        Machine { budget, replays: generator_replays(), allocator }
    }

    /// A described card: its memory less what is in use goes to the graph's leaves, and the
    /// rest, less the margin, is the budget (unless the options set one).
    fn on_card(options: &Options, card: &CudaCard, c: &Compiled) -> Machine {
        let free = card.memory().saturating_sub(card.in_use_bytes());
        let leaves: u64 = c.leaf_bytes().iter().map(|&b| crate::lazy::round_block(b)).sum();
        let budget =
            options.budget.unwrap_or_else(|| (free.saturating_sub(leaves) as f64 * (1.0 - options.margin)) as u64);
        let start = Start {
            config: card.config.clone(),
            card: Card::new(card.memory(), budget.saturating_add(leaves).min(free)),
            segments: Vec::new(),
            place_leaves: true,
            empty_cache: false,
        };
        Machine { budget, replays: generator_replays(), allocator: Some(start) }
    }

    /// On a CUDA card toma runs on, the allocator as the step finds it: its segments
    /// ([`crate::memory::cuda_segments`]), whose cached blocks serve the step first, and for new
    /// segments what the budget leaves beside those cached blocks (at most the driver's free
    /// bytes). Read only where a plan is made (a reused one reads nothing); unchanged where
    /// there is no snapshot (the shim built without CUDA's headers) or it is not one the model
    /// can hold (logged).
    pub(crate) fn read_card(mut self, device: Device) -> Machine {
        let (Device::Cuda(i), Some(start)) = (device, self.allocator.as_mut()) else { return self };
        if start.place_leaves {
            return self;
        }
        let Some(segments) = crate::memory::cuda_segments(i) else { return self };
        let segments: Vec<SegmentState> = segments.iter().map(segment_state).collect();
        let driver_free = crate::memory::cuda_memory(i).map_or(u64::MAX, |m| m.free);
        match start.clone().holding(segments, self.budget, driver_free) {
            Ok(held) => *start = held,
            Err(why) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(%why, "toma::lazy: the allocator's snapshot is not one its model holds; planning from an empty allocator")
                });
            }
        }
        self
    }

    /// The machine of the tests: a budget, no allocator to place blocks in.
    #[cfg(test)]
    pub(crate) fn with_budget(budget: u64, replays: bool) -> Machine {
        Machine { budget, replays, allocator: None }
    }
}

/// A segment of libtorch's snapshot as the allocator's model holds it. A private pool's free
/// blocks serve nothing the step asks for: they are taken as allocated.
fn segment_state(s: &crate::memory::CudaSegment) -> SegmentState {
    use crate::memory::CudaBlockState;
    SegmentState {
        address: Some(s.address),
        stream: Stream(s.stream),
        pool: if s.large_pool { PoolKind::Large } else { PoolKind::Small },
        expandable: s.expandable,
        blocks: s
            .blocks
            .iter()
            .map(|b| BlockState { size: b.size, allocated: s.private_pool || b.state != CudaBlockState::Free })
            .collect(),
    }
}

/// The memory of CUDA device `i` (it never changes: asked of the driver once per thread, not
/// every step).
fn card_total(i: usize) -> Option<u64> {
    thread_local! {
        static TOTALS: std::cell::RefCell<Vec<(usize, Option<u64>)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    TOTALS.with(|totals| {
        if let Some(&(_, total)) = totals.borrow().iter().find(|&&(d, _)| d == i) {
            return total;
        }
        let total = crate::memory::cuda_memory(i).map(|m| m.total);
        totals.borrow_mut().push((i, total));
        total
    })
}

/// The budget in bytes: the user's, or the free memory of the device less the margin.
fn budget(options: &Options, device: Device) -> u64 {
    if let Some(b) = options.budget {
        return b;
    }
    let free = match device {
        // The driver's free bytes plus what libtorch's caching allocator holds unused.
        Device::Cuda(i) => crate::memory::cuda_usable_memory(i).unwrap_or_else(crate::cpu_memory::available_cpu_memory),
        // The system's figure shared by the steps of the last 50 ms, the caps' headroom fresh.
        _ => crate::memory::available_cpu_memory_for_plans(),
    };
    (free as f64 * (1.0 - options.margin)) as u64
}

/// Whether a recomputed segment can replay libtorch's random generator: toma's shim is built
/// (without it nothing is recomputed, and plans split as before). Known at build time, so
/// that asking costs no call into libtorch.
fn generator_replays() -> bool {
    if !cfg!(toma_shim) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!("toma::lazy: the libtorch shim is not built: plans split and never recompute")
        });
    }
    cfg!(toma_shim)
}

/// The sizes a micro-batch asked for runs at ([`Options::micro_batch`]): it and the remainder
/// of the batch (0 where it divides the batch, or none was asked for), measured beside the usual
/// sizes. On the stack: every step gathers evidence.
fn asked_sizes(c: &Compiled, options: &Options) -> [u64; 2] {
    let n = c.batch.max(1) as u64;
    match options.micro_batch.map(|m| m as u64) {
        Some(m) if m > 0 && m < n => [m, n % m],
        _ => [0, 0],
    }
}

/// Whether gathering evidence may run kernels to measure what no rule read here prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Measure {
    /// Measure what is missing (a step, or an explicit calibration).
    Now,
    /// Only find what was measured earlier (a plan asked for: it runs nothing).
    Never,
}

/// What measurement and earlier runs found about one graph in one mode.
#[derive(Clone, Debug)]
pub(crate) struct Evidence {
    /// The kernel calls measured for this graph (or found measured), by node.
    pub(crate) calibrated: Rc<Calibrated>,
    /// What earlier runs measured above their plans ([`Corrections`]).
    pub(crate) reserve: Reserve,
    /// How fast earlier steps of this graph ran against their estimates.
    pub(crate) speed: Speed,
}

/// Measured over estimated seconds of this graph's steps, per kind of plan ([`Timings`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Speed {
    pub(crate) split: f64,
    pub(crate) recompute: f64,
    /// Whether either factor was measured (rather than the prior's 1).
    pub(crate) measured: bool,
}

impl Evidence {
    /// Gathers the evidence for planning `c` in `mode` under `options` on `machine`:
    /// calibration (measuring what is missing where `measure` allows, within the machine's
    /// budget, and remembering it), the graph's reserve and its measured speeds.
    pub(crate) fn gather(c: &Compiled, mode: Mode, options: &Options, measure: Measure, machine: &Machine) -> Evidence {
        let training = mode == Mode::Backward;
        let calibrated = measured::calibrate(
            &c.nodes,
            c.structure,
            &c.model,
            training,
            options.calibrate,
            measure == Measure::Now,
            machine.budget,
            &asked_sizes(c, options),
        );
        Corrections::process().remember_calibrations(&calibrated.new);
        let reserve = Corrections::process().of(c, mode, !calibrated.by_node().is_empty());
        let timings = Timings::process();
        let speed = Speed {
            split: timings.factor(c, Choice::Split),
            recompute: timings.factor(c, Choice::Recompute),
            measured: timings.measured(c, Choice::Split) || timings.measured(c, Choice::Recompute),
        };
        Evidence { calibrated, reserve, speed }
    }

    /// No evidence: rules only, nothing in reserve, the prior's speeds.
    pub(crate) fn none(mode: Mode) -> Evidence {
        Evidence {
            calibrated: Rc::new(Calibrated::empty(mode == Mode::Backward)),
            reserve: Reserve::default(),
            speed: Speed { split: 1.0, recompute: 1.0, measured: false },
        }
    }

    /// What calibration did for the plan.
    pub(crate) fn calibration(&self) -> Calibration {
        self.calibrated.summary.clone()
    }

    /// Whether calibration priced any node: an excess over the rules' plan is not one over the
    /// measured plan, so the two keep separate reserves.
    pub(crate) fn calibrated_any(&self) -> bool {
        !self.calibrated.by_node().is_empty()
    }
}

#[cfg(all(test, feature = "tch"))]
mod tests {
    use super::{segment_state, Evidence, Machine};
    use crate::lazy::cost::caching::{BlockState, PoolKind, Stream};
    use crate::lazy::options::Options;
    use crate::lazy::plan::{compile, search, Mode};
    use crate::memory::{CudaBlock, CudaBlockState, CudaSegment};
    use tch::{Device, Kind, Tensor};

    /// A snapshot's blocks as the model holds them: only free blocks of the shared pools can
    /// serve the step; a block another stream still uses, or a private pool's, cannot.
    #[test]
    fn snapshot_blocks_serve_the_step_only_when_free_and_shared() {
        let block = |size, state| CudaBlock { size, state };
        let blocks = vec![
            block(1 << 20, CudaBlockState::Allocated),
            block(2 << 20, CudaBlockState::Free),
            block(512, CudaBlockState::PendingFree),
        ];
        let shared = CudaSegment {
            address: 0x7f00_0000_0000,
            stream: 0x55,
            large_pool: true,
            expandable: false,
            private_pool: false,
            blocks,
        };
        let s = segment_state(&shared);
        assert_eq!(
            (s.address, s.stream, s.pool, s.expandable),
            (Some(0x7f00_0000_0000), Stream(0x55), PoolKind::Large, false)
        );
        let held = |allocated: &[bool]| -> Vec<BlockState> {
            [1 << 20, 2 << 20, 512]
                .iter()
                .zip(allocated)
                .map(|(&size, &allocated)| BlockState { size, allocated })
                .collect()
        };
        assert_eq!(s.blocks, held(&[true, false, true]));
        let private = segment_state(&CudaSegment { private_pool: true, large_pool: false, ..shared });
        assert_eq!((private.pool, private.blocks), (PoolKind::Small, held(&[true, true, true])));
    }

    /// Planning is a function of the graph, the machine and the evidence: the same three give
    /// the same plan, and other evidence another.
    #[test]
    fn the_same_evidence_plans_the_same() {
        let w = Tensor::randn([64, 64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([256, 64], (Kind::Float, Device::Cpu));
        let mut h = crate::lazy::lazy(&x, 0);
        for _ in 0..6 {
            h = h.matmul(&w).relu();
        }
        let loss = h.sum(None);
        let c = compile(&loss).unwrap();
        let options = Options::new();
        let evidence = Evidence::none(Mode::Backward);
        let whole = search::plan(&c, Mode::Backward, &options, &Machine::with_budget(u64::MAX / 4, false), &evidence)
            .unwrap()
            .peak;
        let machine = Machine::with_budget(whole / 2, true);
        let summary = |d: &search::Decision| {
            (
                d.micro_batch,
                d.peak,
                d.full_peak,
                d.reserved,
                d.segments.as_ref().map(|s| s.starts.clone()),
                d.why.clone(),
            )
        };
        let first = search::plan(&c, Mode::Backward, &options, &machine, &evidence).unwrap();
        let second = search::plan(&c, Mode::Backward, &options, &machine, &evidence).unwrap();
        assert_eq!(summary(&first), summary(&second));
        assert!(first.micro_batch < 256 || first.segments.is_some(), "half the whole batch's peak: {}", first.why);
        // Other evidence: earlier runs measured far above the plan at every size.
        let mut measured_over = evidence.clone();
        for b in [1u64, 256] {
            measured_over.reserve.add(b, whole / 4);
        }
        let held = search::plan(&c, Mode::Backward, &options, &machine, &measured_over).unwrap();
        assert_ne!(summary(&held), summary(&first), "a reserve changes the plan");
        assert_eq!(held.reserved, measured_over.reserve.at(held.micro_batch as u64));
    }
}

//! Plans in reserved bytes: a decision's schedule replayed through the model of libtorch's CUDA
//! caching allocator ([`caching`](crate::lazy::cost::caching)), from the card's state.
//!
//! CUDA fails on what the allocator must *reserve*, not on what tensors hold: a request the
//! cached pieces cannot serve needs a new segment, and the card may have no room for it though
//! the step's allocated bytes fit. So a plan on a card is held to two things: its allocated peak
//! fits the budget (the search), and the replay places every request of the step in the budget
//! (here). Where it does not, the search runs again under a lower budget, until the plan it
//! makes is placed ([`super::reserved`]).
//!
//! The replay runs the micro-batches a split runs: the first, a later one of the same size
//! (the first's gradients live and its blocks cached), and the smaller remainder. Scratch space
//! is allocated before the kernels run and freed after; the accumulation step allocates the
//! gradients parameters have no `.grad()` for, one block each.

use std::collections::HashMap;

use super::compiled::Compiled;
use super::schedule::{Phase, Request, Schedule};
use crate::lazy::cost::caching::{Allocator, BlockId, Card, Config, Oom, SegmentState, Stream};
use crate::lazy::unplaced::UnplacedRequest;

/// The allocator a step starts from: its settings, the card, the segments already on it, and
/// whether the graph's own tensors (parameters, inputs) are still to be placed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Start {
    pub(crate) config: Config,
    /// The card's size and what it can give to new segments: the budget less what is cached
    /// in `segments`, on a card toma runs on; the card's free memory, on a described one.
    pub(crate) card: Card,
    /// The allocator's segments as the step finds them (libtorch's snapshot, on a card toma
    /// runs on): its free blocks serve the step's requests first. Empty: an empty allocator.
    pub(crate) segments: Vec<SegmentState>,
    /// A described card ([`CudaCard`](crate::lazy::CudaCard)): the leaves are placed first, and
    /// the step gets what they leave of `card.free`.
    pub(crate) place_leaves: bool,
    /// The step begins with `emptyCache`: the cached segments nothing lives in go back to the
    /// card first, so that none of them is split for a small request.
    pub(crate) empty_cache: bool,
}

impl Start {
    /// This start with the allocator holding `segments` (libtorch's snapshot): their cached
    /// blocks count in `budget`, so new segments get what is left of it beside them, and at
    /// most `card_free` (the driver's free bytes). An error where the segments are not a state
    /// the model can hold (blocks not whole 512-byte units, overlapping addresses).
    pub(crate) fn holding(mut self, segments: Vec<SegmentState>, budget: u64, card_free: u64) -> Result<Start, String> {
        Allocator::from_snapshot(self.config.clone(), self.card, &segments)?;
        let cached: u64 = segments.iter().map(|s| s.total() - s.allocated()).sum();
        self.card = Card::new(self.card.total, budget.saturating_sub(cached).min(card_free));
        self.segments = segments;
        Ok(self)
    }

    /// The allocator holding [`Start::segments`] (an empty one where they do not form one:
    /// [`Start::holding`] checked them already).
    fn allocator(&self) -> Allocator {
        match self.segments.is_empty() {
            true => Allocator::new(self.config.clone(), self.card),
            false => Allocator::from_snapshot(self.config.clone(), self.card, &self.segments)
                .map(|(a, _)| a)
                .unwrap_or_else(|_| Allocator::new(self.config.clone(), self.card)),
        }
    }
}

/// What replaying a plan through the allocator found.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Placement {
    /// The highest reserved bytes of the step (segments and mapped pages), the leaves' segments
    /// included where they were placed.
    pub(crate) peak_reserved: u64,
    /// The highest allocated bytes, counted in the allocator's blocks, likewise: above the
    /// bytes asked where a cached block was handed out whole.
    pub(crate) peak_allocated: u64,
    /// The highest bytes asked for (each rounded to 512), likewise: the plan's peak.
    pub(crate) peak_asked: u64,
    /// Bytes of the leaves' blocks placed before the step (0 on a card toma runs on).
    pub(crate) leaves: u64,
    /// The allocator's reserved and allocated bytes as the step found them (its snapshot's, on
    /// a card toma runs on; 0 on an empty one): the step's own figures are above them.
    pub(crate) held: (u64, u64),
    /// Whether the settings replayed use expandable segments.
    pub(crate) expandable: bool,
    /// Bytes of cached segments an `emptyCache` gave back at the step's start (0: none was
    /// replayed, [`Start::empty_cache`]).
    pub(crate) emptied: u64,
    /// The first request the allocator could not place, if any.
    pub(crate) unplaced: Option<Unplaced>,
}

/// A request of the step that no cached block and no new segment could serve.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Unplaced {
    /// The node and pass that asked, and the micro-batch it ran in.
    pub(crate) node: usize,
    pub(crate) phase: Phase,
    pub(crate) micro_batch: u64,
    /// The allocator's answer: the request, the cached pieces, the card left.
    pub(crate) oom: Oom,
}

/// The failure `u` of a plan (`plan_peak` allocated at `micro_batch`, `segments` recomputed)
/// as users read it.
pub(crate) fn unplaced_request(
    c: &Compiled,
    plan_peak: u64,
    micro_batch: usize,
    segments: usize,
    u: &Unplaced,
) -> UnplacedRequest {
    UnplacedRequest {
        plan_peak,
        micro_batch,
        segments,
        op: u.node,
        op_name: c.nodes[u.node].name().into(),
        phase: u.phase,
        op_micro_batch: u.micro_batch as usize,
        requested: u.oom.requested,
        segment: u.oom.segment,
        cached_free: u.oom.cached_free,
        largest_cached: u.oom.largest_cached,
        card_free: u.oom.card_free,
        why: u.oom.to_string(),
    }
}

impl Placement {
    /// Whether every request was placed.
    pub(crate) fn placed(&self) -> bool {
        self.unplaced.is_none()
    }

    /// The step's own reserved peak: above what the card held before it, leaves placed for
    /// it excluded (what `max_memory_reserved` grows by over the step).
    pub(crate) fn step_reserved(&self) -> u64 {
        self.peak_reserved.saturating_sub(self.leaves + self.held.0)
    }

    /// The step's own allocated peak, likewise.
    pub(crate) fn step_allocated(&self) -> u64 {
        self.peak_allocated.saturating_sub(self.leaves + self.held.1)
    }
}

/// The allocator, with the bytes the step asked for counted beside its blocks: the two differ
/// where a cached block is handed out whole (its rest too small to split off).
struct Tracked {
    a: Allocator,
    asked: HashMap<BlockId, u64>,
    live: u64,
    peak: u64,
}

impl Tracked {
    fn alloc(&mut self, bytes: u64, stream: Stream) -> Result<BlockId, Oom> {
        let id = self.a.alloc(bytes, stream)?;
        let rounded = crate::lazy::round_block(bytes);
        self.asked.insert(id, rounded);
        self.live += rounded;
        self.peak = self.peak.max(self.live);
        Ok(id)
    }

    fn free(&mut self, id: BlockId) {
        self.live -= self.asked.remove(&id).unwrap_or(0);
        self.a.free(id);
    }
}

/// Replays `schedule` at micro-batch `b` (the whole batch of `c` when `b` covers it) from
/// `start`; `new_grads` are the bytes of `.grad()`s the accumulation step creates.
pub(crate) fn replay(c: &Compiled, schedule: &Schedule, b: u64, new_grads: u64, start: &Start) -> Placement {
    let mut a = Tracked { a: start.allocator(), asked: HashMap::new(), live: 0, peak: 0 };
    // What the card held as the step found it: an `emptyCache` at its start lowers what it
    // holds, not what it held (the peak of the step's reserved bytes is measured from here).
    let held = a.a.stats();
    let held = (held.reserved, held.allocated);
    if start.empty_cache {
        a.a.empty_cache();
    }
    let emptied = held.0 - a.a.stats().reserved;
    let mut leaves = 0;
    if start.place_leaves {
        for bytes in c.leaf_bytes() {
            if let Err(oom) = a.alloc(bytes, Stream(0)) {
                let unplaced = Unplaced { node: 0, phase: Phase::Forward, micro_batch: 0, oom };
                return finish(&a, leaves, (held, emptied), Some(unplaced));
            }
        }
        leaves = a.a.stats().allocated - held.1;
    }
    let n = c.batch.max(1) as u64;
    let b = b.clamp(1, n);
    // The micro-batches that differ: the first, a later one (after the first's accumulation),
    // and the remainder.
    let mut sizes = vec![b];
    if n / b >= 2 {
        sizes.push(b);
    }
    if n % b > 0 && b < n {
        sizes.push(n % b);
    }
    let mut grads: Vec<BlockId> = Vec::new();
    let in_place = schedule.training() && c.accumulates_in_place();
    for (k, &m) in sizes.iter().enumerate() {
        // The first micro-batch's accumulation creates the `.grad()`s that did not exist, beside
        // the gradients autograd computed; later ones add into them in place.
        let created: Vec<u64> = match k == 0 && new_grads > 0 {
            true => c.new_grads(new_grads < c.param_grad_bytes, 1).collect(),
            false => Vec::new(),
        };
        // Accumulating in place, the first micro-batch's gradients become `.grad` as autograd
        // made them, and stay.
        let keep = k == 0 && in_place;
        let add_in_place = k > 0 && in_place;
        if let Err(unplaced) = micro_batch(c, schedule, m, &created, (keep, add_in_place), &mut grads, &mut a) {
            return finish(&a, leaves, (held, emptied), Some(*unplaced));
        }
    }
    finish(&a, leaves, (held, emptied), None)
}

fn finish(a: &Tracked, leaves: u64, (held, emptied): ((u64, u64), u64), unplaced: Option<Unplaced>) -> Placement {
    let stats = a.a.stats();
    Placement {
        peak_reserved: stats.peak_reserved,
        peak_allocated: stats.peak_allocated,
        peak_asked: a.peak,
        leaves,
        held,
        expandable: a.a.config().expandable_segments,
        emptied,
        unplaced,
    }
}

/// One micro-batch of `m` samples: its requests in order, then the `.grad()`s it creates
/// (`created`, kept in `grads`), then every block it still holds freed (the executor drops the
/// graph's values and autograd's gradients once added), but for the leaves' gradients where
/// they become `.grad` (`keep_grads`). Where a later micro-batch adds into `.grad` in place
/// (`add_in_place`), each leaf's gradient is freed as the step that completes it ends.
fn micro_batch(
    c: &Compiled,
    schedule: &Schedule,
    m: u64,
    created: &[u64],
    (keep_grads, add_in_place): (bool, bool),
    grads: &mut Vec<BlockId>,
    a: &mut Tracked,
) -> Result<(), Box<Unplaced>> {
    // Live blocks by table entry, oldest first, with their bytes.
    let mut live: HashMap<u32, Vec<(BlockId, u64)>> = HashMap::new();
    let mut scratch: Vec<BlockId> = Vec::new();
    let mut failed: Option<(usize, Oom)> = None;
    let mut complete: Vec<u32> = Vec::new();
    schedule.requests(m, |request| {
        if failed.is_some() {
            return;
        }
        match request {
            Request::Alloc { entry, bytes, step } => match a.alloc(bytes, Stream(0)) {
                Ok(id) => live.entry(entry).or_default().push((id, bytes)),
                Err(oom) => failed = Some((step, oom)),
            },
            Request::Free { entry, bytes } => {
                if let Some(id) = take(&mut live, entry, bytes) {
                    a.free(id);
                }
            }
            Request::Grad { entry } if add_in_place => complete.push(entry),
            Request::Grad { .. } => {}
            Request::Ended => {
                for entry in complete.drain(..) {
                    if let Some(id) = take(&mut live, entry, schedule.entry_bytes(entry, m)) {
                        a.free(id);
                    }
                }
            }
            Request::Scratch { bytes, step } => match a.alloc(bytes, Stream(0)) {
                Ok(id) => scratch.push(id),
                Err(oom) => failed = Some((step, oom)),
            },
            Request::Ran => scratch.drain(..).for_each(|id| a.free(id)),
        }
    });
    let result = match failed {
        Some((step, oom)) => {
            let (node, phase) = schedule.step_node(c, step);
            Err(Box::new(Unplaced { node, phase, micro_batch: m, oom }))
        }
        None => created.iter().try_for_each(|&bytes| match a.alloc(bytes, Stream(0)) {
            Ok(id) => {
                grads.push(id);
                Ok(())
            }
            Err(oom) => Err(Box::new(Unplaced { node: c.len() - 1, phase: Phase::Accumulate, micro_batch: m, oom })),
        }),
    };
    if keep_grads && result.is_ok() {
        for &k in schedule.grad_entries() {
            grads.extend(take(&mut live, k, schedule.entry_bytes(k, m)));
        }
    }
    for id in scratch.drain(..).chain(live.into_values().flatten().map(|(id, _)| id)) {
        a.free(id);
    }
    result
}

/// The oldest live block of table entry `entry`, or where the schedule names a parameter's
/// gradient through another use of the parameter, one of the same bytes.
fn take(live: &mut HashMap<u32, Vec<(BlockId, u64)>>, entry: u32, bytes: u64) -> Option<BlockId> {
    if let Some(held) = live.get_mut(&entry).filter(|held| !held.is_empty()) {
        return Some(held.remove(0).0);
    }
    live.values_mut().find_map(|held| {
        let k = held.iter().position(|&(_, b)| b == bytes)?;
        Some(held.remove(k).0)
    })
}

#[cfg(all(test, feature = "tch"))]
mod tests {
    use super::{replay, Start};
    use crate::lazy::cost::caching::{Card, Config};
    use crate::lazy::options::{Options, Recompute};
    use crate::lazy::plan::reserved::plan;
    use crate::lazy::plan::{compile, compiled::Compiled, search, Evidence, Machine, Mode};
    use crate::lazy::{LazyError, LazyTensor};
    use tch::{Device, Kind, Tensor};

    /// An H100's multiprocessors and threads each.
    const H100: (u32, u32) = (132, 2048);

    /// An MLP; with `tr`, its weights stored `[out, in]` and used through `w.tr()`, as
    /// tch-rs's min-gpt writes its layers.
    fn mlp(x: &Tensor, ws: &[Tensor], tr: bool) -> LazyTensor {
        let mut h = crate::lazy::lazy(x, 0);
        for w in ws {
            h = if tr { h.matmul(&w.tr()) } else { h.matmul(w) }.relu();
        }
        h.square().mean(None)
    }

    fn start(config: Config) -> Start {
        Start { config, card: Card::unlimited(), segments: Vec::new(), place_leaves: false, empty_cache: false }
    }

    /// The replay asks for what the schedule counts, tensor for tensor: the peak of the bytes
    /// it asks is the plan's, whole, split (evenly or not), recomputing, with `.grad` none or
    /// defined, in f32, in f64 through `w.tr()` and under bf16 autocast. The allocator's
    /// blocks hold at least that.
    #[test]
    fn the_replay_allocates_what_the_plan_counts() {
        let evidence = Evidence::none(Mode::Backward);
        let (mut checked, mut recomputed) = (0, false);
        // f32; f64 through `w.tr()`; f32 recorded under bf16 autocast.
        for (kind, tr, autocast) in
            [(Kind::Float, false, false), (Kind::Double, true, false), (Kind::Float, false, true)]
        {
            let ws: Vec<Tensor> = [(256, 512), (512, 512), (512, 512), (512, 512), (512, 256)]
                .iter()
                .map(|&(i, o)| {
                    let shape = if tr { [o, i] } else { [i, o] };
                    Tensor::randn(shape, (kind, Device::Cpu)).set_requires_grad(true)
                })
                .collect();
            let x = Tensor::randn([2000, 256], (kind, Device::Cpu));
            for defined in [false, true] {
                if defined {
                    // Every `.grad` defined: the micro-batches' gradients are added apart.
                    ws.iter().for_each(|w| w.sum(kind).backward());
                }
                let loss = match autocast {
                    true => crate::autocast(Device::Cpu, Kind::BFloat16, || mlp(&x, &ws, tr)),
                    false => mlp(&x, &ws, tr),
                };
                let c = compile(&loss).unwrap().for_cuda(H100);
                assert_eq!(c.accumulates_in_place(), !defined);
                let unbounded = Machine::with_budget(1 << 40, true);
                let whole = search::plan(&c, Mode::Backward, &Options::new(), &unbounded, &evidence).unwrap().peak;
                for options in [
                    Options::new(),
                    Options::new().micro_batch(512),
                    Options::new().micro_batch(700),
                    Options::new().micro_batch(1500),
                    Options::new().recompute(Recompute::Always),
                ] {
                    let budget = if options.recompute == Recompute::Always { whole - whole / 16 } else { 1 << 40 };
                    let machine = Machine::with_budget(budget, true);
                    let d = search::plan(&c, Mode::Backward, &options, &machine, &evidence).unwrap();
                    recomputed |= d.segments.is_some();
                    for config in [Config::default(), Config::parse("expandable_segments:True").unwrap()] {
                        let p = replay(&c, &d.schedule, d.micro_batch as u64, d.outcome.1, &start(config));
                        assert!(p.placed());
                        let what = format!(
                            "{kind:?} (tr {tr}, autocast {autocast}), micro-batch {} of 2000, recomputing {}, .grad defined {defined}",
                            d.micro_batch,
                            d.segments.is_some()
                        );
                        assert_eq!(p.peak_asked, d.peak, "{what}");
                        assert!(p.peak_reserved >= p.peak_allocated && p.peak_allocated >= p.peak_asked, "{what}");
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 60);
        assert!(recomputed);
    }

    /// An MLP 1536 → 3072 → 1536 at batch 2048 in f32, priced for an H100 by rules, split only:
    /// its activations are 24 and 12 MiB requests, its weights' gradients 18 MiB.
    fn wide_mlp_on_h100() -> (Compiled, Evidence, Options) {
        let ws: Vec<Tensor> = [(1536, 3072), (3072, 1536)]
            .iter()
            .map(|&(i, o)| Tensor::randn([i, o], (Kind::Float, Device::Cpu)).set_requires_grad(true))
            .collect();
        let x = Tensor::randn([2048, 1536], (Kind::Float, Device::Cpu));
        let c = compile(&mlp(&x, &ws, false)).unwrap().for_cuda(H100);
        (c, Evidence::none(Mode::Backward), Options::new().recompute(Recompute::Never))
    }

    /// A card with room for the tensors but not for the segments: the plan of allocated bytes
    /// is refused by the replay, and the plan given is placed.
    #[test]
    fn a_plan_the_allocator_cannot_place_is_planned_again_smaller() {
        let (c, evidence, options) = wide_mlp_on_h100();
        let (mut lowered, mut placed_as_is) = (0, 0);
        for budget_mib in (40u64..200).step_by(3) {
            let budget = budget_mib << 20;
            let machine = Machine::with_budget(budget, false);
            let Ok(plain) = search::plan(&c, Mode::Backward, &options, &machine, &evidence) else { continue };
            let on_card = Machine {
                allocator: Some(Start { card: Card::new(8 << 30, budget), ..start(Config::default()) }),
                ..machine
            };
            let placed = match plan(&c, Mode::Backward, &options, &on_card, &evidence) {
                Ok(placed) => placed,
                // Near the floor even the smallest plan may need a segment the card lacks.
                Err(LazyError::NotPlaced { request, .. }) => {
                    assert!(request.why.contains("left on the card"), "{request}");
                    assert_eq!(lowered + placed_as_is, 0, "{budget_mib} MiB refused after a smaller budget was placed");
                    continue;
                }
                Err(e) => panic!("{budget_mib} MiB: {e}"),
            };
            let p = placed.placement.as_ref().unwrap();
            assert!(p.placed() && p.peak_reserved <= budget);
            assert!(placed.micro_batch <= plain.micro_batch);
            let first = replay(
                &c,
                &plain.schedule,
                plain.micro_batch as u64,
                plain.outcome.1,
                &on_card.allocator.clone().unwrap(),
            );
            if !first.placed() {
                assert!(placed.micro_batch < plain.micro_batch, "{budget_mib} MiB");
                lowered += 1;
            } else {
                assert_eq!(placed.micro_batch, plain.micro_batch, "{budget_mib} MiB");
                placed_as_is += 1;
            }
        }
        assert!(lowered > 0 && placed_as_is > 0, "{lowered} lowered, {placed_as_is} placed as planned");
    }

    /// A step on a card starts from the segments already there (libtorch's snapshot): a cached
    /// block that fits serves it without a new segment, and cached pieces too small for its
    /// requests count in the budget without serving them, as ResNet-18's 904 MiB request met
    /// 1.4 GiB in pieces on the H200 (`docs/gpu.md`).
    #[test]
    fn a_step_starts_from_the_segments_on_the_card() {
        use crate::lazy::cost::caching::{BlockState, PoolKind, SegmentState, Stream};
        const MIB: u64 = 1 << 20;
        let (c, evidence, options) = wide_mlp_on_h100();
        let budget = 400 * MIB;
        let segment = |blocks: &[(u64, bool)]| SegmentState {
            address: None,
            stream: Stream(0),
            pool: PoolKind::Large,
            expandable: false,
            blocks: blocks.iter().map(|&(size, allocated)| BlockState { size, allocated }).collect(),
        };
        let machine = |segments: Vec<SegmentState>| {
            let empty = Start { card: Card::new(80 << 30, budget), ..start(Config::default()) };
            Machine {
                allocator: Some(empty.holding(segments, budget, 80 << 30).unwrap()),
                ..Machine::with_budget(budget, false)
            }
        };
        let planned = |m: &Machine| plan(&c, Mode::Backward, &options, m, &evidence);

        let empty = planned(&machine(Vec::new())).unwrap();
        let p = empty.placement.as_ref().unwrap();
        assert_eq!(p.held, (0, 0));
        assert_eq!(empty.micro_batch, 2048, "the whole batch fits {budget} B from an empty allocator");

        // A cached 100 MiB block and a live one: the step takes the cached block first, and its
        // reserved bytes grow by less.
        let cached = planned(&machine(vec![segment(&[(100 * MIB, false)]), segment(&[(30 * MIB, true)])])).unwrap();
        let q = cached.placement.as_ref().unwrap();
        assert_eq!(q.held, (130 * MIB, 30 * MIB));
        assert_eq!(cached.micro_batch, 2048);
        assert!(
            q.step_reserved() < p.step_reserved(),
            "{} B from the cache, {} B empty",
            q.step_reserved(),
            p.step_reserved()
        );
        assert_eq!(q.step_allocated(), p.step_allocated());

        // 324 MiB cached in 9 MiB pieces, each beside a live block: the whole batch's 24 MiB
        // requests fit none, and the budget leaves 76 MiB for new segments. The whole batch's
        // plan is not placed there, and the plan that is asks for no more than the pieces and
        // what is left give.
        let pieces: Vec<SegmentState> =
            (0..18).map(|_| segment(&[(9 * MIB, false), (2 * MIB, true), (9 * MIB, false)])).collect();
        let cached_free: u64 = pieces.iter().map(|s| s.total() - s.allocated()).sum();
        let fragmented = machine(pieces);
        let start = fragmented.allocator.as_ref().unwrap();
        assert_eq!(start.card.free, budget - cached_free);
        let first = replay(&c, &empty.schedule, 2048, empty.outcome.1, start);
        let u = first.unplaced.as_ref().expect("the whole batch's requests meet only pieces");
        assert!(u.oom.cached_free >= u.oom.requested && u.oom.largest_cached < u.oom.requested, "{}", u.oom);
        // Placed at a smaller micro-batch (256 here), whose requests fit the pieces, with
        // what it still needs of new segments within what the budget left.
        let d = planned(&fragmented).unwrap();
        let r = d.placement.as_ref().unwrap();
        assert!(r.placed() && d.micro_batch < 2048, "micro-batch {}", d.micro_batch);
        assert!(r.step_reserved() <= start.card.free, "{r:?}");
        assert!(d.unplaced.as_ref().is_some_and(|u| u.largest_cached < u.requested), "{}", d.why);
    }

    /// A cached segment that a small request splits pins memory the allocator's own release
    /// cannot give back; emptying the cache at the step's start places the plan as it is,
    /// where it would otherwise be planned smaller.
    #[test]
    fn a_step_empties_the_cache_where_that_places_it() {
        use crate::lazy::cost::caching::{BlockState, PoolKind, SegmentState, Stream};
        const MIB: u64 = 1 << 20;
        let (c, evidence, options) = wide_mlp_on_h100();
        let budget = 80 * MIB;
        let cached = SegmentState {
            address: None,
            stream: Stream(0),
            pool: PoolKind::Large,
            expandable: false,
            blocks: vec![BlockState { size: 8 * MIB, allocated: false }],
        };
        let empty = Start { card: Card::new(80 << 30, budget), ..start(Config::default()) };
        let start = empty.holding(vec![cached], budget, 80 << 30).unwrap();
        let machine = Machine { allocator: Some(start.clone()), ..Machine::with_budget(budget, false) };
        let d = plan(&c, Mode::Backward, &options, &machine, &evidence).unwrap();
        let p = d.placement.as_ref().unwrap();
        assert!(p.placed() && p.emptied == 8 * MIB, "{p:?}");
        assert!(d.why.contains("empties the cache first"), "{}", d.why);
        // As the search planned it under the budget, not smaller; from the cache as it was, the
        // same plan is not placed.
        let searched = search::plan(&c, Mode::Backward, &options, &machine, &evidence).unwrap();
        assert_eq!(d.micro_batch, searched.micro_batch);
        let kept = replay(&c, &d.schedule, d.micro_batch as u64, d.outcome.1, &start);
        assert!(!kept.placed(), "{kept:?}");
        // The step's reserved bytes grow from what the card held before the cache was emptied.
        assert_eq!(p.held.0, 8 * MIB);
        assert!(p.step_reserved() <= budget - 8 * MIB + p.emptied, "{p:?}");
    }

    /// The settings are libtorch's as it parsed them, and `Options::expandable_segments` changes
    /// them at run time. (Process-wide: only CUDA plans read them, and none runs here.)
    #[test]
    fn libtorch_settings_are_read_as_parsed_and_set_at_run_time() {
        let now = Config::libtorch().expect("the shim is built with tch");
        let env = std::env::var("PYTORCH_ALLOC_CONF").or_else(|_| std::env::var("PYTORCH_CUDA_ALLOC_CONF"));
        assert_eq!(now, Config::parse(&env.unwrap_or_default()).unwrap());
        let was = now.expandable_segments;
        for on in [!was, was] {
            crate::lazy::plan::expandable_segments(on);
            assert_eq!(Config::libtorch().unwrap(), Config { expandable_segments: on, ..now.clone() });
        }
    }
}

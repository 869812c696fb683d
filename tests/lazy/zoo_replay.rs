//! The H200 run of 2026-11-27 as data (`docs/gpu-runs/2026-11-27-h200.log`, the GPU suite's
//! test 12): each zoo step's plan rebuilt on the CPU for a described H200 filled as that test
//! filled it (4 GiB left beside the model's parameters and inputs), priced by the CUDA cost
//! model and replayed through the model of the caching allocator.
//!
//! What the log holds, and so what is compared: the training steps were planned by rules alone
//! (`calibrated=0`), so their plans rebuild exactly; the evaluation steps were planned from
//! kernel calls calibrated on the card, which the log counts but does not list, so they are not
//! rebuilt. The LSTM's step ran cuDNN's fused kernel, which a graph recorded on the CPU does not
//! hold. Step 1 ran with Adam's state on the card, which a plan made before any step lacks.

use crate::support::zoo::*;
use tch::{nn, Device, Kind};
use toma::lazy::nn::OptimizerConfig;
use toma::lazy::{CudaCard, LazyError, Options, Phase, Plan};

const LOG: &str = include_str!("../../docs/gpu-runs/2026-11-27-h200.log");
const MIB: f64 = (1 << 20) as f64;

/// One `GPU-RESULT zoo` line.
#[derive(Debug)]
struct Row {
    allocator: String,
    model: ZooKind,
    kind: Kind,
    train: bool,
    batch: i64,
    step: u32,
    planned: f64,
    reserved: f64,
    micro_batch: usize,
    segments: usize,
    ooms: u32,
    calibrated: u32,
}

fn rows() -> Vec<Row> {
    let rows: Vec<Row> = LOG
        .lines()
        .filter_map(|line| line.strip_prefix("GPU-RESULT zoo "))
        .map(|fields| {
            let get = |key: &str| {
                fields
                    .split(' ')
                    .find_map(|f| f.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                    .unwrap_or_else(|| panic!("no {key} in {fields}"))
            };
            let mib = |key: &str| get(key).trim_end_matches("MiB").parse::<f64>().unwrap() * MIB;
            Row {
                allocator: get("allocator").into(),
                model: match get("model") {
                    "ResNet18" => ZooKind::ResNet18,
                    "MobileNetV2" => ZooKind::MobileNetV2,
                    "Gpt2" => ZooKind::Gpt2,
                    "Lstm" => ZooKind::Lstm,
                    other => panic!("model {other}"),
                },
                kind: if get("kind") == "bf16" { Kind::BFloat16 } else { Kind::Float },
                train: get("mode") == "train",
                batch: get("batch").parse().unwrap(),
                step: get("step").parse().unwrap(),
                planned: mib("planned"),
                reserved: mib("reserved"),
                micro_batch: get("micro_batch").parse().unwrap(),
                segments: get("segments").parse().unwrap(),
                ooms: get("ooms").parse().unwrap(),
                calibrated: get("calibrated").parse().unwrap(),
            }
        })
        .collect();
    assert_eq!(rows.len(), 48, "the log's zoo lines");
    rows
}

/// The rows whose plans the CPU rebuilds exactly (see the module's docs).
fn rebuilt(rows: &[Row]) -> impl Iterator<Item = &Row> {
    rows.iter()
        .filter(|r| r.allocator == "default" && r.step == 0 && r.train && r.calibrated == 0 && r.model != ZooKind::Lstm)
}

/// What the log's failures say: "<model> <kind> train batch <n> step 0: ... Tried to allocate
/// X MiB ... and Y GiB is reserved by PyTorch but unallocated".
fn logged_failure(row: &Row) -> (f64, f64) {
    let name = format!("{:?} {} train batch {} step 0:", row.model, kind_name(row.kind), row.batch);
    let line = LOG.lines().find(|l| l.contains(&name) && l.contains("Tried to allocate")).expect("the failure's line");
    let after = |key: &str| {
        let rest = &line[line.find(key).expect(key) + key.len()..];
        let (value, unit) = rest.trim_start().split_once(' ').unwrap();
        value.parse::<f64>().unwrap() * if unit.starts_with("GiB") { 1024.0 * MIB } else { MIB }
    };
    let cached = line[..line.find("GiB is reserved by PyTorch but unallocated").unwrap()]
        .rsplit(' ')
        .nth(1)
        .unwrap()
        .parse::<f64>()
        .unwrap();
    (after("Tried to allocate"), cached * 1024.0 * MIB)
}

/// The row's step planned on a described H200 holding the row's model and inputs with 4 GiB
/// left beside them, default `Options` (the budget is what is left less the margin) and Adam.
fn plan_on_the_card(row: &Row, batch: i64, settings: &str) -> Result<Plan, LazyError> {
    let size = if row.model == ZooKind::Gpt2 { 256 } else { 128 };
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = ZooModel::new(&vs, row.model, size);
    vs.set_kind(row.kind);
    let mut opt = toma::lazy::nn::Adam::default().build(&vs, 1e-4).unwrap();
    let (x, y) = model.data(batch, row.kind, Device::Cpu);
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    let leaves: u64 = vs.trainable_variables().iter().map(bytes).sum::<u64>() + bytes(&x) + bytes(&y);
    let h200 = CudaCard::h200();
    let card = h200.clone().in_use(h200.memory() - ZOO_LEFT - leaves).allocator_settings(settings).unwrap();
    let loss = model.lazy_loss(&x, &y, row.train);
    opt.plan_step(&loss, &Options::new().card(card))
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / MIB)
}

/// The steps that died on the card (ResNet-18 recomputed, f32 and bf16) are refused before
/// they run, for the reason libtorch gave: the same plan, the same request in the recompute,
/// and about as much reserved but unallocated.
#[test]
fn the_zoo_steps_that_ran_out_of_memory_on_the_h200_are_not_placed() {
    let rows = rows();
    let failed: Vec<&Row> = rebuilt(&rows).filter(|r| r.ooms > 0).collect();
    assert_eq!(failed.len(), 2, "ResNet-18 in f32 and bf16");
    for row in failed {
        let (tried, cached) = logged_failure(row);
        let request = match plan_on_the_card(row, row.batch, "") {
            Err(LazyError::NotPlaced { request, .. }) => request,
            Ok(plan) => panic!("{row:?} is placed:\n{plan}"),
            Err(e) => panic!("{row:?}: {e}"),
        };
        println!(
            "{:?} {}: log: {} asked, {} cached free; replay: {} ({}), {} cached free, {} left on the card",
            row.model,
            kind_name(row.kind),
            mib(tried),
            mib(cached),
            mib(request.segment as f64),
            request.op_name,
            mib(request.cached_free as f64),
            mib(request.card_free as f64)
        );
        // The plan the card ran: the same peak, whole batch, as many segments.
        assert!((request.plan_peak as f64 - row.planned).abs() <= 0.001 * row.planned, "{request}");
        assert_eq!((request.micro_batch, request.segments), (row.micro_batch, row.segments), "{request}");
        // Where it failed: the first block's recompute, a request of the size libtorch tried.
        assert_eq!(request.phase, Phase::Recompute, "{request}");
        assert!((request.segment as f64 - tried).abs() <= 0.01 * tried, "{request}");
        assert!((request.cached_free as f64 - cached).abs() <= 0.15 * cached, "{request}");
        assert!(request.largest_cached < request.requested, "{request}");
    }
}

/// The plan a refused step can have: the largest batch the model places, within the budget.
#[test]
fn a_zoo_step_the_card_cannot_place_is_placed_at_a_smaller_batch() {
    let rows = rows();
    let row = rebuilt(&rows).find(|r| r.ooms > 0 && r.kind == Kind::Float).expect("ResNet-18 f32");
    // Bisection: `lo` is placed, `hi` is not.
    let (mut lo, mut hi) = (64, row.batch);
    assert!(plan_on_the_card(row, lo, "").is_ok());
    while hi - lo > 8 {
        let mid = (lo + hi) / 2;
        match plan_on_the_card(row, mid, "") {
            Ok(_) => lo = mid,
            Err(LazyError::NotPlaced { .. } | LazyError::DoesNotFit { .. }) => hi = mid,
            Err(e) => panic!("batch {mid}: {e}"),
        }
    }
    let plan = plan_on_the_card(row, lo, "").unwrap();
    let reserved = plan.reserved_bytes().unwrap();
    println!("ResNet-18 f32 train: placed at batch {lo} (refused at {hi}), {} reserved\n{plan}", mib(reserved as f64));
    assert!(plan.recomputes(), "{plan}");
    assert!(reserved <= plan.budget(), "{plan}");
    assert!(lo as f64 >= 0.5 * row.batch as f64, "placed only at {lo} of {}", row.batch);
}

/// The steps that ran: the same plans, and the reserved peaks the replay predicts beside the
/// card's (`max_memory_reserved` grown during the step). Where the replay refuses the card's
/// plan within the budget (it ran in the margin beyond it), the card reserved more than the
/// budget too. A row whose plan the cost model no longer makes (it changed since the run) is
/// listed and left out.
#[test]
fn the_zoo_steps_that_ran_reserve_what_the_card_reserved() {
    let rows = rows();
    let ran: Vec<&Row> = rebuilt(&rows).filter(|r| r.ooms == 0).collect();
    assert_eq!(ran.len(), 4, "MobileNet-V2 and the GPT-2 stack, f32 and bf16");
    let (mut compared, mut misses) = (0, Vec::new());
    for row in ran {
        let name = format!("{:?} {}", row.model, kind_name(row.kind));
        let plan = plan_on_the_card(row, row.batch, "").unwrap_or_else(|e| panic!("{name}: {e}"));
        let reserved = plan.reserved_bytes().unwrap() as f64;
        let budget = plan.budget() as f64;
        assert!(reserved <= budget, "{plan}");
        // The plan by tensors alone: the one given, or the one the replay refused.
        let (peak, micro_batch, segments) = match plan.unplaced() {
            Some(r) => (r.plan_peak as f64, r.micro_batch, r.segments),
            None => (plan.peak_bytes() as f64, plan.micro_batch(), plan.segments().len()),
        };
        if (peak - row.planned).abs() > 0.001 * row.planned
            || (micro_batch, segments) != (row.micro_batch, row.segments)
        {
            println!(
                "{name}: not rebuilt: the card planned {} in {} segments, the CPU now {} in {segments}",
                mib(row.planned),
                row.segments,
                mib(peak)
            );
            continue;
        }
        compared += 1;
        if let Some(refused) = plan.unplaced() {
            println!(
                "{name}: reserved {} on the card, over the {} budget; the replay refuses that plan ({}) and \
                 places {} segments, {} reserved",
                mib(row.reserved),
                mib(budget),
                refused.why,
                plan.segments().len(),
                mib(reserved)
            );
            assert!(row.reserved > budget, "{name}: refused, yet the card reserved {}", mib(row.reserved));
            continue;
        }
        let error = 100.0 * (reserved - row.reserved) / row.reserved;
        println!("{name}: reserved {} on the card, {} replayed ({error:+.1}%)", mib(row.reserved), mib(reserved));
        if error.abs() > 10.0 {
            misses.push(format!("{name}: {error:+.1}%"));
        }
    }
    assert!(compared >= 2, "only {compared} of the log's plans rebuilt");
    assert!(misses.is_empty(), "reserved peaks off by more than 10%: {misses:?}");
}

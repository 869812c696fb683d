//! Plans for a CUDA card described, not present (`Options::card`): priced by the CUDA cost
//! model and held to what libtorch's caching allocator would reserve, by a replay of its model.

use tch::{Device, Kind, Tensor};
use toma::lazy::nn::{self, Module};
use toma::lazy::{lazy, CudaCard, LazyError, LazyTensor, Mode, Options};

/// An MLP whose activations come in sizes between 1 and 10 MiB per micro-batch of 256, the
/// large pool's 20 MiB segments: where the allocator's rounding and segments show.
fn mlp(vs: &nn::Path, widths: &[i64]) -> nn::Sequential {
    let mut seq = nn::seq();
    for (k, w) in widths.windows(2).enumerate() {
        seq = seq.add(nn::linear(vs / k, w[0], w[1], Default::default()));
        if k + 2 < widths.len() {
            seq = seq.add_fn(|x| x.relu());
        }
    }
    seq
}

fn loss_of(batch: i64) -> (nn::VarStore, LazyTensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root(), &[1536, 3072, 3072, 1536, 10]);
    let x = lazy(&Tensor::zeros([batch, 1536], (Kind::Float, Device::Cpu)), 0);
    let h = net.forward(&x);
    (vs, h.square().mean(None))
}

const MIB: u64 = 1 << 20;

#[test]
fn a_card_plan_reserves_at_least_what_it_allocates_and_places_its_leaves() {
    let (vs, loss) = loss_of(1024);
    let card = CudaCard::new(8 << 30);
    let plan = loss.plan(Mode::Backward, &Options::new().card(card)).unwrap();
    assert!(!plan.splits(), "{plan}");
    let reserved = plan.reserved_bytes().expect("a card plan replays the allocator");
    assert!(reserved >= plan.peak_bytes(), "{plan}");
    // Rounding, cached pieces and whole segments: a few segments above the tensors at most.
    assert!(reserved <= plan.peak_bytes() + 8 * 20 * MIB, "{plan}");
    let params: u64 = vs.trainable_variables().iter().map(|t| t.numel() as u64 * 4).sum();
    let leaves = plan.placed_leaf_bytes().unwrap();
    assert!(leaves >= params + 1024 * 1536 * 4, "{leaves} placed, {params} of parameters");
    assert!(plan.to_string().contains("reserved by the CUDA caching allocator"), "{plan}");
}

#[test]
fn every_plan_on_a_card_is_placed_within_its_budget() {
    let (_vs, loss) = loss_of(4096);
    let mut micro_batches = Vec::new();
    for budget_mib in [128u64, 160, 192, 256, 384, 512, 768, 1024] {
        let budget = budget_mib * MIB;
        let options = Options::new().card(CudaCard::new(8 << 30)).budget(budget);
        match loss.plan(Mode::Backward, &options) {
            Ok(plan) => {
                let reserved = plan.reserved_bytes().unwrap();
                assert!(reserved <= budget, "budget {budget_mib} MiB: reserved {reserved}\n{plan}");
                assert!(plan.peak_bytes() <= budget, "{plan}");
                micro_batches.push(plan.micro_batch());
            }
            Err(e @ (LazyError::DoesNotFit { .. } | LazyError::NotPlaced { .. })) => {
                assert!(budget_mib <= 160, "budget {budget_mib} MiB: {e}")
            }
            Err(e) => panic!("budget {budget_mib} MiB: {e}"),
        }
    }
    assert!(micro_batches.windows(2).all(|w| w[0] <= w[1]), "{micro_batches:?}");
    assert!(micro_batches.first() < micro_batches.last(), "{micro_batches:?}");
}

/// Where tensors alone would fit, the segments may not: the allocated-bytes plan, replayed, is
/// refused, and the plan given is a smaller one that the allocator places.
#[test]
fn a_budget_that_fits_the_tensors_but_not_the_segments_plans_smaller() {
    let (_vs, loss) = loss_of(4096);
    let card = || CudaCard::new(8 << 30);
    let mut lowered = 0;
    for budget_mib in (60u64..400).step_by(7) {
        let budget = budget_mib * MIB;
        let Ok(plan) = loss.plan(Mode::Backward, &Options::new().card(card()).budget(budget)) else { continue };
        let reserved = plan.reserved_bytes().unwrap();
        assert!(reserved <= budget, "{plan}");
        if let Some(refused) = plan.unplaced() {
            lowered += 1;
            // The plan refused fit the budget in tensors, at a larger micro-batch.
            assert!(refused.plan_peak <= budget && refused.micro_batch > plan.micro_batch(), "{refused}\n{plan}");
            assert!(plan.reason().contains(&refused.to_string()), "{plan}");
            // The plan is held below the budget by the allocator, not by its tensors.
            let at_budget = loss
                .plan(Mode::Backward, &Options::new().card(card()).budget(budget).micro_batch(plan.micro_batch() * 2));
            if let Ok(bigger) = at_budget {
                assert!(bigger.peak_bytes() <= budget || bigger.micro_batch() >= 4096, "{bigger}");
            }
        }
    }
    assert!(lowered > 0, "no budget between 60 and 400 MiB needed the allocator's replay to lower the plan");
}

/// The card's settings are the ones replayed: expandable segments map pages of 2 and 20 MiB
/// where default segments are cut to size, so the two reserve differently for one plan.
#[test]
fn the_cards_allocator_settings_are_the_ones_replayed() {
    let (_vs, loss) = loss_of(1000);
    let plan = |settings: &str| {
        let card = CudaCard::new(8 << 30).allocator_settings(settings).unwrap();
        loss.plan(Mode::Backward, &Options::new().card(card).micro_batch(300)).unwrap()
    };
    let (default, expandable) = (plan(""), plan("expandable_segments:True"));
    assert_eq!(default.micro_batch(), expandable.micro_batch());
    assert_eq!(default.peak_bytes(), expandable.peak_bytes());
    for p in [&default, &expandable] {
        assert!(p.reserved_bytes().unwrap() >= p.peak_bytes(), "{p}");
    }
    assert!(default.to_string().contains("(default segments"), "{default}");
    assert!(expandable.to_string().contains("(expandable segments"), "{expandable}");
}

#[test]
fn a_card_without_room_for_the_step_says_which_request_failed() {
    let (_vs, loss) = loss_of(64);
    // The parameters take ~63 MiB; the card leaves a few MiB beside them.
    let card = CudaCard::new(72 * MIB);
    match loss.plan(Mode::Backward, &Options::new().card(card).safety_margin(0.0)) {
        Err(LazyError::NotPlaced { request, .. }) => {
            assert!(request.why.contains("request"), "{request}");
            assert!(!request.op_name.is_empty());
        }
        Err(LazyError::DoesNotFit { .. }) => {}
        Ok(plan) => panic!("planned on a card with no room: {plan}"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_step_with_a_described_card_refuses() {
    let (_vs, loss) = loss_of(8);
    let e = loss.backward_with(&Options::new().card(CudaCard::h100_80gb())).unwrap_err();
    assert!(matches!(e, LazyError::Unsupported { .. }), "{e}");
}

#[test]
fn allocator_settings_libtorch_would_refuse_are_refused() {
    let e = CudaCard::h100_80gb().allocator_settings("max_split_size_mb:banana").unwrap_err();
    assert!(matches!(e, toma::ConfigError::AllocatorSettings { .. }), "{e}");
    assert!(CudaCard::h100_80gb().allocator_settings("max_split_size_mb:256,expandable_segments:True").is_ok());
}

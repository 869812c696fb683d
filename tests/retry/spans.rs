//! Each call runs in its own span (`toma.batch`, `toma.range`), named after the function and
//! the call site, and toma's events are emitted inside it.

use crate::support::events;

fn oom_above(limit: usize, size: usize) -> Result<usize, String> {
    if size > limit {
        Err("CUDA out of memory. Tried to allocate 2.00 GiB".into())
    } else {
        Ok(size)
    }
}

/// The events emitted inside spans called `name` opened in this file (other tests run beside
/// these and record into the same global subscriber).
fn in_span<'a>(recorded: &'a [events::Recorded], name: &str) -> Vec<&'a events::Recorded> {
    recorded
        .iter()
        .filter(|e| e.span.as_ref().is_some_and(|(n, fields)| *n == name && fields["site"].contains("spans.rs")))
        .collect()
}

#[test]
fn calls_run_in_spans_named_after_their_site() {
    events::record();
    let _serial = crate::support::serial();
    events::take();
    let line = line!() + 1;
    let batch = toma::Batch::new(8).cache(toma::CacheKind::None).run(|size| oom_above(4, size));
    assert_eq!(batch, Ok(4));
    let ranged =
        toma::Range::new(0, 10, 4).cache(toma::CacheKind::None).run(|start, end| oom_above(2, end - start).map(drop));
    assert_eq!(ranged, Ok(()));
    let recorded = events::take();
    let batch = in_span(&recorded, "toma.batch");
    let oom = batch.iter().find(|e| e.is_caught_oom()).expect("the batch's out-of-memory event is in its span");
    let fields = &oom.span.as_ref().unwrap().1;
    assert_eq!(fields["function"], "execute");
    assert_eq!(fields["initial"], "8");
    assert!(fields["site"].contains(&format!("spans.rs:{line}")), "{fields:?}");
    let range = in_span(&recorded, "toma.range");
    assert!(range.iter().any(|e| e.is_caught_oom()), "{range:?}");
    assert_eq!(range[0].span.as_ref().unwrap().1["initial"], "4");
}

#[cfg(feature = "macros")]
#[toma::batch(initial_batchsize = 8, cache = None)]
fn halves_once(batchsize: usize) -> Result<usize, String> {
    oom_above(4, batchsize)
}

#[cfg(feature = "macros")]
#[test]
fn an_attribute_names_its_function() {
    events::record();
    let _serial = crate::support::serial();
    events::take();
    assert_eq!(halves_once(), Ok(4));
    let recorded = events::take();
    let batch = in_span(&recorded, "toma.batch");
    let fields = &batch.first().expect("events in the span").span.as_ref().unwrap().1;
    assert!(fields["function"].ends_with("halves_once"), "{fields:?}");
}

//! Properties of the engine over random sizes and thresholds.

use proptest::prelude::*;
use toma::{Batch, CacheKind, Range};

fn oom() -> String {
    "CUDA out of memory. Tried to allocate 2.00 MiB".to_string()
}

/// The largest of initial, initial/2, initial/4, … that is ≤ limit (at least 1).
fn largest_halving(initial: usize, limit: usize) -> usize {
    let mut size = initial;
    while size > limit && size > 1 {
        size /= 2;
    }
    size
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn batch_ends_at_the_largest_halving_that_fits(initial in 1usize..1 << 20, limit in 0usize..1 << 21) {
        let mut attempts = 0u32;
        let out = Batch::new(initial).cache(CacheKind::None).run(|size| {
            attempts += 1;
            if size > limit { Err(oom()) } else { Ok(size) }
        });
        let expected = largest_halving(initial, limit);
        if expected <= limit {
            prop_assert_eq!(out, Ok(expected));
        } else {
            // Even size 1 does not fit: the last out-of-memory comes back.
            prop_assert_eq!(expected, 1);
            prop_assert!(out.is_err());
        }
        prop_assert!(attempts <= usize::BITS - initial.leading_zeros());
    }

    #[test]
    fn range_covers_every_index_once_in_order(
        start in 0usize..1000,
        len in 0usize..2000,
        initial in 1usize..512,
        limit in 1usize..600,
    ) {
        let end = start + len;
        let mut calls = Vec::new();
        let mut covered = Vec::new();
        Range::new(start, end, initial).cache(CacheKind::None).run(|s, e| {
            calls.push((s, e));
            if e - s > limit {
                return Err(oom());
            }
            covered.extend(s..e);
            Ok(())
        }).unwrap();
        prop_assert_eq!(covered, (start..end).collect::<Vec<_>>());
        prop_assert!(calls.iter().all(|&(s, e)| start <= s && s < e && e <= end));
        // The step never grows back within a call, so sub-range lengths never increase.
        prop_assert!(calls.windows(2).all(|w| w[1].1 - w[1].0 <= w[0].1 - w[0].0), "{:?}", calls);
    }
}

#[cfg(feature = "tch")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn chunked_writes_every_index_once(
        rows in 0i64..300,
        cols in 1i64..4,
        dimension in 0i64..2,
        initial in 1usize..200,
        limit in 1usize..100,
    ) {
        use tch::{Device, Kind, Tensor};
        let t = Tensor::zeros([rows, cols], (Kind::Float, Device::Cpu));
        let mut next = 0;
        toma::Chunked::new(&t, initial).dimension(dimension).cache(CacheKind::None).run(|mut chunk, s, e| {
            if e - s > limit {
                return Err(oom());
            }
            assert_eq!(s, next, "in order, no gaps");
            next = e;
            let _ = chunk.g_add_scalar_(1.0);
            Ok(())
        }).unwrap();
        prop_assert_eq!(next as i64, t.size()[dimension as usize]);
        // Every element written exactly once.
        prop_assert!(t == t.ones_like());
    }
}

//! `set_default_cache` changes what later calls use. Its own binary: the default is process-wide.

use std::cell::RefCell;

use toma::{Batch, CacheKind};

fn run_twice_from_one_line(calls: &RefCell<Vec<usize>>) {
    for _ in 0..2 {
        Batch::new(8)
            .run(|size| {
                calls.borrow_mut().push(size);
                if size > 2 {
                    return Err("CUDA error: out of memory".to_string());
                }
                Ok(())
            })
            .unwrap();
    }
}

#[test]
fn set_default_cache_takes_effect_for_later_calls() {
    assert_eq!(toma::default_cache(), CacheKind::StacktraceMemory);
    let calls = RefCell::new(Vec::new());
    toma::set_default_cache(CacheKind::None);
    run_twice_from_one_line(&calls);
    assert_eq!(calls.take(), [8, 4, 2, 8, 4, 2]);
    toma::set_default_cache(CacheKind::Global);
    assert_eq!(toma::default_cache(), CacheKind::Global);
    run_twice_from_one_line(&calls);
    assert_eq!(calls.take(), [8, 4, 2, 2]);
    // A kind named on the call wins over the default.
    let mut sizes = Vec::new();
    for _ in 0..2 {
        Batch::new(8)
            .cache(CacheKind::None)
            .run(|size| {
                sizes.push(size);
                if size > 2 {
                    return Err("CUDA error: out of memory".to_string());
                }
                Ok(())
            })
            .unwrap();
    }
    assert_eq!(sizes, [8, 4, 2, 8, 4, 2]);
}

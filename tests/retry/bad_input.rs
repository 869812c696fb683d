//! Bad input: each case is a documented, typed error (or compile error, see tests/ui) — never a
//! hang or a wrong result.

use toma::{Batch, CacheKind, ConfigError, Range};

fn oom() -> String {
    "CUDA out of memory. Tried to allocate 2.00 MiB".to_string()
}

#[test]
fn zero_sizes_and_reversed_ranges() {
    assert_eq!(Batch::try_new(0).unwrap_err(), ConfigError::ZeroSize { what: "initial batch size" });
    assert_eq!(Range::try_new(0, 1, 0).unwrap_err(), ConfigError::ZeroSize { what: "initial step" });
    let err = Range::try_new(10, 3, 4).unwrap_err();
    assert_eq!(err, ConfigError::StartAfterEnd { start: 10, end: 3 });
    assert_eq!(err.to_string(), "toma: range start 10 is after its end 3");
    // The panicking forms say the same, at the caller.
    let payload = std::panic::catch_unwind(|| toma::execute::range(10, 3, 4, |_, _| Ok::<(), String>(()))).unwrap_err();
    assert_eq!(payload.downcast_ref::<String>().unwrap(), "toma: range start 10 is after its end 3");
    assert!(toma::Policy::try_factor(1.0).is_err());
}

#[test]
fn sizes_near_usize_max() {
    let mut sizes = Vec::new();
    let out = Batch::new(usize::MAX).cache(CacheKind::None).run(|size| {
        sizes.push(size);
        if size > 1000 {
            Err(oom())
        } else {
            Ok(size)
        }
    });
    assert_eq!(out, Ok(usize::MAX >> 55));
    assert_eq!(sizes.len(), 56);
    let mut calls = 0;
    Range::new(0, usize::MAX, usize::MAX)
        .cache(CacheKind::None)
        .run(|start, end| {
            calls += 1;
            // Pretend only the first sub-range exists, then stop with a non-OOM error.
            if end - start > 1 << 40 {
                return Err(oom());
            }
            Err(format!("stop at [{start}, {end})"))
        })
        .unwrap_err();
    assert_eq!(calls, 25);
}

#[cfg(feature = "tch")]
mod tensors {
    use super::*;
    use tch::{Device, Kind, Tensor};
    use toma::Chunked;

    #[test]
    fn dimensions_out_of_range_and_scalars() {
        let t = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
        for dimension in [2, 7, -3] {
            let err = Chunked::try_new(&t, 2, dimension).unwrap_err();
            assert_eq!(err, ConfigError::DimensionOutOfRange { dimension, ndim: 2 });
        }
        assert!(Chunked::try_new(&t, 2, -1).is_ok());
        let scalar = Tensor::from(3.0f64);
        assert_eq!(
            Chunked::try_new(&scalar, 2, 0).unwrap_err(),
            ConfigError::DimensionOutOfRange { dimension: 0, ndim: 0 }
        );
        let payload = std::panic::catch_unwind(|| Chunked::new(&t, 2).dimension(9)).unwrap_err();
        assert!(payload.downcast_ref::<String>().unwrap().contains("dimension 9 is out of range"));
        assert_eq!(Chunked::try_new(&t, 0, 0).unwrap_err(), ConfigError::ZeroSize { what: "initial step" });
    }

    #[test]
    fn empty_and_zero_sized_dimensions_call_nothing() {
        for shape in [vec![0, 3], vec![3, 0], vec![0]] {
            let t = Tensor::zeros(shape.as_slice(), (Kind::Float, Device::Cpu));
            let last = shape.len() as i64 - 1;
            let mut calls = 0;
            Chunked::new(&t, 4)
                .dimension(last)
                .cache(CacheKind::None)
                .run(|_, _, _| {
                    calls += 1;
                    Ok::<(), String>(())
                })
                .unwrap();
            let len = shape[last as usize] as usize;
            assert_eq!(calls, len.div_ceil(4));
        }
    }

    #[test]
    fn non_contiguous_tensors_are_chunked_as_views() {
        // A transposed tensor: chunks along dim 0 are strided views into the original storage.
        let base = Tensor::zeros([6, 10], (Kind::Float, Device::Cpu));
        let t = base.transpose(0, 1);
        assert!(!t.is_contiguous());
        Chunked::new(&t, 4)
            .cache(CacheKind::None)
            .run(|mut chunk, start, end| {
                if end - start > 3 {
                    return Err(oom());
                }
                let _ = chunk.g_add_scalar_(start as f64 + 1.0);
                Ok(())
            })
            .unwrap();
        // Rows of `t` are columns of `base`: column j got (start of its chunk) + 1.
        let expected: Vec<f32> = (0..10).map(|j| (j / 2 * 2 + 1) as f32).collect();
        let row: Vec<f32> = Vec::try_from(&base.get(0)).unwrap();
        assert_eq!(row, expected);
    }
}

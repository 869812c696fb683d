//! `i(..)` with tch's index grammar (`tch::TensorIndexer`: an `i64` selects and removes a
//! dimension, a range narrows it, `NewAxis` inserts one, a 1-D integer tensor picks entries), on
//! lazy tensors (recorded as `select`, `narrow`, `unsqueeze` and `index_select`) and through
//! [`TensorOps::i`](super::TensorOps::i) on both kinds of tensor.
//!
//! ```
//! use tch::{Device, IndexOp, Kind, NewAxis, Tensor};
//! use toma::lazy::lazy;
//!
//! let x = Tensor::randn([4, 6, 5], (Kind::Float, Device::Cpu));
//! let picked = lazy(&x, 0).i((.., 1..3, -1)).to_tensor()?;
//! assert!(picked.equal(&x.i((.., 1..3, -1))));
//! assert_eq!(lazy(&x, 0).i((.., NewAxis, 2..)).size(), [4, 1, 4, 5]);
//! # Ok::<(), toma::lazy::LazyError>(())
//! ```

use std::ops::{Bound, Range, RangeFrom, RangeFull, RangeInclusive, RangeTo, RangeToInclusive};

use tch::{Kind, NewAxis, TchError, Tensor, TensorIndexer};

use super::error::LazyError;
use super::LazyTensor;
use crate::lazy::error::OrPanic;

/// What `i(..)` takes: one index ([`LazyIndexer`]) or a tuple of up to six, as tch's
/// `IndexOp`. Both tensor kinds index with it: a `Tensor` through tch's own `IndexOp`, a
/// [`LazyTensor`] by recording the same ops.
pub trait TensorIndex {
    /// The index applied to a tensor, by tch.
    ///
    /// # Errors
    /// tch's.
    fn index_tensor(self, x: &Tensor) -> Result<Tensor, TchError>;
    /// The index recorded on a lazy tensor.
    ///
    /// # Errors
    /// As the ops it records; more indices than dimensions; an index tensor that is not 1-D
    /// integers ([`LazyError::Argument`]).
    fn index_lazy(self, x: &LazyTensor) -> Result<LazyTensor, LazyError>;
}

impl LazyTensor {
    /// Indexes with tch's grammar (tch's `IndexOp::f_i`): `x.f_i((.., 1..3, -1))`.
    ///
    /// # Errors
    /// As the ops it records; more indices than dimensions; an index tensor that is not 1-D
    /// integers ([`LazyError::Argument`]).
    pub fn f_i(&self, index: impl TensorIndex) -> Result<LazyTensor, LazyError> {
        if let Some(t) = self.eager_value() {
            return super::ops::eager("i", index.index_tensor(t));
        }
        index.index_lazy(self)
    }

    /// Like [`f_i`](Self::f_i), panicking with its error (tch's `IndexOp::i`).
    ///
    /// # Panics
    /// When the index does not apply.
    #[track_caller]
    pub fn i(&self, index: impl TensorIndex) -> LazyTensor {
        self.f_i(index).or_panic()
    }
}

impl LazyTensor {
    fn indexed(&self, specs: Vec<TensorIndexer>) -> Result<LazyTensor, LazyError> {
        let new_axes = specs.iter().filter(|s| matches!(s, TensorIndexer::InsertNewAxis)).count();
        let bad = |reason: String| LazyError::Argument { op: "i".into(), shape: self.size(), reason };
        if specs.len() > self.dim() + new_axes {
            return Err(bad(format!("too many indices for tensor of dimension {}", self.dim())));
        }
        let mut x = self.clone();
        let mut dim = 0i64;
        for spec in specs {
            x = match spec {
                TensorIndexer::InsertNewAxis => {
                    dim += 1;
                    x.f_unsqueeze(dim - 1)?
                }
                // `select` removes the dimension: the next index applies at the same position.
                TensorIndexer::Select(index) => x.f_select(dim, index)?,
                TensorIndexer::Narrow(start, end) => {
                    let len = x.size()[dim as usize];
                    let first = match start {
                        Bound::Included(s) => s,
                        Bound::Excluded(s) => s + 1,
                        Bound::Unbounded => 0,
                    };
                    let last = match end {
                        Bound::Included(e) => e + 1,
                        Bound::Excluded(e) => e,
                        Bound::Unbounded => len,
                    };
                    dim += 1;
                    if matches!((start, end), (Bound::Unbounded, Bound::Unbounded)) {
                        x
                    } else {
                        x.f_narrow(dim - 1, first, last - first)?
                    }
                }
                TensorIndexer::IndexSelect(tensor) => {
                    if tensor.dim() != 1 || !matches!(tensor.kind(), Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8)
                    {
                        return Err(bad("an index tensor must be 1-D integers (Int64, Int, Int16 or Int8)".into()));
                    }
                    dim += 1;
                    x.f_index_select(dim - 1, &tensor.to_kind(Kind::Int64))?
                }
            };
        }
        Ok(x)
    }
}

/// One index of [`TensorIndex`]: what tch turns into a `TensorIndexer` (its own trait, so that
/// tuples of indices do not overlap a single one).
pub trait LazyIndexer {
    /// As tch's indexer.
    fn indexer(self) -> TensorIndexer;
}

macro_rules! indexers {
    ($($t:ty),*) => {$(
        impl LazyIndexer for $t {
            fn indexer(self) -> TensorIndexer {
                self.into()
            }
        }
    )*};
}

indexers!(
    i64,
    NewAxis,
    Range<i64>,
    RangeFrom<i64>,
    RangeTo<i64>,
    RangeFull,
    RangeInclusive<i64>,
    RangeToInclusive<i64>,
    &[i64],
    Vec<i64>,
    &Tensor
);

impl<A: LazyIndexer> TensorIndex for A {
    fn index_tensor(self, x: &Tensor) -> Result<Tensor, TchError> {
        tch::IndexOp::f_i(x, self.indexer())
    }
    fn index_lazy(self, x: &LazyTensor) -> Result<LazyTensor, LazyError> {
        x.indexed(vec![self.indexer()])
    }
}

macro_rules! tuple_index {
    ($($t:ident . $n:tt),+) => {
        impl<$($t: LazyIndexer),+> TensorIndex for ($($t,)+) {
            fn index_tensor(self, x: &Tensor) -> Result<Tensor, TchError> {
                tch::IndexOp::f_i(x, ($(self.$n.indexer(),)+))
            }
            fn index_lazy(self, x: &LazyTensor) -> Result<LazyTensor, LazyError> {
                x.indexed(vec![$(self.$n.indexer()),+])
            }
        }
    };
}

tuple_index!(A.0);
tuple_index!(A.0, B.1);
tuple_index!(A.0, B.1, C.2);
tuple_index!(A.0, B.1, C.2, D.3);
tuple_index!(A.0, B.1, C.2, D.3, E.4);
tuple_index!(A.0, B.1, C.2, D.3, E.4, F.5);

//! Wrapping inputs for recording: [`lazy`] and [`try_lazy`] over a tensor, or a tuple, array or
//! `Vec` of them, all with one batch dimension.

use tch::Tensor;

use super::error::LazyError;
use super::graph::LazyTensor;
use super::shape;
use crate::lazy::error::OrPanic;

/// What [`lazy`] wraps: a tensor, or a tuple, array or `Vec` of them.
pub trait Lazify {
    /// The lazy counterpart: a [`LazyTensor`], or a tuple/array/`Vec` of them.
    type Output;

    /// Wraps with batch dimension `batch` (`None`: no batch dimension).
    ///
    /// # Errors
    /// [`LazyError::Argument`] when a tensor has no such dimension, [`LazyError::Batch`] when
    /// the tensors' batch sizes differ.
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError>;

    /// The batch sizes of what is wrapped, to check that they agree.
    #[doc(hidden)]
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>);

    /// How many tensors are wrapped.
    #[doc(hidden)]
    fn count(&self) -> usize;

    /// What is wrapped, as tensors again: what [`lazy`] gives in the eager body that
    /// `#[toma::lazy::module]` writes ([`eager_wrap`]).
    #[doc(hidden)]
    type Tensors;

    /// The tensors themselves (shallow clones), unwrapped.
    #[doc(hidden)]
    fn tensors(self) -> Self::Tensors;
}

impl Lazify for &Tensor {
    type Output = LazyTensor;
    fn lazify(self, batch: Option<i64>) -> Result<LazyTensor, LazyError> {
        match batch {
            Some(dim) => LazyTensor::batched(self, dim),
            None => Ok(LazyTensor::fixed(self)),
        }
    }
    fn count(&self) -> usize {
        1
    }
    type Tensors = Tensor;
    fn tensors(self) -> Tensor {
        self.shallow_clone()
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        if let Some(dim) = batch {
            let shape = self.size();
            if let Ok(d) = shape::wrap_dim(dim, shape.len()) {
                if let Some(&size) = shape.get(d) {
                    sizes.push((shape, size));
                }
            }
        }
    }
}

macro_rules! lazify_tuple {
    ($($name:ident),+) => {
        impl<$($name: Lazify),+> Lazify for ($($name,)+) {
            type Output = ($($name::Output,)+);
            #[allow(non_snake_case)]
            fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
                let ($($name,)+) = self;
                Ok(($($name.lazify(batch)?,)+))
            }
            #[allow(non_snake_case)]
            fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
                let ($($name,)+) = self;
                $($name.batch_sizes(batch, sizes);)+
            }
            #[allow(non_snake_case)]
            fn count(&self) -> usize {
                let ($($name,)+) = self;
                0 $(+ $name.count())+
            }
            type Tensors = ($($name::Tensors,)+);
            #[allow(non_snake_case)]
            fn tensors(self) -> Self::Tensors {
                let ($($name,)+) = self;
                ($($name.tensors(),)+)
            }
        }
    };
}

lazify_tuple!(A);
lazify_tuple!(A, B);
lazify_tuple!(A, B, C);
lazify_tuple!(A, B, C, D);
lazify_tuple!(A, B, C, D, E);
lazify_tuple!(A, B, C, D, E, F);

impl<const K: usize> Lazify for &[Tensor; K] {
    type Output = [LazyTensor; K];
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        let v = self.as_slice().lazify(batch)?;
        Ok(v.try_into().unwrap_or_else(|_| unreachable!("K tensors give K lazy tensors")))
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        self.as_slice().batch_sizes(batch, sizes)
    }
    fn count(&self) -> usize {
        self.len()
    }
    type Tensors = [Tensor; K];
    fn tensors(self) -> [Tensor; K] {
        std::array::from_fn(|k| self[k].shallow_clone())
    }
}

impl Lazify for &[Tensor] {
    type Output = Vec<LazyTensor>;
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        self.iter().map(|t| t.lazify(batch)).collect()
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        for t in self.iter() {
            t.batch_sizes(batch, sizes);
        }
    }
    fn count(&self) -> usize {
        self.len()
    }
    type Tensors = Vec<Tensor>;
    fn tensors(self) -> Vec<Tensor> {
        self.iter().map(Tensor::shallow_clone).collect()
    }
}

impl Lazify for &Vec<Tensor> {
    type Output = Vec<LazyTensor>;
    fn lazify(self, batch: Option<i64>) -> Result<Self::Output, LazyError> {
        self.as_slice().lazify(batch)
    }
    fn batch_sizes(&self, batch: Option<i64>, sizes: &mut Vec<(Vec<i64>, i64)>) {
        self.as_slice().batch_sizes(batch, sizes)
    }
    fn count(&self) -> usize {
        self.len()
    }
    type Tensors = Vec<Tensor>;
    fn tensors(self) -> Vec<Tensor> {
        self.as_slice().tensors()
    }
}

/// A batch dimension argument: `0`, `-1`, `Some(0)`, or `None` for no batch dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchDimArg(pub Option<i64>);

impl From<i32> for BatchDimArg {
    fn from(d: i32) -> Self {
        BatchDimArg(Some(i64::from(d)))
    }
}
impl From<i64> for BatchDimArg {
    fn from(d: i64) -> Self {
        BatchDimArg(Some(d))
    }
}
impl From<usize> for BatchDimArg {
    fn from(d: usize) -> Self {
        BatchDimArg(Some(d as i64))
    }
}
impl From<Option<i64>> for BatchDimArg {
    fn from(d: Option<i64>) -> Self {
        BatchDimArg(d)
    }
}

/// Wraps inputs for lazy recording, all with the same batch dimension: a tensor, or a tuple,
/// array or `Vec` of them (`lazy((&input, &label), 0)`, as koila's `lazy(input, label,
/// batch=0)`).
///
/// # Panics
/// When a tensor has no such dimension, or the tensors' batch sizes differ; [`try_lazy`]
/// reports these as errors.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let input = Tensor::randn([8, 3, 4, 4], (Kind::Float, Device::Cpu));
/// let label = Tensor::zeros([8], (Kind::Int64, Device::Cpu));
/// let (x, y) = toma::lazy::lazy((&input, &label), 0);
/// assert_eq!((x.batch_dim(), y.batch_size()), (Some(0), Some(8)));
/// ```
#[track_caller]
pub fn lazy<L: Lazify>(inputs: L, batch: impl Into<BatchDimArg>) -> L::Output {
    try_lazy(inputs, batch).or_panic()
}

/// [`lazy`] in the eager body `#[toma::lazy::module]` writes: the tensors as they are (shallow
/// clones), so that a method that wraps its own inputs (`fn loss(&self, tokens: &[i64]) ->
/// Tensor { let xs = lazy(&Tensor::from_slice(tokens), 0); .. }`) runs eagerly on tch's
/// tensors and lazily on toma's from one body. The batch dimension is not checked.
#[doc(hidden)]
pub fn eager_wrap<L: Lazify>(inputs: L, _batch: impl Into<BatchDimArg>) -> L::Tensors {
    inputs.tensors()
}

/// [`try_lazy`] in the eager body `#[toma::lazy::module]` writes ([`eager_wrap`]).
///
/// # Errors
/// None: the tensors are given back as they are.
#[doc(hidden)]
pub fn try_eager_wrap<L: Lazify>(inputs: L, _batch: impl Into<BatchDimArg>) -> Result<L::Tensors, LazyError> {
    Ok(inputs.tensors())
}

/// Like [`lazy`], with bad dimensions and mismatched batch sizes reported as errors.
///
/// # Errors
/// [`LazyError::Argument`] for a dimension a tensor lacks, [`LazyError::Batch`] for batch
/// sizes that differ.
pub fn try_lazy<L: Lazify>(inputs: L, batch: impl Into<BatchDimArg>) -> Result<L::Output, LazyError> {
    let batch = batch.into().0;
    // One tensor agrees with itself (its dimension is checked as it is wrapped).
    if inputs.count() < 2 {
        return inputs.lazify(batch);
    }
    let mut sizes = Vec::new();
    inputs.batch_sizes(batch, &mut sizes);
    if let Some((first_shape, first)) = sizes.first() {
        if let Some((shape, size)) = sizes.iter().find(|(_, s)| s != first) {
            return Err(LazyError::Batch {
                op: "lazy".into(),
                lhs: first_shape.clone(),
                rhs: shape.clone(),
                reason: format!("batch sizes {first} and {size} differ along dimension {batch:?}"),
            });
        }
    }
    inputs.lazify(batch)
}

// ---------------------------------------------------------------------------------------------
// Arguments of mixed kinds: `#[toma::lazy::module]` on a `fn style_loss(m1: &Tensor, m2: &Tensor)`
// takes a recorded feature map and a fixed `Tensor` target together. The first tensor argument
// picks the kind the body runs on (its result's), so that callers infer as before; the others
// are of that kind or, lazily, `Tensor`s recorded as fixed operands.

/// An argument as the kind its body runs on: itself, or a `Tensor` recorded as a fixed operand.
#[doc(hidden)]
pub enum Arg<'a, K> {
    Borrowed(&'a K),
    Owned(K),
}

impl<K> std::ops::Deref for Arg<'_, K> {
    type Target = K;
    #[inline]
    fn deref(&self) -> &K {
        match self {
            Arg::Borrowed(k) => k,
            Arg::Owned(k) => k,
        }
    }
}

/// `A` as an argument of a body on `Self`.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "a `#[toma::lazy::module]` function's first tensor argument is a `{Self}`, so its body runs on tensors, and this argument is a `{A}`",
    label = "a lazy value where the first tensor argument is a `Tensor`",
    note = "pass the lazy value first, or wrap the first with `toma::lazy::lazy(&x, None)`"
)]
pub trait ArgOf<A>: Sized {
    /// `a`, beside the first tensor argument `first`.
    fn arg<'a>(a: &'a A, first: &Self) -> Arg<'a, Self>;
}

impl ArgOf<Tensor> for Tensor {
    #[inline]
    fn arg<'a>(a: &'a Tensor, _: &Tensor) -> Arg<'a, Tensor> {
        Arg::Borrowed(a)
    }
}
impl ArgOf<LazyTensor> for LazyTensor {
    #[inline]
    fn arg<'a>(a: &'a LazyTensor, _: &LazyTensor) -> Arg<'a, LazyTensor> {
        Arg::Borrowed(a)
    }
}
impl ArgOf<Tensor> for LazyTensor {
    /// A fixed operand, or a value computed at once beside one (in a closure run on a
    /// `Tensor`), as an operator's `Tensor` operand is.
    fn arg<'a>(a: &'a Tensor, first: &LazyTensor) -> Arg<'a, LazyTensor> {
        Arg::Owned(LazyTensor::operand_beside(a, first))
    }
}

//! Integer-list arguments as tch takes them: a size, dims, a stride can be an `i64`, an array,
//! a slice or a `Vec` (tch's `IntList`), and a list of reduced dims can also be `None` for all
//! of them (tch's `IntListOption`). [`LazyTensor`](super::LazyTensor) and
//! [`TensorOps`](super::TensorOps) take these, so code written for tch's methods compiles
//! unchanged: `x.sum_dim_intlist(-1, false, Kind::Float)`, `x.permute([0, 2, 1])`,
//! `x.reshape(&shape)`.
//!
//! tch's own traits hand out raw pointers; these hand out slices, which is all toma needs and
//! keeps the conversion safe.

/// A list of integers: `i64` (one), `[i64; N]`, `&[i64; N]`, `&[i64]`, `Vec<i64>`, `&Vec<i64>`,
/// `&Box<[i64]>`, as tch's `IntList`.
pub trait IntList {
    /// The integers.
    fn as_slice(&self) -> &[i64];
}

impl IntList for i64 {
    fn as_slice(&self) -> &[i64] {
        std::slice::from_ref(self)
    }
}

impl<const N: usize> IntList for [i64; N] {
    fn as_slice(&self) -> &[i64] {
        self
    }
}

impl<const N: usize> IntList for &[i64; N] {
    fn as_slice(&self) -> &[i64] {
        *self
    }
}

impl IntList for &[i64] {
    fn as_slice(&self) -> &[i64] {
        self
    }
}

impl IntList for Vec<i64> {
    fn as_slice(&self) -> &[i64] {
        self
    }
}

impl IntList for &Vec<i64> {
    fn as_slice(&self) -> &[i64] {
        self
    }
}

impl IntList for &Box<[i64]> {
    fn as_slice(&self) -> &[i64] {
        self
    }
}

/// An [`IntList`], or `None` for "all dimensions", as tch's `IntListOption`.
pub trait IntListOption {
    /// The integers, or `None`.
    fn as_option(&self) -> Option<&[i64]>;
}

impl<T: IntList> IntListOption for T {
    fn as_option(&self) -> Option<&[i64]> {
        Some(self.as_slice())
    }
}

impl<T: IntList> IntListOption for Option<T> {
    fn as_option(&self) -> Option<&[i64]> {
        self.as_ref().map(IntList::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(l: impl IntList) -> Vec<i64> {
        l.as_slice().to_vec()
    }

    fn option(l: impl IntListOption) -> Option<Vec<i64>> {
        l.as_option().map(<[i64]>::to_vec)
    }

    #[test]
    #[allow(clippy::needless_borrows_for_generic_args)] // the borrowed forms are the point
    fn every_form_tch_takes_reads_the_same() {
        let v = vec![1i64, 2];
        let b: Box<[i64]> = v.clone().into_boxed_slice();
        assert_eq!(list(3), [3]);
        assert_eq!(list([1, 2]), [1, 2]);
        assert_eq!(list(&[1, 2]), [1, 2]);
        assert_eq!(list(&v[..]), [1, 2]);
        assert_eq!(list(&v), [1, 2]);
        assert_eq!(list(&b), [1, 2]);
        assert_eq!(list(v.clone()), [1, 2]);
        assert_eq!(option(-1), Some(vec![-1]));
        assert_eq!(option(Some([0, 1])), Some(vec![0, 1]));
        assert_eq!(option(None::<i64>), None);
    }
}

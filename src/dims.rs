//! A tensor's sizes or strides, held in place up to [`INLINE`] dimensions.
//!
//! A lazy step records two such lists per op, and a `Vec` of each cost two allocations and
//! two frees per op that the plain tch step never makes (a third of a VAE step's remaining
//! allocations). Almost every tensor has at most six dimensions; more go to the heap.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::{Deref, DerefMut};

/// Dimensions held without an allocation.
pub(crate) const INLINE: usize = 6;

/// Sizes or strides: a `[i64]` that lives in place when short. Compares, hashes and prints as
/// the slice it holds, so it stands in for a `Vec<i64>` anywhere a slice is read.
#[derive(Clone)]
pub(crate) enum Dims {
    Inline { len: u8, dims: [i64; INLINE] },
    Heap(Vec<i64>),
}

impl Dims {
    /// No dimensions (a scalar's).
    pub(crate) const fn new() -> Self {
        Dims::Inline { len: 0, dims: [0; INLINE] }
    }

    /// Whether the dimensions are held apart, past the inline ones.
    pub(crate) fn on_heap(&self) -> bool {
        matches!(self, Dims::Heap(_))
    }

    /// The dimensions as a slice (what tch's calls take).
    pub(crate) fn as_slice(&self) -> &[i64] {
        self
    }

    /// `n` zeros.
    pub(crate) fn zeros(n: usize) -> Self {
        match u8::try_from(n) {
            Ok(len) if n <= INLINE => Dims::Inline { len, dims: [0; INLINE] },
            _ => Dims::Heap(vec![0; n]),
        }
    }

    pub(crate) fn push(&mut self, value: i64) {
        match self {
            Dims::Inline { len, dims } if usize::from(*len) < INLINE => {
                dims[usize::from(*len)] = value;
                *len += 1;
            }
            Dims::Inline { len, dims } => {
                let mut heap = Vec::with_capacity(INLINE * 2);
                heap.extend_from_slice(&dims[..usize::from(*len)]);
                heap.push(value);
                *self = Dims::Heap(heap);
            }
            Dims::Heap(heap) => heap.push(value),
        }
    }

    /// Inserts `value` before position `at` (as [`Vec::insert`]; panics past the end).
    pub(crate) fn insert(&mut self, at: usize, value: i64) {
        assert!(at <= self.len(), "insertion index {at} past the end ({})", self.len());
        self.push(value);
        self[at..].rotate_right(1);
    }

    /// Removes and returns the value at `at` (as [`Vec::remove`]; panics past the end).
    pub(crate) fn remove(&mut self, at: usize) -> i64 {
        let value = self[at];
        self[at..].rotate_left(1);
        self.truncate(self.len() - 1);
        value
    }

    pub(crate) fn truncate(&mut self, to: usize) {
        match self {
            Dims::Inline { len, .. } => *len = (*len).min(u8::try_from(to).unwrap_or(u8::MAX)),
            Dims::Heap(heap) => heap.truncate(to),
        }
    }
}

impl Default for Dims {
    fn default() -> Self {
        Dims::new()
    }
}

impl Deref for Dims {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        match self {
            Dims::Inline { len, dims } => &dims[..usize::from(*len)],
            Dims::Heap(heap) => heap,
        }
    }
}

impl DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [i64] {
        match self {
            Dims::Inline { len, dims } => &mut dims[..usize::from(*len)],
            Dims::Heap(heap) => heap,
        }
    }
}

impl From<&[i64]> for Dims {
    fn from(slice: &[i64]) -> Self {
        match u8::try_from(slice.len()) {
            Ok(len) if slice.len() <= INLINE => {
                let mut dims = [0; INLINE];
                dims[..slice.len()].copy_from_slice(slice);
                Dims::Inline { len, dims }
            }
            _ => Dims::Heap(slice.to_vec()),
        }
    }
}

impl<const N: usize> From<[i64; N]> for Dims {
    fn from(array: [i64; N]) -> Self {
        Dims::from(&array[..])
    }
}

impl From<Vec<i64>> for Dims {
    /// Short lists move in place (the `Vec` freed); long ones keep their buffer.
    fn from(list: Vec<i64>) -> Self {
        if list.len() <= INLINE {
            Dims::from(&list[..])
        } else {
            Dims::Heap(list)
        }
    }
}

impl From<Dims> for Vec<i64> {
    fn from(dims: Dims) -> Self {
        match dims {
            Dims::Heap(heap) => heap,
            inline => inline.to_vec(),
        }
    }
}

impl FromIterator<i64> for Dims {
    fn from_iter<I: IntoIterator<Item = i64>>(iter: I) -> Self {
        let mut dims = Dims::new();
        dims.extend(iter);
        dims
    }
}

impl Extend<i64> for Dims {
    fn extend<I: IntoIterator<Item = i64>>(&mut self, iter: I) {
        for value in iter {
            self.push(value);
        }
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a i64;
    type IntoIter = std::slice::Iter<'a, i64>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Dims {}

impl PartialEq<[i64]> for Dims {
    fn eq(&self, other: &[i64]) -> bool {
        **self == *other
    }
}

impl PartialEq<Vec<i64>> for Dims {
    fn eq(&self, other: &Vec<i64>) -> bool {
        **self == **other
    }
}

impl<const N: usize> PartialEq<[i64; N]> for Dims {
    fn eq(&self, other: &[i64; N]) -> bool {
        **self == other[..]
    }
}

impl PartialEq<Dims> for Vec<i64> {
    fn eq(&self, other: &Dims) -> bool {
        **self == **other
    }
}

impl Hash for Dims {
    /// As the slice hashes (and a `Vec` of it), so keys read from either agree.
    fn hash<H: Hasher>(&self, state: &mut H) {
        (**self).hash(state);
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::{Dims, INLINE};

    #[test]
    fn dims_act_as_the_list_they_hold_in_place_or_on_the_heap() {
        for n in [0, 1, INLINE - 1, INLINE, INLINE + 1, 3 * INLINE] {
            let list: Vec<i64> = (1..=n as i64).collect();
            let dims = Dims::from(list.clone());
            assert_eq!(matches!(dims, Dims::Heap(_)), n > INLINE, "{n} dimensions");
            assert_eq!(dims, list);
            assert_eq!(format!("{dims:?}"), format!("{list:?}"));
            assert_eq!(crate::hash::hash_of(&dims), crate::hash::hash_of(&list));
            assert_eq!(list.iter().copied().collect::<Dims>(), dims);
            let mut pushed = Dims::new();
            list.iter().for_each(|&v| pushed.push(v));
            assert_eq!(pushed, dims);
            assert_eq!(Vec::from(pushed), list);
            // Inserting and removing, as a `Vec` does, across the inline bound.
            let (mut d, mut v) = (dims.clone(), list.clone());
            for at in [0, n / 2, n + 1] {
                d.insert(at, -(at as i64));
                v.insert(at, -(at as i64));
                assert_eq!(d, v);
            }
            while !v.is_empty() {
                let at = v.len() / 2;
                assert_eq!(d.remove(at), v.remove(at));
                assert_eq!(d, v);
            }
        }
        let mut d = Dims::from([4, 5, 6]);
        d[1] = 7;
        d.truncate(1);
        assert_eq!(d, [4]);
    }
}

//! What a tensor or a buffer takes, as a function of the micro-batch: one type for elements and
//! for bytes, for what ops state, what the cost layer prices and what the planner adds up.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;

use tch::Kind;

/// `per * b + fixed` at a micro-batch of `b` samples, counted in `U` ([`Elem`] or [`Byte`]),
/// and its own value at one sample (`one`) where a single sample runs another way (libtorch's
/// native convolution where oneDNN runs a batch, threads splitting one sample otherwise).
pub(crate) struct Size<U> {
    pub(crate) per: u64,
    pub(crate) fixed: u64,
    pub(crate) one: Option<u64>,
    unit: PhantomData<U>,
}

/// Counted in elements of some kind (what ops state, the kind theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Elem;

/// Counted in bytes (what the allocator sees).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Byte;

pub(crate) type Elements = Size<Elem>;
pub(crate) type Bytes = Size<Byte>;

impl<U> Size<U> {
    /// Nothing.
    pub(crate) const ZERO: Size<U> = Size::line(0, 0);

    /// `per * b + fixed`, the same at one sample.
    pub(crate) const fn line(per: u64, fixed: u64) -> Size<U> {
        Size { per, fixed, one: None, unit: PhantomData }
    }

    /// `per * b + fixed`, but `one` at one sample.
    pub(crate) const fn with_one(self, one: u64) -> Size<U> {
        Size { one: Some(one), ..self }
    }

    /// Its value at `b` samples.
    pub(crate) fn at(self, b: u64) -> u64 {
        match self.one {
            Some(one) if b == 1 => one,
            _ => self.per * b + self.fixed,
        }
    }

    /// `(per, fixed)`, the line without its value at one sample.
    pub(crate) fn parts(self) -> (u64, u64) {
        (self.per, self.fixed)
    }

    /// Both at once: the lines add, and so do the values at one sample where either has one.
    pub(crate) fn plus(self, other: Size<U>) -> Size<U> {
        let line = Size::line(self.per + other.per, self.fixed + other.fixed);
        if self.one.is_none() && other.one.is_none() {
            line
        } else {
            line.with_one(self.at(1) + other.at(1))
        }
    }

    /// `k` of them.
    pub(crate) fn times(self, k: u64) -> Size<U> {
        Size { per: self.per * k, fixed: self.fixed * k, one: self.one.map(|one| one * k), unit: PhantomData }
    }
}

impl Elements {
    /// The bytes of these elements of `kind`.
    pub(crate) fn bytes(self, kind: Kind) -> Bytes {
        let e = kind.elt_size_in_bytes() as u64;
        Size { per: self.per * e, fixed: self.fixed * e, one: self.one.map(|one| one * e), unit: PhantomData }
    }
}

// By hand: the unit needs none of these traits, and a size hashes as its `(per, fixed)` line
// (calibration keys hashed those before this type existed).
impl<U> Clone for Size<U> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<U> Copy for Size<U> {}

impl<U> Default for Size<U> {
    fn default() -> Self {
        Size::ZERO
    }
}

impl<U> PartialEq for Size<U> {
    fn eq(&self, other: &Self) -> bool {
        (self.per, self.fixed, self.one) == (other.per, other.fixed, other.one)
    }
}

impl<U> Eq for Size<U> {}

impl<U> Hash for Size<U> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self.per, self.fixed).hash(h);
        if let Some(one) = self.one {
            one.hash(h);
        }
    }
}

impl<U> fmt::Debug for Size<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}·b + {}", self.per, self.fixed)?;
        if let Some(one) = self.one {
            write!(f, " ({one} at one sample)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Bytes, Elements};

    #[test]
    fn a_size_is_a_line_with_its_own_value_at_one_sample() {
        let conv = Elements::line(10, 4).with_one(30);
        let other = Elements::line(2, 1);
        assert_eq!((conv.at(1), conv.at(3)), (30, 34));
        // Added, the line is the sum and one sample the sum of each's value there.
        let both = conv.plus(other);
        assert_eq!((both.at(1), both.at(3)), (33, 41));
        assert_eq!(other.plus(other), Elements::line(4, 2));
        assert_eq!(conv.bytes(tch::Kind::Float), Bytes::line(40, 16).with_one(120));
        assert_eq!(conv.times(2).at(1), 60);
    }
}

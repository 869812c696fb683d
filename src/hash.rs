//! The hashes behind cache keys and graph fingerprints: a 64-bit mixer, a `const` string hash,
//! a call site's hash, and a walk of the enclosing functions on the stack.

use std::hash::Hasher;
use std::panic::Location;

/// Frames the stack walk looks at, at most: toma's own two or three and the five or so
/// enclosing functions above the call, which tell call chains apart; each frame costs about
/// 0.1–0.15 µs (an unwind-table lookup), so this bounds the walk near 1 µs.
pub(crate) const MAX_STACK_FRAMES: usize = if cfg!(debug_assertions) {
    // Unoptimised builds inline nothing: toma's own frames alone are about seven.
    14
} else {
    8
};

/// Keys are already well-mixed 64-bit hashes; hashing them again would only cost time.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = mix(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A [`Hasher`] over [`mix`], for keys derived from data (`#[derive(Hash)]`): stable across
/// processes of one build, so that keys written to a file are found again.
#[cfg(feature = "tch")]
#[derive(Default)]
pub(crate) struct Mixer(u64);

#[cfg(feature = "tch")]
impl Hasher for Mixer {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = mix(self.0 ^ u64::from_le_bytes(word));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = mix(self.0 ^ v);
    }
}

/// `value`'s hash by [`Mixer`].
#[cfg(feature = "tch")]
pub(crate) fn hash_of(value: &impl std::hash::Hash) -> u64 {
    let mut h = Mixer::default();
    value.hash(&mut h);
    h.finish()
}

/// A call site's hash.
pub(crate) fn location_hash(location: &Location<'_>) -> u64 {
    // The file's text, not its address: one call site may be compiled into several codegen
    // units, each with its own copy of the string.
    mix(hash_bytes(0x10c, location.file().as_bytes())
        ^ (u64::from(location.line()) << 32)
        ^ u64::from(location.column()))
}

/// The chain of enclosing functions: the start address of each function on the stack (not the
/// return address, which differs between unrolled copies of one loop), for a bounded number of
/// frames, without resolving symbols.
pub(crate) fn stack_hash() -> u64 {
    unwind::stack_hash()
}

/// On Unix the walk asks the unwinder for each frame's function start (`_Unwind_GetRegionStart`,
/// read from the frame's unwind entry, which the unwinder has already found). The portable
/// `backtrace::Frame::symbol_address` looks the entry up a second time per frame, which doubles
/// the cost of the walk.
#[cfg(all(unix, not(target_vendor = "apple")))]
mod unwind {
    use super::{mix, MAX_STACK_FRAMES};
    use std::ffi::{c_int, c_void};

    #[repr(C)]
    struct Context {
        _private: [u8; 0],
    }

    const URC_NO_REASON: c_int = 0;
    const URC_NORMAL_STOP: c_int = 4;

    unsafe extern "C" {
        // From the unwinder every Rust program on these targets already links (libgcc_s or
        // libunwind): the one that implements panics.
        fn _Unwind_Backtrace(
            trace: extern "C" fn(ctx: *mut Context, arg: *mut c_void) -> c_int,
            arg: *mut c_void,
        ) -> c_int;
        fn _Unwind_GetRegionStart(ctx: *mut Context) -> usize;
    }

    struct Walk {
        hash: u64,
        frames: usize,
    }

    extern "C" fn visit(ctx: *mut Context, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the `Walk` passed below, alive for the whole `_Unwind_Backtrace` call;
        // `ctx` is the unwinder's own context for this frame.
        let walk = unsafe { &mut *(arg as *mut Walk) };
        let start = unsafe { _Unwind_GetRegionStart(ctx) };
        walk.hash = mix(walk.hash ^ start as u64);
        walk.frames += 1;
        if walk.frames < MAX_STACK_FRAMES {
            URC_NO_REASON
        } else {
            URC_NORMAL_STOP
        }
    }

    pub(super) fn stack_hash() -> u64 {
        let mut walk = Walk { hash: 0x5ac4, frames: 0 };
        // SAFETY: `visit` only touches `walk` through the pointer we give it.
        unsafe { _Unwind_Backtrace(visit, &mut walk as *mut Walk as *mut c_void) };
        walk.hash
    }
}

#[cfg(not(all(unix, not(target_vendor = "apple"))))]
mod unwind {
    use super::{mix, MAX_STACK_FRAMES};

    pub(super) fn stack_hash() -> u64 {
        let mut h = 0x5ac4_u64;
        let mut frames = 0;
        backtrace::trace(|frame| {
            h = mix(h ^ frame.symbol_address() as u64);
            frames += 1;
            frames < MAX_STACK_FRAMES
        });
        h
    }
}

/// A 64-bit finaliser (splitmix64): cheap and well-spread, usable in `const fn`.
pub(crate) const fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Odd constants, one for each word [`weigh`] takes.
#[cfg(feature = "tch")]
const WEIGHTS: [u64; 9] = [
    0x9e37_79b9_7f4a_7c15,
    0xbf58_476d_1ce4_e5b9,
    0x94d0_49bb_1331_11eb,
    0xd6e8_feb8_6659_fd93,
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
    0x8ebc_6af0_9c88_c6e3,
    0x5899_65cc_7537_4cc3,
    0x1d8e_4e27_c47d_124f,
];

/// Up to nine words in one: each times a constant of its own, summed. The products are
/// independent (a chain of [`mix`]es waits on each one), and, the constants being odd, words
/// that differ in one place never give the same sum. Mix the result before using its bits.
#[cfg(feature = "tch")]
pub(crate) fn weigh(words: &[u64]) -> u64 {
    debug_assert!(words.len() <= WEIGHTS.len());
    words.iter().zip(WEIGHTS).fold(0, |h, (&w, k)| h.wrapping_add(w.wrapping_mul(k)))
}

pub(crate) const fn hash_bytes(seed: u64, bytes: &[u8]) -> u64 {
    // FNV-1a, then mixed: short strings, evaluated at compile time for `Site`.
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    mix(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_hash_depends_on_the_chain() {
        #[inline(never)]
        fn a() -> u64 {
            std::hint::black_box(stack_hash())
        }
        #[inline(never)]
        fn b() -> u64 {
            std::hint::black_box(a())
        }
        assert_eq!(a(), a());
        assert_ne!(a(), b());
    }
}

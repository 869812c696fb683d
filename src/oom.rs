//! Deciding whether a failure is an out-of-memory.
//!
//! Every decision in toma goes through [`is_out_of_memory_message`]: the trait impls and the
//! panic check only find the text and ask it.

use std::any::Any;
use std::error::Error;

/// Substrings that mark an allocator failure in PyTorch, libtorch, CUDA and the vendor
/// libraries. Matched case-sensitively, as the libraries print them.
const OOM_MARKERS: &[&str] = &[
    "CUDA out of memory",
    "CUDA error: out of memory",
    // cuDNN reports a failed workspace allocation as NOT_SUPPORTED; PyTorch's own retry logic
    // (and Python toma) treat it as an out-of-memory.
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    // The other CUDA libraries' own allocation failures, as PyTorch's error checks print them.
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "HIP error: out of memory",
    "MPS backend out of memory",
    "XPU out of memory",
    // C++ `new` failing inside libtorch (tch passes the exception's text on).
    "std::bad_alloc",
];

/// Texts that report an allocation failure only ambiguously: out-of-memory when CPU memory is
/// short ([`cpu_memory::under_pressure`](crate::cpu_memory::under_pressure)), another error
/// otherwise.
///
/// oneDNN, which libtorch runs convolutions with on x86 CPUs, says `could not create a
/// primitive` when it cannot build a kernel for a new shape. Under a CPU cap that was memory:
/// its primitive cache keeps every shape's kernel and scratch space, a resnet18 batch that
/// fitted before failed this way after a dozen other batch sizes had filled the cache, and
/// with `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` the same sweep never failed (`tests/real_oom.rs`).
/// An unsupported configuration fails earlier, at `could not create a primitive descriptor`,
/// which stays another error.
const PRESSURE_MARKERS: &[(&str, &str)] =
    &[("could not create a primitive", "could not create a primitive descriptor")];

/// How [`classify_message`] reads an error text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// An allocator failure: retried with a smaller size.
    OutOfMemory,
    /// An allocator failure when CPU memory is short, another error otherwise (see
    /// [`cpu_memory::under_pressure`](crate::cpu_memory::under_pressure)).
    UnderPressure,
    /// Any other error: given back at once.
    Other,
}

/// A call's own say on what is an out-of-memory (the builders' `when`, e.g.
/// [`Batch::when`](crate::Batch::when)): given a failure's text, `Some(true)` to retry it as an
/// out-of-memory, `Some(false)` to give it back at once, `None` to leave it to
/// [`is_out_of_memory_message`] and the [`OutOfMemory`] impls.
pub type Decide = fn(&str) -> Option<bool>;

/// Extra texts to count as out-of-memory, added by [`add_out_of_memory_marker`].
static EXTRA_MARKERS: std::sync::RwLock<Vec<String>> = std::sync::RwLock::new(Vec::new());

/// Counts every error text that contains `marker` as an out-of-memory from now on, in the whole
/// process: for libraries whose allocation failures toma does not know. Adding a marker twice,
/// or an empty one, does nothing.
///
/// ```
/// use toma::oom::{add_out_of_memory_marker, is_out_of_memory_message};
/// assert!(!is_out_of_memory_message("my_allocator: arena exhausted"));
/// add_out_of_memory_marker("arena exhausted");
/// assert!(is_out_of_memory_message("my_allocator: arena exhausted"));
/// ```
pub fn add_out_of_memory_marker(marker: impl Into<String>) {
    let marker = marker.into();
    let mut markers = EXTRA_MARKERS.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !marker.is_empty() && !markers.contains(&marker) {
        tracing::debug!(marker = %marker, "toma: an out-of-memory marker was added");
        markers.push(marker);
    }
}

/// What a text says, without asking about the machine: see [`Verdict`].
///
/// ```
/// use toma::oom::{classify_message, Verdict};
/// assert_eq!(classify_message("CUDA out of memory. Tried to allocate 2.00 GiB"), Verdict::OutOfMemory);
/// assert_eq!(classify_message("could not create a primitive"), Verdict::UnderPressure);
/// assert_eq!(classify_message("index out of range in self"), Verdict::Other);
/// ```
pub fn classify_message(message: &str) -> Verdict {
    if OOM_MARKERS.iter().any(|marker| message.contains(marker)) {
        return Verdict::OutOfMemory;
    }
    let extra = EXTRA_MARKERS.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    if extra.iter().any(|marker| message.contains(marker.as_str())) {
        return Verdict::OutOfMemory;
    }
    // A pressure marker counts unless each of its occurrences is the start of its exclusion.
    let ambiguous = PRESSURE_MARKERS
        .iter()
        .any(|&(marker, unless)| message.match_indices(marker).any(|(at, _)| !message[at..].starts_with(unless)));
    if ambiguous {
        Verdict::UnderPressure
    } else {
        Verdict::Other
    }
}

/// Whether an error text reports an out-of-memory.
///
/// This is the one place where toma decides; everything else finds a text and asks here.
/// It recognises CUDA, cuDNN, cuBLAS, HIP and MPS out-of-memory errors and libtorch's CPU
/// allocator failures, wherever they appear in the text (tch wraps them in
/// `Torch("...")`, `unwrap()` wraps them again). Anything else, such as
/// `CUDA error: device-side assert triggered`, is not an out-of-memory.
///
/// ```
/// use toma::oom::is_out_of_memory_message;
/// assert!(is_out_of_memory_message("CUDA out of memory. Tried to allocate 20.00 MiB"));
/// assert!(!is_out_of_memory_message("CUDA error: device-side assert triggered"));
/// ```
pub fn is_out_of_memory_message(message: &str) -> bool {
    match classify_message(message) {
        Verdict::OutOfMemory => true,
        Verdict::UnderPressure => crate::cpu_memory::under_pressure(),
        Verdict::Other => false,
    }
}

/// A failure that can tell whether it is an out-of-memory.
///
/// toma retries a body with a smaller size only when its error says `true` here; every other
/// error is given back to the caller at once. Implement it for your own error types by
/// forwarding to the error they wrap, or to [`is_out_of_memory_message`].
///
/// ```
/// use toma::OutOfMemory;
/// let err = std::io::Error::other("CUDA error: out of memory");
/// assert!(err.is_out_of_memory());
/// ```
#[diagnostic::on_unimplemented(
    message = "toma cannot tell whether `{Self}` is an out-of-memory",
    label = "the error type of a body toma retries must implement `toma::OutOfMemory`",
    note = "return `tch::TchError`, `std::io::Error`, `String`, a boxed error or (feature `anyhow`) \
            `anyhow::Error`, or implement `toma::OutOfMemory` for `{Self}` by forwarding to the error it \
            wraps or to `toma::oom::is_out_of_memory_message`"
)]
pub trait OutOfMemory {
    /// Whether this failure is an out-of-memory that a smaller size may avoid.
    fn is_out_of_memory(&self) -> bool;

    /// The failure's text, for the log event toma emits when it retries. `None` (the default)
    /// logs the out-of-memory without text.
    fn message(&self) -> Option<String> {
        None
    }
}

impl OutOfMemory for str {
    fn is_out_of_memory(&self) -> bool {
        is_out_of_memory_message(self)
    }
    fn message(&self) -> Option<String> {
        Some(self.to_owned())
    }
}

impl OutOfMemory for String {
    fn is_out_of_memory(&self) -> bool {
        is_out_of_memory_message(self)
    }
    fn message(&self) -> Option<String> {
        Some(self.clone())
    }
}

impl<T: OutOfMemory + ?Sized> OutOfMemory for &T {
    fn is_out_of_memory(&self) -> bool {
        (**self).is_out_of_memory()
    }
    fn message(&self) -> Option<String> {
        (**self).message()
    }
}

impl OutOfMemory for std::io::Error {
    fn is_out_of_memory(&self) -> bool {
        if self.kind() == std::io::ErrorKind::OutOfMemory {
            return true;
        }
        match self.get_ref() {
            Some(inner) => error_chain_is_out_of_memory(inner),
            None => is_out_of_memory_message(&self.to_string()),
        }
    }
    fn message(&self) -> Option<String> {
        Some(self.to_string())
    }
}

#[cfg(feature = "anyhow")]
#[cfg_attr(docsrs, doc(cfg(feature = "anyhow")))]
impl OutOfMemory for anyhow::Error {
    /// Whether any error in the chain of causes is an out-of-memory.
    fn is_out_of_memory(&self) -> bool {
        error_chain_is_out_of_memory(self.as_ref())
    }
    fn message(&self) -> Option<String> {
        Some(format!("{self:#}"))
    }
}

impl OutOfMemory for Box<dyn Error + Send + Sync> {
    fn is_out_of_memory(&self) -> bool {
        error_chain_is_out_of_memory(self.as_ref())
    }
    fn message(&self) -> Option<String> {
        Some(self.to_string())
    }
}

impl OutOfMemory for Box<dyn Error> {
    fn is_out_of_memory(&self) -> bool {
        error_chain_is_out_of_memory(self.as_ref())
    }
    fn message(&self) -> Option<String> {
        Some(self.to_string())
    }
}

/// Never an out-of-memory: lets bodies that cannot fail share the retry engine.
impl OutOfMemory for std::convert::Infallible {
    fn is_out_of_memory(&self) -> bool {
        match *self {}
    }
}

#[cfg(feature = "tch")]
#[cfg_attr(docsrs, doc(cfg(feature = "tch")))]
impl OutOfMemory for tch::TchError {
    fn is_out_of_memory(&self) -> bool {
        match self {
            // The common case: libtorch's own text, checked without formatting.
            tch::TchError::Torch(message) => is_out_of_memory_message(message),
            other => is_out_of_memory_message(&other.to_string()),
        }
    }
    fn message(&self) -> Option<String> {
        Some(self.to_string())
    }
}

/// Walks an error and its `source()` chain, looking at known types first.
fn error_chain_is_out_of_memory(err: &(dyn Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(err) = current {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::OutOfMemory {
                return true;
            }
        }
        if is_out_of_memory_message(&err.to_string()) {
            return true;
        }
        current = err.source();
    }
    false
}

/// Whether a panic payload reports an out-of-memory.
///
/// tch's plain (non-`f_`) methods panic with libtorch's text as a `String`; `panic!("...")`
/// with a literal gives a `&'static str`; `std::panic::panic_any` can carry a `TchError`, an
/// `io::Error` or a boxed error. All of these are looked at; any other payload is not an
/// out-of-memory.
pub fn is_out_of_memory_panic(payload: &(dyn Any + Send)) -> bool {
    payload_failure(payload).is_some_and(|failure| failure.is_out_of_memory())
}

/// The message of a panic payload, for logs; `None` for payloads without text.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> Option<String> {
    payload_failure(payload).and_then(|failure| failure.message())
}

/// The one list of panic payload types toma can read: what a payload is, as a failure that can
/// be asked. Both questions above go through it, so they never disagree on a type.
fn payload_failure(payload: &(dyn Any + Send)) -> Option<&dyn OutOfMemory> {
    if let Some(message) = payload.downcast_ref::<String>() {
        return Some(message);
    }
    if let Some(message) = payload.downcast_ref::<&'static str>() {
        return Some(message);
    }
    #[cfg(feature = "tch")]
    if let Some(err) = payload.downcast_ref::<tch::TchError>() {
        return Some(err);
    }
    #[cfg(feature = "anyhow")]
    if let Some(err) = payload.downcast_ref::<anyhow::Error>() {
        return Some(err);
    }
    if let Some(err) = payload.downcast_ref::<std::io::Error>() {
        return Some(err);
    }
    if let Some(err) = payload.downcast_ref::<Box<dyn Error + Send + Sync>>() {
        return Some(err);
    }
    None
}

/// The first line of a text, trimmed, for one-line log events. tch's panics carry libtorch's
/// text `Debug`-escaped (`Torch("...\\n...")`), so an escaped newline ends the line too.
pub(crate) fn first_line(text: &str) -> &str {
    let line = text.lines().next().unwrap_or("");
    line.split("\\n").next().unwrap_or("").trim()
}

/// What libtorch's CUDA out-of-memory message says of the request that failed
/// (`CUDACachingAllocator`'s `malloc`): the block it tried to allocate, what the card had free,
/// and what the allocator held reserved but unallocated (free in cached pieces).
#[cfg(feature = "tch")]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct CudaOomText {
    /// "Tried to allocate 904.00 MiB".
    pub(crate) tried: u64,
    /// "of which 135.12 MiB is free".
    pub(crate) free: u64,
    /// "and 1.40 GiB is reserved by PyTorch but unallocated".
    pub(crate) reserved_unallocated: Option<u64>,
}

/// Reads a CUDA out-of-memory message as libtorch 2.x writes it (`format_size`: "bytes",
/// "KiB", "MiB", "GiB", two decimals); `None` for any other text.
#[cfg(feature = "tch")]
pub(crate) fn cuda_oom_text(message: &str) -> Option<CudaOomText> {
    // "904.00 MiB": libtorch's `format_size`.
    fn size(value: &str, unit: &str) -> Option<u64> {
        let value: f64 = value.parse().ok()?;
        let unit = match unit.trim_end_matches(['.', ',']) {
            "bytes" | "B" => 1u64,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            _ => return None,
        };
        Some((value * unit as f64) as u64)
    }
    fn size_after(text: &str, key: &str) -> Option<u64> {
        let mut words = text[text.find(key)? + key.len()..].split_whitespace();
        size(words.next()?, words.next()?)
    }
    fn size_before(text: &str, key: &str) -> Option<u64> {
        let mut words = text[..text.find(key)?].split_whitespace().rev();
        let unit = words.next()?;
        size(words.next()?, unit)
    }
    Some(CudaOomText {
        tried: size_after(message, "Tried to allocate")?,
        free: size_after(message, "of which")?,
        reserved_unallocated: size_before(message, " is reserved by PyTorch but unallocated"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared corpus of real error texts, copied into the repo so a plain clone has it.
    const CORPUS: &str = include_str!("../tests/data/oom-messages.tsv");

    #[test]
    fn corpus_verdicts_match() {
        let mut checked = 0;
        for line in CORPUS.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let (verdict, text) = line.split_once('\t').expect("verdict<TAB>text");
            let (verdict, expected) = match verdict {
                "oom" => (Verdict::OutOfMemory, true),
                "other" => (Verdict::Other, false),
                "pressure" => (Verdict::UnderPressure, crate::cpu_memory::under_pressure()),
                v => panic!("unknown verdict {v:?}"),
            };
            assert_eq!(classify_message(text), verdict, "{text}");
            assert_eq!(is_out_of_memory_message(text), expected, "{text}");
            assert_eq!(text.is_out_of_memory(), expected, "{text}");
            let payload: Box<dyn Any + Send> = Box::new(text.to_owned());
            assert_eq!(is_out_of_memory_panic(payload.as_ref()), expected, "{text}");
            checked += 1;
        }
        assert!(checked >= 18, "corpus too small: {checked}");
    }

    #[test]
    fn every_marker_alone_is_oom() {
        for marker in OOM_MARKERS {
            assert!(is_out_of_memory_message(marker), "{marker}");
            // Markers are matched as written: a mangled marker is not enough.
            let mangled = if marker.to_lowercase() == *marker { marker.to_uppercase() } else { marker.to_lowercase() };
            assert!(!is_out_of_memory_message(&mangled), "{marker}");
        }
    }

    #[test]
    fn pressure_markers_need_pressure_and_skip_their_exclusion() {
        assert_eq!(classify_message("could not create a primitive"), Verdict::UnderPressure);
        assert_eq!(classify_message("x: could not create a primitive descriptor for a pooling"), Verdict::Other);
        // One bare occurrence is enough, even beside an excluded one.
        let both = "could not create a primitive descriptor; then could not create a primitive";
        assert_eq!(classify_message(both), Verdict::UnderPressure);
        assert_eq!(is_out_of_memory_message("could not create a primitive"), crate::cpu_memory::under_pressure());
    }

    #[test]
    fn added_markers_count_everywhere() {
        let text = "toma-test-allocator: pool 7 exhausted";
        assert_eq!(classify_message(text), Verdict::Other);
        add_out_of_memory_marker("pool 7 exhausted");
        add_out_of_memory_marker("pool 7 exhausted");
        add_out_of_memory_marker("");
        assert_eq!(classify_message(text), Verdict::OutOfMemory);
        assert!(text.is_out_of_memory());
        assert!(!is_out_of_memory_message("index out of range in self"));
    }

    #[cfg(feature = "anyhow")]
    #[test]
    fn anyhow_errors_look_through_their_context() {
        let oom = anyhow::anyhow!("CUDA out of memory. Tried to allocate 2.00 GiB").context("scoring batch 7");
        assert!(oom.is_out_of_memory(), "{oom:#}");
        assert!(oom.message().unwrap().contains("scoring batch 7: CUDA out of memory"));
        let io = anyhow::Error::from(std::io::Error::from(std::io::ErrorKind::OutOfMemory)).context("reading");
        assert!(io.is_out_of_memory());
        assert!(!anyhow::anyhow!("index out of range in self").context("x").is_out_of_memory());
        let payload: Box<dyn Any + Send> = Box::new(anyhow::anyhow!("HIP out of memory"));
        assert!(is_out_of_memory_panic(payload.as_ref()));
    }

    #[test]
    fn io_errors() {
        use std::io::{Error as IoError, ErrorKind};
        assert!(IoError::from(ErrorKind::OutOfMemory).is_out_of_memory());
        assert!(IoError::other("HIP out of memory. Tried").is_out_of_memory());
        assert!(!IoError::from(ErrorKind::NotFound).is_out_of_memory());
        assert!(!IoError::other("index out of range in self").is_out_of_memory());
    }

    #[derive(Debug)]
    struct Wrapper(std::io::Error);
    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("step failed")
        }
    }
    impl Error for Wrapper {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn boxed_errors_follow_the_source_chain() {
        let oom: Box<dyn Error + Send + Sync> = Box::new(Wrapper(std::io::Error::other("CUDA error: out of memory")));
        assert!(oom.is_out_of_memory());
        let other: Box<dyn Error + Send + Sync> =
            Box::new(Wrapper(std::io::Error::other("CUDA error: device-side assert triggered")));
        assert!(!other.is_out_of_memory());
        let plain: Box<dyn Error + Send + Sync> = "MPS backend out of memory (MPS allocated".into();
        assert!(plain.is_out_of_memory());
    }

    #[test]
    fn panic_payloads_of_every_kind() {
        let text = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes";
        let payloads: Vec<Box<dyn Any + Send>> = vec![
            Box::new(text.to_owned()),
            Box::new("CUDA out of memory. Tried to allocate 2 MiB"),
            Box::new(std::io::Error::other(text)),
            Box::new(Box::<dyn Error + Send + Sync>::from(text)),
        ];
        for payload in &payloads {
            assert!(is_out_of_memory_panic(payload.as_ref()));
            assert!(panic_message(payload.as_ref()).is_some());
        }
        let not_oom: Vec<Box<dyn Any + Send>> = vec![
            Box::new("index out of range in self".to_owned()),
            Box::new("CUDA error: device-side assert triggered"),
            Box::new(42_u32),
        ];
        for payload in &not_oom {
            assert!(!is_out_of_memory_panic(payload.as_ref()));
        }
    }

    #[cfg(feature = "tch")]
    #[test]
    fn tch_errors() {
        let oom = tch::TchError::Torch(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 17179869184 bytes.".into(),
        );
        assert!(oom.is_out_of_memory());
        let payload: Box<dyn Any + Send> =
            Box::new(tch::TchError::Torch("CUDA out of memory. Tried to allocate 1 GiB".into()));
        assert!(is_out_of_memory_panic(payload.as_ref()));
        assert!(!tch::TchError::Torch("mat1 and mat2 shapes cannot be multiplied".into()).is_out_of_memory());
        assert!(!tch::TchError::Kind("expected Float, got Int".into()).is_out_of_memory());
    }

    #[test]
    fn first_line_trims() {
        assert_eq!(first_line("  CUDA out of memory.  \nException raised from"), "CUDA out of memory.");
        assert_eq!(first_line(""), "");
        assert_eq!(
            first_line(
                r#"called `Result::unwrap()` on an `Err` value: Torch("CUDA out of memory.\nException raised")"#
            ),
            r#"called `Result::unwrap()` on an `Err` value: Torch("CUDA out of memory."#
        );
    }

    #[test]
    #[cfg(feature = "tch")]
    fn cuda_messages_name_the_block_the_card_and_the_pieces() {
        // From the H200 run of 2026-11-27 (docs/gpu-runs/2026-11-27-h200.log).
        let text = "CUDA out of memory. Tried to allocate 904.00 MiB. GPU 0 has a total capacity of 139.80 GiB \
                    of which 135.12 MiB is free. Including non-PyTorch memory, this process has 139.66 GiB memory in \
                    use. Of the allocated memory 137.51 GiB is allocated by PyTorch, and 1.40 GiB is reserved by \
                    PyTorch but unallocated. If reserved but unallocated memory is large try setting";
        let r = cuda_oom_text(text).unwrap();
        assert_eq!(r.tried, 904 << 20);
        assert_eq!(r.free, (135.12 * (1u64 << 20) as f64) as u64);
        assert_eq!(r.reserved_unallocated, Some((1.40 * (1u64 << 30) as f64) as u64));
        let small = "CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity of 79.10 GiB of which 0 bytes is free.";
        assert_eq!(cuda_oom_text(small), Some(CudaOomText { tried: 512, free: 0, reserved_unallocated: None }));
        assert_eq!(cuda_oom_text("DefaultCPUAllocator: can't allocate memory: you tried to allocate 80 bytes"), None);
    }
}

//! Catching an attempt's panic, and keeping a caught out-of-memory panic quiet: tch's plain
//! methods panic on an out-of-memory, and the default hook would print a message and a
//! backtrace for every retry.

use std::cell::Cell;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;
use std::task::{Context, Poll};

use crate::oom::{is_out_of_memory_panic, panic_message, Decide, OutOfMemory};

thread_local! {
    /// How many retryable attempts enclose the current code on this thread.
    static RETRYABLE_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Whether caught out-of-memory panics are silenced: [`quiet_caught_panics`].
static QUIET: AtomicBool = AtomicBool::new(true);

/// Whether toma silences the message of an out-of-memory panic that it catches and retries (on
/// by default): tch's plain methods panic on an out-of-memory, and the default hook would print
/// a message and a backtrace for every retry.
///
/// To do that, the first retryable attempt wraps the process's panic hook once
/// ([`std::panic::set_hook`]): an out-of-memory panic inside a retryable attempt is then not
/// passed on; every other panic reaches the previous hook unchanged. `quiet_caught_panics(false)`
/// before the first call keeps toma's hook out entirely; later, it makes the wrapper pass every
/// panic on. A hook you set after toma's replaces it (caught panics then print again): install
/// your hook first, and toma wraps it.
///
/// ```
/// toma::quiet_caught_panics(false); // every caught panic reaches the panic hook
/// # toma::quiet_caught_panics(true);
/// ```
pub fn quiet_caught_panics(on: bool) {
    QUIET.store(on, Ordering::Relaxed);
}

/// Wraps the panic hook once, while quieting is on (see [`quiet_caught_panics`]).
fn install_quiet_hook() {
    static INSTALL: Once = Once::new();
    if !QUIET.load(Ordering::Relaxed) {
        return;
    }
    INSTALL.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let quiet = QUIET.load(Ordering::Relaxed)
                && RETRYABLE_DEPTH.with(Cell::get) > 0
                && is_out_of_memory_panic(info.payload());
            if !quiet {
                previous(info);
            }
        }));
    });
}

/// Marks the current thread as inside a retryable attempt while it lives.
struct QuietGuard {
    active: bool,
}

impl QuietGuard {
    fn new(retryable: bool) -> Self {
        if retryable {
            install_quiet_hook();
            RETRYABLE_DEPTH.with(|d| d.set(d.get() + 1));
        }
        QuietGuard { active: retryable }
    }
}

impl Drop for QuietGuard {
    fn drop(&mut self) {
        if self.active {
            RETRYABLE_DEPTH.with(|d| d.set(d.get() - 1));
        }
    }
}

/// Runs one attempt, catching its panic. `AssertUnwindSafe` is sound in the sense that
/// matters here: after a caught panic the body runs again only when the panic was an
/// out-of-memory, which libtorch raises before it changes any tensor.
pub(super) fn catch_attempt<R>(retryable: bool, body: impl FnOnce() -> R) -> std::thread::Result<R> {
    let _quiet = QuietGuard::new(retryable);
    panic::catch_unwind(AssertUnwindSafe(body))
}

/// A future that catches a panic of the future it wraps, silencing out-of-memory panics
/// while it is polled when its attempt is retryable.
#[doc(hidden)]
pub struct CatchUnwind<F> {
    future: F,
    retryable: bool,
    /// The call's span, entered at every poll (a guard must not live across an `.await`).
    span: Option<tracing::Span>,
}

impl<F: Future> CatchUnwind<F> {
    #[doc(hidden)]
    pub fn new(future: F, retryable: bool) -> Self {
        CatchUnwind { future, retryable, span: None }
    }

    pub(super) fn in_span(mut self, span: Option<tracing::Span>) -> Self {
        self.span = span;
        self
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: `future` is structurally pinned: it is never moved out of `self`.
        let this = unsafe { self.get_unchecked_mut() };
        let retryable = this.retryable;
        let _entered = this.span.as_ref().map(tracing::Span::enter);
        let future = unsafe { Pin::new_unchecked(&mut this.future) };
        match catch_attempt(retryable, || future.poll(cx)) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

/// How one attempt failed, as the engine sees it.
pub(super) enum Failure<E> {
    Error(E),
    Panic(Box<dyn std::any::Any + Send>),
}

impl<E: OutOfMemory> Failure<E> {
    /// Whether this is an out-of-memory: by the call's own `decide` where it says so (see the
    /// builders' `when`), else by toma's decision.
    pub(super) fn is_out_of_memory(&self, decide: Option<Decide>) -> bool {
        if let Some(decide) = decide {
            let text = match self {
                Failure::Error(err) => err.message(),
                Failure::Panic(payload) => panic_message(payload.as_ref()),
            };
            if let Some(own) = text.and_then(|text| decide(&text)) {
                return own;
            }
        }
        match self {
            Failure::Error(err) => err.is_out_of_memory(),
            Failure::Panic(payload) => is_out_of_memory_panic(payload.as_ref()),
        }
    }

    /// Gives the failure back to the caller unchanged: an error is returned, a panic resumed.
    pub(super) fn give_back(self) -> E {
        match self {
            Failure::Error(err) => err,
            Failure::Panic(payload) => panic::resume_unwind(payload),
        }
    }
}

/// Splits an attempt's outcome into success and failure.
pub(super) fn classify<T, E>(outcome: std::thread::Result<Result<T, E>>) -> Result<T, Failure<E>> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(Failure::Error(err)),
        Err(payload) => Err(Failure::Panic(payload)),
    }
}

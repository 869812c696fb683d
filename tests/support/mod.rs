//! Shared by the integration tests: recorders, a simulated out-of-memory, a tiny executor.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

/// A real libtorch CUDA out-of-memory text (from the shared corpus).
pub fn oom() -> String {
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 3.95 GiB total capacity; \
     3.16 GiB already allocated; 2.69 MiB free; 3.19 GiB reserved in total by PyTorch)"
        .to_string()
}

/// Records the sizes a body was called with.
pub struct Recorder(Mutex<Vec<usize>>);

impl Recorder {
    pub const fn new() -> Self {
        Recorder(Mutex::new(Vec::new()))
    }
    pub fn push(&self, size: usize) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(size);
    }
    pub fn take(&self) -> Vec<usize> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Serialises the tests of one binary that share a recorder.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread.
pub fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// Returns `Pending` once (after waking itself), like a real await point.
pub async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

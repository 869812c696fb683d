//! Shared by the integration tests: recorders, a simulated out-of-memory, a tiny executor.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

#[cfg(feature = "tch")]
pub mod models;
#[cfg(feature = "tch")]
pub mod zoo;

/// A plan as the step makes it: what the step would measure first (calls no rule read on this
/// machine prices) is measured, then planned. A plan alone runs nothing.
#[cfg(feature = "tch")]
pub trait MeasuredPlan {
    fn measured_plan(
        &self,
        mode: toma::lazy::Mode,
        options: &toma::lazy::Options,
    ) -> Result<toma::lazy::Plan, toma::lazy::LazyError>;
}

#[cfg(feature = "tch")]
impl MeasuredPlan for toma::lazy::LazyTensor {
    fn measured_plan(
        &self,
        mode: toma::lazy::Mode,
        options: &toma::lazy::Options,
    ) -> Result<toma::lazy::Plan, toma::lazy::LazyError> {
        self.calibrate(mode, options)?;
        self.plan(mode, options)
    }
}

/// Warms libtorch up (its thread pool, its first allocations) and caps `kind` at what is in
/// use now plus `headroom_gib`. Returns the headroom in bytes. For child processes only: a cap
/// cannot be raised again.
#[cfg(all(feature = "tch", target_os = "linux"))]
pub fn cap_memory(kind: toma::cpu_memory::CpuCap, headroom_gib: f64) -> u64 {
    const GIB: f64 = (1u64 << 30) as f64;
    use tch::{Device, Kind, Tensor};
    // A parallel op starts libtorch's intra-op threads now, while their stacks still fit.
    let warm = Tensor::ones([1 << 20], (Kind::Float, Device::Cpu)).sum(Kind::Double).double_value(&[]);
    assert_eq!(warm, (1 << 20) as f64);
    let in_use = kind.in_use().expect("VmSize or VmData");
    kind.set_headroom((headroom_gib * GIB) as u64).expect("set the cap");
    let cap = kind.limit().expect("getrlimit").expect("a cap is set");
    println!(
        "cap ({kind}): {:.2} GiB in use, cap {:.2} GiB, headroom {:.2} GiB",
        in_use as f64 / GIB,
        cap as f64 / GIB,
        (cap - in_use) as f64 / GIB
    );
    cap - in_use
}

/// A real libtorch CUDA out-of-memory text (from the shared corpus).
pub fn oom() -> String {
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 3.95 GiB total capacity; \
     3.16 GiB already allocated; 2.69 MiB free; 3.19 GiB reserved in total by PyTorch)"
        .to_string()
}

/// Records what a body was called with (sizes by default), across threads and panics.
pub struct Recorder<T = usize>(Mutex<Vec<T>>);

impl<T> Recorder<T> {
    pub const fn new() -> Self {
        Recorder(Mutex::new(Vec::new()))
    }
    pub fn push(&self, item: T) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(item);
    }
    pub fn take(&self) -> Vec<T> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The text of a panic payload: `panic!`'s `String` or `&str`, or "" for anything else.
pub fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Asserts that `attempts` start at `initial` and halve each time.
pub fn assert_halving(attempts: &[usize], initial: usize) {
    assert_eq!(attempts.first(), Some(&initial), "{attempts:?}");
    for pair in attempts.windows(2) {
        assert_eq!(pair[1], pair[0] / 2, "each retry halves the size: {attempts:?}");
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

/// Checks the attempts of one call over `[0, len)` (each a sub-range it was called with): the
/// first covers everything, a failed one is retried at the same start with half the length,
/// the finished ones are consecutive and cover `[0, len)`. Returns the finished sub-ranges.
pub fn check_halving_ranges(ranges: &[(usize, usize)], len: usize) -> Vec<(usize, usize)> {
    assert_eq!(ranges.first(), Some(&(0, len)), "the first attempt is the whole range: {ranges:?}");
    let mut done = Vec::new();
    for (i, &(start, end)) in ranges.iter().enumerate() {
        // An attempt failed when the next one starts at the same index.
        match ranges.get(i + 1) {
            // A full step halves; a clipped last sub-range goes on at the halved step (or a
            // further halving of it), so at less than it.
            Some(&(next_start, next_end)) if next_start == start && end < len => {
                assert_eq!(next_end - next_start, (end - start) / 2, "the step halves: {ranges:?}")
            }
            Some(&(next_start, next_end)) if next_start == start => {
                assert!(next_end - next_start < end - start, "the step shrinks: {ranges:?}")
            }
            _ => done.push((start, end)),
        }
    }
    assert_eq!(done.first().map(|r| r.0), Some(0), "{ranges:?}");
    assert_eq!(done.last().map(|r| r.1), Some(len), "{ranges:?}");
    for pair in done.windows(2) {
        assert_eq!(pair[0].1, pair[1].0, "finished sub-ranges are consecutive: {done:?}");
    }
    done
}

pub mod events {
    //! A global subscriber that records every event whose target is toma's (`toma::retry`,
    //! `toma::cache`, `toma::lazy`, ..). Global, not scoped: tracing caches each callsite's
    //! interest, and a scoped subscriber loses the events of callsites that another test
    //! thread registered first.

    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, MutexGuard, Once};

    /// One event toma emitted: its level and its fields (`message` among them).
    #[derive(Clone, Debug)]
    pub struct Recorded {
        pub level: tracing::Level,
        pub fields: BTreeMap<String, String>,
        /// The innermost span the event was emitted in (its name), and that span's fields.
        pub span: Option<(&'static str, BTreeMap<String, String>)>,
    }

    impl Recorded {
        /// The field's value, or "" when the event has none.
        pub fn field(&self, name: &str) -> &str {
            self.fields.get(name).map_or("", String::as_str)
        }
        /// A caught out-of-memory: the info event the retry loop emits before retrying.
        pub fn is_caught_oom(&self) -> bool {
            self.level == tracing::Level::INFO && self.fields.contains_key("caught")
        }
    }

    static EVENTS: Mutex<Vec<Recorded>> = Mutex::new(Vec::new());
    type SpanInfo = (&'static str, BTreeMap<String, String>);
    static SPANS: Mutex<BTreeMap<u64, SpanInfo>> = Mutex::new(BTreeMap::new());
    thread_local! {
        static ENTERED: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    struct Recorder;

    struct FieldsVisitor<'a>(&'a mut BTreeMap<String, String>);

    impl FieldsVisitor<'_> {
        /// Keeps a repeated name apart (`name`, then `name#2`) rather than losing one.
        fn insert(&mut self, name: &str, value: String) {
            let key = if self.0.contains_key(name) { format!("{name}#2") } else { name.to_owned() };
            self.0.insert(key, value);
        }
    }

    impl tracing::field::Visit for FieldsVisitor<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.insert(field.name(), format!("{value:?}"));
        }
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            self.insert(field.name(), value.to_owned());
        }
    }

    impl tracing::Subscriber for Recorder {
        fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
            metadata.target().starts_with("toma")
        }
        fn new_span(&self, attributes: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            let mut fields = BTreeMap::new();
            attributes.record(&mut FieldsVisitor(&mut fields));
            SPANS.lock().unwrap_or_else(|e| e.into_inner()).insert(id, (attributes.metadata().name(), fields));
            tracing::span::Id::from_u64(id)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            let mut fields = BTreeMap::new();
            event.record(&mut FieldsVisitor(&mut fields));
            let level = *event.metadata().level();
            let current = ENTERED.with(|stack| stack.borrow().last().copied());
            let span = current.and_then(|id| SPANS.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned());
            lock().push(Recorded { level, fields, span });
        }
        fn enter(&self, id: &tracing::span::Id) {
            ENTERED.with(|stack| stack.borrow_mut().push(id.into_u64()));
        }
        fn exit(&self, id: &tracing::span::Id) {
            ENTERED.with(|stack| {
                let mut stack = stack.borrow_mut();
                if let Some(at) = stack.iter().rposition(|&s| s == id.into_u64()) {
                    stack.remove(at);
                }
            });
        }
    }

    fn lock() -> MutexGuard<'static, Vec<Recorded>> {
        EVENTS.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Installs the recorder as the process's subscriber (once; later calls do nothing).
    /// Panics if another subscriber was installed first.
    pub fn record() {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| tracing::subscriber::set_global_default(Recorder).expect("the first subscriber"));
    }

    /// Every event recorded so far, taken out of the record.
    pub fn take() -> Vec<Recorded> {
        std::mem::take(&mut *lock())
    }

    /// The caught out-of-memory events, taken out of the record with everything else.
    pub fn take_caught_ooms() -> Vec<Recorded> {
        take().into_iter().filter(Recorded::is_caught_oom).collect()
    }

    /// A copy of the events recorded so far, left in the record.
    pub fn snapshot() -> Vec<Recorded> {
        lock().clone()
    }
}

pub mod child {
    //! Re-running one test of this binary in a child process: for work that must not touch the
    //! parent (a memory cap can never be raised again).

    use std::collections::BTreeMap;
    use std::process::{Command, ExitStatus};
    use std::time::Instant;

    /// What a child test process did.
    pub struct Child {
        pub status: ExitStatus,
        pub stdout: String,
        pub stderr: String,
        /// Status, time and both outputs, for failure messages.
        pub report: String,
    }

    impl Child {
        /// The first stdout line that starts with `prefix`, without it; fails (showing the
        /// child's output) when there is none, so that a child that never reached its end
        /// — a test name that matched nothing, say — cannot pass.
        pub fn line_after(&self, prefix: &str) -> &str {
            self.stdout
                .lines()
                .find_map(|line| line.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("the child printed no line starting with `{prefix}`\n{}", self.report))
        }

        /// Asserts that the child exited successfully and printed a line starting with
        /// `marker`; returns the `key=value` pairs that follow the marker on that line.
        pub fn assert_finished(&self, marker: &str) -> BTreeMap<String, String> {
            assert!(self.status.success(), "{}", self.report);
            key_values(self.line_after(marker))
        }
    }

    /// Runs test `test` of this binary again, alone and exactly, with `env` set to `value`.
    pub fn run(test: &str, env: &str, value: &str) -> Child {
        run_with(test, &[(env, Some(value))])
    }

    /// [`run`] with several variables: each set to its value, or removed (`None`).
    pub fn run_with(test: &str, envs: &[(&str, Option<&str>)]) -> Child {
        let exe = std::env::current_exe().expect("path of the test binary");
        let started = Instant::now();
        let mut command = Command::new(exe);
        // Ignored tests (the GPU ones) re-run themselves too.
        command.args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"]);
        for (env, value) in envs {
            match value {
                Some(value) => command.env(env, value),
                None => command.env_remove(env),
            };
        }
        let output = command.output().expect("spawn the child test process");
        let (env, value) = envs.first().map_or(("", ""), |(e, v)| (*e, v.unwrap_or("(unset)")));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        let report = format!(
            "child `{env}={value}` of test `{test}` exited with {} after {:.1} s\n\
             --- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}--- end of child output ---",
            output.status,
            started.elapsed().as_secs_f64()
        );
        Child { status: output.status, stdout, stderr, report }
    }

    /// The `key=value` pairs of a line (other words are ignored).
    pub fn key_values(line: &str) -> BTreeMap<String, String> {
        line.split_whitespace()
            .filter_map(|pair| pair.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }
}

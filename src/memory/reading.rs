//! The free-memory figures in `StacktraceMemory` cache keys: one shared reading per device,
//! refreshed at most about once a second, and at once after a CPU cap changes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::cpu::{available_cpu_memory, cap_changes};
use super::cuda_allocator::cuda_usable_memory;

/// How old a free-memory reading used for cache keys may be.
const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(1);
const NO_READING: u64 = u64::MAX;
/// Devices with a shared reading; a higher ordinal is read fresh on every key.
const READING_DEVICES: usize = 64;

/// One free-memory figure shared by all threads, refreshed at most about once a second:
/// reading `/proc/meminfo` costs ~15 µs, a CUDA probe a few µs, too much for every call of a
/// wrapped function.
struct Reading {
    /// Nanoseconds after `epoch()` when the reading was taken; 0 = never.
    taken_at: AtomicU64,
    /// The figure, or `NO_READING`.
    value: AtomicU64,
}

impl Reading {
    const fn new() -> Self {
        Reading { taken_at: AtomicU64::new(0), value: AtomicU64::new(NO_READING) }
    }

    /// The stored figure, or a fresh one from `read` when the stored one is missing or stale.
    fn get(&self, now: u64, read: impl FnOnce() -> u64) -> u64 {
        self.get_within(now, SNAPSHOT_MAX_AGE, read)
    }

    /// As [`get`](Self::get), stale after `max_age`.
    fn get_within(&self, now: u64, max_age: Duration, read: impl FnOnce() -> u64) -> u64 {
        let taken_at = self.taken_at.load(Ordering::Acquire);
        if taken_at == 0 || now.saturating_sub(taken_at) > max_age.as_nanos() as u64 {
            // Several threads may refresh at once; each stores a valid reading, so no lock.
            let value = read();
            self.value.store(value, Ordering::Relaxed);
            self.taken_at.store(now, Ordering::Release);
            return value;
        }
        self.value.load(Ordering::Relaxed)
    }

    fn forget(&self) {
        self.taken_at.store(0, Ordering::Release);
    }
}

static CPU_READING: Reading = Reading::new();
/// The CPU caps set when the readings were last checked ([`cap_changes`]).
static CAPS_SEEN: AtomicU64 = AtomicU64::new(0);
static GPU_READINGS: [Reading; READING_DEVICES] = [const { Reading::new() }; READING_DEVICES];

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Free memory as used in cache keys: CPU available bytes, and GPU 0's usable bytes
/// ([`cuda_usable_memory`]) when a device is present. Up to about a second old.
pub(crate) fn free_memory_reading() -> (u64, Option<u64>) {
    free_memory_reading_for(Some(0))
}

/// As [`free_memory_reading`], for the CUDA device the work runs on: `Some(ordinal)`, or
/// `None` for work on the CPU (no GPU figure). Each device has its own shared reading.
pub(crate) fn free_memory_reading_for(device: Option<usize>) -> (u64, Option<u64>) {
    // +1 keeps "taken at the epoch" distinct from "never taken".
    let now = epoch().elapsed().as_nanos() as u64 + 1;
    // A cap set since the last key changes what is available: read afresh.
    let changes = cap_changes();
    if CAPS_SEEN.swap(changes, Ordering::AcqRel) != changes {
        refresh_free_memory_reading();
    }
    let cpu = CPU_READING.get(now, available_cpu_memory);
    let gpu = device.map(|device| {
        let read = || cuda_usable_memory(device).unwrap_or(NO_READING);
        match GPU_READINGS.get(device) {
            Some(reading) => reading.get(now, read),
            None => read(),
        }
    });
    (cpu, gpu.filter(|&free| free != NO_READING))
}

/// How old the system's available memory may be when a plan reads it: a step shorter than
/// this shares one reading with the steps around it.
#[cfg(feature = "tch")]
const PLAN_READING_MAX_AGE: Duration = Duration::from_millis(50);

/// [`available_cpu_memory`] for a plan made every step: the system's `MemAvailable` and which
/// caps are set from shared readings up to [`PLAN_READING_MAX_AGE`] old (reading
/// `/proc/meminfo` costs tens of microseconds, 1% of a small model's step, and each `getrlimit`
/// a few in the middle of a step), read again at once after toma sets a cap; the headroom under
/// each cap that is set read fresh (the process's own usage moves with every allocation).
#[cfg(feature = "tch")]
pub(crate) fn available_cpu_memory_for_plans() -> u64 {
    static CAPS: AtomicU64 = AtomicU64::new(0);
    let now = epoch().elapsed().as_nanos() as u64 + 1;
    let changes = cap_changes();
    if CAPS.swap(changes, Ordering::AcqRel) != changes {
        PLAN_READING.forget();
        PLAN_CAPS.forget();
    }
    let available = PLAN_READING.get_within(now, PLAN_READING_MAX_AGE, super::cpu::system_available);
    let set = PLAN_CAPS.get_within(now, PLAN_READING_MAX_AGE, super::cpu::caps_set);
    super::cpu::within_set_caps(available, set)
}

/// The system's figure plans share ([`available_cpu_memory_for_plans`]).
#[cfg(feature = "tch")]
static PLAN_READING: Reading = Reading::new();
/// Which caps were set when plans last looked ([`super::cpu::caps_set`]).
#[cfg(feature = "tch")]
static PLAN_CAPS: Reading = Reading::new();

/// Forgets the shared readings so that the next key takes fresh ones.
pub(crate) fn refresh_free_memory_reading() {
    CPU_READING.forget();
    GPU_READINGS.iter().for_each(Reading::forget);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::cuda_device_count;
    use crate::memory::cuda_memory;

    #[test]
    fn reading_is_reused_within_a_second() {
        // Another test may refresh the shared reading between two reads: a few tries, and
        // one of them must see the stored reading reused.
        let reused = (0..5).any(|_| {
            refresh_free_memory_reading();
            let first = free_memory_reading();
            assert!(first.0 > 0);
            assert_eq!(first.1.is_some(), cuda_memory(0).is_some());
            let taken =
                (CPU_READING.taken_at.load(Ordering::Acquire), GPU_READINGS[0].taken_at.load(Ordering::Acquire));
            let second = free_memory_reading();
            // Taken well within a second of the first, so it is the same stored reading.
            let again =
                (CPU_READING.taken_at.load(Ordering::Acquire), GPU_READINGS[0].taken_at.load(Ordering::Acquire));
            again == taken && first == second
        });
        assert!(reused, "a reading taken within a second of the last was taken again");
    }

    #[cfg(all(feature = "tch", target_os = "linux"))]
    #[test]
    fn plans_share_a_recent_system_reading() {
        // Without a cap in this process the figure is the shared system reading: read twice
        // in a row (within 50 ms, a few tries as other tests run), the same bytes.
        let total = std::fs::read_to_string("/proc/meminfo").unwrap();
        let total: u64 = total
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .unwrap()
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap();
        let shared = (0..5).any(|_| {
            let t = std::time::Instant::now();
            let a = available_cpu_memory_for_plans();
            let taken = PLAN_READING.taken_at.load(Ordering::Acquire);
            let b = available_cpu_memory_for_plans();
            assert!(a > 0 && a <= total * 1024, "{a} bytes available of {total} KiB");
            let again = PLAN_READING.taken_at.load(Ordering::Acquire);
            taken == again && a == b && t.elapsed() < std::time::Duration::from_millis(50)
        });
        // Older than 50 ms: read again.
        let taken = PLAN_READING.taken_at.load(Ordering::Acquire);
        std::thread::sleep(std::time::Duration::from_millis(60));
        available_cpu_memory_for_plans();
        assert_ne!(PLAN_READING.taken_at.load(Ordering::Acquire), taken, "a reading 60 ms old was used");
        assert!(shared, "two plans within 50 ms read the system's figure twice");
    }

    #[test]
    fn readings_are_per_device() {
        let (cpu, gpu) = free_memory_reading_for(None);
        assert!(cpu > 0);
        assert_eq!(gpu, None, "work on the CPU has no GPU figure");
        let count = cuda_device_count();
        for device in [0, 1, count, READING_DEVICES, usize::MAX] {
            let (_, gpu) = free_memory_reading_for(Some(device));
            assert_eq!(gpu.is_some(), device < count, "device {device} of {count}");
        }
    }
}

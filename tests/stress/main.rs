//! Many threads, forced races and injected faults. The tests that empty the process-wide cache
//! or hammer it hold `support::serial()` for their whole run; the fault schedules use no cache.
#[path = "../support/mod.rs"]
mod support;

mod cache_race;
mod concurrency;
mod fault_injection;

//! Compile errors a user can hit, with the messages they see (golden files in `tests/ui/`).
//!
//! Runs in the `--no-default-features --features macros` pass of `scripts/test.sh`: trybuild
//! builds its own copy of the crate, and without libtorch that takes seconds, not minutes.
#![cfg(all(feature = "macros", not(feature = "tch")))]

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}

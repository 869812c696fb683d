//! The retry engine in one process: attributes, builders, bad input and properties. Tests that
//! change process-wide state take `support::serial()`, or run in a child process.
#[path = "../support/mod.rs"]
mod support;

mod attributes;
mod bad_input;
mod builders;
mod properties;
mod spans;

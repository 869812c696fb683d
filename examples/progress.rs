//! A long `range` with its progress on stderr (feature `progress`):
//! `cargo run --example progress --features progress`.
//!
//! The body "runs out of memory" above 300 items per chunk, so the bar shows the step settling
//! and the out-of-memories caught. In a terminal the bar redraws in place; piped, nothing is
//! drawn (`progress = true`), unless asked with `progress = always`.

use std::time::Duration;

#[toma::range(initial_step = 1024, cache = None, progress = true)]
fn process(start: usize, end: usize) -> Result<(), String> {
    if end - start > 300 {
        return Err("CUDA out of memory. Tried to allocate 2.00 GiB".into());
    }
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}

fn main() -> Result<(), String> {
    process(0, 20_000)?;
    eprintln!("done");
    Ok(())
}

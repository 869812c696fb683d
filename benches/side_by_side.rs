//! The Rust side of `benches/side_by_side.sh`: the same two workloads as
//! `benches/side_by_side.py`, printed as `name value unit` lines.

mod workload;

use std::hint::black_box;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

#[toma::batch(initial_batchsize = 64)]
fn wrapped(batchsize: usize, x: u64) -> Result<u64, String> {
    Ok(black_box(x).wrapping_mul(batchsize as u64))
}

fn best(mut f: impl FnMut(), repeat: u32, number: u32) -> f64 {
    (0..repeat)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..number {
                f();
            }
            start.elapsed().as_secs_f64() / f64::from(number)
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    println!(
        "rust_batch_call {:.0} ns",
        best(
            || {
                let _ = black_box(wrapped(black_box(3)));
            },
            5,
            100_000
        ) * 1e9
    );
    let t = Tensor::zeros([128, 256, 256], (Kind::Float, Device::Cpu));
    println!("rust_fill_native {:.3} ms", best(|| workload::native(&t), 15, 1) * 1e3);
    println!("rust_fill_toma {:.3} ms", best(|| workload::with_toma(&t), 15, 1) * 1e3);
}

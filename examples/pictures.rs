//! The README's pictures, from real runs: `scripts/pictures.sh` (or `cargo run --example
//! pictures -- docs`) writes
//!
//! - `plan.svg`: the plan of a training step that does not fit its budget (the micro-batch's
//!   schedule beside the whole batch's, the peak, the budget);
//! - `run.svg`: a `toma::Batch` call that runs out of memory for real, under a cap on the
//!   process's address space (as the demo does), with each attempt's measured peak.

use std::path::PathBuf;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use toma::cpu_memory::CpuCap;
use toma::lazy::{lazy, Mode, Options};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "docs".into()));
    std::fs::create_dir_all(&dir)?;

    // 1. A plan: a small MLP's forward + backward, 2048 samples, a budget of a third of what
    //    the whole batch needs.
    let vs = nn::VarStore::new(Device::Cpu);
    let (l1, l2) = (
        nn::linear(vs.root() / "l1", 512, 1024, Default::default()),
        nn::linear(vs.root() / "l2", 1024, 10, Default::default()),
    );
    let (x, y) = (Tensor::randn([2048, 512], CPU), Tensor::randint(10, [2048], (Kind::Int64, Device::Cpu)));
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.apply(&l1).relu().apply(&l2).cross_entropy_for_logits(&ly);
    let whole = loss.plan(Mode::Backward, &Options::new().budget(u64::MAX / 4))?.full_batch_peak_bytes();
    let plan = loss.plan(Mode::Backward, &Options::new().budget(whole / 3))?;
    std::fs::write(dir.join("plan.svg"), plan.to_svg())?;
    println!(
        "plan.svg: {} in {} micro-batches of {}, peak {} bytes",
        plan.batch_size(),
        plan.chunks(),
        plan.micro_batch(),
        plan.peak_bytes()
    );

    // 2. A run: batches of 1 MiB items, far more than the capped address space holds.
    assert!(toma::memory::track_cpu_allocations(), "counting libtorch's CPU allocations");
    let _ = Tensor::ones([1 << 20], CPU).sum(Kind::Float); // libtorch's threads, before the cap
    CpuCap::AddressSpace.set_headroom(3 << 29)?; // 1.5 GiB for tensors
    let (result, report) = toma::Batch::new(16384).cache(toma::CacheKind::None).run_with_report(|batchsize| {
        let batch = Tensor::f_rand([batchsize as i64, 262_144], CPU)?;
        let doubled = batch.f_mul_scalar(2.0)?;
        doubled.f_mean(Kind::Float)?.f_double_value(&[])
    });
    let mean = result?;
    std::fs::write(dir.join("run.svg"), report.to_svg("Batch::new(16384), 1 MiB items, 1.5 GiB cap"))?;
    println!(
        "run.svg: {} attempts, {} out of memory, settled at {} (mean {mean:.3})",
        report.attempts, report.out_of_memory, report.final_size
    );
    let _ = l1.forward(&x); // the layers stay alive until here
    Ok(())
}

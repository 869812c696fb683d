//! One rank of a job that agrees on sizes and trains with exact gradients across ranks.
//!
//! ```sh
//! cargo build --release --features dist --example dist
//! torchrun --nproc-per-node=2 --no-python target/release/examples/dist
//! ```
//!
//! Each rank holds its own shard of a dataset (ranks hold different amounts), runs inference
//! over it in chunks whose step all ranks share, then takes one training step on its own batch,
//! split into micro-batches of its own size; afterwards every rank holds the gradient of one
//! backward over all ranks' batches.

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use toma::dist::Group;
use toma::lazy::{lazy, Layer, Options, TensorOps};

/// A small classifier, written once for tensors and lazy tensors.
struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
}

impl Mlp {
    fn logits<T: TensorOps>(&self, x: &T) -> T
    where
        nn::Linear: Layer<T>,
    {
        x.apply(&self.l1).relu().apply(&self.l2)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let group = Group::from_env()?;
    let (rank, world) = (group.rank(), group.world_size());
    tch::manual_seed(0); // the same initial model on every rank
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Mlp {
        l1: nn::linear(vs.root() / "l1", 32, 64, Default::default()),
        l2: nn::linear(vs.root() / "l2", 64, 10, Default::default()),
    };
    let mut opt = nn::Sgd::default().build(&vs, 0.1)?;

    // Inference over this rank's shard: every rank uses the same step at every chunk.
    tch::manual_seed(1 + rank as i64);
    let shard = Tensor::randn([1000 + 300 * rank as i64, 32], (Kind::Float, Device::Cpu));
    let mut predictions = Vec::new();
    let (result, report) =
        toma::Range::new(0, shard.size()[0] as usize, 512).group(&group).run_with_report(|start, end| {
            let rows = shard.f_narrow(0, start as i64, (end - start) as i64)?;
            predictions.push(tch::no_grad(|| net.logits(&rows).argmax(-1, false)));
            Ok::<(), tch::TchError>(())
        });
    result?;
    println!("rank {rank}/{world}: {} chunks, final step {}", report.attempts, report.final_size);

    // One training step on this rank's batch, split its own way; gradients summed over ranks.
    let n = 64 + 32 * rank as i64;
    let (x, y) =
        (Tensor::randn([n, 32], (Kind::Float, Device::Cpu)), Tensor::randint(10, [n], (Kind::Int64, Device::Cpu)));
    opt.zero_grad();
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = net.logits(&lx).cross_entropy_for_logits(&ly);
    let value = loss.backward_with(&Options::new().micro_batch(16 + 8 * rank).group(&group))?;
    opt.step();
    println!(
        "rank {rank}/{world}: loss over all ranks' {} samples = {value:.4}",
        group.all_reduce("example/n", toma::dist::Reduce::Sum, &[n])?[0]
    );
    Ok(())
}

//! An unchanged `tch::vision::resnet::resnet18` through `toma::Range::auto`: inference over a
//! dataset, and a training step with exact gradient accumulation (each chunk's mean loss
//! weighted by its share, then one `opt.step()`). No step size is guessed anywhere.
//!
//! `cargo run --release --example resnet_auto`.
//!
//! One caveat of accumulating by hand: an out-of-memory inside a chunk's `backward` can leave
//! part of that chunk's gradients added before the chunk is retried smaller. Once the fit
//! exists the budget keeps chunks under the free memory, so this needs a real out-of-memory
//! in the probes; `toma::lazy` adds a chunk's gradients only after its backward completed.

use tch::nn::{self, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let device = Device::cuda_if_available();
    let vs = nn::VarStore::new(device);
    let model = tch::vision::resnet::resnet18(&vs.root(), 10);
    let n = 512;
    let images = Tensor::randn([n as i64, 3, 32, 32], (Kind::Float, device));
    let labels = Tensor::randint(10, [n as i64], (Kind::Int64, device));

    // Inference over the dataset: the step is fitted from the first chunks' peaks.
    let mut predictions = Vec::with_capacity(n);
    let (result, report) = toma::Range::auto(0, n).budget(256 << 20).run_with_report(|start, end| {
        let x = images.f_narrow(0, start as i64, (end - start) as i64)?;
        let logits = tch::no_grad(|| model.forward_t(&x, false));
        predictions.extend(Vec::<i64>::try_from(&logits.f_argmax(-1, false)?)?);
        Ok::<(), tch::TchError>(())
    });
    result?;
    let auto = report.auto.as_ref().expect("an auto report");
    println!(
        "inference: {} predictions in {} chunks; fitted step {} ({}), {} probes",
        predictions.len(),
        report.attempts,
        auto.step,
        auto.reason,
        auto.probes
    );
    for device in &auto.devices {
        println!(
            "  {:?}: {} B fixed + {} B per image, budget {} B",
            device.device, device.fixed_bytes, device.bytes_per_item, device.budget
        );
    }

    // One training step over the whole batch, in chunks that fit: weight each chunk's mean
    // loss by its share, so that the gradients are the full batch's (with batch norm in eval
    // mode; in training mode every micro-batch uses its own statistics, as in any gradient
    // accumulation).
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    opt.zero_grad();
    let mut loss_total = 0.0;
    let (result, report) = toma::Range::auto(0, n).budget(256 << 20).run_with_report(|start, end| {
        let x = images.f_narrow(0, start as i64, (end - start) as i64)?;
        let y = labels.f_narrow(0, start as i64, (end - start) as i64)?;
        let loss = model.forward_t(&x, false).cross_entropy_for_logits(&y);
        let weighted = loss.f_mul_scalar(toma::share(start, end, n))?;
        weighted.f_backward()?;
        loss_total += weighted.f_double_value(&[])?;
        Ok::<(), tch::TchError>(())
    });
    result?;
    opt.step();
    println!(
        "training step: mean loss {loss_total:.4} over {n} images in {} chunks (step {})",
        report.attempts,
        report.auto.map_or(0, |a| a.step)
    );
    Ok(())
}

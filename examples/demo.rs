//! toma's demo: real out-of-memory errors from libtorch, caught and retried with smaller sizes.
//!
//! The process caps its own address space (`RLIMIT_AS`) a little above what it uses, so that
//! libtorch's CPU allocator fails for real (`DefaultCPUAllocator: can't allocate memory`), then:
//!
//! 1. runs a `#[toma::batch]` function that starts at a batch far too large for the cap, and
//!    settles on one that fits;
//! 2. runs it again: it starts at the remembered size, with no out-of-memory;
//! 3. runs a `#[toma::chunked]` function over a 1 GiB tensor, its step adapting to what is left.
//!
//! toma reports each attempt and each caught out-of-memory through `tracing`; the small
//! subscriber below prints them. Run it with `cargo run --example demo`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use tch::{Device, Kind, TchError, Tensor};
use toma::cpu_memory::CpuCap;

const GIB: f64 = (1u64 << 30) as f64;
/// One item is a row of this many `f32`: 1 MiB.
const ITEM_FLOATS: i64 = 262_144;
const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);
/// Address space left for tensors under the cap.
const HEADROOM_GIB: f64 = 1.5;

// ---------------------------------------------------------------------------------------------
// The work: plain tch code, with a toma attribute on top.

/// One batch of `batchsize` random items (1 MiB each): their mean. 65536 items would need
/// 64 GiB. tch's plain methods panic on out-of-memory; toma catches the panic and retries.
#[toma::batch(initial_batchsize = 65536, cache = Global)]
fn batch_mean(batchsize: usize) -> (usize, f64) {
    let batch = Tensor::rand([batchsize as i64, ITEM_FLOATS], CPU);
    let mean = batch.mean(Kind::Float).double_value(&[]);
    (batchsize, mean)
}

/// Softmax of each row of a tensor, in place, a chunk of rows at a time. The softmax of a chunk
/// is a temporary as large as the chunk. tch's `f_` methods return the out-of-memory as an
/// `Err`; toma retries that too.
#[toma::chunked(initial_step = 1024)]
fn softmax_rows(mut chunk: Tensor, start: usize, end: usize) -> Result<(), TchError> {
    let softmax = chunk.f_softmax(1, Kind::Float)?;
    chunk.f_copy_(&softmax)?;
    LARGEST_CHUNK_DONE.fetch_max(end - start, Ordering::Relaxed);
    Ok(())
}

/// The most rows one finished chunk held.
static LARGEST_CHUNK_DONE: AtomicUsize = AtomicUsize::new(0);

// ---------------------------------------------------------------------------------------------
// The demo around it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("toma=debug,info"));
        tracing_subscriber::registry().with(filter).with(Printer).try_init()?;
    }
    println!("toma demo: out-of-memory in tch, caught and retried with smaller sizes");
    println!("=======================================================================\n");

    // Start libtorch's threads before the cap: their stacks need address space too.
    let _ = Tensor::ones([1 << 20], CPU).sum(Kind::Float);
    let in_use = CpuCap::AddressSpace.in_use()?;
    println!("Address space in use:   {:.2} GiB (libtorch's libraries, before any tensor)", in_use as f64 / GIB);
    CpuCap::AddressSpace.set_headroom((HEADROOM_GIB * GIB) as u64)?;
    let cap = CpuCap::AddressSpace.limit()?.unwrap_or(u64::MAX);
    println!(
        "Cap set (RLIMIT_AS):    {:.2} GiB, leaving {:.2} GiB for tensors; more fails in libtorch's allocator",
        cap as f64 / GIB,
        toma::cpu_memory::available_cpu_memory() as f64 / GIB
    );

    println!("\n1) #[toma::batch(initial_batchsize = 65536)] fn batch_mean(batchsize): one item = 1 MiB");
    let (first, first_ooms, first_secs) = timed(batch_mean);
    println!(
        "   => settled on batch size {} ({:.2} GiB, mean {:.4}) after {first_ooms} caught OOMs, in {first_secs:.2} s",
        first.0,
        first.0 as f64 / 1024.0,
        first.1
    );

    println!("\n2) The same call again: toma remembers the size that worked (cache = Global)");
    let (second, second_ooms, second_secs) = timed(batch_mean);
    let hit = if second.0 == first.0 && second_ooms == 0 { "cache hit" } else { "NO cache hit" };
    println!("   => {hit}: ran at batch size {} with {second_ooms} OOMs, in {second_secs:.2} s", second.0);

    println!("\n3) #[toma::chunked(initial_step = 1024)] fn softmax_rows(chunk, start, end)");
    let rows = Tensor::f_rand([1024, ITEM_FLOATS], CPU)?;
    println!("   a 1024 x 1 MiB tensor (1 GiB) under the cap; one chunk's softmax needs as much again");
    let (result, chunk_ooms, chunk_secs) = timed(|| softmax_rows(&rows));
    result?;
    let row_sums = rows.f_sum_dim_intlist(&[1i64][..], false, Kind::Float)?;
    let worst = (row_sums - 1.0).abs().max().double_value(&[]);
    let step = LARGEST_CHUNK_DONE.load(Ordering::Relaxed);
    println!(
        "   => every row done in chunks of {step} rows ({chunk_ooms} caught OOMs, {chunk_secs:.2} s); \
         each row now sums to 1 within {worst:.1e}"
    );

    drop(rows);

    println!("\n4) toma::lazy: plan a training step first, then run it in micro-batches that fit");
    let (lazy_chunks, lazy_ooms) = lazy_training_step()?;

    println!("\n5) toma::lazy: a model that may not be split (batch norm in training) recomputes instead");
    let (segments, bn_ooms) = recomputed_training_step()?;

    println!(
        "\nSummary: under a {:.2} GiB cap, batch 65536 -> {} after {first_ooms} OOMs; 2nd call {hit} \
         ({second_ooms} OOMs); chunked step 1024 -> {} after {chunk_ooms} OOMs; a training step that \
         OOMs eagerly ran lazily in {lazy_chunks} micro-batches with {lazy_ooms} OOMs; a batch-norm step \
         that OOMs eagerly and may not be split ran whole, recomputing {segments} segments, with {bn_ooms} OOMs.",
        cap as f64 / GIB,
        first.0,
        step,
    );
    Ok(())
}

/// An MLP step on 32,768 samples whose hidden activations are 1 GiB each. The model is one
/// `toma::lazy::nn::seq()`: trained eagerly on a small batch, it then runs out of memory eagerly
/// on all samples under the cap; through `toma::lazy` the same model is planned against the
/// memory left and runs in micro-batches, with gradients equal to the full batch's, then one
/// optimizer step on the same `VarStore`.
fn lazy_training_step() -> Result<(usize, usize), Box<dyn std::error::Error>> {
    use tch::nn::{self, OptimizerConfig};
    use toma::lazy::{lazy, Mode, Options};
    const N: i64 = 32_768;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mlp = toma::lazy::nn::seq()
        .add(nn::linear(vs.root() / "l1", 64, 8192, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 8192, 10, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let x = Tensor::f_randn([N, 64], CPU)?;
    let y = Tensor::f_randint(10, [N], (Kind::Int64, Device::Cpu))?;

    let (xs, ys) = (x.narrow(0, 0, 256), y.narrow(0, 0, 256));
    let small = xs.apply(&mlp).cross_entropy_for_logits(&ys);
    opt.backward_step(&small);
    println!(
        "   eagerly, 256 samples: loss {:.4}, one SGD step (the model is one toma::lazy::nn::seq())",
        small.double_value(&[])
    );
    println!("   eagerly, all {N} samples: x.apply(&mlp).cross_entropy(y).backward()");
    eagerly_out_of_memory(|| x.apply(&mlp).cross_entropy_for_logits(&y).backward());
    opt.zero_grad();

    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.apply(&mlp).cross_entropy_for_logits(&ly);
    let plan = loss.plan(Mode::Backward, &Options::default())?;
    println!("   lazily: the same model and step, recorded shape-only and planned before anything runs:\n");
    for line in plan.to_string().lines() {
        println!("      {line}");
    }
    let (value, ooms, secs) = timed(|| loss.backward());
    let value = value?;
    opt.step();
    println!(
        "\n   => loss {value:.4} over all {N} samples in {} micro-batch(es) of {}, {ooms} OOMs, {secs:.2} s; one SGD step",
        plan.chunks(),
        plan.micro_batch()
    );
    Ok((plan.chunks(), ooms))
}

/// Eight layers of linear, batch norm (training) and ReLU over 98,304 samples: 1.7 GiB at the
/// peak of a plain step, so it runs out of memory eagerly under the cap; batch norm's
/// statistics are over the whole batch, so micro-batches would change it. Lazily, the plan
/// drops activations after the forward and recomputes them segment by segment: the whole
/// batch, the same statistics, within the budget.
fn recomputed_training_step() -> Result<(usize, usize), Box<dyn std::error::Error>> {
    use tch::nn::{self, OptimizerConfig};
    use toma::lazy::nn::ModuleT;
    use toma::lazy::{lazy, Mode, Options};
    const N: i64 = 98_304;
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut net = toma::lazy::nn::seq_t();
    let mut width = 64;
    for k in 0..8 {
        net = net
            .add(nn::linear(vs.root() / format!("l{k}"), width, 256, Default::default()))
            .add(nn::batch_norm1d(vs.root() / format!("bn{k}"), 256, Default::default()))
            .add_fn(|x| x.relu());
        width = 256;
    }
    let net = net.add(nn::linear(vs.root() / "head", 256, 10, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.01)?;
    let x = Tensor::f_randn([N, 64], CPU)?;
    let y = Tensor::f_randint(10, [N], (Kind::Int64, Device::Cpu))?;
    println!("   eagerly, all {N} samples: net.forward_t(x, true).cross_entropy(y).backward()");
    eagerly_out_of_memory(|| net.forward_t(&x, true).cross_entropy_for_logits(&y).backward());
    opt.zero_grad();
    let running_mean =
        vs.variables().iter().find(|(name, _)| name.ends_with("bn0.running_mean")).map(|(_, t)| t.copy());

    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.apply_t(&net, true).cross_entropy_for_logits(&ly);
    let plan = loss.plan(Mode::Backward, &Options::default())?;
    println!("   lazily, planned before anything runs (the table left out):\n");
    for line in plan.to_string().lines().take_while(|l| !l.starts_with("peak =")) {
        println!("      {line}");
    }
    let (value, ooms, secs) = timed(|| loss.backward());
    let value = value?;
    opt.step();
    let moved = running_mean.is_some_and(|before| {
        let after = vs.variables().into_iter().find(|(name, _)| name.ends_with("bn0.running_mean")).map(|(_, t)| t);
        after.is_some_and(|after| !after.equal(&before))
    });
    println!(
        "\n   => loss {value:.4} over all {N} samples as one batch (batch statistics of all of them{}), \
         {} segments, {ooms} OOMs, {secs:.2} s; one SGD step",
        if moved { "; running statistics moved once" } else { "" },
        plan.segments().len()
    );
    Ok((plan.segments().len(), ooms))
}

/// Runs an eager step expected to run out of memory, and says how it ended. tch's plain
/// methods panic on out-of-memory; the default hook's backtrace is hidden for this one.
fn eagerly_out_of_memory(step: impl FnOnce()) {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let eager = std::panic::catch_unwind(std::panic::AssertUnwindSafe(step));
    std::panic::set_hook(hook);
    match eager {
        Err(payload) => {
            let text = payload.downcast_ref::<String>().map_or("", String::as_str);
            println!("   => out of memory, as expected: {}", libtorch_line(text));
        }
        Ok(()) => println!("   => (it fit after all: the cap left more room than this step needs)"),
    }
}

/// Runs `work`, returning its result, the out-of-memories toma caught meanwhile, and seconds.
fn timed<T>(work: impl FnOnce() -> T) -> (T, usize, f64) {
    let ooms = OOMS.load(Ordering::Relaxed);
    let started = Instant::now();
    let value = work();
    (value, OOMS.load(Ordering::Relaxed) - ooms, started.elapsed().as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// toma's events through tracing-subscriber: an `EnvFilter` (`RUST_LOG`, default
// `toma=debug,info`) and a layer that prints each event as a readable line.

/// Out-of-memories toma reported so far.
static OOMS: AtomicUsize = AtomicUsize::new(0);

struct Printer;

/// An event's fields in order.
#[derive(Default)]
struct Fields(Vec<(&'static str, String)>);

impl Fields {
    fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0.iter().filter(move |(k, _)| *k == name).map(|(_, v)| v.as_str())
    }
    fn get<'a>(&'a self, name: &'a str) -> &'a str {
        self.all(name).next().unwrap_or("")
    }
}

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name(), value.to_owned()));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Printer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        match f.get("message") {
            "toma: attempt" if !f.get("size").is_empty() => {
                let size: usize = f.get("size").parse().unwrap_or(0);
                println!("   [toma] attempt: batch size {size:>5} ({:>5.2} GiB)", size as f64 / 1024.0);
            }
            "toma: attempt" => {
                let (start, end) = (f.get("start"), f.get("end"));
                let rows = end.parse::<usize>().unwrap_or(0).saturating_sub(start.parse().unwrap_or(0));
                println!("   [toma] attempt: rows [{start}, {end}) = {rows} rows");
            }
            "toma: out of memory, retrying with a smaller size" => {
                OOMS.fetch_add(1, Ordering::Relaxed);
                println!(
                    "   [toma]   out of memory at {} (caught a tch {}), retrying at {}",
                    f.get("from"),
                    f.get("caught"),
                    f.get("to")
                );
                let text = f.get("error");
                if !libtorch_line(text).is_empty() {
                    println!("   [toma]     {}", libtorch_line(text));
                }
            }
            "toma::lazy: plan" => {
                let gib = |k: &str| f.get(k).parse::<f64>().unwrap_or(0.0) / (1u64 << 30) as f64;
                println!(
                    "   [toma::lazy] plan: {} samples in {} micro-batch(es) of {}; peak {:.2} GiB, budget {:.2} GiB",
                    f.get("batch"),
                    f.get("chunks"),
                    f.get("micro_batch"),
                    gib("peak"),
                    gib("budget")
                );
            }
            "toma::lazy: micro-batch" => {
                println!("   [toma::lazy] micro-batch: samples [{}, {})", f.get("start"), f.get("end"));
            }
            "toma: starting from the cache" => {
                println!("   [toma] cache: starting at the remembered size {}", f.get("size"));
            }
            message => {
                let rest: Vec<String> = f.0.iter().skip(1).map(|(k, v)| format!("{k}={v}")).collect();
                let meta = event.metadata();
                println!("   [{} {}] {message} {}", meta.target(), meta.level(), rest.join(" "));
            }
        }
    }
}

/// The part of an out-of-memory text worth one line: from libtorch's allocator message (or the
/// start) to the end of its first line, whether the line ends in a newline or, inside a tch
/// panic's `Debug` text, in an escaped `\n`.
fn libtorch_line(text: &str) -> &str {
    let from = text.find("DefaultCPUAllocator").unwrap_or(0);
    let line = &text[from..];
    let end = [line.find('\n'), line.find("\\n")].into_iter().flatten().min().unwrap_or(line.len());
    line[..end].trim()
}

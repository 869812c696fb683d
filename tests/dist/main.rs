//! Ranks in real processes on 127.0.0.1, agreeing through c10d's TCPStore (feature `dist`).
//!
//! Each test launches this binary again once per rank (its ignored test `rank_process`, with
//! `TOMA_DIST_SCENARIO` saying what to do), under the variables torchrun sets, or under real
//! `torchrun` itself. Ranks print `RESULT ...` lines; the test compares them across ranks.

#[path = "../support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use toma::dist::{Config, DistError, Group, GroupError, Reduce};
use toma::{Batch, CacheKind, Range};

// ---------------------------------------------------------------------------------------------
// The rank side.

/// One rank of a job (run by the tests below as a child process; does nothing alone).
#[test]
#[ignore = "a rank of the multi-process tests: they run it as a child process"]
fn rank_process() {
    let Ok(scenario) = std::env::var("TOMA_DIST_SCENARIO") else {
        eprintln!("rank_process: TOMA_DIST_SCENARIO is not set; the multi-rank tests run this");
        return;
    };
    let group = Group::from_env().expect("join the group");
    let rank = group.rank();
    match scenario.as_str() {
        "sizes" => sizes(&group),
        "fatal" => {
            let out = Batch::new(8).cache(CacheKind::None).group(&group).run(|size| {
                if rank == 1 {
                    Err(format!("disk on fire at {size}"))
                } else {
                    Ok(size)
                }
            });
            println!("RESULT {}", outcome(out));
        }
        "oom_at_one" => {
            let out = Batch::new(4).cache(CacheKind::None).group(&group).run(|size| {
                if rank == 0 {
                    Err(format!("CUDA out of memory at {size}"))
                } else {
                    Ok(size)
                }
            });
            println!("RESULT {}", outcome(out));
        }
        "killed" => {
            let victim: usize = std::env::var("VICTIM").unwrap().parse().unwrap();
            let started = Instant::now();
            let out = Range::new(0, 1000, 64).cache(CacheKind::None).group(&group).run(|start, _| {
                if rank == victim && start >= 128 {
                    // Dies mid-call, as a rank killed by the OOM killer or a fault would.
                    std::process::exit(9);
                }
                Ok::<(), String>(())
            });
            println!("RESULT {} after={:.1}", outcome(out), started.elapsed().as_secs_f64());
        }
        "grads" => {
            let world = group.world_size() as f64;
            let a = Tensor::ones([3, 5], (Kind::Float, Device::Cpu)) * (rank as f64 + 1.0);
            let b = Tensor::arange(7, (Kind::Double, Device::Cpu)) * (rank as f64);
            group.all_reduce_sum(&[&a, &b]).expect("all-reduce");
            let want_a = world * (world + 1.0) / 2.0;
            let want_b = world * (world - 1.0) / 2.0;
            let ok_a = (a - want_a).abs().max().double_value(&[]) == 0.0;
            let ok_b =
                (b - Tensor::arange(7, (Kind::Double, Device::Cpu)) * want_b).abs().max().double_value(&[]) == 0.0;
            println!("RESULT sums_ok={}", ok_a && ok_b);
        }
        "grads_cuda" => {
            // Every rank on the one card: Gloo stages CUDA tensors through the host.
            let world = group.world_size() as f64;
            let cuda = Device::Cuda(0);
            let a = Tensor::ones([1 << 20], (Kind::Float, cuda)) * (rank as f64 + 1.0);
            let b = Tensor::arange(7, (Kind::Double, cuda)) * (rank as f64);
            let outcome = group.all_reduce_sum(&[&a, &b]);
            let want_a = world * (world + 1.0) / 2.0;
            let want_b = world * (world - 1.0) / 2.0;
            let ok = outcome.is_ok()
                && a.device() == cuda
                && (a - want_a).abs().max().double_value(&[]) == 0.0
                && (b - Tensor::arange(7, (Kind::Double, cuda)) * want_b).abs().max().double_value(&[]) == 0.0;
            let error =
                outcome.err().map_or(String::new(), |e| e.to_string().lines().next().unwrap_or("").replace(' ', "_"));
            println!("RESULT sums_ok={ok} error={error:?}");
        }
        "store" => {
            // The store-level protocol, also spoken by tests/dist/py_rank.py.
            let max = group.all_reduce("probe", Reduce::Max, &[rank as i64 * 10, -(rank as i64)]).unwrap();
            let sum = group.all_reduce("probe", Reduce::Sum, &[rank as i64 + 1]).unwrap();
            group.barrier("end").unwrap();
            println!("RESULT max={},{} sum={}", max[0], max[1], sum[0]);
        }
        "real" => real_out_of_memory(&group),
        "lazy" => lazy_step(&group, false),
        "lazy_recompute" => lazy_step(&group, true),
        other => panic!("unknown scenario {other}"),
    }
}

/// `ok=..`, `local=..`, `peer=<rank>` or `dist=..` words for a grouped call's result.
fn outcome<T: std::fmt::Debug>(out: Result<T, GroupError<String>>) -> String {
    match out {
        Ok(value) => format!("ok={value:?}"),
        Err(GroupError::Local(e)) => format!("local={:?}", e.replace(' ', "_")),
        Err(GroupError::Peer { rank, message, out_of_memory }) => {
            format!("peer={rank} oom={out_of_memory} message={:?}", message.replace(' ', "_"))
        }
        Err(GroupError::Dist(DistError::Timeout { missing, .. })) => format!("dist=timeout missing={missing:?}"),
        Err(GroupError::Dist(e)) => format!("dist=other error={:?}", e.to_string().replace(' ', "_")),
        Err(e) => format!("other={e}"),
    }
}

/// Every rank runs out of memory above its own size: a batch call and a range call.
fn sizes(group: &Group) {
    let rank = group.rank();
    let batch_limit = [100, 40, 60, 20, 90][rank % 5];
    let (out, report) = Batch::new(256).cache(CacheKind::None).group(group).run_with_report(|size| {
        if size > batch_limit {
            Err(format!("CUDA out of memory. Tried to allocate {size} MiB"))
        } else {
            Ok(size)
        }
    });
    let history: Vec<String> =
        report.history.iter().map(|a| format!("{}{}", a.size, if a.out_of_memory { "x" } else { "" })).collect();
    println!("RESULT batch={} history={}", out.unwrap(), history.join(","));

    // Ranges of different lengths; each rank fails above its own length.
    let len = 100 + 37 * rank;
    let range_limit = [50, 20, 70, 30, 11][rank % 5];
    let mut covered = vec![0u32; len];
    let mut steps = Vec::new();
    let (out, report) = Range::new(0, len, 64).cache(CacheKind::None).group(group).run_with_report(|start, end| {
        steps.push(end - start);
        if end - start > range_limit {
            return Err(format!("CUDA out of memory at {start}..{end}"));
        }
        for c in &mut covered[start..end] {
            *c += 1;
        }
        Ok(())
    });
    out.unwrap();
    assert!(covered.iter().all(|&c| c == 1), "every index exactly once: {covered:?}");
    println!("RESULT range_final={} attempts={}", report.final_size, report.attempts);
}

/// Real allocator failures under a CPU cap that differs per rank.
fn real_out_of_memory(group: &Group) {
    let rank = group.rank();
    // 16 MiB per item; rank 0 has room for about 40 items, rank 1 for about 20.
    let headroom = [0.7, 0.4, 0.55, 0.3][rank % 4];
    support::cap_memory(toma::cpu_memory::CpuCap::AddressSpace, headroom);
    let (out, report) = Batch::new(256).cache(CacheKind::None).group(group).run_with_report(|size| {
        let t = Tensor::f_zeros([size as i64, 4 << 20], (Kind::Float, Device::Cpu))?;
        t.f_sum(Kind::Double)?.f_double_value(&[])?;
        Ok::<usize, tch::TchError>(size)
    });
    let history: Vec<String> =
        report.history.iter().map(|a| format!("{}{}", a.size, if a.out_of_memory { "x" } else { "" })).collect();
    println!("RESULT batch={} history={}", out.map_err(|e| e.to_string()).unwrap(), history.join(","));
}

/// A lazy training step split differently on every rank matches one full-batch backward; with
/// `recompute`, every rank recomputes activations under a budget below its whole batch (and
/// splits too where recomputing alone does not fit).
fn lazy_step(group: &Group, recompute: bool) {
    use tch::nn::{self, Module};
    use toma::lazy::{lazy, LazyTensor, Mode, Options, Recompute};
    let (rank, world) = (group.rank(), group.world_size());
    tch::manual_seed(7);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "l1", 8, 16, Default::default());
    let l2 = nn::linear(vs.root() / "l2", 16, 4, Default::default());
    let hidden: Vec<nn::Linear> = (0..if recompute { 4 } else { 0 })
        .map(|k| nn::linear(vs.root() / format!("h{k}"), 16, 16, Default::default()))
        .collect();
    vs.double();
    tch::manual_seed(11);
    // Recomputing pays where activations outweigh the parameters: a larger batch.
    let scale: i64 = if recompute { 40 } else { 1 };
    let n = 10 * scale * world as i64 + 7;
    let x = Tensor::randn([n, 8], (Kind::Double, Device::Cpu));
    let y = Tensor::randint(4, [n], (Kind::Int64, Device::Cpu));
    let target = Tensor::randn([n, 4], (Kind::Double, Device::Cpu));
    let zero = |vs: &nn::VarStore| vs.trainable_variables().into_iter().for_each(|mut v| v.zero_grad());
    let grads =
        |vs: &nn::VarStore| -> Vec<Tensor> { vs.trainable_variables().iter().map(|v| v.grad().copy()).collect() };

    // The reference: one eager backward over everyone's samples.
    zero(&vs);
    let eager = |x: &Tensor, y: &Tensor, t: &Tensor| {
        let h = hidden.iter().fold(l1.forward(x).tanh(), |h, l| l.forward(&h).tanh());
        let out = l2.forward(&h);
        out.log_softmax(-1, None).nll_loss(y)
            + out.mse_loss(t, tch::Reduction::Sum) * 0.1
            + l1.ws.square().sum(Kind::Double) * 0.01
            + 1.5
    };
    let full = eager(&x, &y, &target);
    let full_value = full.double_value(&[]);
    full.backward();
    let want = grads(&vs);

    // This rank's uneven slice, in micro-batches of its own size.
    zero(&vs);
    let bounds: Vec<i64> =
        (0..=world as i64).map(|r| if r == world as i64 { n } else { r * 10 * scale - r.min(1) * 3 }).collect();
    let (start, end) = (bounds[rank], bounds[rank + 1]);
    let part = |t: &Tensor| t.narrow(0, start, end - start);
    let (lx, ly, lt) = lazy((&part(&x), &part(&y), &part(&target)), 0);
    let h = hidden.iter().fold(lx.apply(&l1).tanh(), |h, l| h.apply(l).tanh());
    let out = h.apply(&l2);
    let penalty = LazyTensor::fixed(&l1.ws).pow_tensor_scalar(2.0).sum(Kind::Double) * 0.01;
    let loss = out.cross_entropy_for_logits(&ly) + out.mse_loss(&lt, tch::Reduction::Sum) * 0.1 + penalty + 1.5;
    let options = if recompute {
        let whole = loss
            .plan(Mode::Backward, &Options::new().recompute(Recompute::Never).budget(u64::MAX / 4))
            .expect("a plan")
            .full_batch_peak_bytes();
        let options = Options::new().budget(whole * 6 / 10).recompute(Recompute::Always);
        let plan = loss.plan(Mode::Backward, &options).expect("a recomputing plan");
        println!("RESULT recomputes={}", plan.recomputes());
        options.group(group)
    } else {
        Options::new().micro_batch(2 + rank).group(group)
    };
    let value = loss.backward_with(&options).expect("grouped backward");
    let got = grads(&vs);
    let worst = want
        .iter()
        .zip(&got)
        .map(|(w, g)| (g - w).abs().max().double_value(&[]) / w.abs().max().double_value(&[]).max(1e-7))
        .fold(0.0f64, f64::max);
    let loss_error = (value - full_value).abs() / full_value.abs();
    println!("RESULT samples={} grad_error={worst:e} loss_error={loss_error:e}", end - start);
}

// ---------------------------------------------------------------------------------------------
// The launcher side.

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn rank_command(scenario: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["rank_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("TOMA_DIST_SCENARIO", scenario)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Starts `world` ranks of `scenario`, rank 0 hosting the store.
fn spawn(scenario: &str, world: usize, timeout_s: f64, env: &[(&str, String)]) -> Vec<Child> {
    let port = free_port();
    (0..world)
        .map(|rank| {
            let mut cmd = rank_command(scenario);
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("TOMA_DIST_TIMEOUT", timeout_s.to_string())
                // Starting a process that loads libtorch can take seconds on a busy machine.
                .env("TOMA_DIST_JOIN_TIMEOUT", "120");
            for (k, v) in env {
                cmd.env(k, v);
            }
            cmd.spawn().expect("spawn a rank")
        })
        .collect()
}

fn text(output: &Output) -> String {
    format!(
        "exit {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The `RESULT` lines of one rank, as `key=value` maps (fails when there are none).
fn results(output: &Output) -> Vec<BTreeMap<String, String>> {
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<_> = stdout
        .lines()
        .filter_map(|l| l.split_once("RESULT ").map(|(_, rest)| rest))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect();
    assert!(!lines.is_empty(), "a rank printed no RESULT\n{}", text(output));
    lines
}

fn wait_all(children: Vec<Child>) -> Vec<Output> {
    children.into_iter().map(|c| c.wait_with_output().expect("wait for a rank")).collect()
}

fn run_ok(scenario: &str, world: usize) -> Vec<Vec<BTreeMap<String, String>>> {
    let outputs = wait_all(spawn(scenario, world, 60.0, &[]));
    outputs
        .iter()
        .map(|o| {
            assert!(o.status.success(), "{}", text(o));
            results(o)
        })
        .collect()
}

/// Every rank fails at a different size; all end at the same size with the same attempts.
fn check_sizes(ranks: &[Vec<BTreeMap<String, String>>]) {
    let world = ranks.len();
    let batch_limit = [100, 40, 60, 20, 90][..world.min(5)].iter().min().copied().unwrap();
    let want = (0..=8).map(|k| 256 >> k).find(|&s| s <= batch_limit).unwrap();
    for r in ranks {
        assert_eq!(r[0]["batch"], want.to_string(), "{ranks:?}");
        assert_eq!(r[0]["history"], ranks[0][0]["history"], "identical attempt sequences: {ranks:?}");
        assert_eq!(r[1]["range_final"], ranks[0][1]["range_final"], "the same step at the end: {ranks:?}");
    }
    let range_limit = [50, 20, 70, 30, 11][..world.min(5)].iter().min().copied().unwrap();
    let step = (0..=6).map(|k| 64 >> k).find(|&s| s <= range_limit).unwrap();
    assert_eq!(ranks[0][1]["range_final"], step.to_string(), "{ranks:?}");
}

#[test]
fn two_ranks_agree_on_sizes() {
    check_sizes(&run_ok("sizes", 2));
}

#[test]
fn four_ranks_agree_on_sizes() {
    check_sizes(&run_ok("sizes", 4));
}

#[test]
fn a_rank_that_fails_for_good_fails_every_rank() {
    let ranks = run_ok("fatal", 3);
    assert_eq!(ranks[1][0]["local"], "\"disk_on_fire_at_8\"", "{ranks:?}");
    for r in [0, 2] {
        assert_eq!(ranks[r][0]["peer"], "1", "{ranks:?}");
        assert_eq!(ranks[r][0]["oom"], "false", "{ranks:?}");
        assert!(ranks[r][0]["message"].contains("disk_on_fire"), "{ranks:?}");
    }
    // Out of memory at size 1 on one rank: after 4, 2, 1 on every rank.
    let ranks = run_ok("oom_at_one", 2);
    assert!(ranks[0][0]["local"].contains("out_of_memory_at_1"), "{ranks:?}");
    assert_eq!(ranks[1][0]["peer"], "0", "{ranks:?}");
    assert_eq!(ranks[1][0]["oom"], "true", "{ranks:?}");
}

#[test]
fn a_killed_rank_makes_the_others_fail_within_the_timeout() {
    const TIMEOUT_S: f64 = 4.0;
    for (world, victim) in [(3, 2), (2, 0)] {
        let started = Instant::now();
        let outputs = wait_all(spawn("killed", world, TIMEOUT_S, &[("VICTIM", victim.to_string())]));
        let elapsed = started.elapsed();
        assert!(elapsed < Duration::from_secs_f64(TIMEOUT_S + 10.0), "took {elapsed:?}");
        for (rank, output) in outputs.iter().enumerate() {
            if rank == victim {
                assert_eq!(output.status.code(), Some(9), "{}", text(output));
                continue;
            }
            assert!(output.status.success(), "{}", text(output));
            let r = &results(output)[0];
            let dist = r.get("dist").map(String::as_str);
            assert!(dist.is_some(), "a survivor returns a dist error: {r:?}\n{}", text(output));
            if victim != 0 {
                // The store is up: it says who is missing.
                assert_eq!(r["dist"], "timeout", "{r:?}");
                assert_eq!(r["missing"], format!("[{victim}]"), "{r:?}");
            }
            let after: f64 = r["after"].parse().unwrap();
            assert!(after < TIMEOUT_S + 10.0, "{r:?}");
            assert!(
                !String::from_utf8_lossy(&output.stderr).contains("Exception raised from"),
                "no C++ stack trace:\n{}",
                text(output)
            );
        }
    }
}

#[test]
fn gloo_sums_gradients_across_ranks() {
    for r in run_ok("grads", 3) {
        assert_eq!(r[0]["sums_ok"], "true");
    }
}

/// CUDA tensors summed over Gloo, two ranks on one card (opt-in: `TOMA_CUDA_TESTS=1` on a CUDA
/// machine; `scripts/gpu-run.sh` runs it).
#[test]
fn gloo_sums_cuda_tensors_of_two_ranks_on_one_card() {
    if std::env::var("TOMA_CUDA_TESTS").as_deref() != Ok("1") {
        println!("gloo_sums_cuda_tensors_of_two_ranks_on_one_card: skipped: set TOMA_CUDA_TESTS=1 on a CUDA machine");
        return;
    }
    let started = Instant::now();
    let ranks = run_ok("grads_cuda", 2);
    let sums: Vec<&str> = ranks.iter().map(|r| r[0]["sums_ok"].as_str()).collect();
    println!(
        "GPU-RESULT dist_gloo_cuda ranks=2 sums_ok={} secs={:.1}",
        sums.join(","),
        started.elapsed().as_secs_f64()
    );
    for r in ranks {
        assert_eq!(r[0]["sums_ok"], "true", "{r:?}");
    }
}

#[test]
fn a_lazy_step_split_per_rank_matches_the_full_batch_gradient() {
    for world in [2, 3] {
        let ranks = run_ok("lazy", world);
        let mut samples = Vec::new();
        for r in &ranks {
            let grad: f64 = r[0]["grad_error"].parse().unwrap();
            let loss: f64 = r[0]["loss_error"].parse().unwrap();
            assert!(grad <= 1e-5 && loss <= 1e-10, "{ranks:?}");
            samples.push(r[0]["samples"].clone());
        }
        samples.dedup();
        assert!(samples.len() > 1, "the ranks held different batch sizes: {ranks:?}");
    }
}

#[test]
fn a_lazy_step_recomputed_per_rank_matches_the_full_batch_gradient() {
    let ranks = run_ok("lazy_recompute", 2);
    for r in &ranks {
        let grad: f64 = r[1]["grad_error"].parse().unwrap();
        let loss: f64 = r[1]["loss_error"].parse().unwrap();
        assert_eq!(r[0]["recomputes"], "true", "{ranks:?}");
        assert!(grad <= 1e-9 && loss <= 1e-10, "{ranks:?}");
    }
}

#[test]
fn ranks_agree_under_real_out_of_memory() {
    let ranks = run_ok("real", 2);
    assert_eq!(ranks[0][0]["history"], ranks[1][0]["history"], "{ranks:?}");
    assert_eq!(ranks[0][0]["batch"], ranks[1][0]["batch"], "{ranks:?}");
    assert!(ranks[0][0]["history"].contains('x'), "real out-of-memories happened: {ranks:?}");
}

#[test]
fn a_python_rank_speaks_the_store_protocol() {
    let port = free_port();
    let world = 3;
    let mut children: Vec<Child> = (0..2)
        .map(|rank| {
            let mut cmd = rank_command("store");
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("TOMA_DIST_TIMEOUT", "60");
            cmd.spawn().unwrap()
        })
        .collect();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/dist/py_rank.py");
    children.push(
        Command::new("python3")
            .arg(script)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", "2")
            .env("WORLD_SIZE", world.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 from the venv (scripts/env.sh puts it on PATH)"),
    );
    let outputs = wait_all(children);
    for output in &outputs {
        assert!(output.status.success(), "{}", text(output));
        let r = &results(output)[0];
        assert_eq!(r["max"], "20,0", "{r:?}");
        assert_eq!(r["sum"], "6", "{r:?}");
    }
}

#[test]
fn ranks_agree_under_torchrun() {
    let port = free_port();
    let exe = std::env::current_exe().unwrap();
    let output = Command::new("torchrun")
        .args(["--nnodes=1", "--nproc-per-node=2", "--no-python", "--master-addr=127.0.0.1"])
        .arg(format!("--master-port={port}"))
        .arg(exe)
        .args(["rank_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("TOMA_DIST_SCENARIO", "sizes")
        .env("TOMA_DIST_TIMEOUT", "60")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("torchrun from the venv (scripts/env.sh puts it on PATH)");
    assert!(output.status.success(), "{}", text(&output));
    // torchrun's agent hosts the store: every rank is a client.
    let all = results(&output);
    assert_eq!(all.len(), 4, "two lines per rank: {all:?}");
    let ranks: Vec<Vec<BTreeMap<String, String>>> = vec![
        all.iter().filter(|m| m.contains_key("batch")).cloned().collect(),
        all.iter().filter(|m| m.contains_key("range_final")).cloned().collect(),
    ];
    // Regroup per rank: [batch line, range line] each.
    let per_rank: Vec<Vec<BTreeMap<String, String>>> =
        (0..2).map(|i| vec![ranks[0][i].clone(), ranks[1][i].clone()]).collect();
    check_sizes(&per_rank);
}

#[test]
fn a_missing_rank_at_connect_is_a_timeout_naming_it() {
    let port = free_port();
    let started = Instant::now();
    let err = Config::new("127.0.0.1", port, 0, 2).timeout(Duration::from_secs(2)).connect().unwrap_err();
    match &err {
        DistError::Timeout { missing, .. } => assert_eq!(missing, &[1], "{err}"),
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(err.to_string().contains("rank(s) [1]"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(12));
}

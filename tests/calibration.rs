//! Calibration as a step meets it in a fresh process: held to the step's budget, unreached by
//! other threads' work, refusing plans it has not measured, and trusting no rule off the
//! machine the rules were read on. Each scenario runs in a child process of its own (this
//! binary again): a process's first step is what is tested, and CPU counting, once on, stays on.
#![cfg(feature = "tch")]

mod support;

use support::child;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, Calibrate, LazyError, LazyTensor, Mode, Options};
use toma::memory;

const CPU: Device = Device::Cpu;

/// The CNN of the report: conv 3→32 3×3, conv 32→64 3×3 stride 2, adaptive pool, linear 64→10,
/// on 3×32×32 inputs.
struct Cnn {
    c1: nn::Conv2D,
    c2: nn::Conv2D,
    fc: nn::Linear,
}

impl Cnn {
    fn new(vs: &nn::VarStore, width: i64) -> Cnn {
        let r = vs.root();
        let same = nn::ConvConfig { padding: 1, ..Default::default() };
        Cnn {
            c1: nn::conv2d(&r / "c1", 3, width, 3, same),
            c2: nn::conv2d(&r / "c2", width, 2 * width, 3, nn::ConvConfig { stride: 2, ..same }),
            fc: nn::linear(&r / "fc", 2 * width, 10, Default::default()),
        }
    }

    fn lazy(&self, x: &Tensor, y: &Tensor) -> LazyTensor {
        let (x, y) = lazy((x, y), 0);
        let h = x.apply(&self.c1).relu().apply(&self.c2).relu().adaptive_avg_pool2d([1, 1]);
        h.flatten(1, -1).apply(&self.fc).cross_entropy_for_logits(&y)
    }

    fn eager(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let h = self.c2.forward(&self.c1.forward(x).relu()).relu().adaptive_avg_pool2d([1, 1]);
        self.fc.forward(&h.flatten(1, -1)).cross_entropy_for_logits(y)
    }
}

fn inputs(n: i64, kind: Kind) -> (Tensor, Tensor) {
    (Tensor::randn([n, 3, 32, 32], (kind, CPU)), Tensor::randint(10, [n], (Kind::Int64, CPU)))
}

/// The counter's peak above what was in use when `run` started.
fn peak_of(run: impl FnOnce()) -> u64 {
    let before = memory::cpu_allocator_stats().expect("tracking").allocated;
    assert!(memory::reset_cpu_peak());
    run();
    memory::cpu_allocator_stats().expect("tracking").peak_allocated.saturating_sub(before)
}

/// The first step of a process holds its budget, calibration included: the CNN in f64 with
/// SGD (Nesterov momentum), budget 0.6× the eager step's peak, three steps. Calibration once
/// measured its convolutions at the whole batch and took 1.84× the budget on step 1.
#[test]
fn the_first_step_holds_its_budget_calibration_included() {
    const CHILD: &str = "TOMA_FIRST_STEP_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out = child::run("the_first_step_holds_its_budget_calibration_included", CHILD, "1");
        let done = out.assert_finished("first-step ");
        println!("{}", out.stdout);
        let ratios: Vec<f64> = ["step1", "step2", "step3"].iter().map(|k| done[*k].parse().unwrap()).collect();
        for (k, r) in ratios.iter().enumerate() {
            assert!(*r <= 1.05, "step {} peaked at {r:.3}× its budget\n{}", k + 1, out.report);
        }
        return;
    }
    tch::manual_seed(0);
    assert!(memory::track_cpu_allocations());
    let (x, y) = inputs(64, Kind::Double);
    // The eager step's peak, on a model of its own (toma's measurements stay untouched).
    let eager = {
        let mut vs = nn::VarStore::new(CPU);
        let m = Cnn::new(&vs, 32);
        vs.double();
        let mut opt =
            nn::OptimizerConfig::build(nn::Sgd { momentum: 0.9, nesterov: true, ..Default::default() }, &vs, 0.01)
                .unwrap();
        peak_of(|| opt.backward_step(&m.eager(&x, &y)))
    };
    let budget = (eager as f64 * 0.6) as u64;
    let mut vs = nn::VarStore::new(CPU);
    let m = Cnn::new(&vs, 32);
    vs.double();
    let mut opt = toma::lazy::nn::OptimizerConfig::build(
        nn::Sgd { momentum: 0.9, nesterov: true, ..Default::default() },
        &vs,
        0.01,
    )
    .unwrap();
    let options = Options::new().budget(budget);
    let mut ratios = Vec::new();
    for step in 1..=3 {
        opt.zero_grad();
        let loss = m.lazy(&x, &y);
        let peak = peak_of(|| {
            opt.f_backward_step_with(&loss, &options).expect("a step within the budget");
        });
        let loss = f64::try_from(&loss).unwrap();
        println!(
            "step {step}: peak {peak} B, budget {budget} B ({:.3}×), eager {eager} B, loss {loss:.4}",
            peak as f64 / budget as f64
        );
        ratios.push(peak as f64 / budget as f64);
    }
    println!(
        "\nfirst-step step1={:.4} step2={:.4} step3={:.4} budget={budget} eager={eager}",
        ratios[0], ratios[1], ratios[2]
    );
}

/// Two threads that calibrate different models at once plan as each does alone: each measures
/// on its own count. Both runs are fresh processes, so each measures anew; every plan of the
/// threads' run is within 1% of the same plan made alone.
#[test]
fn two_threads_calibrating_at_once_plan_as_alone() {
    const CHILD: &str = "TOMA_TWO_THREADS_CHILD";
    if let Ok(how) = std::env::var(CHILD) {
        assert!(memory::track_cpu_allocations());
        // A model per thread; each round another width, so that every round measures anew.
        let rounds = |first: bool| {
            let mut peaks = Vec::new();
            for round in 0..6i64 {
                tch::manual_seed(round);
                let vs = nn::VarStore::new(CPU);
                let width = if first { 8 + round } else { 16 + 2 * round };
                let m = Cnn::new(&vs, width);
                let (x, y) = inputs(if first { 32 } else { 24 }, Kind::Float);
                let loss = m.lazy(&x, &y);
                let options = Options::new().micro_batch(8).calibrate(Calibrate::Always);
                loss.calibrate(Mode::Backward, &options).unwrap();
                peaks.push(loss.plan(Mode::Backward, &options).unwrap().peak_bytes());
            }
            peaks
        };
        let (a, b) = if how == "alone" {
            (rounds(true), rounds(false))
        } else {
            let first = std::thread::spawn(move || rounds(true));
            let second = std::thread::spawn(move || rounds(false));
            (first.join().unwrap(), second.join().unwrap())
        };
        let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        println!("\nthreads-done a={} b={}", list(&a), list(&b));
        return;
    }
    let parse = |s: &str| s.split(',').map(|v| v.parse::<u64>().unwrap()).collect::<Vec<_>>();
    let alone =
        child::run("two_threads_calibrating_at_once_plan_as_alone", CHILD, "alone").assert_finished("threads-done ");
    let together =
        child::run("two_threads_calibrating_at_once_plan_as_alone", CHILD, "together").assert_finished("threads-done ");
    let mut bad = Vec::new();
    for model in ["a", "b"] {
        for (round, (alone, together)) in parse(&alone[model]).into_iter().zip(parse(&together[model])).enumerate() {
            let error = (together as f64 - alone as f64) / alone as f64;
            println!(
                "model {model} round {round}: alone {alone} B, two threads at once {together} B ({:+.2}%)",
                100.0 * error
            );
            if error.abs() > 0.01 {
                bad.push(format!("model {model} round {round}: {together} against {alone}"));
            }
        }
    }
    assert!(bad.is_empty(), "plans made while another thread calibrated differ:\n{}", bad.join("\n"));
}

/// A plan asked before measuring refuses where an allocator could measure and the machine's
/// rules are not trusted (a char-RNN's LSTM, whose rules were once 3.6× under; `Half`
/// products), naming the op and what to do; once calibrated, it plans within the safety margin
/// of the step it predicts.
#[test]
fn a_plan_before_measuring_is_refused_or_holds() {
    const CHILD: &str = "TOMA_PLAN_BEFORE_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out = child::run("a_plan_before_measuring_is_refused_or_holds", CHILD, "1");
        out.assert_finished("plan-before-done");
        println!("{}", out.stdout);
        return;
    }
    assert!(memory::track_cpu_allocations());
    let vs = nn::VarStore::new(CPU);
    let lstm = toma::lazy::nn::lstm(vs.root() / "lstm", 32, 64, Default::default());
    let head = nn::linear(vs.root() / "head", 64, 32, Default::default());
    let x = Tensor::randn([16, 24, 32], (Kind::Float, CPU));
    let y = Tensor::randint(32, [16, 24], (Kind::Int64, CPU));
    let char_rnn = || {
        use toma::lazy::nn::RNN;
        let (lx, ly) = lazy((&x, &y), 0);
        let (out, _) = lstm.seq(&lx);
        out.apply(&head).view([-1, 32]).cross_entropy_for_logits(&ly.view([-1]))
    };
    let mut half = nn::VarStore::new(CPU);
    let mlp = (
        nn::linear(half.root() / "a", 256, 1024, Default::default()),
        nn::linear(half.root() / "b", 1024, 256, Default::default()),
    );
    half.half();
    let xh = Tensor::randn([64, 256], (Kind::Half, CPU));
    let half_mlp = || lazy(&xh, 0).apply(&mlp.0).gelu("none").apply(&mlp.1).sum(None::<Kind>);
    type Make<'a> = Box<dyn Fn() -> LazyTensor + 'a>;
    let models: Vec<(&str, Make)> = vec![("char-rnn", Box::new(char_rnn)), ("half mlp", Box::new(half_mlp))];
    for (name, make) in &models {
        for micro in [16usize, 4] {
            let options = Options::new().micro_batch(micro);
            let loss = make();
            match loss.plan(Mode::Backward, &options) {
                Err(LazyError::NotCalibrated { calls, op }) => {
                    println!("{name} micro {micro}: refused before measuring: {calls} call(s), first `{op}`");
                }
                Ok(plan) => {
                    // Only where every call has a trusted rule.
                    assert_eq!(plan.calibration().awaiting, 0, "{name}: {plan}");
                    println!("{name} micro {micro}: planned by trusted rules or earlier measurements");
                }
                Err(other) => panic!("{name}: {other}"),
            }
            loss.calibrate(Mode::Backward, &options).unwrap();
            let plan = loss.plan(Mode::Backward, &options).unwrap();
            let measured = peak_of(|| {
                loss.backward_with(&options).unwrap();
            });
            let error = (plan.peak_bytes() as f64 - measured as f64) / measured as f64;
            println!(
                "{name} micro {micro}: planned {} B, measured {measured} B ({:+.1}%)",
                plan.peak_bytes(),
                100.0 * error
            );
            assert!(error >= -0.10, "{name} micro {micro}: planned {} under {measured}\n{plan}", plan.peak_bytes());
        }
    }
    println!("\nplan-before-done");
}

/// With rules off (`toma::lazy::trust_rules(false)`, or `TOMA_TRUST_RULES=0`), every kernel
/// call a rule would price is measured, on any machine, the rules' own included; back on, the
/// machine's key decides again.
#[test]
fn rules_off_measures_every_priced_call() {
    const CHILD: &str = "TOMA_RULES_OFF_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let out =
            child::run_with("rules_off_measures_every_priced_call", &[(CHILD, Some("1")), ("TOMA_TRUST_RULES", None)]);
        out.assert_finished("rules-off-done");
        return;
    }
    assert!(memory::track_cpu_allocations());
    assert!(toma::lazy::rules_trusted(), "on unless asked");
    let vs = nn::VarStore::new(CPU);
    let m = Cnn::new(&vs, 8);
    let (x, y) = inputs(16, Kind::Float);
    let loss = m.lazy(&x, &y);
    let on = loss.calibrate(Mode::Backward, &Options::new()).unwrap();
    assert!(toma::lazy::trust_rules(false));
    let loss = m.lazy(&x, &y);
    let off = loss.calibrate(Mode::Backward, &Options::new()).unwrap();
    toma::lazy::trust_rules(true);
    // Two convolutions and a linear layer have rules; off, all three are measured.
    assert_eq!(off.by_rules, 0, "{off:?}");
    assert!(off.measured + off.remembered >= 3, "{off:?}");
    assert!(off.measured + off.remembered >= on.measured + on.remembered, "{on:?} {off:?}");
    println!("\nrules-off-done on={on:?} off={off:?}");
}

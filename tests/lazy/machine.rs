//! The machine toma prices plans for is the one the libraries use: oneDNN's instruction set as
//! oneDNN itself reports it (`ONEDNN_VERBOSE=1`), with and without `ONEDNN_MAX_CPU_ISA`, so
//! that a cap (how developers run as an AVX2 machine on an AVX-512 one) moves toma's model with
//! oneDNN's kernels.

use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, Calibrate, CpuIsa, CpuMachine, Mode, Options};

use crate::support::child;

/// What oneDNN's verbose `isa:` line says of an instruction set, and whether `isa` is it: the
/// family (SSE4.1, AVX, AVX2, AVX-512) and the extensions it names (DL Boost, bfloat16, AMX).
fn agrees(onednn: &str, isa: CpuIsa) -> bool {
    let family = if onednn.contains("AVX-512") || onednn.contains("AVX10") {
        isa >= CpuIsa::Avx512Core
    } else if onednn.contains("AVX2") {
        (CpuIsa::Avx2..=CpuIsa::Avx2Vnni2).contains(&isa)
    } else if onednn.contains("AVX") {
        isa == CpuIsa::Avx
    } else if onednn.contains("SSE4.1") {
        isa == CpuIsa::Sse41
    } else {
        isa == CpuIsa::Generic
    };
    let vnni = matches!(isa, CpuIsa::Avx2Vnni | CpuIsa::Avx2Vnni2) || isa >= CpuIsa::Avx512CoreVnni;
    let amx = isa >= CpuIsa::Avx512CoreAmx;
    family && onednn.contains("DL Boost") == vnni && onednn.contains("AMX") == amx
}

/// Run by [`toma_reads_the_instruction_set_onednn_uses`] in a child: a convolution makes oneDNN
/// print its `isa:` line; toma prints what it reads.
#[test]
#[ignore = "a child of toma_reads_the_instruction_set_onednn_uses"]
fn print_the_machine() {
    let x = Tensor::ones([2, 3, 8, 8], (Kind::Float, Device::Cpu));
    let w = Tensor::ones([4, 3, 3, 3], (Kind::Float, Device::Cpu));
    let _ = x.conv2d(&w, None::<&Tensor>, [1, 1], [1, 1], [1, 1], 1);
    println!("toma-machine isa={}", CpuMachine::host().isa);
}

#[test]
fn toma_reads_the_instruction_set_onednn_uses() {
    let host = CpuMachine::host().isa;
    let mut seen = Vec::new();
    for cap in [None, Some("AVX2"), Some("AVX")] {
        let out = child::run_with(
            "machine::print_the_machine",
            &[("ONEDNN_VERBOSE", Some("1")), ("ONEDNN_MAX_CPU_ISA", cap), ("DNNL_MAX_CPU_ISA", None)],
        );
        let fields = out.assert_finished("toma-machine ");
        let isa = CpuIsa::from_name(&fields["isa"]).unwrap_or(CpuIsa::Generic);
        let onednn = out
            .stdout
            .lines()
            .find_map(|l| l.split_once(",isa:").map(|(_, isa)| isa.to_string()))
            .unwrap_or_else(|| panic!("oneDNN printed no isa line\n{}", out.report));
        assert!(agrees(&onednn, isa), "cap {cap:?}: oneDNN says `{onednn}`, toma read {isa}");
        if cap.is_none()
            && std::env::var_os("ONEDNN_MAX_CPU_ISA").is_none()
            && std::env::var_os("DNNL_MAX_CPU_ISA").is_none()
        {
            assert_eq!(isa, host, "this process reads what a child without a cap reads");
        }
        seen.push(format!("{cap:?}: {isa} (oneDNN: {onednn})"));
    }
    println!("{}", seen.join("\n"));
}

/// Under `Auto`, a convolution's memory is measured wherever an allocator counts unless this is
/// the machine its rules were read on; the printed plan says which machine it priced for. In a
/// child process: counting allocations would make every later plan of this one calibrate.
#[test]
fn auto_measures_convolutions_on_any_machine_but_the_rules_one() {
    if std::env::var_os("TOMA_AUTO_MEASURES_CHILD").is_none() {
        let out = child::run(
            "machine::auto_measures_convolutions_on_any_machine_but_the_rules_one",
            "TOMA_AUTO_MEASURES_CHILD",
            "1",
        );
        out.assert_finished("auto-measures ");
        return;
    }
    assert!(toma::memory::track_cpu_allocations());
    let x = Tensor::randn([16, 3, 12, 12], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([8, 3, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let loss = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1).relu().sum(Kind::Float);
    // A plan runs nothing; calibrating measures what it will find.
    loss.calibrate(Mode::Backward, &Options::new()).unwrap();
    let plan = loss.plan(Mode::Backward, &Options::new()).unwrap();
    let cal = plan.calibration();
    let here = CpuMachine::host();
    let read_on = CpuMachine::rules_read_on();
    assert_eq!(cal.machine, Some(here));
    // The rules hold on the key they were read on (instruction set, features, libtorch's
    // checks, ATen's capability, release), at as many threads or fewer, while trusted.
    let rules_hold = here.reads_rules_of(&read_on) && toma::lazy::rules_trusted();
    let measured = cal.measured + cal.remembered;
    if rules_hold {
        assert!(measured == 0 && cal.by_rules >= 1, "{plan}");
    } else {
        assert!(measured == 1, "the convolution is measured on {here}\n{plan}");
    }
    let text = plan.to_string();
    assert!(text.contains(&format!("machine: {here}")), "{text}");
    let never = loss.plan(Mode::Backward, &Options::new().calibrate(Calibrate::Never)).unwrap();
    assert!(never.calibration().is_empty(), "{:?}", never.calibration());
    println!("\nauto-measures measured={measured} by_rules={}", cal.by_rules);
}

/// A plan runs no kernel, even where calls want measuring (`Calibrate::Always`): where an
/// allocator could measure them and none did yet, it refuses, naming the op and how to measure
/// it, rather than price it by rules read elsewhere. `calibrate` measures them; a plan then finds
/// them, still running nothing, and plans the same every time it is asked. In a child process,
/// as above.
#[test]
fn a_plan_runs_nothing_and_says_what_it_lacks() {
    if std::env::var_os("TOMA_PLAN_RUNS_NOTHING_CHILD").is_none() {
        let out =
            child::run("machine::a_plan_runs_nothing_and_says_what_it_lacks", "TOMA_PLAN_RUNS_NOTHING_CHILD", "1");
        out.assert_finished("runs-nothing ");
        return;
    }
    assert!(toma::memory::track_cpu_allocations());
    let allocations = || toma::memory::cpu_allocator_stats().expect("tracking").allocations;
    let x = Tensor::randn([16, 3, 12, 12], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([8, 3, 3, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let loss = lazy(&x, 0).conv2d(&w, None::<&Tensor>, 1, 1, 1, 1).relu().sum(Kind::Float);
    let always = Options::new().calibrate(Calibrate::Always);

    let before = allocations();
    let refused = loss.plan(Mode::Backward, &always).unwrap_err();
    assert_eq!(allocations(), before, "a plan allocated, so it ran something");
    let lacking = match &refused {
        toma::lazy::LazyError::NotCalibrated { calls, op } => {
            assert_eq!(op, "conv2d", "{refused}");
            *calls
        }
        other => panic!("{other}"),
    };
    let text = refused.to_string();
    assert!(text.contains(".calibrate(") && text.contains("Calibrate::Never"), "says what to do: {text}");
    // Asked to, it plans by the rules read elsewhere, and says so.
    let never = loss.plan(Mode::Backward, &Options::new().calibrate(Calibrate::Never)).unwrap();
    assert!(never.calibration().is_empty(), "{:?}", never.calibration());
    assert_eq!(allocations(), before, "a plan allocated, so it ran something");

    let measured = loss.calibrate(Mode::Backward, &always).unwrap();
    assert!(measured.measured >= 1, "{measured:?}");
    assert!(allocations() > before, "calibration runs the calls it measures");

    let before = allocations();
    let found = loss.plan(Mode::Backward, &always).unwrap();
    let again = loss.plan(Mode::Backward, &always).unwrap();
    assert_eq!(allocations(), before, "a plan allocated, so it ran something\n{found}");
    let cal = found.calibration();
    assert_eq!((cal.measured, cal.unmeasured), (0, 0), "{cal:?}");
    assert_eq!(cal.remembered, measured.measured + measured.remembered, "{cal:?}");
    // The same graph with the same evidence: the same plan, every figure and line of it.
    assert_eq!(found.to_string(), again.to_string());
    assert_eq!(format!("{:?}", found.steps()), format!("{:?}", again.steps()));
    println!("\nruns-nothing lacking={lacking} measured={}", measured.measured);
}

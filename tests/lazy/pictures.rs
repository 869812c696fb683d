//! The pictures render: a plan's and a run's SVG, opened by headless Chromium (Debian's
//! `chromium`, installed by `scripts/ensure-chromium.sh`), parse without error and carry the
//! series they promise. Where Chromium is missing the render is skipped and says so; the SVG is
//! still checked for its series here.

use std::path::PathBuf;
use std::process::Command;

use tch::{Device, Kind, Tensor};
use toma::lazy::{lazy, Mode, Options};

/// The Chromium binary, if installed.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|dir| PathBuf::from(dir).join(name))
            .find(|path| path.is_file())
    })
}

/// Opens `svg` in headless Chromium: the document as Chromium parsed it, and a screenshot
/// beside the file. `None` (said on stderr) without Chromium, unless `TOMA_REQUIRE_CHROMIUM`
/// is set.
fn render(name: &str, svg: &str) -> Option<String> {
    let dir = std::env::temp_dir().join(format!("toma-pictures-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{name}.svg"));
    std::fs::write(&file, svg).unwrap();
    let Some(chromium) = chromium() else {
        assert!(
            std::env::var_os("TOMA_REQUIRE_CHROMIUM").is_none(),
            "TOMA_REQUIRE_CHROMIUM is set but chromium is missing"
        );
        eprintln!("skipped: rendering {name}.svg needs chromium (scripts/ensure-chromium.sh installs it)");
        return None;
    };
    let url = format!("file://{}", file.display());
    let headless = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"];
    let dom = Command::new(&chromium).args(headless).arg("--dump-dom").arg(&url).output().expect("run chromium");
    assert!(dom.status.success(), "chromium failed: {}", String::from_utf8_lossy(&dom.stderr));
    let png = dir.join(format!("{name}.png"));
    let shot = Command::new(&chromium)
        .args(headless)
        .arg(format!("--screenshot={}", png.display()))
        .arg("--window-size=960,480")
        .arg(&url)
        .output()
        .expect("run chromium");
    assert!(shot.status.success() && png.is_file(), "no screenshot: {}", String::from_utf8_lossy(&shot.stderr));
    eprintln!("rendered {} (and {})", file.display(), png.display());
    Some(String::from_utf8_lossy(&dom.stdout).into_owned())
}

fn check(name: &str, svg: &str, series: &[&str]) {
    for s in series {
        assert!(svg.contains(&format!("data-series=\"{s}\"")), "{name}: no series {s}");
    }
    if let Some(dom) = render(name, svg) {
        assert!(!dom.contains("parsererror"), "{name}: Chromium could not parse it:\n{dom}");
        assert!(dom.trim_start().starts_with("<svg"), "{name}: not an SVG document:\n{dom}");
        for s in series {
            assert!(dom.contains(&format!("data-series=\"{s}\"")), "{name}: Chromium's document lost the series {s}");
        }
    }
}

#[test]
fn a_split_plan_renders_with_every_series() {
    let w1 = Tensor::randn([64, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w2 = Tensor::randn([256, 10], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (x, y) =
        (Tensor::randn([512, 64], (Kind::Float, Device::Cpu)), Tensor::randint(10, [512], (Kind::Int64, Device::Cpu)));
    let (lx, ly) = lazy((&x, &y), 0);
    let loss = lx.matmul(&w1).relu().matmul(&w2).cross_entropy_for_logits(&ly);
    let whole = loss.plan(Mode::Backward, &Options::new().budget(u64::MAX / 4)).unwrap().peak_bytes();
    let plan = loss.plan(Mode::Backward, &Options::new().budget(whole / 3)).unwrap();
    assert!(plan.splits(), "{plan}");
    let svg = plan.to_svg();
    check("plan", &svg, &["forward", "backward", "micro-batch", "whole batch", "peak", "budget"]);
    let (_, op, _) = plan.peak_op();
    assert!(svg.contains(op), "the peak's op {op} is named");
}

#[test]
fn a_run_report_renders_each_attempt() {
    let (result, report) = toma::Batch::new(64).cache(toma::CacheKind::None).run_with_report(|size| {
        if size > 8 {
            Err("CUDA out of memory".to_string())
        } else {
            Ok(size)
        }
    });
    assert_eq!(result, Ok(8));
    assert_eq!(report.history.len(), 4);
    let svg = report.to_svg("batch");
    check("run", &svg, &["attempts"]);
    assert_eq!(svg.matches("<rect x=").count(), 4, "one bar per attempt");
}

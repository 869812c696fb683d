//! Compiles the libtorch shim (`src/shim/`) with feature `tch`, against the libtorch that tch
//! links (torch-sys exports its lib dir as `DEP_TCH_LIBTORCH_LIB`).
//!
//! Without feature `tch` nothing is compiled and no libtorch is needed. A shim that fails to
//! compile is a warning, not an error: `toma::memory`'s allocator functions then report `None`,
//! as on a machine without CUDA, and the unit test `shim_is_built_with_tch` fails, so CI notices.

#[cfg(feature = "tch")]
use std::env;
#[cfg(feature = "tch")]
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(toma_shim)");
    println!("cargo::rustc-check-cfg=cfg(toma_dist_shim)");
    println!("cargo::rustc-check-cfg=cfg(toma_gloo)");
    println!("cargo::rustc-check-cfg=cfg(toma_shim_cuda)");
    println!("cargo::rerun-if-changed=build.rs");
    // `cc` is a build dependency of feature `tch` only.
    #[cfg(feature = "tch")]
    with_libtorch();
}

#[cfg(feature = "tch")]
fn with_libtorch() {
    println!("cargo::rerun-if-changed=src/shim/toma_shim.cpp");
    println!("cargo::rerun-if-changed=src/shim/toma_shim.h");
    println!("cargo::rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo::rerun-if-env-changed=DOCS_RS");
    let Some(lib) = env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
        // torch-sys without a libtorch (its `doc-only` feature, as on docs.rs): nothing to
        // compile against.
        if env::var_os("DOCS_RS").is_none() {
            println!("cargo::warning=toma: torch-sys reported no libtorch lib dir; CUDA allocator statistics disabled");
        }
        return;
    };
    let include = lib.parent().map_or_else(|| lib.join("include"), |root| root.join("include"));
    // The planner's cost layer says which libtorch its rules were read on: pass the version on.
    if let Some(version) = libtorch_version(&include) {
        println!("cargo::rustc-env=TOMA_LIBTORCH_VERSION={version}");
    }

    // With CUDA's runtime headers the shim also reads the allocator's segments; where they are
    // missing or do not compile with libtorch's, it is built without that one call.
    let cuda = cuda_include(&lib);
    let built = match cuda.as_deref().map(|dir| compile_shim(&include, Some(dir))) {
        Some(Ok(())) => {
            println!("cargo::rustc-cfg=toma_shim_cuda");
            Ok(())
        }
        Some(Err(err)) => {
            println!(
                "cargo::warning=toma: the libtorch shim did not compile with CUDA's headers ({err}); built without the allocator's snapshot"
            );
            compile_shim(&include, None)
        }
        None => compile_shim(&include, None),
    };
    match built {
        Ok(()) => println!("cargo::rustc-cfg=toma_shim"),
        Err(err) => println!(
            "cargo::warning=toma: the libtorch shim did not compile against {}; CUDA allocator statistics disabled: {err}",
            include.display()
        ),
    }
    if env::var_os("CARGO_FEATURE_DIST").is_some() {
        compile_dist(&include);
    }
    link_torch_cuda(&lib);
}

/// `major.minor.patch` from libtorch's headers (`torch/headeronly/version.h` since 2.9,
/// `torch/csrc/api/include/torch/version.h` before).
#[cfg(feature = "tch")]
fn libtorch_version(include: &Path) -> Option<String> {
    let text = ["torch/headeronly/version.h", "torch/csrc/api/include/torch/version.h"]
        .iter()
        .find_map(|file| std::fs::read_to_string(include.join(file)).ok())?;
    let number = |name: &str| {
        text.lines()
            .find_map(|line| line.trim().strip_prefix("#define ")?.strip_prefix(name)?.trim().parse::<u32>().ok())
    };
    Some(format!(
        "{}.{}.{}",
        number("TORCH_VERSION_MAJOR")?,
        number("TORCH_VERSION_MINOR")?,
        number("TORCH_VERSION_PATCH")?
    ))
}

/// Feature `dist`: c10d's store and, with gloo's headers, its Gloo process group. Unlike the
/// allocator shim, a failure here fails the build: the feature is nothing without it.
#[cfg(feature = "tch")]
fn compile_dist(include: &Path) {
    println!("cargo::rerun-if-changed=src/shim/toma_dist.cpp");
    println!("cargo::rerun-if-changed=src/shim/toma_dist.h");
    println!("cargo::rerun-if-env-changed=TOMA_GLOO_INCLUDE");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    // scripts/ensure-gloo-headers.sh puts them here; TOMA_GLOO_INCLUDE points elsewhere.
    let gloo = env::var_os("TOMA_GLOO_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join(".deps/gloo/include"))
        .canonicalize()
        .ok()
        .filter(|dir| dir.join("gloo/algorithm.h").exists());
    println!("cargo::rerun-if-changed={}", manifest.join(".deps/gloo/include").display());
    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").file("src/shim/toma_dist.cpp").include("src/shim");
    for dir in [include.to_path_buf(), include.join("torch/csrc/api/include")] {
        build.flag("-isystem").flag(dir);
    }
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    build.define("_GLIBCXX_USE_CXX11_ABI", abi.as_str());
    // c10d's headers are heavy; the shim is a thin layer, so optimizing it buys nothing.
    build.opt_level(0).debug(false);
    match &gloo {
        Some(dir) => {
            build.flag("-isystem").flag(dir).define("USE_C10D_GLOO", None).define("TOMA_DIST_GLOO", None);
            println!("cargo::rustc-cfg=toma_gloo");
        }
        None => println!(
            "cargo::warning=toma: no gloo headers (run scripts/ensure-gloo-headers.sh, or set TOMA_GLOO_INCLUDE); toma::dist's gradient all-reduce is disabled"
        ),
    }
    if let Err(err) = build.try_compile("toma_dist") {
        panic!("toma: feature `dist` needs c10d's headers from libtorch ({}): {err}", include.display());
    }
    println!("cargo::rustc-cfg=toma_dist_shim");
}

/// A directory holding CUDA's runtime headers, which libtorch's `c10/cuda` headers include
/// (`cuda_runtime_api.h`, and `crt/host_config.h` that `cuda_runtime.h` includes):
/// `TOMA_CUDA_INCLUDE`, then beside a pip-installed torch the CUDA wheels' (`nvidia/cu13`,
/// `nvidia/cuda_runtime`; the runtime wheel lacks `crt/`) and triton's full copy, then
/// `CUDA_HOME`, `CUDA_PATH` and `/usr/local/cuda`. Only types are used: any CUDA 12 or 13 set
/// lays c10's classes out alike. `None` also where libtorch has no `c10/cuda` headers.
#[cfg(feature = "tch")]
fn cuda_include(lib: &Path) -> Option<PathBuf> {
    println!("cargo::rerun-if-env-changed=TOMA_CUDA_INCLUDE");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    println!("cargo::rerun-if-env-changed=CUDA_PATH");
    let root = lib.parent()?;
    if !root.join("include/c10/cuda/CUDACachingAllocator.h").exists() {
        return None;
    }
    let mut candidates: Vec<PathBuf> = env::var_os("TOMA_CUDA_INCLUDE").map(PathBuf::from).into_iter().collect();
    // site-packages/torch/lib -> site-packages/nvidia/*/include
    if let Some(nvidia) = root.parent().map(|site| site.join("nvidia")) {
        let mut wheels: Vec<PathBuf> = std::fs::read_dir(&nvidia)
            .map(|dirs| dirs.filter_map(|d| d.ok()).map(|d| d.path().join("include")).collect())
            .unwrap_or_default();
        wheels.sort();
        candidates.extend(wheels);
    }
    candidates.extend(root.parent().map(|site| site.join("triton/backends/nvidia/include")));
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        candidates.extend(env::var_os(var).map(|home| PathBuf::from(home).join("include")));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.into_iter().find(|dir| dir.join("cuda_runtime_api.h").exists() && dir.join("crt/host_config.h").exists())
}

#[cfg(feature = "tch")]
fn compile_shim(include: &Path, cuda: Option<&Path>) -> Result<(), cc::Error> {
    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").file("src/shim/toma_shim.cpp").include("src/shim");
    let msvc = build.get_compiler().is_like_msvc();
    if let Some(dir) = cuda {
        match msvc {
            true => build.include(dir),
            false => build.flag("-isystem").flag(dir),
        };
        build.define("TOMA_SHIM_CUDA_HEADERS", None);
    }
    if msvc {
        build.include(include);
    } else {
        // libtorch's headers as system headers: their warnings are not ours to fix.
        build.flag("-isystem").flag(include);
        // The same std::string ABI as libtorch (torch-sys's default; PyTorch wheels use 1).
        let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
        build.define("_GLIBCXX_USE_CXX11_ABI", abi.as_str());
    }
    build.try_compile("toma_shim")
}

/// Makes this package's tests, examples and benches load `libtorch_cuda` (`rustc-link-arg`
/// reaches only those, never a dependent crate's binaries).
///
/// Nothing in tch or toma references a symbol of `libtorch_cuda`, so a linker with
/// `--as-needed` (the Linux default through rustc) drops it, and libtorch then sees no CUDA at
/// all; tch's own build script does the same (tch-rs issue 980). Linking `libtorch.so`, which
/// depends on `libtorch_cuda.so`, without `--as-needed` keeps it. Users of toma need the same
/// lines in their own build scripts to use CUDA through tch.
#[cfg(feature = "tch")]
fn link_torch_cuda(lib: &Path) {
    let linux = env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    if linux && lib.join("libtorch_cuda.so").exists() && lib.join("libtorch.so").exists() {
        println!("cargo::rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo::rustc-link-arg=-ltorch");
        println!("cargo::rustc-link-arg=-Wl,--as-needed");
    }
}

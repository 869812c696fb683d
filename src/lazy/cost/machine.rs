//! The CPU as the libraries will run on it: the instruction set oneDNN will use (which honours
//! `ONEDNN_MAX_CPU_ISA`), the CPU features libtorch and oneDNN choose kernels by (AVX512-FP16,
//! AMX, AVX512-BF16, VNNI, AVX-VNNI), libtorch's own answer to which reduced-precision kinds it
//! hands to oneDNN, ATen's CPU capability (which honours `ATEN_CPU_CAPABILITY`), the intra-op
//! threads and the libtorch release. A plan's rules for products and convolutions are trusted
//! only on the key they were read on ([`CpuMachine::rules_read_on`]); elsewhere those calls are
//! measured ([`Calibrate`](crate::lazy::Calibrate)). `docs/cpu-dispatch.md` says which feature
//! changes which kernel.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// oneDNN's x86 instruction sets, lowest first, as `ONEDNN_MAX_CPU_ISA` names them. oneDNN
/// picks its kernels, and so their blocked layouts and scratchpads, by the one it may use.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuIsa {
    /// Not x86, or x86 without SSE4.1: oneDNN's reference kernels.
    Generic,
    /// SSE4.1.
    Sse41,
    /// AVX.
    Avx,
    /// AVX2 (8-channel blocks).
    Avx2,
    /// AVX2 with AVX-VNNI.
    Avx2Vnni,
    /// AVX2 with AVX-VNNI-INT8 and AVX-NE-CONVERT.
    Avx2Vnni2,
    /// AVX-512 F, BW, VL and DQ (16-channel blocks).
    Avx512Core,
    /// AVX-512 core with VNNI.
    Avx512CoreVnni,
    /// AVX-512 core with VNNI and BF16.
    Avx512CoreBf16,
    /// AVX-512 core with FP16 (AVX10.1/512).
    Avx512CoreFp16,
    /// AVX-512 core with AMX tiles (int8, bf16).
    Avx512CoreAmx,
    /// AVX-512 core with AMX fp16.
    Avx512CoreAmxFp16,
}

impl CpuIsa {
    const ALL: [CpuIsa; 12] = [
        CpuIsa::Generic,
        CpuIsa::Sse41,
        CpuIsa::Avx,
        CpuIsa::Avx2,
        CpuIsa::Avx2Vnni,
        CpuIsa::Avx2Vnni2,
        CpuIsa::Avx512Core,
        CpuIsa::Avx512CoreVnni,
        CpuIsa::Avx512CoreBf16,
        CpuIsa::Avx512CoreFp16,
        CpuIsa::Avx512CoreAmx,
        CpuIsa::Avx512CoreAmxFp16,
    ];

    /// oneDNN's name (`ONEDNN_MAX_CPU_ISA`'s values, lower case).
    pub fn name(self) -> &'static str {
        match self {
            CpuIsa::Generic => "generic",
            CpuIsa::Sse41 => "sse41",
            CpuIsa::Avx => "avx",
            CpuIsa::Avx2 => "avx2",
            CpuIsa::Avx2Vnni => "avx2_vnni",
            CpuIsa::Avx2Vnni2 => "avx2_vnni_2",
            CpuIsa::Avx512Core => "avx512_core",
            CpuIsa::Avx512CoreVnni => "avx512_core_vnni",
            CpuIsa::Avx512CoreBf16 => "avx512_core_bf16",
            CpuIsa::Avx512CoreFp16 => "avx512_core_fp16",
            CpuIsa::Avx512CoreAmx => "avx512_core_amx",
            CpuIsa::Avx512CoreAmxFp16 => "avx512_core_amx_fp16",
        }
    }

    /// The instruction set `ONEDNN_MAX_CPU_ISA` names (any case; oneDNN's AVX10 aliases too);
    /// `None` for `ALL`, `DEFAULT` or a name oneDNN does not know, which cap nothing.
    pub fn from_name(name: &str) -> Option<CpuIsa> {
        let name = name.trim().to_ascii_lowercase();
        let alias = match name.as_str() {
            "avx10_1_512" => "avx512_core_fp16",
            "avx10_1_512_amx" => "avx512_core_amx",
            "avx10_1_512_amx_fp16" => "avx512_core_amx_fp16",
            other => other,
        };
        CpuIsa::ALL.into_iter().find(|isa| isa.name() == alias)
    }

    /// Whether libtorch's `mkldnn_bf16_device_check` passes where oneDNN uses this instruction
    /// set: ideep's bf16 support, from AVX2 with VNNI-INT8 and NE-CONVERT, or AVX-512 core. It
    /// reads oneDNN's effective instruction set, so `ONEDNN_MAX_CPU_ISA` lowers it too.
    pub fn passes_bf16_check(self) -> bool {
        self == CpuIsa::Avx2Vnni2 || self >= CpuIsa::Avx512Core
    }

    /// Whether libtorch's `mkldnn_fp16_device_check` passes: ideep's fp16 support, on AVX2
    /// with VNNI-INT8 and NE-CONVERT, or from AVX-512 with FP16 (capped like the bf16 check).
    pub fn passes_fp16_check(self) -> bool {
        self == CpuIsa::Avx2Vnni2 || self >= CpuIsa::Avx512CoreFp16
    }

    /// oneDNN's channel block for `Float` convolutions: 16 with AVX-512, else 8.
    pub(crate) fn block(self) -> u64 {
        if self >= CpuIsa::Avx512Core {
            16
        } else {
            8
        }
    }

    /// The most this CPU offers oneDNN, as its CPUID says.
    fn detected() -> CpuIsa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let (leaf7_0, leaf7_1) = leaf7();
            let bit = |word: u32, b: u32| word & (1 << b) != 0;
            let avx_vnni = bit(leaf7_1.0, 4);
            let avx_vnni_int8_ne = bit(leaf7_1.1, 4) && bit(leaf7_1.1, 5);
            let amx_base = bit(leaf7_0.0, 22) && bit(leaf7_0.0, 24) && bit(leaf7_0.0, 25);
            let amx_fp16 = bit(leaf7_1.0, 21);
            let avx512_core = has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
            if avx512_core {
                let vnni = has!("avx512vnni");
                let bf16 = vnni && has!("avx512bf16");
                let fp16 = bf16 && has!("avx512fp16");
                let amx = fp16 && amx_base;
                return match (amx && amx_fp16, amx, fp16, bf16, vnni) {
                    (true, ..) => CpuIsa::Avx512CoreAmxFp16,
                    (_, true, ..) => CpuIsa::Avx512CoreAmx,
                    (_, _, true, ..) => CpuIsa::Avx512CoreFp16,
                    (.., true, _) => CpuIsa::Avx512CoreBf16,
                    (.., true) => CpuIsa::Avx512CoreVnni,
                    _ => CpuIsa::Avx512Core,
                };
            }
            if has!("avx2") {
                return match (avx_vnni, avx_vnni_int8_ne) {
                    (true, true) => CpuIsa::Avx2Vnni2,
                    (true, false) => CpuIsa::Avx2Vnni,
                    _ => CpuIsa::Avx2,
                };
            }
            if has!("avx") {
                return CpuIsa::Avx;
            }
            if has!("sse4.1") {
                return CpuIsa::Sse41;
            }
        }
        CpuIsa::Generic
    }

    /// What oneDNN will use: the CPU's most, capped where `ONEDNN_MAX_CPU_ISA` (else
    /// `DNNL_MAX_CPU_ISA`) names a lower one, as oneDNN reads them at its first primitive.
    fn effective(cap: Option<&str>) -> CpuIsa {
        let detected = CpuIsa::detected();
        match cap.and_then(CpuIsa::from_name) {
            Some(cap) => detected.min(cap),
            None => detected,
        }
    }
}

/// CPUID leaf 7, the words std's feature detection does not name: sub-leaf 0's EDX (bits 22,
/// 24, 25: AMX-BF16, -TILE, -INT8) and sub-leaf 1's EAX (bits 4 and 21: AVX-VNNI, AMX-FP16) and
/// EDX (bits 4 and 5: AVX-VNNI-INT8, AVX-NE-CONVERT), as `((edx0, 0), (eax1, edx1))`.
#[cfg(target_arch = "x86_64")]
fn leaf7() -> ((u32, u32), (u32, u32)) {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return ((0, 0), (0, 0));
    }
    let (l0, l1) = (__cpuid_count(7, 0), __cpuid_count(7, 1));
    ((l0.edx, 0), (l1.eax, l1.edx))
}

/// Whether CPUID's vendor is "AuthenticAMD".
#[cfg(target_arch = "x86_64")]
fn amd() -> bool {
    let vendor = std::arch::x86_64::__cpuid(0);
    (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
}

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The CPU features libtorch and oneDNN choose kernels by, as the CPU reports them (CPUID),
/// whatever `ONEDNN_MAX_CPU_ISA` caps: a cap lowers oneDNN's [`CpuIsa`], not what the CPU has.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuFeatures {
    /// AVX512-FP16: oneDNN's `Half` kernels (and libtorch's fp16 check).
    pub avx512_fp16: bool,
    /// AVX512-BF16.
    pub avx512_bf16: bool,
    /// AMX tiles with BF16 (and INT8).
    pub amx_bf16: bool,
    /// AMX tiles with FP16.
    pub amx_fp16: bool,
    /// AVX512-VNNI.
    pub avx512_vnni: bool,
    /// AVX-VNNI (VEX-encoded).
    pub avx_vnni: bool,
    /// An AMD CPU. oneDNN sizes its blocking by the caches, and an AMD CPU's are not those of
    /// the Intel CPU the rules were read on: with the same instruction set (AVX-512 with BF16 on
    /// an EPYC), a strided convolution's rule was 5.9% over, so there they are measured.
    pub amd: bool,
}

impl CpuFeatures {
    /// The features a CPU has whose oneDNN reaches `isa` uncapped (what each level requires).
    pub fn of_isa(isa: CpuIsa) -> CpuFeatures {
        CpuFeatures {
            avx512_fp16: isa >= CpuIsa::Avx512CoreFp16,
            avx512_bf16: isa >= CpuIsa::Avx512CoreBf16,
            amx_bf16: isa >= CpuIsa::Avx512CoreAmx,
            amx_fp16: isa >= CpuIsa::Avx512CoreAmxFp16,
            avx512_vnni: isa >= CpuIsa::Avx512CoreVnni,
            avx_vnni: matches!(isa, CpuIsa::Avx2Vnni | CpuIsa::Avx2Vnni2) || isa >= CpuIsa::Avx512CoreFp16,
            amd: false,
        }
    }

    /// This CPU's, from CPUID (read once).
    pub fn detected() -> CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        *FEATURES.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                let ((edx0, _), (eax1, _)) = leaf7();
                let bit = |word: u32, b: u32| word & (1 << b) != 0;
                CpuFeatures {
                    avx512_fp16: has!("avx512fp16"),
                    avx512_bf16: has!("avx512bf16"),
                    amx_bf16: bit(edx0, 22),
                    amx_fp16: bit(eax1, 21),
                    avx512_vnni: has!("avx512vnni"),
                    avx_vnni: bit(eax1, 4),
                    amd: amd(),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            CpuFeatures::default()
        })
    }
}

impl fmt::Display for CpuFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let named = [
            (self.avx512_fp16, "avx512_fp16"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.amx_bf16, "amx_bf16"),
            (self.amx_fp16, "amx_fp16"),
            (self.avx512_vnni, "avx512_vnni"),
            (self.avx_vnni, "avx_vnni"),
        ];
        let mut any = false;
        for (_, name) in named.iter().filter(|(has, _)| *has) {
            f.write_str(if any { "+" } else { "" })?;
            f.write_str(name)?;
            any = true;
        }
        if !any {
            f.write_str("none of avx512_fp16/bf16, amx, vnni")?;
        }
        if self.amd {
            f.write_str(", AMD")?;
        }
        Ok(())
    }
}

/// A CPU as the planner's rules price it: the instruction set oneDNN uses, the CPU features
/// kernels are chosen by, libtorch's reduced-precision checks, ATen's capability, libtorch's
/// intra-op threads and its release. [`host`](Self::host) is this one;
/// [`rules_read_on`](Self::rules_read_on) the one the rules were read on. A plan prices
/// products and convolutions by rules without measuring only where the two keys agree
/// ([`reads_rules_of`](Self::reads_rules_of)), and never in [`trust_rules`]`(false)` mode.
///
/// ```
/// use toma::lazy::{CpuIsa, CpuMachine};
///
/// let here = CpuMachine::host();
/// println!("planning for {here}");
/// // The machine the rules were read on is data, not special.
/// let avx2 = CpuMachine::new(CpuIsa::Avx2, 2);
/// assert_ne!(avx2, CpuMachine::rules_read_on());
/// assert!(!avx2.reads_rules_of(&CpuMachine::rules_read_on()));
/// // One feature apart is another machine: AVX512-FP16 hands `Half` products to oneDNN.
/// let mut fp16 = CpuMachine::rules_read_on();
/// fp16.features.avx512_fp16 = true;
/// assert!(!fp16.reads_rules_of(&CpuMachine::rules_read_on()));
/// ```
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuMachine {
    /// The instruction set oneDNN uses.
    pub isa: CpuIsa,
    /// The features the CPU has (not capped by `ONEDNN_MAX_CPU_ISA`).
    pub features: CpuFeatures,
    /// Whether libtorch hands `BFloat16` kernels to oneDNN (its `mkldnn_bf16_device_check`).
    pub bf16_onednn: bool,
    /// Whether libtorch hands `Half` kernels to oneDNN (its `mkldnn_fp16_device_check`).
    pub fp16_onednn: bool,
    /// ATen's CPU capability (`"AVX512"`, `"AVX2"`, `"DEFAULT"`, ..; `ATEN_CPU_CAPABILITY`
    /// lowers it).
    pub aten: &'static str,
    /// libtorch's intra-op threads.
    pub threads: usize,
    /// libtorch's `(major, minor)` release; `None` when unknown.
    pub libtorch: Option<(u32, u32)>,
}

impl CpuMachine {
    /// A CPU whose oneDNN uses `isa` uncapped, with `threads` intra-op threads, on the libtorch
    /// toma was built against: its features, libtorch's checks and ATen's capability are what
    /// such a CPU has.
    pub fn new(isa: CpuIsa, threads: usize) -> CpuMachine {
        CpuMachine {
            isa,
            features: CpuFeatures::of_isa(isa),
            bf16_onednn: isa.passes_bf16_check(),
            fp16_onednn: isa.passes_fp16_check(),
            aten: if isa >= CpuIsa::Avx512Core {
                "AVX512"
            } else if isa >= CpuIsa::Avx2 {
                "AVX2"
            } else {
                "DEFAULT"
            },
            threads: threads.max(1),
            libtorch: libtorch_version(),
        }
    }

    /// The machine the CPU rules were read on (`src/lazy/cost/onednn.rs`): libtorch 2.11.0
    /// (oneDNN 3.10.2) on an x86 CPU whose oneDNN uses AVX-512 with BF16 (VNNI, no FP16, no
    /// AMX), ATen's AVX512 kernels, 2 threads. `docs/ops.md` prices ops for it.
    pub fn rules_read_on() -> CpuMachine {
        CpuMachine {
            threads: READ_THREADS as usize,
            libtorch: Some(super::onednn::READ_ON),
            ..CpuMachine::new(CpuIsa::Avx512CoreBf16, READ_THREADS as usize)
        }
    }

    /// This machine as libtorch runs it now: oneDNN's instruction set and the CPU's features
    /// (read once), libtorch's own bf16 and fp16 checks and ATen's capability (asked once),
    /// libtorch's threads at this moment, and its release.
    pub fn host() -> CpuMachine {
        let isa = host_isa();
        let (bf16_onednn, fp16_onednn) = host_onednn_checks();
        CpuMachine {
            isa,
            features: CpuFeatures::detected(),
            bf16_onednn,
            fp16_onednn,
            aten: aten_capability(),
            threads: tch::get_num_threads().max(1) as usize,
            libtorch: libtorch_version(),
        }
    }

    /// Whether rules read on `read_on` price this machine's products and convolutions: the same
    /// key (oneDNN's instruction set, the features, libtorch's checks, ATen's capability, the
    /// release) and at most the threads they were read on.
    pub fn reads_rules_of(&self, read_on: &CpuMachine) -> bool {
        self.libtorch.is_some()
            && CpuMachine { threads: read_on.threads, ..*self } == *read_on
            && self.threads <= read_on.threads
    }
}

impl fmt::Display for CpuMachine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "oneDNN {} ({}), ATen {}, ", self.isa, self.features, self.aten)?;
        let kinds = match (self.bf16_onednn, self.fp16_onednn) {
            (true, true) => "BFloat16 and Half to oneDNN",
            (true, false) => "BFloat16 to oneDNN",
            (false, true) => "Half to oneDNN",
            (false, false) => "no reduced kind to oneDNN",
        };
        write!(f, "{kinds}, {} thread(s), libtorch ", self.threads)?;
        match self.libtorch {
            Some((major, minor)) => write!(f, "{major}.{minor}"),
            None => f.write_str("unknown"),
        }
    }
}

/// Whether a plan may price products and convolutions by rules at all (on by default; off
/// where `TOMA_TRUST_RULES` is `0`, `off` or `false` when first asked): off, every kernel call
/// that has a rule is measured instead, as [`Calibrate::Always`](crate::lazy::Calibrate) does
/// for one plan. For tests, and for users whose machine no rule was read on. Returns the
/// setting before.
///
/// ```
/// let before = toma::lazy::trust_rules(false);
/// assert!(!toma::lazy::rules_trusted());
/// toma::lazy::trust_rules(before);
/// ```
pub fn trust_rules(on: bool) -> bool {
    let before = rules_trusted();
    TRUST.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    before
}

/// Whether rules are trusted ([`trust_rules`]).
pub fn rules_trusted() -> bool {
    match TRUST.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let off = std::env::var("TOMA_TRUST_RULES")
                .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "off" | "false" | "no"));
            // A setting made meanwhile stands.
            let _ = TRUST.compare_exchange(0, if off { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
            TRUST.load(Ordering::Relaxed) == 1
        }
    }
}

/// 0: not asked yet; 1: trusted; 2: not.
static TRUST: AtomicU8 = AtomicU8::new(0);

/// libtorch's own bf16 and fp16 checks on this machine (asked once); without the shim, what
/// its checks read on x86 (oneDNN's capped instruction set, see [`CpuIsa::passes_bf16_check`]).
fn host_onednn_checks() -> (bool, bool) {
    static CHECKS: OnceLock<(bool, bool)> = OnceLock::new();
    *CHECKS.get_or_init(|| {
        crate::memory::onednn_kind_checks().unwrap_or_else(|_| {
            let isa = host_isa();
            (isa.passes_bf16_check(), isa.passes_fp16_check())
        })
    })
}

/// The most intra-op threads the thread-dependent rules (oneDNN's convolutions) were read on:
/// plans for more threads measure those calls ([`Calibrate`](crate::lazy::Calibrate)).
pub(crate) const READ_THREADS: u64 = 2;

/// The libtorch release toma's shim was built against (`TOMA_LIBTORCH_VERSION`, from its
/// headers), `None` when unknown.
pub(crate) fn libtorch_version() -> Option<(u32, u32)> {
    let version = option_env!("TOMA_LIBTORCH_VERSION")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

/// oneDNN's instruction set on this machine, read once (oneDNN reads its cap once too).
pub(crate) fn host_isa() -> CpuIsa {
    static ISA: OnceLock<CpuIsa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("ONEDNN_MAX_CPU_ISA").or_else(|_| std::env::var("DNNL_MAX_CPU_ISA")).ok();
        CpuIsa::effective(cap.as_deref())
    })
}

/// ATen's CPU capability as libtorch picked it (`"AVX512"`, `"AVX2"`, `"DEFAULT"`, ..; it
/// honours `ATEN_CPU_CAPABILITY`), read once; `"unknown"` without the shim.
pub(crate) fn aten_capability() -> &'static str {
    static CAPABILITY: OnceLock<&'static str> = OnceLock::new();
    CAPABILITY.get_or_init(|| match crate::memory::aten_cpu_capability() {
        // The names libtorch gives, as static strings (a key is `Copy`).
        Ok(name) => ["DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE128", "SVE256", "SVE512"]
            .into_iter()
            .find(|known| name.eq_ignore_ascii_case(known))
            .unwrap_or_else(|| Box::leak(name.into_boxed_str())),
        Err(_) => "unknown",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_caps_only_lower() {
        for isa in CpuIsa::ALL {
            assert_eq!(CpuIsa::from_name(isa.name()), Some(isa));
            assert_eq!(CpuIsa::from_name(&isa.name().to_ascii_uppercase()), Some(isa));
        }
        assert_eq!(CpuIsa::from_name("AVX10_1_512_AMX"), Some(CpuIsa::Avx512CoreAmx));
        assert_eq!(CpuIsa::from_name("ALL"), None);
        assert_eq!(CpuIsa::from_name("DEFAULT"), None);
        let most = CpuIsa::detected();
        assert_eq!(CpuIsa::effective(None), most);
        assert_eq!(CpuIsa::effective(Some("AVX512_CORE_AMX_FP16")), most, "a cap never raises");
        assert_eq!(CpuIsa::effective(Some("SSE41")), most.min(CpuIsa::Sse41));
        assert_eq!((CpuIsa::Avx2.block(), CpuIsa::Avx512Core.block(), CpuIsa::Avx.block()), (8, 16, 8));
    }
}

//! The CPU as the libraries will run on it: the instruction set oneDNN will use (which honours
//! `ONEDNN_MAX_CPU_ISA`), ATen's CPU capability (which honours `ATEN_CPU_CAPABILITY`), the
//! intra-op threads and the libtorch release. A plan's rules are trusted only on the machine
//! they were read on ([`CpuMachine::rules_read_on`]); elsewhere the calls whose memory depends
//! on the library's kernel choice are measured ([`Calibrate`](crate::lazy::Calibrate)).

use std::fmt;
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
            // AVX-VNNI and AMX are read from CPUID leaf 7 (sub-leaf 0: EDX bits 22, 24, 25 for
            // AMX-BF16, -TILE, -INT8; sub-leaf 1: EAX bits 4 and 21 for AVX-VNNI and AMX-FP16,
            // EDX bits 4 and 5 for AVX-VNNI-INT8 and AVX-NE-CONVERT).
            use std::arch::x86_64::{__cpuid, __cpuid_count};
            let (leaf7_0, leaf7_1) = if __cpuid(0).eax >= 7 {
                let (l0, l1) = (__cpuid_count(7, 0), __cpuid_count(7, 1));
                ((l0.edx, 0), (l1.eax, l1.edx))
            } else {
                ((0, 0), (0, 0))
            };
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

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A CPU as the planner's rules price it: the instruction set oneDNN uses, libtorch's intra-op
/// threads and its release. [`host`](Self::host) is this one; [`rules_read_on`](Self::rules_read_on)
/// the one the rules were read on; a plan's calls are priced by rules without measuring only
/// where the two agree (for the calls whose memory depends on the library's kernel choice).
///
/// ```
/// use toma::lazy::{CpuIsa, CpuMachine};
///
/// let here = CpuMachine::host();
/// println!("planning for {here}");
/// // The machine the rules were read on is data, not special.
/// let avx2 = CpuMachine::new(CpuIsa::Avx2, 2);
/// assert_ne!(avx2, CpuMachine::rules_read_on());
/// ```
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuMachine {
    /// The instruction set oneDNN uses.
    pub isa: CpuIsa,
    /// libtorch's intra-op threads.
    pub threads: usize,
    /// libtorch's `(major, minor)` release; `None` when unknown.
    pub libtorch: Option<(u32, u32)>,
}

impl CpuMachine {
    /// A CPU whose oneDNN uses `isa`, with `threads` intra-op threads, on the libtorch toma was
    /// built against.
    pub fn new(isa: CpuIsa, threads: usize) -> CpuMachine {
        CpuMachine { isa, threads: threads.max(1), libtorch: libtorch_version() }
    }

    /// The machine the CPU rules were read on (`src/lazy/cost/onednn.rs`): libtorch 2.11.0
    /// (oneDNN 3.10.2) on an x86 CPU whose oneDNN uses AVX-512 with BF16, 2 threads.
    /// `docs/ops.md` prices ops for it.
    pub fn rules_read_on() -> CpuMachine {
        CpuMachine {
            isa: CpuIsa::Avx512CoreBf16,
            threads: READ_THREADS as usize,
            libtorch: Some(super::onednn::READ_ON),
        }
    }

    /// This machine as libtorch runs it now: oneDNN's instruction set (read once), libtorch's
    /// threads at this moment, and its release.
    pub fn host() -> CpuMachine {
        CpuMachine { isa: host_isa(), threads: tch::get_num_threads().max(1) as usize, libtorch: libtorch_version() }
    }
}

impl fmt::Display for CpuMachine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "oneDNN {}, {} thread(s), libtorch ", self.isa, self.threads)?;
        match self.libtorch {
            Some((major, minor)) => write!(f, "{major}.{minor}"),
            None => f.write_str("unknown"),
        }
    }
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
    static CAPABILITY: OnceLock<String> = OnceLock::new();
    CAPABILITY.get_or_init(|| crate::memory::aten_cpu_capability().unwrap_or_else(|_| "unknown".into()))
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

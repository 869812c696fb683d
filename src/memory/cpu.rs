//! A cap on the process's CPU memory, and how much of it is left.
//!
//! Two kernel limits can serve as the cap ([`CpuCap`]); either way, allocations beyond it fail
//! inside libtorch with `DefaultCPUAllocator: can't allocate memory`, which toma catches and
//! retries like a CUDA out-of-memory:
//!
//! - [`CpuCap::AddressSpace`] (`RLIMIT_AS`) counts every
//!   mapping, reservations included. Use it where no CUDA driver is loaded.
//! - [`CpuCap::Data`] (`RLIMIT_DATA`) counts private writable memory only: what tensors,
//!   `malloc` and thread stacks take, not mapped libraries or address ranges reserved with
//!   `PROT_NONE`. The CUDA driver reserves such ranges, far larger than the card (NVIDIA's
//!   cuda-python observed about twice the device memory for a memory pool alone), so an
//!   address-space cap can make CUDA itself fail to start or allocate; use this one on CUDA
//!   machines.
//!
//! Linux only; elsewhere the functions report [`std::io::ErrorKind::Unsupported`] and no cap.
//! A cap can be lowered but never raised again by an unprivileged process, so set it once,
//! early, or in a child process.

use std::fmt;
use std::io;

use super::cuda::cuda_driver_present;

use crate::error::ConfigError;

/// Bad input to a cap, as the `io::Error` the cap functions return.
fn invalid(err: ConfigError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, err)
}

/// Which kernel limit caps the process's CPU memory. See the [module docs](self) for which
/// to use where.
///
/// ```no_run
/// use toma::cpu_memory::CpuCap;
/// // On a CUDA machine: cap private memory at what is in use now plus 8 GiB.
/// CpuCap::Data.set(CpuCap::Data.in_use()? + (8 << 30))?;
/// assert!(CpuCap::Data.limit()?.is_some());
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CpuCap {
    /// `RLIMIT_AS`: all address space the process maps (`VmSize`), mapped libraries and
    /// reserved-but-unused ranges included.
    AddressSpace,
    /// `RLIMIT_DATA`: private writable memory (`VmData`, Linux ≥ 4.7): heap, anonymous
    /// mappings, thread stacks; not libraries, shared mappings or `PROT_NONE` reservations.
    Data,
}

impl CpuCap {
    /// Both caps, address space first.
    pub const ALL: [CpuCap; 2] = [CpuCap::AddressSpace, CpuCap::Data];

    /// The kernel's name for the limit: `RLIMIT_AS` or `RLIMIT_DATA`.
    pub fn name(self) -> &'static str {
        match self {
            CpuCap::AddressSpace => "RLIMIT_AS",
            CpuCap::Data => "RLIMIT_DATA",
        }
    }

    /// Caps this figure at `bytes` (soft = hard = `min(bytes, current hard limit)`: a cap can
    /// only be lowered). Size it against [`CpuCap::in_use`], not against the memory you want
    /// for tensors alone; [`CpuCap::set_headroom`] does that for you.
    ///
    /// # Errors
    /// - [`io::ErrorKind::InvalidInput`], wrapping a [`ConfigError`], when `bytes` is 0 or the
    ///   cap would sit below what is already in use (every later allocation would fail).
    /// - The OS error when `setrlimit` fails, and [`io::ErrorKind::Unsupported`] off Linux.
    pub fn set(self, bytes: u64) -> io::Result<()> {
        if bytes == 0 {
            return Err(invalid(ConfigError::ZeroSize { what: "CPU memory cap (bytes)" }));
        }
        imp::set_limit(self, bytes)
    }

    /// Caps this figure at what is in use now plus `bytes`: the usual way to leave a known
    /// amount of room for tensors.
    ///
    /// ```no_run
    /// use toma::cpu_memory::CpuCap;
    /// CpuCap::Data.set_headroom(8 << 30)?; // 8 GiB above what the process uses now
    /// # Ok::<(), std::io::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`CpuCap::set`], and when `/proc/self` cannot be read.
    pub fn set_headroom(self, bytes: u64) -> io::Result<()> {
        if bytes == 0 {
            return Err(invalid(ConfigError::ZeroSize { what: "CPU memory headroom (bytes)" }));
        }
        self.set(self.in_use()?.saturating_add(bytes))
    }

    /// The cap in bytes (the soft limit), or `None` when unlimited.
    ///
    /// # Errors
    /// The OS error when `getrlimit` fails, and [`io::ErrorKind::Unsupported`] off Linux.
    pub fn limit(self) -> io::Result<Option<u64>> {
        imp::limit(self).map(|(soft, _hard)| soft)
    }

    /// Bytes of this figure in use now (`VmSize` or `VmData`): what the cap is compared with.
    ///
    /// # Errors
    /// When `/proc/self` cannot be read, and [`io::ErrorKind::Unsupported`] off Linux.
    pub fn in_use(self) -> io::Result<u64> {
        imp::in_use(self)
    }

    /// Bytes left under the cap, or `None` when it is not set (or cannot be read).
    pub fn headroom(self) -> Option<u64> {
        // Usage is read only under a cap: without one (the usual case) no /proc file is read.
        let cap = self.limit().ok().flatten()?;
        Some(cap.saturating_sub(self.in_use().ok()?))
    }
}

impl fmt::Display for CpuCap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Caps set so far in this process: the cache keys' shared reading of free memory is read
/// afresh when this changes.
static CAP_CHANGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(crate) fn cap_changes() -> u64 {
    CAP_CHANGES.load(std::sync::atomic::Ordering::Acquire)
}

/// Bytes of CPU memory an allocation could still get: the smallest of the system's available
/// memory (`MemAvailable`) and the headroom under each cap that is set.
///
/// Reads the kernel's figures fresh on every call (tens of microseconds); the retry engine's
/// cache keys use a reading up to a second old instead.
pub fn available_cpu_memory() -> u64 {
    within_caps(system_available())
}

/// The system's available memory (`MemAvailable`), `u64::MAX` where it cannot be read.
pub(super) fn system_available() -> u64 {
    imp::system_available().unwrap_or(u64::MAX)
}

/// `bytes`, or less: the headroom under each cap that is set.
pub(super) fn within_caps(bytes: u64) -> u64 {
    within_set_caps(bytes, u64::MAX)
}

/// Which caps are set now: bit `i` for `CpuCap::ALL[i]`.
#[cfg(feature = "tch")]
pub(super) fn caps_set() -> u64 {
    CpuCap::ALL
        .iter()
        .enumerate()
        .filter(|(_, cap)| matches!(cap.limit(), Ok(Some(_))))
        .fold(0, |set, (i, _)| set | 1 << i)
}

/// `bytes`, or less: the headroom under each cap in `set` ([`caps_set`]) that is set, read now.
pub(super) fn within_set_caps(bytes: u64, set: u64) -> u64 {
    CpuCap::ALL
        .iter()
        .enumerate()
        .filter(|&(i, _)| set >> i & 1 == 1)
        .filter_map(|(_, cap)| cap.headroom())
        .fold(bytes, u64::min)
}

/// Whether CPU memory is short now: a cap ([`CpuCap`]) is set, or the system's available memory
/// is under an eighth of its total. toma counts an error text that reports an allocation failure
/// only ambiguously (oneDNN's `could not create a primitive`) as an out-of-memory only then; see
/// [`Verdict::UnderPressure`](crate::oom::Verdict::UnderPressure). Reads the kernel's figures
/// (tens of microseconds): it is asked when a body has failed, never on the fast path.
pub fn under_pressure() -> bool {
    if CpuCap::ALL.iter().any(|cap| matches!(cap.limit(), Ok(Some(_)))) {
        return true;
    }
    match (imp::system_available(), imp::system_total()) {
        (Ok(available), Ok(total)) => available < total / 8,
        _ => false,
    }
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;

    use super::CpuCap;

    /// The kernel's resource number; a macro, since its type differs between C libraries
    /// (glibc's `__rlimit_resource_t`, musl's `c_int`) and the call site infers it.
    macro_rules! resource {
        ($cap:expr) => {
            match $cap {
                CpuCap::AddressSpace => libc::RLIMIT_AS,
                CpuCap::Data => libc::RLIMIT_DATA,
            }
        };
    }

    pub(super) fn limit(cap: CpuCap) -> io::Result<(Option<u64>, Option<u64>)> {
        let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one `rlimit` into the struct we own.
        if unsafe { libc::getrlimit(resource!(cap), &mut current) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let finite = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
        Ok((finite(current.rlim_cur), finite(current.rlim_max)))
    }

    pub(super) fn set_limit(kind: CpuCap, requested: u64) -> io::Result<()> {
        let (_, hard) = limit(kind)?;
        let cap = hard.map_or(requested, |hard| requested.min(hard));
        let used = in_use(kind)?;
        if cap <= used {
            return Err(super::invalid(crate::ConfigError::CapBelowUse { limit: kind.name(), cap, in_use: used }));
        }
        if kind == CpuCap::AddressSpace && (super::cuda_driver_present() || cuda_driver_loaded()) {
            tracing::warn!(
                "toma: an address-space cap (RLIMIT_AS) on a machine with a CUDA driver: the driver's \
                 address-space reservations count against it and can make CUDA fail; cap CpuCap::Data instead"
            );
        }
        let new = libc::rlimit { rlim_cur: cap as libc::rlim_t, rlim_max: cap as libc::rlim_t };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(resource!(kind), &new) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Cache keys bucket free memory; the cap just changed it.
        super::CAP_CHANGES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        tracing::info!(limit = kind.name(), cap_bytes = cap, in_use_bytes = used, "toma: CPU memory cap set");
        Ok(())
    }

    /// Whether the CUDA driver library is mapped into this process (a build without the
    /// `cuda` feature cannot probe for it otherwise). Read when a cap is set, not more often:
    /// `/proc/self/maps` is long.
    fn cuda_driver_loaded() -> bool {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        maps.lines().filter_map(|line| line.rsplit('/').next()).any(|file| file.starts_with("libcuda.so"))
    }

    pub(super) fn in_use(cap: CpuCap) -> io::Result<u64> {
        match cap {
            CpuCap::AddressSpace => {
                // statm's first field is VmSize in pages: one short read, no parsing of a long file.
                let statm = std::fs::read_to_string("/proc/self/statm")?;
                let pages: u64 = statm
                    .split_whitespace()
                    .next()
                    .and_then(|field| field.parse().ok())
                    .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/self/statm"))?;
                Ok(pages * page_size())
            }
            // statm's data field adds the stack; RLIMIT_DATA counts VmData alone.
            CpuCap::Data => kib_field("/proc/self/status", "VmData:"),
        }
    }

    pub(super) fn kib_field(path: &str, name: &str) -> io::Result<u64> {
        kib_in(&std::fs::read_to_string(path)?, name)
            .map(|kib| kib * 1024)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no {name} in {path}")))
    }

    /// The KiB of the line `name` of a `/proc` table.
    fn kib_in(text: &str, name: &str) -> Option<u64> {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    }

    fn page_size() -> u64 {
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if size > 0 {
            size as u64
        } else {
            4096
        }
    }

    /// `MemAvailable`, read with one `pread` of a `/proc/meminfo` kept open (plans read it every
    /// 50 ms: an open, several reads and a close cost about twice as much).
    pub(super) fn system_available() -> io::Result<u64> {
        // Not as expected (longer than the buffer, say): the whole file.
        available_in_place().map_or_else(|| kib_field("/proc/meminfo", "MemAvailable:"), Ok)
    }

    /// `MemAvailable` from the kept file, `None` where it cannot be read so.
    pub(super) fn available_in_place() -> Option<u64> {
        use std::os::unix::fs::FileExt;
        static MEMINFO: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();
        let file = MEMINFO.get_or_init(|| std::fs::File::open("/proc/meminfo").ok()).as_ref()?;
        let mut buf = [0u8; 4096];
        let n = file.read_at(&mut buf, 0).ok()?;
        let kib = std::str::from_utf8(&buf[..n]).ok().and_then(|text| kib_in(text, "MemAvailable:"))?;
        Some(kib * 1024)
    }

    pub(super) fn system_total() -> io::Result<u64> {
        kib_field("/proc/meminfo", "MemTotal:")
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;

    use super::CpuCap;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "toma's CPU memory cap needs Linux")
    }
    pub(super) fn limit(_cap: CpuCap) -> io::Result<(Option<u64>, Option<u64>)> {
        Err(unsupported())
    }
    pub(super) fn set_limit(_cap: CpuCap, _requested: u64) -> io::Result<()> {
        Err(unsupported())
    }
    pub(super) fn in_use(_cap: CpuCap) -> io::Result<u64> {
        Err(unsupported())
    }
    pub(super) fn system_available() -> io::Result<u64> {
        Err(unsupported())
    }
    pub(super) fn system_total() -> io::Result<u64> {
        Err(unsupported())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn meminfo_read_in_place_agrees_with_a_fresh_read() {
        // The kept file is read again from its start each time: a second read is no end of file.
        let total = imp::system_total().unwrap();
        for _ in 0..3 {
            let kept = imp::available_in_place().expect("MemAvailable read in place");
            let fresh = imp::kib_field("/proc/meminfo", "MemAvailable:").unwrap();
            assert!(kept > 0 && kept <= total, "{kept} of {total}");
            // Other processes move it between the two reads, by far less than a tenth.
            assert!(kept.abs_diff(fresh) < total / 10, "kept {kept}, fresh {fresh}");
        }
    }

    #[test]
    fn bad_requests_are_invalid_input() {
        for cap in CpuCap::ALL {
            for err in [cap.set(0).unwrap_err(), cap.set_headroom(0).unwrap_err()] {
                assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{cap}");
                let inner = err.get_ref().and_then(|e| e.downcast_ref::<ConfigError>());
                assert!(matches!(inner, Some(ConfigError::ZeroSize { .. })), "{err}");
            }
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_cap_below_usage_is_refused_and_changes_nothing() {
        for cap in CpuCap::ALL {
            let before = cap.limit().unwrap();
            // One byte is below any process's use of either figure.
            let err = cap.set(1).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
            let text = err.to_string();
            assert!(text.contains("already uses") && text.contains(cap.name()), "{text}");
            let inner = err.get_ref().and_then(|e| e.downcast_ref::<ConfigError>());
            assert!(matches!(inner, Some(ConfigError::CapBelowUse { cap: 1, .. })), "{err}");
            assert_eq!(cap.limit().unwrap(), before);
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn readings_are_plausible() {
        let size = CpuCap::AddressSpace.in_use().unwrap();
        let data = CpuCap::Data.in_use().unwrap();
        assert!(data > 1 << 20 && size > data, "VmSize {size}, VmData {data}");
        // A private writable mapping counts in VmData. Other test threads map and unmap
        // meanwhile, which can hide the growth once, not five times running.
        let bytes = 64 << 20;
        let grew = (0..5).any(|_| {
            let before = CpuCap::Data.in_use().unwrap();
            // SAFETY: a fresh anonymous mapping, unmapped below; nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            let after = CpuCap::Data.in_use().unwrap();
            // SAFETY: `p` is the mapping of `bytes` made above.
            unsafe { libc::munmap(p, bytes) };
            after >= before + bytes as u64
        });
        assert!(grew, "VmData never grew by a 64 MiB private writable mapping");
        let available = available_cpu_memory();
        assert!(available > 0 && available < u64::MAX, "{available}");
        // Other tests allocate between the two reads, and the kernel reclaims: a little slack.
        assert!(available <= imp::system_available().unwrap() + (256 << 20));
    }

    #[test]
    fn names() {
        assert_eq!(CpuCap::AddressSpace.to_string(), "RLIMIT_AS");
        assert_eq!(CpuCap::Data.name(), "RLIMIT_DATA");
    }
}

//! A cap on the process's CPU memory, and how much of it is left.
//!
//! The cap is `RLIMIT_AS`, the address-space limit: once it is set, allocations beyond it fail
//! inside libtorch with `DefaultCPUAllocator: can't allocate memory`, which toma catches and
//! retries like a CUDA out-of-memory. Linux only; elsewhere the functions report
//! [`std::io::ErrorKind::Unsupported`] and no cap.
//!
//! A cap can be lowered but never raised again by an unprivileged process, so set it once, early,
//! or in a child process.

use std::io;

const GIB: f64 = (1u64 << 30) as f64;

/// Caps the address space of this process at `gib` GiB (`RLIMIT_AS`, soft = hard).
///
/// The cap applied is `min(gib, current hard limit)`: a cap can only be lowered. It counts
/// virtual memory, which includes mapped libraries and thread stacks (libtorch with its CUDA
/// libraries maps several GiB before it allocates anything), so size it against
/// [`address_space_in_use`] rather than against the memory you want for tensors.
///
/// # Errors
/// - [`io::ErrorKind::InvalidInput`] when `gib` is NaN, infinite, zero or negative, or when
///   the cap would sit below the address space already in use (every later allocation would
///   fail; the message says how much is in use).
/// - The OS error when `setrlimit` fails, and [`io::ErrorKind::Unsupported`] off Linux.
///
/// ```no_run
/// // Leave 2 GiB of headroom above what the process maps now.
/// let in_use = toma::cpu_memory::address_space_in_use()? as f64 / (1u64 << 30) as f64;
/// toma::cpu_memory::set_cpu_memory_limit(in_use + 2.0)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn set_cpu_memory_limit(gib: f64) -> io::Result<()> {
    if !gib.is_finite() || gib <= 0.0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("CPU memory limit must be a finite number of GiB above 0, got {gib}"),
        ));
    }
    // f64 → u64 saturates, so a huge request becomes "no lower than the hard limit".
    let requested = (gib * GIB) as u64;
    imp::set_limit(requested)
}

/// The current address-space cap in bytes (`RLIMIT_AS` soft limit), or `None` when unlimited.
///
/// # Errors
/// The OS error when `getrlimit` fails, and [`io::ErrorKind::Unsupported`] off Linux.
pub fn cpu_memory_limit() -> io::Result<Option<u64>> {
    imp::limit().map(|(soft, _hard)| soft)
}

/// Bytes of address space this process has mapped now (`VmSize`), the figure `RLIMIT_AS` counts.
///
/// # Errors
/// When `/proc/self/statm` cannot be read, and [`io::ErrorKind::Unsupported`] off Linux.
pub fn address_space_in_use() -> io::Result<u64> {
    imp::address_space_in_use()
}

/// Bytes of CPU memory an allocation could still get: the smaller of the system's available
/// memory (`MemAvailable`) and the headroom under this process's cap, if one is set.
///
/// Reads the kernel's figures fresh on every call (tens of microseconds); the retry engine's
/// cache keys use a reading up to a second old instead.
pub fn available_cpu_memory() -> u64 {
    let system = imp::system_available().unwrap_or(u64::MAX);
    let headroom = match (cpu_memory_limit(), address_space_in_use()) {
        (Ok(Some(cap)), Ok(used)) => cap.saturating_sub(used),
        _ => u64::MAX,
    };
    system.min(headroom)
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;

    pub(super) fn limit() -> io::Result<(Option<u64>, Option<u64>)> {
        let mut current = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes one `rlimit` into the struct we own.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut current) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let finite = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
        Ok((finite(current.rlim_cur), finite(current.rlim_max)))
    }

    pub(super) fn set_limit(requested: u64) -> io::Result<()> {
        let (_, hard) = limit()?;
        let cap = hard.map_or(requested, |hard| requested.min(hard));
        let used = address_space_in_use()?;
        if cap <= used {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "CPU memory limit of {:.2} GiB is below the {:.2} GiB of address space this process already uses; \
                     every allocation would fail (size the cap from toma::cpu_memory::address_space_in_use())",
                    cap as f64 / super::GIB,
                    used as f64 / super::GIB
                ),
            ));
        }
        let new = libc::rlimit { rlim_cur: cap as libc::rlim_t, rlim_max: cap as libc::rlim_t };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_AS, &new) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // Cache keys bucket free memory; the cap just changed it.
        crate::memory::refresh_free_memory_reading();
        tracing::info!(cap_bytes = cap, in_use_bytes = used, "toma: CPU memory cap set (RLIMIT_AS)");
        Ok(())
    }

    pub(super) fn address_space_in_use() -> io::Result<u64> {
        // statm's first field is VmSize in pages: one short read, no parsing of a long file.
        let statm = std::fs::read_to_string("/proc/self/statm")?;
        let pages: u64 = statm
            .split_whitespace()
            .next()
            .and_then(|field| field.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/self/statm"))?;
        Ok(pages * page_size())
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

    pub(super) fn system_available() -> io::Result<u64> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")?;
        meminfo
            .lines()
            .find_map(|line| line.strip_prefix("MemAvailable:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no MemAvailable in /proc/meminfo"))
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "toma's CPU memory cap needs Linux")
    }
    pub(super) fn limit() -> io::Result<(Option<u64>, Option<u64>)> {
        Err(unsupported())
    }
    pub(super) fn set_limit(_requested: u64) -> io::Result<()> {
        Err(unsupported())
    }
    pub(super) fn address_space_in_use() -> io::Result<u64> {
        Err(unsupported())
    }
    pub(super) fn system_available() -> io::Result<u64> {
        Err(unsupported())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_are_invalid_input() {
        for gib in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -1.0] {
            let err = set_cpu_memory_limit(gib).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{gib}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_cap_below_usage_is_refused_and_changes_nothing() {
        let before = cpu_memory_limit().unwrap();
        // One byte is below any process's address space.
        let err = set_cpu_memory_limit(1.0 / GIB).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("already uses"), "{err}");
        assert_eq!(cpu_memory_limit().unwrap(), before);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn readings_are_plausible() {
        let used = address_space_in_use().unwrap();
        assert!(used > 1 << 20, "VmSize {used}");
        let available = available_cpu_memory();
        assert!(available > 0 && available < u64::MAX, "{available}");
        assert!(available <= imp::system_available().unwrap());
    }
}

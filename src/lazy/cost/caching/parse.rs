//! Reading a `PYTORCH_ALLOC_CONF` string as libtorch 2.11 does (`ConfigTokenizer`,
//! `AcceleratorAllocatorConfig::parseArgs`, and the CUDA keys of `CUDAAllocatorConfig`), so that
//! a [`Config`] can be built from the same text a run used. Finding that text is the caller's job.

use super::config::ROUNDUP_INTERVALS;
use super::sizes::{MIB, MIN_LARGE_ALLOC};
use super::Config;

/// Keys `CUDAAllocatorConfig` knows but that do not change where blocks go.
const CUDA_KEYS: [&str; 10] = [
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "per_process_memory_fraction",
];

/// `ConfigTokenizer`: `,` `:` `[` `]` are tokens of their own, whitespace is dropped.
struct Tokens(Vec<String>);

impl Tokens {
    fn new(conf: &str) -> Tokens {
        let (mut out, mut buf) = (Vec::new(), String::new());
        for ch in conf.chars() {
            if matches!(ch, ',' | ':' | '[' | ']') {
                if !buf.is_empty() {
                    out.push(std::mem::take(&mut buf));
                }
                out.push(ch.to_string());
            } else if !ch.is_whitespace() {
                buf.push(ch);
            }
        }
        if !buf.is_empty() {
            out.push(buf);
        }
        Tokens(out)
    }

    fn at(&self, i: usize) -> Result<&str, String> {
        self.0.get(i).map(String::as_str).ok_or_else(|| "allocator config ends early".to_string())
    }

    fn expect(&self, i: usize, token: &str) -> Result<(), String> {
        let got = self.at(i)?;
        if got == token {
            Ok(())
        } else {
            Err(format!("expected '{token}' in allocator config, got '{got}'"))
        }
    }

    /// `toSizeT` (`std::stoull`): the leading digits.
    fn size(&self, i: usize) -> Result<u64, String> {
        let t = self.at(i)?;
        let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().map_err(|_| format!("expected a number in allocator config, got '{t}'"))
    }

    /// `toDouble` (`std::stod`).
    fn double(&self, i: usize) -> Result<f64, String> {
        let t = self.at(i)?;
        t.parse().map_err(|_| format!("expected a number in allocator config, got '{t}'"))
    }

    /// `toBool`: exactly `True` or `False`.
    fn boolean(&self, i: usize) -> Result<bool, String> {
        match self.at(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            t => Err(format!("expected 'True' or 'False' in allocator config, got '{t}'")),
        }
    }

    /// `skipKey`: the index of the key's value, or of the `]` closing a list value.
    fn skip_key(&self, i: usize) -> Result<usize, String> {
        self.expect(i + 1, ":")?;
        let mut i = i + 2;
        if self.at(i)? == "[" {
            while self.at(i)? != "]" {
                i += 1;
            }
        }
        Ok(i)
    }
}

impl Config {
    /// The settings a `PYTORCH_ALLOC_CONF` (or `PYTORCH_CUDA_ALLOC_CONF`) string gives, e.g.
    /// `"max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True"`.
    /// Errors where libtorch would refuse the string.
    pub(crate) fn parse(conf: &str) -> Result<Config, String> {
        let t = Tokens::new(conf);
        let mut c = Config::default();
        // `parseArgs` reads large_segment_size_mb first: the other sizes are checked against it.
        let mut i = 0;
        while i < t.0.len() {
            if t.0[i] == "large_segment_size_mb" {
                t.expect(i + 1, ":")?;
                let mb = t.size(i + 2)?;
                if mb <= MIN_LARGE_ALLOC / MIB {
                    return Err(format!("large_segment_size_mb must be > {} MB", MIN_LARGE_ALLOC / MIB));
                }
                c.large_segment_size = mb.min(u64::MAX / MIB) * MIB;
            }
            i += 1;
        }
        c.max_non_split_rounding = c.large_segment_size;
        let mut i = 0;
        while i < t.0.len() {
            let key = t.at(i)?;
            i = match key {
                "max_split_size_mb" => c.parse_at_least(&t, i, "max_split_size_mb", |c, b| c.max_split_size = b)?,
                "max_non_split_rounding_mb" => {
                    c.parse_at_least(&t, i, "max_non_split_rounding_mb", |c, b| c.max_non_split_rounding = b)?
                }
                "garbage_collection_threshold" => {
                    t.expect(i + 1, ":")?;
                    let v = t.double(i + 2)?;
                    if !(v > 0.0 && v < 1.0) {
                        return Err("garbage_collect_threshold is invalid, set it in (0.0, 1.0)".into());
                    }
                    c.garbage_collection_threshold = v;
                    i + 2
                }
                "roundup_power2_divisions" => c.parse_divisions(&t, i)?,
                "expandable_segments" => {
                    t.expect(i + 1, ":")?;
                    c.expandable_segments = t.boolean(i + 2)?;
                    i + 2
                }
                "per_process_memory_fraction" => {
                    t.expect(i + 1, ":")?;
                    let v = t.double(i + 2)?;
                    if !(0.0..=1.0).contains(&v) {
                        return Err("per_process_memory_fraction is invalid, set it in [0.0, 1.0]".into());
                    }
                    c.per_process_memory_fraction = v;
                    i + 2
                }
                "large_segment_size_mb" => t.skip_key(i)?,
                k if CUDA_KEYS.contains(&k) => t.skip_key(i)?,
                k => return Err(format!("Unrecognized key '{k}' in CUDA allocator config.")),
            };
            if i + 1 < t.0.len() {
                t.expect(i + 1, ",")?;
                i += 1;
            }
            i += 1;
        }
        Ok(c)
    }

    /// `parseMaxSplitSize`, `parseMaxNonSplitRoundingSize`: MiB, at least `large_segment_size`.
    fn parse_at_least(
        &mut self,
        t: &Tokens,
        i: usize,
        key: &str,
        set: impl FnOnce(&mut Config, u64),
    ) -> Result<usize, String> {
        t.expect(i + 1, ":")?;
        let mb = t.size(i + 2)?;
        let min = self.large_segment_size / MIB;
        if mb < min {
            return Err(format!("CachingAllocator option {key} too small, must be >= {min}"));
        }
        set(self, mb.min(u64::MAX / MIB) * MIB);
        Ok(i + 2)
    }

    /// `parseRoundUpPower2Divisions`: one power of two for every interval, or a list of
    /// `MiB:divisions` where the first entry also fills the intervals below it and `>` fills
    /// those after the previous entry.
    fn parse_divisions(&mut self, t: &Tokens, i: usize) -> Result<usize, String> {
        t.expect(i + 1, ":")?;
        let mut i = i + 2;
        let table = &mut self.roundup_power2_divisions;
        if t.at(i)? != "[" {
            let v = t.size(i)?;
            if !v.is_power_of_two() {
                return Err("For roundups, the divisions has to be power of 2".into());
            }
            *table = [v; ROUNDUP_INTERVALS];
            return Ok(i);
        }
        let (mut first, mut last_index) = (true, 0usize);
        loop {
            i += 1;
            if t.at(i)? == "]" {
                return Ok(i);
            }
            let bound = i;
            t.expect(i + 1, ":")?;
            let v = t.size(i + 2)?;
            i += 2;
            if v != 0 && !v.is_power_of_two() {
                return Err("For roundups, the divisions has to be power of 2 or 0 to disable roundup".into());
            }
            if t.at(bound)? == ">" {
                // `std::fill` from last_index + 1: a leading `>` leaves entry 0 alone.
                table.iter_mut().skip(last_index + 1).for_each(|d| *d = v);
            } else {
                let b = t.size(bound)?;
                if !b.is_power_of_two() {
                    return Err("For roundups, the intervals have to be power of 2".into());
                }
                let index = (63 - b.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                if first {
                    table[..index].iter_mut().for_each(|d| *d = v);
                    first = false;
                }
                table[index] = v;
                last_index = index;
            }
            if t.at(i + 1)? != "]" {
                t.expect(i + 1, ",")?;
                i += 1;
            }
        }
    }
}

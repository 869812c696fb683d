//! Batch-size policies against random true limits: how close each ends to the largest size
//! that fits, and after how many attempts (body runs, failed ones included).
//!
//! Each trial calls one function repeatedly (as a training or inference loop does) with a body
//! that runs out of memory above a random limit, and the `Global` cache carrying what was
//! learned from call to call. Target (issue 5): `grow` reaches ≥ 95% of the limit within
//! ⌈log2(initial)⌉ + 3 attempts.

use toma::{Batch, CacheKind, Policy};

/// Deterministic (xorshift), so runs compare.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

struct Trial {
    /// Attempts until a call first ended at ≥ 95% of the limit (None: never within the calls).
    attempts_to_95: Option<u32>,
    final_ratio: f64,
    budget: u32,
}

fn trial(policy: Policy, initial: usize, limit: usize, calls: usize) -> Trial {
    toma::cache::clear();
    let mut attempts = 0;
    let mut attempts_to_95 = None;
    let mut last = 0;
    for _ in 0..calls {
        let (out, report) = Batch::new(initial).cache(CacheKind::Global).policy(policy).run_with_report(|size| {
            if size > limit {
                Err("CUDA out of memory. Tried to allocate 2.00 MiB".to_string())
            } else {
                Ok(size)
            }
        });
        attempts += report.attempts;
        last = out.expect("size 1 always fits here");
        if attempts_to_95.is_none() && last as f64 >= 0.95 * limit as f64 {
            attempts_to_95 = Some(attempts);
        }
    }
    let budget = usize::BITS - (initial - 1).leading_zeros() + 3;
    Trial { attempts_to_95, final_ratio: last as f64 / limit as f64, budget }
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to configure here.
    let policies = [("halve", Policy::halve()), ("factor(0.9)", Policy::factor(0.9)), ("grow", Policy::grow())];
    const TRIALS: usize = 2000;
    const CALLS: usize = 12;
    println!("policy simulation: {TRIALS} random (initial, limit) pairs, initial in 2..=4096, limit in 1..initial,");
    println!("{CALLS} calls each; attempts count every body run, failed ones included\n");
    println!(
        "{:<12} {:>14} {:>14} {:>22} {:>26}",
        "policy", "final/limit", "worst", "reached ≥95% (trials)", "within ⌈log2 init⌉+3 (trials)"
    );
    for (name, policy) in policies {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let (mut sum, mut worst, mut reached, mut within) = (0.0, f64::INFINITY, 0, 0);
        for _ in 0..TRIALS {
            let initial = 2 + rng.below(4095) as usize;
            let limit = 1 + rng.below(initial as u64 - 1) as usize;
            let t = trial(policy, initial, limit, CALLS);
            sum += t.final_ratio;
            worst = worst.min(t.final_ratio);
            if let Some(n) = t.attempts_to_95 {
                reached += 1;
                if n <= t.budget {
                    within += 1;
                }
            }
        }
        println!(
            "{name:<12} {:>13.1}% {:>13.1}% {:>21.1}% {:>25.1}%",
            100.0 * sum / TRIALS as f64,
            100.0 * worst,
            100.0 * reached as f64 / TRIALS as f64,
            100.0 * within as f64 / TRIALS as f64
        );
    }
}

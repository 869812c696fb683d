//! What agreement costs: ranks in real processes on 127.0.0.1 (this binary, started again per
//! helper rank), agreeing through c10d's TCPStore.
//!
//! - `round`: one agreement round (`Group::all_reduce` of one integer), what a grouped call
//!   pays after every attempt;
//! - `grouped_call`: a whole `Batch::new(64).group(..).run(..)` whose body succeeds at once (two
//!   rounds: the start and the attempt);
//! - `plain_call`: the same call without a group, side by side.
//!
//! `cargo bench --features dist --bench dist`. Target (issue 16): median round ≤ 1 ms at 4 ranks.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use toma::dist::{Config, Group, Reduce};
use toma::{Batch, CacheKind};

const ROUND: i64 = 1;
const CALL: i64 = 2;
const STOP: i64 = 3;

fn round(group: &Group) {
    group.all_reduce("bench/round", Reduce::Min, &[1]).expect("round");
}

/// One call site for every rank (a grouped call's namespace is its location).
fn grouped_call(group: &Group) -> usize {
    Batch::new(64).cache(CacheKind::None).group(group).run(Ok::<_, String>).expect("grouped call")
}

fn plain_call() -> usize {
    Batch::new(64).cache(CacheKind::None).run(Ok::<_, String>).expect("plain call")
}

/// A helper rank: does what rank 0 announces, as many times, until told to stop.
fn helper(rank: usize, world: usize, port: u16) {
    let group = Config::new("127.0.0.1", port, rank, world).connect().expect("helper joins");
    loop {
        let cmd = group.all_reduce("bench/cmd", Reduce::Max, &[0, 0]).expect("command");
        match cmd[0] {
            ROUND => (0..cmd[1]).for_each(|_| round(&group)),
            CALL => (0..cmd[1]).for_each(|_| {
                grouped_call(&group);
            }),
            _ => return,
        }
    }
}

fn bench_world(c: &mut Criterion, world: usize) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let exe = std::env::current_exe().unwrap();
    let helpers: Vec<Child> = (1..world)
        .map(|rank| {
            Command::new(&exe)
                .env("TOMA_BENCH_RANK", rank.to_string())
                .env("TOMA_BENCH_WORLD", world.to_string())
                .env("TOMA_BENCH_PORT", port.to_string())
                .spawn()
                .expect("spawn a helper rank")
        })
        .collect();
    let group = Config::new("127.0.0.1", port, 0, world).connect().expect("rank 0 joins");
    let announce = |what: i64, iters: u64| {
        group.all_reduce("bench/cmd", Reduce::Max, &[what, iters as i64]).expect("announce");
    };
    let mut g = c.benchmark_group("agreement");
    g.warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    g.bench_function(BenchmarkId::new("round", format!("{world} ranks")), |b| {
        b.iter_custom(|iters| {
            announce(ROUND, iters);
            let started = Instant::now();
            (0..iters).for_each(|_| round(&group));
            started.elapsed()
        })
    });
    g.bench_function(BenchmarkId::new("grouped_call", format!("{world} ranks")), |b| {
        b.iter_custom(|iters| {
            announce(CALL, iters);
            let started = Instant::now();
            (0..iters).for_each(|_| {
                std::hint::black_box(grouped_call(&group));
            });
            started.elapsed()
        })
    });
    g.bench_function(BenchmarkId::new("plain_call", format!("{world} ranks")), |b| b.iter(plain_call));
    g.finish();
    announce(STOP, 0);
    for mut helper in helpers {
        helper.wait().expect("helper exits");
    }
}

fn main() {
    if let Ok(rank) = std::env::var("TOMA_BENCH_RANK") {
        let var = |name: &str| -> usize { std::env::var(name).unwrap().parse().unwrap() };
        helper(rank.parse().unwrap(), var("TOMA_BENCH_WORLD"), var("TOMA_BENCH_PORT") as u16);
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    for world in [2, 4] {
        bench_world(&mut c, world);
    }
    c.final_summary();
}

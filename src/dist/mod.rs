//! Ranks that agree: one process per GPU (launched by `torchrun`, or Slurm with the same
//! variables) retry and shrink together, through PyTorch's own c10d store.
//!
//! Without agreement, a rank that retries alone while its peers wait in a collective hangs the
//! job, and a rank that gives up leaves its peers stuck until a watchdog fires. With a
//! [`Group`], the ranks agree after every attempt, through the `TCPStore` torchrun's agent
//! hosts:
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use tch::{nn, nn::OptimizerConfig, Device, Kind, Tensor};
//! use toma::lazy::{lazy, Options};
//!
//! let group = toma::dist::Group::from_env()?; // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! let data = Tensor::randn([10_000, 512], tch::kind::FLOAT_CPU);
//! let weights = Tensor::randn([512, 512], tch::kind::FLOAT_CPU);
//! // Every rank runs each attempt at the same size; if any rank runs out of memory, all
//! // retry at the same smaller one.
//! let size = toma::Batch::new(4096).group(&group).run(|batch| {
//!     let out = data.f_narrow(0, 0, batch as i64)?.f_matmul(&weights)?;
//!     Ok::<_, tch::TchError>(out.size()[0])
//! })?;
//! println!("rank {} of {}: batch {size}", group.rank(), group.world_size());
//!
//! // Training over ranks with different cards and batch sizes: exact gradients.
//! let vs = nn::VarStore::new(Device::Cpu);
//! let linear = nn::linear(vs.root() / "l", 512, 10, Default::default());
//! let mut opt = nn::Sgd::default().build(&vs, 0.1)?;
//! let labels = Tensor::randint(10, [10_000], (Kind::Int64, Device::Cpu));
//! let (x, y) = lazy((&data, &labels), 0); // this rank's own batch
//! let loss = x.apply(&linear).cross_entropy_for_logits(&y);
//! opt.zero_grad();
//! loss.backward_with(&Options::new().group(&group))?; // global weights, then a Gloo sum
//! opt.step();
//! # Ok(()) }
//! ```
//!
//! `examples/dist.rs` does both; run it as a job of two ranks:
//!
//! ```sh
//! cargo build --release --features dist --example dist
//! torchrun --nproc-per-node=2 --no-python target/release/examples/dist
//! ```
//!
//! ## What is agreed, and when
//! After every attempt of a grouped call ([`Batch::group`](crate::Batch::group),
//! [`Range::group`](crate::Range::group), [`Chunked::group`](crate::Chunked::group)) the ranks
//! exchange one small record through the store (Composer's protocol, in one round):
//! - **all succeeded**: the call goes on (a batch returns; a range takes its next chunk at the
//!   smallest next step any rank proposes, so `auto` steps follow the smallest card);
//! - **some rank ran out of memory**: every rank shrinks to the same next size, the smallest any
//!   rank's policy proposes, and records the same failure in its cache. A [`Batch`](crate::Batch)
//!   is one unit of work, so every rank runs it again at that size, the ranks that succeeded
//!   too; a range's finished chunks stand on every rank (its items are never run twice) and only
//!   the step changes;
//! - **some rank failed for good** (out of memory at size 1, another error, or a panic): every
//!   rank returns [`GroupError`], which names that rank and its message; the rank that failed
//!   gets its own error back ([`GroupError::Local`]), or its panic.
//! - **a rank died or hangs**: the others return [`DistError::Timeout`] naming it after the
//!   group's timeout (5 minutes unless set: [`Config::timeout`] or `TOMA_DIST_TIMEOUT`;
//!   joining has its own, [`Config::join_timeout`] or `TOMA_DIST_JOIN_TIMEOUT`). Nothing waits
//!   forever.
//!
//! Each rank keeps its own range (ranks may hold different amounts of data): a rank that is
//! done keeps answering rounds until every rank is done. The first size of a call is the
//! smallest any rank would start at (its cache, its plan).
//!
//! ## Keys
//! Rounds use the store's keys `toma/<restart>/<namespace>/<round>/<rank>`, where `<restart>` is
//! `TORCHELASTIC_RESTART_COUNT` (0 outside torchrun) and `<namespace>` is the call site
//! (`file:line:column`) for grouped calls, or the name given to [`Group::all_reduce`] and
//! [`Group::barrier`]. Each namespace counts its own rounds, so calls never collide, and each
//! rank deletes its key of the round before, so the store holds at most one key per rank and
//! namespace. Values are ASCII: integers joined by `,`, and for grouped calls the failure
//! message after a `;`. Joining is a round of namespace `join` whose value is the world size;
//! leaving adds 1 to `toma/<restart>/exit` (the rank that hosts the store waits for every rank
//! to leave before it takes the store down). Any process that can reach the store can take
//! part: a Python rank with `torch.distributed.TCPStore` (`tests/dist/py_rank.py` does).
//!
//! ## Gradients
//! [`Group::all_reduce_sum`] sums tensors across ranks over a c10d Gloo process group created
//! on first use over the same store (on the CPU; CUDA tensors are staged through the host by
//! Gloo). For exact gradients over ranks with different batch sizes, weight each rank's mean
//! loss by its share of the global count ([`Group::all_reduce`] with [`Reduce::Sum`] gives it),
//! or let `toma::lazy` do both: [`Options::group`](crate::lazy::Options::group) lets each rank
//! plan its own micro-batch under its own budget (mixed cards), weighs mean losses by the
//! *global* sample or target count, and sums `.grad()` across ranks, so every rank ends with
//! the gradient of one backward over the union of all batches.
//!
//! Gloo's headers: the PyPI wheel has gloo's code inside `libtorch_cpu.so` but not its headers,
//! which `ProcessGroupGloo.hpp` includes. `scripts/ensure-gloo-headers.sh` takes them from
//! Debian's `libgloo-dev` (49 kB, pinned by SHA-256; nothing of it is linked), and toma only
//! creates the group and calls `allreduce` through c10d's classes. Without them `dist` still
//! builds, and [`Group::all_reduce_sum`] returns [`DistError::Gloo`] saying so.
//!
//! ## Not covered
//! - Collectives inside your retried body (a gradient all-reduce in the forward pass, a
//!   `barrier` in a data loader): toma cannot see them. If one rank runs out of memory before
//!   such a collective while its peers wait in it, that collective hangs until its own
//!   timeout. Keep collectives outside the retried body, and sum gradients after it.
//! - NCCL: the gradient sum runs over Gloo, also for CUDA tensors, staged through the host (an
//!   NCCL group needs the CUDA headers and a GPU session to test it).
//! - Elastic membership changes within a call.
//! - The attributes: `#[toma::batch]` returns the body's own error type, and grouped calls
//!   return [`GroupError`], so grouping is for the builders only.
//!
//! ## Tested, and what it costs
//! `tests/dist/` runs ranks as real processes on 127.0.0.1, in CI: 2 and 4 ranks failing at
//! different sizes end at the same size with identical attempt histories; the same under real
//! allocator failures (a CPU cap per rank); one rank failing for good (an error, or out of
//! memory at size 1) fails every rank with its message; a killed rank (the store's host, or
//! not) makes the others fail within the timeout (4 s in the test), with no C++ stack trace on
//! stderr; a lazy step split differently on 2 and 3 ranks of different batch sizes matches the
//! single-process full-batch gradient (1e-5); a job under real `torchrun` (agent store: every
//! rank a client); a job with one Python rank; Gloo sums across 3 ranks.
//!
//! A round is four store requests (set this rank's key, wait for all, read all, delete this
//! rank's key of the round before): 0.34 ms with 2 ranks and 0.45 ms with 4 on a 2-core
//! machine (`cargo bench --features dist --bench dist`; `docs/performance.md` has the table).
//! Against a GPU step of tens of milliseconds that is noise; for a range over tiny chunks it
//! is not, so a grouped range pays most where the step is small.

mod error;
mod store;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use error::{DistError, GroupError};
use store::{Gloo, ShimError, Store};

/// How [`Group::all_reduce`] combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The largest.
    Max,
    /// The smallest.
    Min,
    /// The sum (saturating).
    Sum,
}

impl Reduce {
    fn apply(self, a: i64, b: i64) -> i64 {
        match self {
            Reduce::Max => a.max(b),
            Reduce::Min => a.min(b),
            Reduce::Sum => a.saturating_add(b),
        }
    }
}

/// Where a group's store is and who this rank is: [`Config::from_env`] reads torchrun's
/// variables, [`Config::new`] takes them by hand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    host_store: bool,
    restart: u64,
    timeout: Duration,
    /// `None`: the timeout.
    join_timeout: Option<Duration>,
}

impl Config {
    /// The default [`timeout`](Self::timeout): 5 minutes.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    /// Rank `rank` of `world_size`, with the store at `host:port`, hosted by rank 0.
    pub fn new(host: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Config {
        Config {
            host: host.into(),
            port,
            rank,
            world_size,
            local_rank: rank,
            host_store: rank == 0,
            restart: 0,
            timeout: Self::DEFAULT_TIMEOUT,
            join_timeout: None,
        }
    }

    /// torchrun's variables: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` (required),
    /// `LOCAL_RANK` (default: `RANK`), `TORCHELASTIC_USE_AGENT_STORE` (`True`: torchrun's agent
    /// hosts the store and every rank is a client; otherwise rank 0 hosts it),
    /// `TORCHELASTIC_RESTART_COUNT` (keys of a restarted job never meet the old ones),
    /// `TOMA_DIST_TIMEOUT` (seconds; default 300) and `TOMA_DIST_JOIN_TIMEOUT` (seconds; default:
    /// the timeout).
    pub fn from_env() -> Result<Config, DistError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Config, DistError> {
        fn parse<T: std::str::FromStr>(
            var: &impl Fn(&str) -> Option<String>,
            name: &'static str,
        ) -> Result<T, DistError> {
            let text = var(name).ok_or(DistError::Env { var: name, problem: "is not set".into() })?;
            text.trim().parse().map_err(|_| DistError::Env { var: name, problem: format!("is not a number: {text:?}") })
        }
        let host = var("MASTER_ADDR").ok_or(DistError::Env { var: "MASTER_ADDR", problem: "is not set".into() })?;
        let port: u16 = parse(&var, "MASTER_PORT")?;
        let rank: usize = parse(&var, "RANK")?;
        let world_size: usize = parse(&var, "WORLD_SIZE")?;
        let mut config = Config::new(host, port, rank, world_size);
        if var("LOCAL_RANK").is_some() {
            config.local_rank = parse(&var, "LOCAL_RANK")?;
        }
        if var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1") {
            config.host_store = false;
        }
        if var("TORCHELASTIC_RESTART_COUNT").is_some() {
            config.restart = parse(&var, "TORCHELASTIC_RESTART_COUNT")?;
        }
        // A positive, finite number of seconds, when set.
        let seconds = |name: &'static str| -> Result<Option<Duration>, DistError> {
            if var(name).is_none() {
                return Ok(None);
            }
            let seconds: f64 = parse(&var, name)?;
            if !(seconds > 0.0 && seconds.is_finite()) {
                return Err(DistError::Env {
                    var: name,
                    problem: format!("must be a positive number of seconds, got {seconds}"),
                });
            }
            Ok(Some(Duration::from_secs_f64(seconds)))
        };
        if let Some(timeout) = seconds("TOMA_DIST_TIMEOUT")? {
            config.timeout = timeout;
        }
        if let Some(timeout) = seconds("TOMA_DIST_JOIN_TIMEOUT")? {
            config.join_timeout = Some(timeout);
        }
        Ok(config)
    }

    /// How long a rank waits for the others (to connect, and in each round) before it returns
    /// [`DistError::Timeout`]. Default 5 minutes.
    pub fn timeout(mut self, timeout: Duration) -> Config {
        self.timeout = timeout;
        self
    }

    /// How long [`connect`](Self::connect) waits for the store and for every rank to join
    /// (default: the [`timeout`](Self::timeout)). Ranks start unevenly (loading libtorch, a
    /// model, data), so joining may deserve longer than a round.
    pub fn join_timeout(mut self, timeout: Duration) -> Config {
        self.join_timeout = Some(timeout);
        self
    }

    /// Whether this rank hosts the store (default: rank 0, unless torchrun's agent does).
    pub fn host_store(mut self, host: bool) -> Config {
        self.host_store = host;
        self
    }

    /// The local rank (which GPU on its machine; default: the rank).
    pub fn local_rank(mut self, local_rank: usize) -> Config {
        self.local_rank = local_rank;
        self
    }

    /// Connects this rank and waits until every rank has (at most the timeout).
    pub fn connect(self) -> Result<Group, DistError> {
        Group::connect(self)
    }
}

/// The ranks of one job, agreeing through c10d's `TCPStore`. Cheap to clone (shared).
///
/// Every rank must make the same grouped calls, [`all_reduce`](Self::all_reduce)s and
/// [`barrier`](Self::barrier)s in the same order per namespace, as with any collective.
#[derive(Clone)]
pub struct Group {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    store: Store,
    prefix: String,
    /// Next round of each namespace.
    rounds: Mutex<HashMap<String, u64>>,
    /// Created by the first gradient all-reduce.
    gloo: Mutex<Option<Gloo>>,
    /// A round failed: peers may be gone, so leaving waits only for those known alive.
    broken: std::sync::atomic::AtomicBool,
    /// How many ranks a failed round found missing (they will never leave).
    missing: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("store", &format_args!("{}:{}", self.inner.config.host, self.inner.config.port))
            .field("timeout", &self.inner.config.timeout)
            .finish()
    }
}

impl PartialEq for Group {
    /// The same connection (clones of one group).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Group {
    /// [`Config::from_env`], then [`Config::connect`].
    pub fn from_env() -> Result<Group, DistError> {
        Config::from_env()?.connect()
    }

    /// Connects as `config` says and waits for every rank (see [`Config::connect`]).
    pub fn connect(config: Config) -> Result<Group, DistError> {
        if config.world_size == 0 {
            return Err(DistError::Config("the world size must be at least 1".into()));
        }
        if config.rank >= config.world_size {
            return Err(DistError::Config(format!(
                "rank {} is not below the world size {}",
                config.rank, config.world_size
            )));
        }
        let started = Instant::now();
        let join_timeout = config.join_timeout.unwrap_or(config.timeout);
        let store = Store::connect(&config.host, config.port, config.host_store, join_timeout).map_err(|e| {
            DistError::Connect {
                rank: config.rank,
                addr: format!("{}:{}", config.host, config.port),
                waited: started.elapsed(),
                message: e.message,
            }
        })?;
        let prefix = format!("toma/{}/", config.restart);
        let group = Group {
            inner: Arc::new(Inner {
                config,
                store,
                prefix,
                rounds: Mutex::new(HashMap::new()),
                gloo: Mutex::new(None),
                broken: std::sync::atomic::AtomicBool::new(false),
                missing: std::sync::atomic::AtomicUsize::new(0),
            }),
        };
        // Everyone arrives, with the same world size.
        let sizes = group.exchange_within("join", &[group.world_size() as i64], "", join_timeout)?;
        if let Some((rank, _)) =
            sizes.iter().enumerate().find(|(_, (v, _))| v.first() != Some(&(group.world_size() as i64)))
        {
            return Err(DistError::Mismatch(format!(
                "rank {rank} has world size {:?}, rank {} has {}",
                sizes[rank].0.first(),
                group.rank(),
                group.world_size()
            )));
        }
        tracing::debug!(rank = group.rank(), world_size = group.world_size(), "toma::dist: joined");
        Ok(group)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.config.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.config.world_size
    }

    /// The local rank (which GPU on its machine).
    pub fn local_rank(&self) -> usize {
        self.inner.config.local_rank
    }

    /// How long a round waits for every rank.
    pub fn timeout(&self) -> Duration {
        self.inner.config.timeout
    }

    /// Combines each rank's `values` element by element (every rank passes as many); all
    /// ranks get the same result. `namespace` names the call (see the module docs' "Keys").
    pub fn all_reduce(&self, namespace: &str, op: Reduce, values: &[i64]) -> Result<Vec<i64>, DistError> {
        self.reduce(namespace, values, |v| v, |v| v, |a, b| op.apply(a, b))
    }

    /// [`all_reduce`](Self::all_reduce) of `f64`s (each travels as its bit pattern, an `i64`).
    pub fn all_reduce_f64(&self, namespace: &str, op: Reduce, values: &[f64]) -> Result<Vec<f64>, DistError> {
        let combine = |a: f64, b: f64| match op {
            Reduce::Max => a.max(b),
            Reduce::Min => a.min(b),
            Reduce::Sum => a + b,
        };
        self.reduce(namespace, values, |v| v.to_bits() as i64, |v| f64::from_bits(v as u64), combine)
    }

    /// One round of `values` (sent as `encode`d integers), folded in rank order with `combine`.
    fn reduce<T: Copy>(
        &self,
        namespace: &str,
        values: &[T],
        encode: impl Fn(T) -> i64,
        decode: impl Fn(i64) -> T,
        combine: impl Fn(T, T) -> T,
    ) -> Result<Vec<T>, DistError> {
        let sent: Vec<i64> = values.iter().map(|&v| encode(v)).collect();
        let all = self.exchange_checked(namespace, &sent, "")?;
        let mut out = values.to_vec();
        for (rank, (theirs, _)) in all.iter().enumerate() {
            if rank != self.rank() {
                for (o, &v) in out.iter_mut().zip(theirs) {
                    *o = combine(*o, decode(v));
                }
            }
        }
        Ok(out)
    }

    /// Returns once every rank has reached the barrier `namespace` (or the timeout passed).
    pub fn barrier(&self, namespace: &str) -> Result<(), DistError> {
        self.exchange(namespace, &[], "").map(drop)
    }

    /// Sums `tensors` across the ranks, in place (a c10d Gloo all-reduce; every rank passes the
    /// same shapes in the same order). The group is created on the first call, which every rank
    /// must make. Meant for gradients after a step: `vs.trainable_variables()` and their
    /// `.grad()`.
    pub fn all_reduce_sum(&self, tensors: &[&tch::Tensor]) -> Result<(), DistError> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let mut gloo = self.inner.gloo.lock().unwrap_or_else(|e| e.into_inner());
        if gloo.is_none() {
            let prefix = format!("{}gloo/", self.inner.prefix);
            let created = Gloo::new(&self.inner.store, &prefix, self.rank(), self.world_size(), self.timeout())
                .map_err(|e| DistError::Gloo(e.message))?;
            *gloo = Some(created);
        }
        let group = gloo.as_mut().expect("created above");
        group.all_reduce_sum(tensors).map_err(|e| {
            if e.timeout {
                self.inner.broken.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            DistError::Gloo(e.message)
        })
    }

    fn key(&self, namespace: &str, round: u64) -> String {
        format!("{}{namespace}/{round}/", self.inner.prefix)
    }

    /// [`exchange`](Self::exchange), failing when a rank sent a different number of values (the
    /// ranks made different calls under one namespace).
    pub(crate) fn exchange_checked(
        &self,
        namespace: &str,
        values: &[i64],
        message: &str,
    ) -> Result<Vec<(Vec<i64>, String)>, DistError> {
        let all = self.exchange(namespace, values, message)?;
        if let Some((rank, (theirs, _))) = all.iter().enumerate().find(|(_, (v, _))| v.len() != values.len()) {
            return Err(DistError::Mismatch(format!(
                "`{namespace}`: rank {rank} sent {} value(s), rank {} sent {}: the ranks made different calls there",
                theirs.len(),
                self.rank(),
                values.len()
            )));
        }
        Ok(all)
    }

    /// One round: every rank publishes `values` (and a message), and gets every rank's, in rank
    /// order.
    pub(crate) fn exchange(
        &self,
        namespace: &str,
        values: &[i64],
        message: &str,
    ) -> Result<Vec<(Vec<i64>, String)>, DistError> {
        self.exchange_within(namespace, values, message, self.timeout())
    }

    fn exchange_within(
        &self,
        namespace: &str,
        values: &[i64],
        message: &str,
        timeout: Duration,
    ) -> Result<Vec<(Vec<i64>, String)>, DistError> {
        let round = {
            let mut rounds = self.inner.rounds.lock().unwrap_or_else(|e| e.into_inner());
            let next = rounds.entry(namespace.to_owned()).or_insert(0);
            *next += 1;
            *next - 1
        };
        let result = self.exchange_round(namespace, round, values, message, timeout);
        if result.is_err() {
            self.inner.broken.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        result
    }

    fn exchange_round(
        &self,
        namespace: &str,
        round: u64,
        values: &[i64],
        message: &str,
        timeout: Duration,
    ) -> Result<Vec<(Vec<i64>, String)>, DistError> {
        let store = &self.inner.store;
        let base = self.key(namespace, round);
        let mut payload = values.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        if !message.is_empty() {
            payload.push(';');
            payload.push_str(message);
        }
        store.set(&format!("{base}{}", self.rank()), payload.as_bytes()).map_err(|e| e.store("set"))?;
        let keys: Vec<String> = (0..self.world_size()).map(|r| format!("{base}{r}")).collect();
        let started = Instant::now();
        if let Err(err) = store.wait(&keys, timeout) {
            return Err(self.missing(&base, &keys, started.elapsed(), err));
        }
        let raw = store.multi_get(&keys).map_err(|e| e.store("multi_get"))?;
        // Everyone has published this round, so everyone is done reading the last one.
        if round > 0 {
            let _ = store.delete(&format!("{}{}", self.key(namespace, round - 1), self.rank()));
        }
        raw.iter()
            .enumerate()
            .map(|(rank, bytes)| {
                parse_payload(bytes).ok_or_else(|| {
                    DistError::Mismatch(format!(
                        "rank {rank} wrote {:?} at `{base}{rank}`",
                        String::from_utf8_lossy(bytes)
                    ))
                })
            })
            .collect()
    }

    /// The error for a wait that failed: which ranks are missing, if the store can still say.
    #[cold]
    fn missing(&self, base: &str, keys: &[String], waited: Duration, err: ShimError) -> DistError {
        let missing: Result<Vec<usize>, ShimError> = keys
            .iter()
            .enumerate()
            .filter_map(|(rank, key)| match self.inner.store.exists(key) {
                Ok(true) => None,
                Ok(false) => Some(Ok(rank)),
                Err(e) => Some(Err(e)),
            })
            .collect();
        match missing {
            Ok(missing) if err.timeout || !missing.is_empty() => {
                self.inner.missing.fetch_max(missing.len(), std::sync::atomic::Ordering::Relaxed);
                DistError::Timeout { key: base.to_owned(), missing, waited, rank: self.rank() }
            }
            Ok(_) => err.store("wait"),
            // The store itself is gone (its host ended): say so, with the wait's message.
            Err(_) => err.store("wait"),
        }
    }
}

fn parse_payload(bytes: &[u8]) -> Option<(Vec<i64>, String)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (numbers, message) = text.split_once(';').unwrap_or((text, ""));
    let values = if numbers.is_empty() {
        Vec::new()
    } else {
        numbers.split(',').map(|n| n.trim().parse().ok()).collect::<Option<Vec<i64>>>()?
    };
    Some((values, message.to_owned()))
}

impl Drop for Inner {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        // The rank that hosts the store keeps it up until every rank has left, so that none
        // loses the store in the middle of a round. After a failed round it waits only for the
        // ranks not found missing (they saw or will see the failure within their timeout); when
        // the failure left it unknown who is alive, it does not wait.
        let key = format!("{}exit", self.prefix);
        let left = self.store.add(&key, 1);
        if !self.config.host_store {
            return;
        }
        let world = self.config.world_size as i64;
        let expected = match (self.broken.load(Relaxed), self.missing.load(Relaxed)) {
            (false, _) => world,
            (true, 0) => return,
            (true, missing) => world - missing as i64,
        };
        let deadline = Instant::now() + self.config.timeout;
        let mut left = left.ok();
        while left.is_some_and(|n| n < expected) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            left = self.store.add(&key, 0).ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip() {
        assert_eq!(parse_payload(b"1,-2,3"), Some((vec![1, -2, 3], String::new())));
        assert_eq!(parse_payload(b""), Some((vec![], String::new())));
        assert_eq!(
            parse_payload(b"2,0;CUDA out of memory; really"),
            Some((vec![2, 0], "CUDA out of memory; really".into()))
        );
        assert_eq!(parse_payload(b"x"), None);
    }

    #[test]
    fn config_reads_torchrun_variables() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        let config = Config::from_vars(vars(&[
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TOMA_DIST_TIMEOUT", "7.5"),
            ("TOMA_DIST_JOIN_TIMEOUT", "60"),
        ]))
        .unwrap();
        assert_eq!((config.rank, config.world_size, config.local_rank), (3, 8, 1));
        assert!(!config.host_store);
        assert_eq!(config.restart, 2);
        assert_eq!(config.timeout, Duration::from_millis(7500));
        assert_eq!(config.join_timeout, Some(Duration::from_secs(60)));

        let rank0 =
            Config::from_vars(vars(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "0"), ("WORLD_SIZE", "2")]))
                .unwrap();
        assert!(rank0.host_store);
        assert_eq!(rank0.local_rank, 0);

        let missing =
            Config::from_vars(vars(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert_eq!(missing, DistError::Env { var: "RANK", problem: "is not set".into() });
        assert!(missing.to_string().contains("torchrun"), "{missing}");
        let bad =
            Config::from_vars(vars(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "x"), ("RANK", "0"), ("WORLD_SIZE", "2")]))
                .unwrap_err();
        assert!(matches!(bad, DistError::Env { var: "MASTER_PORT", .. }), "{bad}");
    }

    #[test]
    fn bad_configs_are_errors_before_connecting() {
        let err = Config::new("127.0.0.1", 1, 2, 2).connect().unwrap_err();
        assert!(matches!(err, DistError::Config(_)), "{err}");
        let err = Config::new("127.0.0.1", 1, 0, 0).connect().unwrap_err();
        assert!(matches!(err, DistError::Config(_)), "{err}");
    }
}

//! A CUDA card described rather than present: plans for it on any machine
//! ([`Options::card`](crate::lazy::Options::card)).

use crate::lazy::cost::caching::Config;
use crate::ConfigError;

/// A CUDA card to plan for without having it: "does this step fit an 80 GiB card, and at which
/// micro-batch", asked on a laptop before renting one.
///
/// A plan made with [`Options::card`](crate::lazy::Options::card) prices every kernel call by
/// the CUDA cost model for the card's multiprocessors (cuBLAS and ATen's reduction staging,
/// cuDNN's bound for convolutions, the allocator's 512-byte blocks), by rules only, and replays
/// the step through the model of libtorch 2.11's caching allocator with the card's settings:
/// the graph's parameters and inputs are placed first, then the step, micro-batch by
/// micro-batch. The plan's peak is held to what the card can *reserve*, not only to what
/// tensors hold ([`Plan::reserved_bytes`](crate::lazy::Plan::reserved_bytes)).
///
/// ```
/// use toma::lazy::CudaCard;
/// let card = CudaCard::h100_80gb().in_use(600 << 20).allocator_settings("expandable_segments:True")?;
/// assert_eq!(card.memory(), 80 << 30);
/// # Ok::<(), toma::ConfigError>(())
/// ```
///
/// The card is only planned for: a step run with such options refuses
/// ([`LazyError::Unsupported`](crate::lazy::LazyError::Unsupported)), since its tensors are
/// not on that card.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaCard {
    memory: u64,
    in_use: u64,
    multiprocessors: u32,
    threads_per_multiprocessor: u32,
    settings: String,
    pub(crate) config: Config,
}

impl CudaCard {
    /// A card of `memory` bytes (what `cudaMemGetInfo` reports as total) with the
    /// multiprocessors of an H100 SXM (132, 2048 threads each), nothing on it yet and
    /// libtorch's default allocator settings.
    pub fn new(memory: u64) -> CudaCard {
        CudaCard {
            memory,
            in_use: 0,
            multiprocessors: 132,
            threads_per_multiprocessor: 2048,
            settings: String::new(),
            config: Config::default(),
        }
    }

    /// An H100 SXM with 80 GiB.
    pub fn h100_80gb() -> CudaCard {
        CudaCard::new(80 << 30)
    }

    /// An H200 (141 GB: 140,041 MiB as the driver reports it; 132 multiprocessors).
    pub fn h200() -> CudaCard {
        CudaCard::new(140_041 << 20)
    }

    /// An A100 with 80 GiB (108 multiprocessors).
    pub fn a100_80gb() -> CudaCard {
        CudaCard::new(80 << 30).multiprocessors(108, 2048)
    }

    /// Bytes already taken before the step's tensors: the CUDA context (~500 MiB), other
    /// processes, whatever the program holds besides the graph's own parameters and inputs.
    pub fn in_use(mut self, bytes: u64) -> CudaCard {
        self.in_use = bytes.min(self.memory);
        self
    }

    /// The card's multiprocessors and resident threads per multiprocessor (what
    /// `cudaGetDeviceProperties` reports): they size ATen's reduction staging.
    pub fn multiprocessors(mut self, count: u32, threads_per_multiprocessor: u32) -> CudaCard {
        self.multiprocessors = count.max(1);
        self.threads_per_multiprocessor = threads_per_multiprocessor.max(32);
        self
    }

    /// The caching allocator's settings the step would run under, in `PYTORCH_ALLOC_CONF`'s
    /// syntax (`"max_split_size_mb:256,expandable_segments:True"`).
    ///
    /// # Errors
    /// [`ConfigError::AllocatorSettings`] where libtorch would refuse the string.
    pub fn allocator_settings(mut self, settings: &str) -> Result<CudaCard, ConfigError> {
        self.config = Config::parse(settings)
            .map_err(|reason| ConfigError::AllocatorSettings { settings: settings.to_owned(), reason })?;
        self.settings = settings.to_owned();
        Ok(self)
    }

    /// The card's memory in bytes.
    pub fn memory(&self) -> u64 {
        self.memory
    }

    /// Bytes taken before the step's tensors ([`CudaCard::in_use`]).
    pub fn in_use_bytes(&self) -> u64 {
        self.in_use
    }

    /// The allocator settings given ([`CudaCard::allocator_settings`]; empty: libtorch's
    /// defaults).
    pub fn settings(&self) -> &str {
        &self.settings
    }

    /// Multiprocessors and resident threads per multiprocessor.
    pub(crate) fn gpu(&self) -> (u32, u32) {
        (self.multiprocessors, self.threads_per_multiprocessor)
    }
}

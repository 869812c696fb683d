//! The segments libtorch's CUDA caching allocator holds now, block by block
//! (`torch.cuda.memory_snapshot()`): what a step on the card starts from, for the planner's
//! replay of the allocator, and for users asking why a large block does not fit.

use super::shim::{self as torch, bytes, AllocatorError, RawBlock, RawSegment};

/// One segment of libtorch's CUDA caching allocator: a `cudaMalloc`'d range, or one mapped
/// range of an expandable segment.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaSegment {
    /// The device address of its first block.
    pub address: u64,
    /// The CUDA stream it serves, as a number (0: the legacy default stream, tch's).
    pub stream: u64,
    /// Whether it belongs to the large pool (blocks over 1 MiB) rather than the small one.
    pub large_pool: bool,
    /// Whether it is mapped pages of an expandable segment
    /// (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`).
    pub expandable: bool,
    /// Whether it belongs to a private pool (a CUDA graph's, or a mempool's): other
    /// allocations never take its free blocks.
    pub private_pool: bool,
    /// Its blocks in address order; their sizes add up to the segment's.
    pub blocks: Vec<CudaBlock>,
}

/// One block of a [`CudaSegment`].
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaBlock {
    /// Bytes, a multiple of 512.
    pub size: u64,
    /// What holds it.
    pub state: CudaBlockState,
}

/// Whether a [`CudaBlock`] can be handed out.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaBlockState {
    /// In a tensor.
    Allocated,
    /// Freed, but used on another stream whose work has not finished: not reusable yet.
    PendingFree,
    /// Cached: the next request that fits gets it.
    Free,
}

impl CudaSegment {
    /// Bytes of the segment.
    pub fn size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }

    /// Bytes of its blocks that are not [`CudaBlockState::Free`].
    pub fn in_use(&self) -> u64 {
        self.blocks.iter().filter(|b| b.state != CudaBlockState::Free).map(|b| b.size).sum()
    }
}

/// The segments of libtorch's CUDA caching allocator on device `device`, by address: the
/// blocks in tensors and the cached ones between them. Their sizes add up to
/// [`AllocatorStats::reserved`](super::AllocatorStats::reserved) at the moment of the call.
///
/// Empty before libtorch's first CUDA allocation. `None` where
/// [`cuda_allocator_stats`](super::cuda_allocator_stats) is, and also where toma's shim was
/// built without CUDA's runtime headers (see [`try_cuda_segments`]). Never panics.
///
/// ```
/// match toma::memory::cuda_segments(0) {
///     Some(segments) => {
///         let cached: u64 = segments.iter().map(|s| s.size() - s.in_use()).sum();
///         println!("GPU 0: {} segments, {cached} bytes cached in them", segments.len());
///     }
///     None => println!("no snapshot of GPU 0's allocator"),
/// }
/// ```
pub fn cuda_segments(device: usize) -> Option<Vec<CudaSegment>> {
    try_cuda_segments(device).map_err(|err| err.log("the allocator's segments")).ok()
}

/// As [`cuda_segments`], saying why there are none.
///
/// # Errors
/// As [`try_cuda_allocator_stats`](super::try_cuda_allocator_stats), and
/// [`AllocatorError::NoCuda`] where toma's shim was built without CUDA's runtime headers
/// (`cuda_runtime_api.h`, which libtorch's `c10/cuda` headers include: the build looks for
/// them in `TOMA_CUDA_INCLUDE`, beside a pip-installed torch, in `CUDA_HOME` and in
/// `/usr/local/cuda`), and [`AllocatorError::Torch`] under a CUDA allocator without snapshots
/// (`backend:cudaMallocAsync`).
pub fn try_cuda_segments(device: usize) -> Result<Vec<CudaSegment>, AllocatorError> {
    let (segments, blocks) = torch::snapshot(device)?;
    segments.iter().map(|s| segment(s, &blocks)).collect()
}

/// A segment from the shim's arrays; an error where its blocks are not in them.
fn segment(raw: &RawSegment, blocks: &[RawBlock]) -> Result<CudaSegment, AllocatorError> {
    let range = usize::try_from(raw.first_block)
        .ok()
        .zip(usize::try_from(raw.block_count).ok())
        .and_then(|(first, n)| blocks.get(first..first.checked_add(n)?))
        .ok_or_else(|| AllocatorError::Torch(format!("a snapshot segment's blocks out of range: {raw:?}")))?;
    Ok(CudaSegment {
        address: raw.address,
        stream: raw.stream,
        large_pool: raw.is_large != 0,
        expandable: raw.is_expandable != 0,
        private_pool: raw.is_private != 0,
        blocks: range
            .iter()
            .map(|b| CudaBlock {
                size: bytes(b.size),
                state: match b.state {
                    1 => CudaBlockState::Allocated,
                    2 => CudaBlockState::PendingFree,
                    _ => CudaBlockState::Free,
                },
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_take_their_own_blocks() {
        let block = |size, state| RawBlock { size, state, reserved: 0 };
        let blocks = [block(512, 1), block(1536, 0), block(2 << 20, 2), block(1024, 0)];
        let raw = |first_block, block_count| RawSegment {
            address: 0x7000_0000,
            stream: 0,
            first_block,
            block_count,
            is_large: 1,
            is_expandable: 0,
            is_private: 0,
            reserved: 0,
        };
        let s = segment(&raw(1, 2), &blocks).unwrap();
        assert_eq!(s.size(), 1536 + (2 << 20));
        assert_eq!(s.in_use(), 2 << 20);
        assert_eq!(s.blocks[1].state, CudaBlockState::PendingFree);
        assert_eq!(segment(&raw(0, 1), &blocks).unwrap().blocks[0].state, CudaBlockState::Allocated);
        for bad in [raw(3, 2), raw(-1, 1), raw(0, -1), raw(i64::MAX, 2)] {
            assert!(matches!(segment(&bad, &blocks), Err(AllocatorError::Torch(_))), "{bad:?}");
        }
    }

    #[test]
    #[cfg(feature = "tch")]
    fn without_a_device_there_are_no_segments() {
        if super::super::torch_device_count() > 0 {
            // A card: its segments add up to what the allocator reserves.
            let t = tch::Tensor::ones([1 << 20], (tch::Kind::Float, tch::Device::Cuda(0)));
            let segments = try_cuda_segments(0).expect("a snapshot");
            let stats = super::super::cuda_allocator_stats(0).unwrap();
            assert_eq!(segments.iter().map(CudaSegment::size).sum::<u64>(), stats.reserved);
            assert!(segments.iter().map(CudaSegment::in_use).sum::<u64>() >= stats.allocated);
            drop(t);
            return;
        }
        match try_cuda_segments(0) {
            Err(AllocatorError::NoCuda(_)) if cfg!(toma_shim) => {}
            Err(AllocatorError::NotBuilt) if !cfg!(toma_shim) => {}
            other => panic!("expected no CUDA, got {other:?}"),
        }
        assert_eq!(cuda_segments(usize::MAX), None);
    }
}

//! Free memory of CUDA devices and of the CPU, and libtorch's CUDA caching allocator.
//!
//! CUDA figures come from the driver API, loaded at run time through cudarc (feature `cuda`):
//! a build needs no CUDA toolkit, and on a machine without a driver or device every probe
//! returns `None`, never a panic.
//!
//! libtorch keeps the CUDA memory its tensors free in a cache of its own, which the driver
//! counts as used. With feature `tch`, a small native shim (compiled against the libtorch tch
//! links) reads the caching allocator's figures ([`cuda_allocator_stats`]), resets its peak
//! ([`reset_cuda_peak`]) and empties its cache ([`empty_cuda_cache`]); [`cuda_usable_memory`]
//! adds the cached bytes back to the driver's free bytes. Without feature `tch`, without CUDA
//! support in libtorch, or without a device, these report `None` or `false`.

//!
//! - [`cpu`] (also at `toma::cpu_memory`): a cap on the process's CPU memory, and what is left.
//! - The CUDA driver's figures: [`cuda_memory`], [`cuda_device_count`].
//! - libtorch's allocators: [`cuda_allocator_stats`], [`track_cpu_allocations`] and the rest;
//!   [`cuda_segments`] lists the CUDA allocator's segments and blocks.

pub mod cpu;
mod cpu_counter;
mod cuda;
mod cuda_allocator;
mod peak;
mod reading;
mod segments;
mod shim;

pub use cpu_counter::{cpu_allocator_stats, reset_cpu_peak, track_cpu_allocations, CpuAllocatorStats};
#[cfg(feature = "tch")]
pub(crate) use cuda::cuda_multiprocessors;
pub use cuda::{cuda_device_count, cuda_memory, DeviceMemory};
pub use cuda_allocator::{
    cuda_allocator_stats, cuda_current_device, cuda_usable_memory, empty_cuda_cache, release_cached_blocks,
    reset_cuda_peak, try_cuda_allocator_stats, AllocatorStats,
};
pub(crate) use cuda_allocator::{torch_device_count, work_device};
pub(crate) use peak::PeakCounter;
#[cfg(feature = "tch")]
pub(crate) use reading::available_cpu_memory_for_plans;
pub(crate) use reading::{free_memory_reading, free_memory_reading_for};
pub use segments::{cuda_segments, try_cuda_segments, CudaBlock, CudaBlockState, CudaSegment};
pub use shim::AllocatorError;

/// The state of libtorch's default random generator of `device` (`None`: the CPU's), to set
/// back with [`set_generator_state`]: a recomputed forward replays its dropout masks so.
#[cfg(feature = "tch")]
pub(crate) fn generator_state(device: Option<usize>) -> Result<Vec<u8>, AllocatorError> {
    shim::generator_state(device)
}

/// Sets the state [`generator_state`] read.
#[cfg(feature = "tch")]
pub(crate) fn set_generator_state(device: Option<usize>, state: &[u8]) -> Result<(), AllocatorError> {
    shim::set_generator_state(device, state)
}

/// The caching allocator's settings as libtorch parsed them (from `PYTORCH_ALLOC_CONF`, or set
/// since): what a plan in reserved bytes replays. `AllocatorError::NotBuilt` without the shim.
#[cfg(feature = "tch")]
pub(crate) fn allocator_config() -> Result<shim::RawAllocatorConfig, AllocatorError> {
    shim::allocator_config()
}

/// Sets the caching allocator's settings at run time (`key:value` pairs, as
/// `PYTORCH_ALLOC_CONF` takes them), as `torch._C._accelerator_setAllocatorSettings` does.
#[cfg(feature = "tch")]
pub(crate) fn set_allocator_settings(settings: &str) -> Result<(), AllocatorError> {
    shim::set_allocator_settings(settings)
}

/// Whether autograd records on this thread now (libtorch's grad mode, which tch sets but does
/// not read), through the shim; `None` without it.
#[cfg(feature = "tch")]
pub(crate) fn grad_enabled() -> Option<bool> {
    shim::grad_enabled()
}

/// Sets `tensor`'s `.grad` to none (tch can only zero it), so that autograd's next backward
/// hands it the gradient it computed instead of adding into a zero buffer.
#[cfg(feature = "tch")]
pub(crate) fn clear_grad(tensor: &tch::Tensor) -> Result<(), AllocatorError> {
    shim::clear_grad(tensor)
}

/// Autograd's backward from `tensors` with the gradients `grads` (PyTorch's
/// `torch.autograd.backward(tensors, grads)`, which tch lacks), through the shim;
/// `AllocatorError::NotBuilt` without it.
#[cfg(feature = "tch")]
pub(crate) fn backward(tensors: &[&tch::Tensor], grads: &[&tch::Tensor]) -> Result<(), AllocatorError> {
    shim::backward(tensors, grads)
}

/// How many tensors share `tensor`'s storage, and its bytes; `None` without the shim.
#[cfg(feature = "tch")]
pub(crate) fn storage_use(tensor: &tch::Tensor) -> Option<(i64, i64)> {
    shim::storage_use(tensor).ok()
}

#[cfg(feature = "tch")]
pub(crate) use shim::ViewBase;

/// The leaf `tensor` is a view of, when autograd made it as a view of a leaf that requires a
/// gradient (a parameter's `t()`, `narrow`, `view`..): a lazy step then records the view as an
/// op on that leaf, whose gradient lands in its `.grad`. `None` otherwise, and without the shim
/// (the view is then an operand of its own).
#[cfg(feature = "tch")]
pub(crate) fn view_base(tensor: &tch::Tensor) -> Option<ViewBase> {
    shim::view_base(tensor).ok().flatten()
}

/// What a lazy leaf records of a tensor (its sizes, strides, kind, device, whether it requires
/// a gradient and is a leaf of autograd's graph, the address of a parameter's data): read in
/// one call into libtorch through the shim, else asked of tch fact by fact.
#[cfg(feature = "tch")]
pub(crate) fn tensor_facts(tensor: &tch::Tensor) -> TensorFacts {
    shim_tensor_facts(tensor).unwrap_or_else(|| tch_tensor_facts(tensor))
}

/// [`tensor_facts`] in one call: `None` without the shim, for more than 8 dimensions, or for a
/// kind or device the shim does not name.
#[cfg(feature = "tch")]
fn shim_tensor_facts(tensor: &tch::Tensor) -> Option<TensorFacts> {
    use tch::{Device, Kind};
    let raw = shim::tensor_facts(tensor).ok()?;
    let kind = match raw.dtype {
        0 => Kind::Uint8,
        1 => Kind::Int8,
        2 => Kind::Int16,
        3 => Kind::Int,
        4 => Kind::Int64,
        5 => Kind::Half,
        6 => Kind::Float,
        7 => Kind::Double,
        11 => Kind::Bool,
        15 => Kind::BFloat16,
        _ => return None,
    };
    let device = match (raw.device_type, usize::try_from(raw.device_index)) {
        (0, _) => Device::Cpu,
        (1, Ok(index)) => Device::Cuda(index),
        _ => return None,
    };
    let dim = usize::try_from(raw.dim).ok()?;
    Some(TensorFacts {
        shape: raw.sizes.get(..dim)?.into(),
        strides: raw.strides.get(..dim)?.into(),
        kind,
        device,
        requires_grad: raw.requires_grad != 0,
        is_leaf: raw.is_leaf != 0,
        data_ptr: raw.data_ptr,
    })
}

/// [`tensor_facts`] asked of tch, one call per fact.
#[cfg(feature = "tch")]
fn tch_tensor_facts(tensor: &tch::Tensor) -> TensorFacts {
    let requires_grad = tensor.requires_grad();
    TensorFacts {
        shape: tensor.size().into(),
        strides: tensor.stride().into(),
        kind: tensor.kind(),
        device: tensor.device(),
        requires_grad,
        is_leaf: tensor.is_leaf(),
        data_ptr: if requires_grad { tensor.data_ptr() as usize } else { 0 },
    }
}

/// The facts [`tensor_facts`] reads.
#[cfg(feature = "tch")]
#[derive(Debug, PartialEq)]
pub(crate) struct TensorFacts {
    pub(crate) shape: crate::dims::Dims,
    pub(crate) strides: crate::dims::Dims,
    pub(crate) kind: tch::Kind,
    pub(crate) device: tch::Device,
    pub(crate) requires_grad: bool,
    pub(crate) is_leaf: bool,
    /// The data's address where the tensor requires a gradient (a parameter's identity), else 0.
    pub(crate) data_ptr: usize,
}

/// Whether `tensor` has a defined `.grad`: through the shim without making a tensor of it
/// (tch's `grad()` allocates a handle, and each of its calls checks for an error), else
/// through tch.
#[cfg(feature = "tch")]
pub(crate) fn grad_defined(tensor: &tch::Tensor) -> bool {
    shim::grad_defined(tensor).unwrap_or_else(|_| tensor.grad().defined())
}

#[cfg(all(test, feature = "tch", toma_shim))]
mod tests {
    use tch::{Device, Kind, Tensor};

    #[test]
    fn tensor_facts_read_in_one_call_agree_with_tchs_own() {
        let param = Tensor::randn([3, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let computed = (&param * 2.0).to_kind(Kind::BFloat16).transpose(0, 1);
        let ids = Tensor::arange(12, (Kind::Int64, Device::Cpu)).view([2, 3, 2]).narrow(2, 1, 1);
        let scalar = Tensor::from(1.5f64);
        for t in [&param, &computed, &ids, &scalar] {
            assert_eq!(super::shim_tensor_facts(t), Some(super::tch_tensor_facts(t)), "{t:?}");
        }
        assert!(!super::tensor_facts(&computed).is_leaf);
        assert_ne!(super::tensor_facts(&param).data_ptr, 0);
        // More dimensions than the shim reads: tch's own calls answer instead.
        let deep = Tensor::zeros([1; 9], (Kind::Float, Device::Cpu));
        assert_eq!(super::shim_tensor_facts(&deep), None);
        assert_eq!(super::tensor_facts(&deep).shape, vec![1; 9]);
        // A gradient asked for without making a tensor of it.
        assert!(!super::grad_defined(&param));
        param.sum(Kind::Float).backward();
        assert!(super::grad_defined(&param));
    }
}

/// libtorch's autocast state of this thread for a device type (c10's numbering: 0 the CPU, 1
/// CUDA): enabled, and the lower-precision dtype (c10's `ScalarType` number).
#[cfg(feature = "tch")]
pub(crate) fn autocast_state(device_type: i32) -> Result<(bool, i32), AllocatorError> {
    shim::autocast_state(device_type)
}

/// Sets libtorch's autocast state for a device type; `nest` counts a region in (> 0) or out
/// (< 0: the cast cache is cleared when no region is left).
#[cfg(feature = "tch")]
pub(crate) fn set_autocast(device_type: i32, enabled: bool, dtype: i32, nest: i32) -> Result<(), AllocatorError> {
    shim::set_autocast(device_type, enabled, dtype, nest)
}

/// ATen's CPU capability as libtorch picked it (`"AVX512"`, `"AVX2"`, `"DEFAULT"`, ..; it honours
/// `ATEN_CPU_CAPABILITY`), through the shim.
#[cfg(feature = "tch")]
pub(crate) fn aten_cpu_capability() -> Result<String, AllocatorError> {
    shim::cpu_capability()
}

/// Whether libtorch hands `BFloat16` and `Half` kernels to oneDNN on this CPU: its
/// `mkldnn_bf16_device_check` and `mkldnn_fp16_device_check`, asked through its own ops.
#[cfg(feature = "tch")]
pub(crate) fn onednn_kind_checks() -> Result<(bool, bool), AllocatorError> {
    shim::cpu_onednn_checks()
}

/// Bytes of CPU memory available to this process now; see
/// [`available_cpu_memory`](cpu::available_cpu_memory).
pub fn cpu_available() -> u64 {
    cpu::available_cpu_memory()
}

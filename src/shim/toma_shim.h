// C interface to libtorch's CUDA caching allocator, and a byte counter around its CPU
// allocator, for toma::memory (src/memory.rs).
//
// tch binds neither the allocator's statistics nor emptying its cache. This shim reaches them
// through c10's generic interfaces (the device guard registry and c10::DeviceAllocator), so it
// compiles against libtorch's headers alone, without CUDA headers, and works with a CPU-only
// libtorch too (every call then reports TOMA_SHIM_NO_CUDA). Only the allocator's snapshot
// needs CUDA's runtime headers to compile (its class is declared beside CUDA types); it links
// nothing of CUDA either.
//
// Every function catches every exception and reports failure by its return code; none throws.
#ifndef TOMA_SHIM_H
#define TOMA_SHIM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TOMA_SHIM_OK = 0,
  // libtorch has no CUDA support loaded, or sees no CUDA device.
  TOMA_SHIM_NO_CUDA = 1,
  // The device index is not one of libtorch's CUDA devices.
  TOMA_SHIM_BAD_DEVICE = 2,
  // libtorch threw; toma_shim_last_error() has its message.
  TOMA_SHIM_ERROR = 3,
  // CPU allocation counting is not installed (toma_shim_cpu_track was not called).
  TOMA_SHIM_NOT_TRACKING = 4,
};

// Byte and event counts of one device, aggregated over the allocator's small and large pools.
typedef struct toma_shim_allocator_stats {
  int64_t allocated;
  int64_t reserved;
  int64_t peak_allocated;
  int64_t peak_reserved;
  // cudaMalloc failures the allocator recovered from by freeing its cache and trying again.
  int64_t alloc_retries;
  // Out-of-memory errors it raised.
  int64_t ooms;
  // Blocks handed out and given back since the process started (every thread's): a
  // measurement that another thread's work reached sees more of them than its own.
  int64_t allocations;
  int64_t frees;
  // 0 while libtorch has not initialised the allocator (nothing allocated yet: all counts 0).
  int32_t initialized;
} toma_shim_allocator_stats;

// Number of CUDA devices libtorch can use (0 without CUDA support). Always TOMA_SHIM_OK
// unless libtorch throws.
int toma_shim_cuda_device_count(int64_t* count);

// libtorch's current CUDA device of the calling thread.
int toma_shim_cuda_current_device(int64_t* device);

int toma_shim_cuda_allocator_stats(int64_t device, toma_shim_allocator_stats* stats);

// Resets the peak figures of `device` to the current ones.
int toma_shim_cuda_reset_peak(int64_t device);

// Releases every cached block no tensor uses back to the driver (torch.cuda.empty_cache()).
int toma_shim_cuda_empty_cache(void);

// The caching allocator's settings as libtorch parsed them (`AcceleratorAllocatorConfig`, from
// PYTORCH_ALLOC_CONF and later calls to set them); sizes in bytes. The same on every device.
typedef struct toma_shim_allocator_config {
  int64_t large_segment_size;
  // -1: unset (no block is too large to split).
  int64_t max_split_size;
  int64_t max_non_split_rounding_size;
  double garbage_collection_threshold;
  int32_t expandable_segments;
  // One entry per power of two from 1 MiB (entry 0 also below) to 32 GiB and beyond.
  int64_t roundup_power2_divisions[16];
} toma_shim_allocator_config;

int toma_shim_allocator_config_get(toma_shim_allocator_config* out);

// `c10::CachingAllocator::setAllocatorSettings(settings)`, as
// `torch._C._accelerator_setAllocatorSettings`: updates the settings (and CUDA's own, when
// libtorch_cuda is loaded) for what the allocator does from then on.
int toma_shim_allocator_settings_set(const char* settings);

// One segment of the caching allocator (`torch.cuda.memory_snapshot()`'s entries): a
// cudaMalloc'd segment, or one mapped range of an expandable segment. Its blocks are
// `blocks[first_block .. first_block + block_count]` of the same call, in address order.
typedef struct toma_shim_segment {
  uint64_t address;
  // The stream's handle as a number (0: the legacy default stream).
  uint64_t stream;
  int64_t first_block;
  int64_t block_count;
  int32_t is_large;
  int32_t is_expandable;
  // 1 when the segment belongs to a private pool (CUDA graphs, mempools): nothing else can
  // take its free blocks.
  int32_t is_private;
  int32_t reserved_;
} toma_shim_segment;

typedef struct toma_shim_block {
  int64_t size;
  // 1: in a tensor; 2: freed but waiting for another stream's work (not reusable yet); 0: free.
  int32_t state;
  int32_t reserved_;
} toma_shim_block;

// The segments of CUDA device `device` now (`CUDACachingAllocator::snapshot()`, without its
// traces). Writes at most `segment_cap` segments and `block_cap` blocks, and the totals to
// `*segments_out` and `*blocks_out`: when either is above its cap, call again with more room.
// TOMA_SHIM_NO_CUDA also when the shim was built without CUDA's headers (the header
// c10/cuda/CUDACachingAllocator.h needs cuda_runtime_api.h), or before libtorch's first CUDA
// allocation (nothing is reserved then: 0 segments, TOMA_SHIM_OK).
int toma_shim_cuda_snapshot(int64_t device, toma_shim_segment* segments, int64_t segment_cap,
                            int64_t* segments_out, toma_shim_block* blocks, int64_t block_cap,
                            int64_t* blocks_out);

// Bytes of libtorch's CPU allocations since toma_shim_cpu_track installed the counter.
typedef struct toma_shim_cpu_counts {
  int64_t allocated;
  int64_t peak_allocated;
  // Allocations made (not bytes).
  int64_t allocations;
} toma_shim_cpu_counts;

// Wraps libtorch's current CPU allocator in one that counts bytes in live allocations, and
// makes it libtorch's CPU allocator. Once per process; later calls do nothing. Allocations
// made before it are not counted (nor their frees). Not thread-safe against libtorch
// allocating on other threads at the same moment (c10::SetCPUAllocator is not): call early.
int toma_shim_cpu_track(void);

// The counts since toma_shim_cpu_track; TOMA_SHIM_NOT_TRACKING before it.
int toma_shim_cpu_stats(toma_shim_cpu_counts* stats);

// Resets the CPU peak to the current figure; TOMA_SHIM_NOT_TRACKING before toma_shim_cpu_track.
int toma_shim_cpu_reset_peak(void);

// Raises the CPU peak to `value` if it is below (a measurement nested in another gives the
// outer one its peak back); TOMA_SHIM_NOT_TRACKING before toma_shim_cpu_track.
int toma_shim_cpu_raise_peak(int64_t value);

// Starts counting the calling thread's CPU allocations on their own (a measurement other
// threads' work must not reach): from the bytes in use now, changed by what this thread
// allocates and frees, and by frees anywhere of what it allocated. `*slot` names the scope;
// TOMA_SHIM_ERROR when the thread counts on its own already or all 63 scopes are taken.
int toma_shim_cpu_scope_begin(int64_t* slot);

// Ends the calling thread's scope `slot` (its number may be taken again).
int toma_shim_cpu_scope_end(int64_t slot);

// A scope's bytes in use and peak (`allocations` is the process's).
int toma_shim_cpu_scope_stats(int64_t slot, toma_shim_cpu_counts* stats);

// Events (allocations and releases outside libtorch's parallel regions, resets of the peak) of
// every thread, and of scope `slot`'s thread: when the first grows more than the second,
// another thread's work reached the process-wide figures.
int toma_shim_cpu_scope_events(int64_t slot, int64_t* all, int64_t* own);

// Resets a scope's peak to its bytes in use.
int toma_shim_cpu_scope_reset_peak(int64_t slot);

// Whether libtorch hands BFloat16 and Half kernels to oneDNN on this CPU (its
// mkldnn_bf16_device_check and mkldnn_fp16_device_check), 1 or 0 each.
int toma_shim_cpu_onednn_checks(int32_t* bf16, int32_t* fp16);

// The state of libtorch's default random generator of a device (`device` < 0: the CPU's, else
// that CUDA ordinal's), copied into `buf` (`cap` bytes); `*size` is its length. When `cap` is
// too small nothing is copied and `*size` says how much is needed: call again.
int toma_shim_generator_state(int64_t device, uint8_t* buf, int64_t cap, int64_t* size);

// Sets the state of that generator from `size` bytes that toma_shim_generator_state gave.
int toma_shim_set_generator_state(int64_t device, const uint8_t* buf, int64_t size);

// What a lazy leaf records of a tensor, read in one call instead of one per fact (each of
// tch's calls checks for an error on its way back). TOMA_SHIM_ERROR when the tensor has more
// than TOMA_SHIM_MAX_DIMS dimensions, is undefined, or has no storage to point at.
enum { TOMA_SHIM_MAX_DIMS = 8 };
typedef struct toma_shim_tensor_info {
  int64_t dim;
  int64_t sizes[TOMA_SHIM_MAX_DIMS];
  int64_t strides[TOMA_SHIM_MAX_DIMS];
  // c10::ScalarType and c10::DeviceType as numbered there.
  int32_t dtype;
  int32_t device_type;
  int64_t device_index;
  int32_t requires_grad;
  int32_t is_leaf;
  // 0 unless the tensor requires a gradient.
  uintptr_t data_ptr;
} toma_shim_tensor_info;

int toma_shim_tensor_facts(void* tensor, toma_shim_tensor_info* out);

// Whether `tensor` (an `at::Tensor*`) has a defined `.grad`, without making a tensor of it.
int toma_shim_grad_defined(void* tensor, int* defined);

// Autograd's backward from `n` tensors (`at::Tensor*`, as tch holds them), each with the
// gradient of the same shape in `grads`: PyTorch's `torch.autograd.backward(tensors, grads)`.
int toma_shim_backward(void* const* tensors, void* const* grads, int64_t n);

// Whether autograd records on this thread now (libtorch's grad mode): 1 or 0.
int toma_shim_grad_enabled(void);

// Sets the `.grad` of `tensor` (an `at::Tensor*`, as tch holds it) to none, as PyTorch's
// `p.grad = None` and tch's `opt.zero_grad()` do: its memory goes back to the allocator.
int toma_shim_clear_grad(void* tensor);

// When `tensor` (an `at::Tensor*`) is a view made with autograd of a leaf that requires a
// gradient (`w.t()`, `w.narrow(..)` of a parameter): `*base` is a new `at::Tensor*` of that
// leaf (the caller frees it as tch frees its tensors), `*offset` the view's storage offset and
// `*base_offset` the leaf's. Otherwise `*base` is NULL.
int toma_shim_view_base(void* tensor, void** base, int64_t* offset, int64_t* base_offset);

// How many tensors share the storage of `tensor` (an `at::Tensor*`), and its bytes.
int toma_shim_storage_use(void* tensor, int64_t* use_count, int64_t* nbytes);

// The autocast state of this thread for a device type (`device_type`: c10's DeviceType, 0 the
// CPU, 1 CUDA): whether it is enabled and its lower-precision dtype (c10's ScalarType).
int toma_shim_autocast_state(int device_type, int* enabled, int* dtype);

// Sets that state. `nest` > 0 counts one level of nesting in; < 0 counts one out and clears
// libtorch's cast cache when no level is left, as PyTorch's context manager does; 0 neither.
int toma_shim_autocast_set(int device_type, int enabled, int dtype, int nest);

// ATen's CPU capability (`at::get_cpu_capability()`: "AVX512", "AVX2", "DEFAULT", ..., which
// honours ATEN_CPU_CAPABILITY): its length in `*size`, its bytes in `buf` when they fit `cap`.
int toma_shim_cpu_capability(char* buf, int64_t cap, int64_t* size);

// Why the last call on this thread did not return TOMA_SHIM_OK: libtorch's message for
// TOMA_SHIM_ERROR, the reason for the others ("" after a success). Valid until the next call
// on this thread.
const char* toma_shim_last_error(void);

#ifdef __cplusplus
}
#endif

#endif

// See toma_shim.h. Only c10 headers: the CUDA pieces are reached through registries that
// libtorch_cuda fills when it is loaded, so nothing here needs CUDA to build or to run.
#include "toma_shim.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
// With CUDA's runtime headers (build.rs finds them beside the wheel's or in CUDA_HOME) the
// allocator's snapshot is reached through its class; every call is virtual, so nothing links
// against libc10_cuda and a CPU-only libtorch still loads the shim.
#ifdef TOMA_SHIM_CUDA_HEADERS
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <atomic>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

thread_local std::string last_error;

// Keeps `what` for toma_shim_last_error() and returns `code`.
int fail(int code, const char* what) noexcept {
  try {
    last_error = what;
  } catch (...) {
    // Out of memory for the message itself: the code still says what happened.
  }
  return code;
}

// Runs `body`, turning any exception into TOMA_SHIM_ERROR: nothing may unwind into Rust.
template <typename F>
int guarded(F&& body) noexcept {
  try {
    last_error.clear();
    return body();
  } catch (const std::exception& e) {
    return fail(TOMA_SHIM_ERROR, e.what());
  } catch (...) {
    return fail(TOMA_SHIM_ERROR, "unknown C++ exception");
  }
}

// CUDA devices libtorch can use; when there are none, `why` says why. The registry is empty
// when libtorch_cuda is not loaded (a CPU-only libtorch, or a binary linked with --as-needed
// that dropped it).
c10::DeviceIndex cuda_device_count(const char** why) {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    *why = "libtorch has no CUDA support loaded (libtorch_cuda missing or not linked)";
    return 0;
  }
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::DeviceIndex count = guard->deviceCount();  // noexcept; 0 without a driver
  // c10 swaps in a no-op guard (one device, index -1) when CUDA is built but has no device.
  if (count <= 0 || guard->getDevice().index() < 0) {
    *why = "libtorch sees no CUDA device (no driver, or no GPU)";
    return 0;
  }
  return count;
}

// The CUDA caching allocator, or null when libtorch has none registered.
c10::DeviceAllocator* cuda_allocator() {
  c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
  return allocator == nullptr ? nullptr : dynamic_cast<c10::DeviceAllocator*>(allocator);
}

// Checks `device` and finds the allocator; TOMA_SHIM_OK when both are usable.
int usable(int64_t device, c10::DeviceAllocator** allocator) {
  const char* why = "";
  const c10::DeviceIndex count = cuda_device_count(&why);
  if (count == 0) {
    return fail(TOMA_SHIM_NO_CUDA, why);
  }
  *allocator = cuda_allocator();
  if (*allocator == nullptr) {
    return fail(TOMA_SHIM_NO_CUDA, "libtorch has no CUDA caching allocator registered");
  }
  if (device < 0 || device >= count) {
    return fail(TOMA_SHIM_BAD_DEVICE, "not a CUDA device index of libtorch");
  }
  return TOMA_SHIM_OK;
}

// Counts the bytes in live allocations of the CPU allocator it wraps, the way the CUDA
// caching allocator counts its own: libtorch's CPU allocator keeps no such figures.
//
// Its DataPtrs stay "simple" (data == context, one raw deleter), as libtorch requires of the
// CPU allocator (oneDNN reaches it through raw_allocate), so sizes live in a side table,
// sharded by address to keep threads apart.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  // `inner` must have a raw deleter (libtorch's default CPU allocator has).
  explicit CountingCpuAllocator(c10::Allocator* inner)
      : inner_(inner),
        inner_delete_(inner->raw_deleter()),
        trace_(std::getenv("TOMA_TRACE_CPU_ALLOCATIONS") != nullptr) {}

  c10::DataPtr allocate(size_t n) override {
    // A failure stays the inner allocator's own (DefaultCPUAllocator: can't allocate memory).
    void* data = inner_->raw_allocate(n);
    if (data != nullptr) {
      // The thread's scope, if it measures: its own count, which other threads never reach.
      const uint32_t slot = thread_scope;
      uint32_t generation = 0;
      if (slot != 0) {
        Scope& scope = scopes_[slot];
        generation = scope.generation.load(std::memory_order_relaxed);
        scope.add(static_cast<int64_t>(n));
      }
      note_event();
      try {
        Shard& shard = shard_of(data);
        std::lock_guard<std::mutex> lock(shard.mutex);
        shard.sizes.emplace(data, Entry{n, slot, generation});
      } catch (...) {
        if (slot != 0) {
          scopes_[slot].add(-static_cast<int64_t>(n));
        }
        inner_delete_(data);
        // Out of memory for the record itself: reported in the allocator's words, so that
        // toma retries it like any other CPU out-of-memory.
        TORCH_CHECK_WITH(OutOfMemoryError, false, "DefaultCPUAllocator: can't allocate memory: toma's CPU counter could not record an allocation of ", n, " bytes");
      }
      allocations_.fetch_add(1, std::memory_order_relaxed);
      if (trace_) {
        std::fprintf(stderr, "toma-alloc +%zu\n", n);
      }
      const int64_t now = allocated_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
      int64_t peak = peak_.load(std::memory_order_relaxed);
      while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
      }
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  toma_shim_cpu_counts stats() const {
    return {allocated_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed)};
  }

  void reset_peak() {
    peak_.store(allocated_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    note_event();
  }

  // An event a measurement on another thread must know of: an allocation or a release outside
  // libtorch's parallel regions (inside them, the workers of some thread's op run), or a reset
  // of the peak. Counted for all, and for the calling thread's scope.
  void note_event() {
    // Outside any measurement nothing reads them: the common path costs one relaxed load.
    if (open_scopes_.load(std::memory_order_relaxed) == 0 || at::in_parallel_region()) {
      return;
    }
    events_.fetch_add(1, std::memory_order_relaxed);
    if (thread_scope != 0) {
      scopes_[thread_scope].events.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void raise_peak(int64_t value) {
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (value > peak && !peak_.compare_exchange_weak(peak, value, std::memory_order_relaxed)) {
    }
  }

  // Starts counting the calling thread on its own: the bytes in use when it starts, changed only
  // by what this thread allocates and frees (and by frees elsewhere of what it allocated). Two
  // threads that measure at once then see only their own work. 0 when the thread counts already
  // or every scope is taken.
  uint32_t begin_scope() {
    if (thread_scope != 0) {
      return 0;
    }
    for (uint32_t slot = 1; slot < kScopes; ++slot) {
      bool free = false;
      if (scopes_[slot].taken.compare_exchange_strong(free, true)) {
        Scope& scope = scopes_[slot];
        const int64_t now = allocated_.load(std::memory_order_relaxed);
        scope.allocated.store(now, std::memory_order_relaxed);
        scope.peak.store(now, std::memory_order_relaxed);
        thread_scope = slot;
        open_scopes_.fetch_add(1, std::memory_order_relaxed);
        return slot;
      }
    }
    return 0;
  }

  // Ends the calling thread's scope: what it allocated and frees later no longer reaches it.
  void end_scope(uint32_t slot) {
    if (slot == 0 || slot >= kScopes || thread_scope != slot) {
      return;
    }
    thread_scope = 0;
    scopes_[slot].generation.fetch_add(1, std::memory_order_relaxed);
    open_scopes_.fetch_sub(1, std::memory_order_relaxed);
    scopes_[slot].taken.store(false);
  }

  bool scope_stats(uint32_t slot, toma_shim_cpu_counts* out) const {
    if (slot == 0 || slot >= kScopes) {
      return false;
    }
    const Scope& scope = scopes_[slot];
    *out = {scope.allocated.load(std::memory_order_relaxed), scope.peak.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed)};
    return true;
  }

  // Events of every thread, and of the scope's own (`note_event`): a difference between their
  // growths is another thread's work.
  bool scope_events(uint32_t slot, int64_t* all, int64_t* own) const {
    if (slot == 0 || slot >= kScopes) {
      return false;
    }
    *all = events_.load(std::memory_order_relaxed);
    *own = scopes_[slot].events.load(std::memory_order_relaxed);
    return true;
  }

  bool scope_reset_peak(uint32_t slot) {
    if (slot == 0 || slot >= kScopes) {
      return false;
    }
    Scope& scope = scopes_[slot];
    scope.peak.store(scope.allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return true;
  }

 private:
  // What the side table keeps of an allocation: its size, and the scope that counted it (0:
  // none) in the generation it had then, so that a scope ended and taken again is not reached.
  struct Entry {
    size_t bytes;
    uint32_t slot;
    uint32_t generation;
  };

  struct Shard {
    std::mutex mutex;
    std::unordered_map<void*, Entry> sizes;
  };

  struct Scope {
    std::atomic<bool> taken{false};
    std::atomic<uint32_t> generation{0};
    std::atomic<int64_t> allocated{0};
    std::atomic<int64_t> peak{0};
    std::atomic<int64_t> events{0};

    void add(int64_t n) {
      const int64_t now = allocated.fetch_add(n, std::memory_order_relaxed) + n;
      int64_t high = peak.load(std::memory_order_relaxed);
      while (now > high && !peak.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
      }
    }
  };

  static constexpr uint32_t kScopes = 64;
  // The scope of the calling thread (0: none).
  static thread_local uint32_t thread_scope;

  Shard& shard_of(void* data) {
    // Allocations are 64-byte aligned: skip the bits that are always zero.
    return shards_[(reinterpret_cast<uintptr_t>(data) >> 6) % kShards];
  }

  static void release(void* data);

  static constexpr size_t kShards = 16;
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_delete_;
  // A developer's trace of every allocation and release on stderr (how the planner's oneDNN
  // rules were read), asked once when the counter is installed.
  const bool trace_;
  Shard shards_[kShards];
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> events_{0};
  std::atomic<int64_t> open_scopes_{0};
  Scope scopes_[kScopes];
};

thread_local uint32_t CountingCpuAllocator::thread_scope = 0;

// The installed counter; never freed, since tensors anywhere may still point at it.
std::atomic<CountingCpuAllocator*> cpu_counter{nullptr};

void CountingCpuAllocator::release(void* data) {
  CountingCpuAllocator* self = cpu_counter.load();
  Entry entry{0, 0, 0};
  {
    Shard& shard = self->shard_of(data);
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto found = shard.sizes.find(data);
    if (found != shard.sizes.end()) {
      entry = found->second;
      shard.sizes.erase(found);
    }
  }
  const size_t bytes = entry.bytes;
  self->allocated_.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  // The scope that counted it, while it lasts; else the freeing thread's: a tensor made before
  // a measurement and freed by its work lowers what is in use, as the process-wide count has it.
  if (entry.slot != 0 && self->scopes_[entry.slot].generation.load(std::memory_order_relaxed) == entry.generation) {
    self->scopes_[entry.slot].add(-static_cast<int64_t>(bytes));
  } else if (entry.slot == 0 && bytes != 0 && thread_scope != 0) {
    self->scopes_[thread_scope].add(-static_cast<int64_t>(bytes));
  }
  if (bytes != 0) {
    self->note_event();
  }
  if (self->trace_) {
    std::fprintf(stderr, "toma-alloc -%zu\n", bytes);
  }
  self->inner_delete_(data);
}

}  // namespace

extern "C" {

int toma_shim_cpu_track(void) {
  return guarded([&]() -> int {
    static std::once_flag once;
    static const char* refused = nullptr;
    std::call_once(once, [] {
      c10::Allocator* inner = c10::GetCPUAllocator();
      if (inner->raw_deleter() == nullptr) {
        refused = "libtorch's CPU allocator has no raw deleter; it cannot be wrapped";
        return;
      }
      auto* counter = new CountingCpuAllocator(inner);
      cpu_counter.store(counter);
      // The highest priority: later registrations of lower priority must not replace it.
      c10::SetCPUAllocator(counter, UINT8_MAX);
    });
    return refused == nullptr ? TOMA_SHIM_OK : fail(TOMA_SHIM_ERROR, refused);
  });
}

int toma_shim_cpu_stats(toma_shim_cpu_counts* out) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr) {
      return fail(TOMA_SHIM_NOT_TRACKING, "CPU allocations are not counted: call toma::memory::track_cpu_allocations first");
    }
    *out = counter->stats();
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_reset_peak(void) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr) {
      return fail(TOMA_SHIM_NOT_TRACKING, "CPU allocations are not counted: call toma::memory::track_cpu_allocations first");
    }
    counter->reset_peak();
    return TOMA_SHIM_OK;
  });
}


int toma_shim_cpu_raise_peak(int64_t value) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr) {
      return fail(TOMA_SHIM_NOT_TRACKING, "CPU allocations are not counted: call toma::memory::track_cpu_allocations first");
    }
    counter->raise_peak(value);
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_scope_begin(int64_t* slot) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr) {
      return fail(TOMA_SHIM_NOT_TRACKING, "CPU allocations are not counted: call toma::memory::track_cpu_allocations first");
    }
    *slot = counter->begin_scope();
    return *slot == 0 ? fail(TOMA_SHIM_ERROR, "this thread counts on its own already, or every scope is taken") : TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_scope_end(int64_t slot) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter != nullptr) {
      counter->end_scope(static_cast<uint32_t>(slot));
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_scope_stats(int64_t slot, toma_shim_cpu_counts* out) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr || !counter->scope_stats(static_cast<uint32_t>(slot), out)) {
      return fail(TOMA_SHIM_NOT_TRACKING, "no such CPU counting scope");
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_scope_events(int64_t slot, int64_t* all, int64_t* own) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr || !counter->scope_events(static_cast<uint32_t>(slot), all, own)) {
      return fail(TOMA_SHIM_NOT_TRACKING, "no such CPU counting scope");
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_scope_reset_peak(int64_t slot) {
  return guarded([&]() -> int {
    CountingCpuAllocator* counter = cpu_counter.load();
    if (counter == nullptr || !counter->scope_reset_peak(static_cast<uint32_t>(slot))) {
      return fail(TOMA_SHIM_NOT_TRACKING, "no such CPU counting scope");
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_onednn_checks(int32_t* bf16, int32_t* fp16) {
  return guarded([&]() -> int {
    // libtorch's own answers (`mkldnn_bf16_device_check`, `mkldnn_fp16_device_check`, as
    // torch.ops.mkldnn._is_mkldnn_bf16_supported gives them): they decide which kinds it hands
    // to oneDNN. Absent ops (a libtorch built without oneDNN) answer no.
    auto ask = [](const char* name) -> int32_t {
      auto op = c10::Dispatcher::singleton().findSchema({name, ""});
      if (!op.has_value()) {
        return 0;
      }
      return op->typed<bool()>().call() ? 1 : 0;
    };
    *bf16 = ask("mkldnn::_is_mkldnn_bf16_supported");
    *fp16 = ask("mkldnn::_is_mkldnn_fp16_supported");
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_device_count(int64_t* count) {
  return guarded([&]() -> int {
    const char* why = "";
    *count = cuda_device_count(&why);
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_current_device(int64_t* device) {
  return guarded([&]() -> int {
    // Called per wrapped call: one registry lookup and one getDevice. The Rust side asks only
    // once libtorch has counted devices, and reads a negative index (no device) as none.
    if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
      return fail(TOMA_SHIM_NO_CUDA, "libtorch has no CUDA support loaded (libtorch_cuda missing or not linked)");
    }
    *device = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_allocator_stats(int64_t device, toma_shim_allocator_stats* out) {
  return guarded([&]() -> int {
    c10::DeviceAllocator* allocator = nullptr;
    if (int code = usable(device, &allocator); code != TOMA_SHIM_OK) {
      return code;
    }
    *out = toma_shim_allocator_stats{};
    // Before libtorch's first CUDA allocation the allocator has no per-device state and
    // getDeviceStats would throw; it holds nothing then.
    if (!allocator->initialized()) {
      return TOMA_SHIM_OK;
    }
    const auto stats = allocator->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out->allocated = stats.allocated_bytes[all].current;
    out->reserved = stats.reserved_bytes[all].current;
    out->peak_allocated = stats.allocated_bytes[all].peak;
    out->peak_reserved = stats.reserved_bytes[all].peak;
    out->alloc_retries = stats.num_alloc_retries;
    out->ooms = stats.num_ooms;
    out->allocations = stats.allocation[all].allocated;
    out->frees = stats.allocation[all].freed;
    out->initialized = 1;
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_reset_peak(int64_t device) {
  return guarded([&]() -> int {
    c10::DeviceAllocator* allocator = nullptr;
    if (int code = usable(device, &allocator); code != TOMA_SHIM_OK) {
      return code;
    }
    if (allocator->initialized()) {
      allocator->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_empty_cache(void) {
  return guarded([&]() -> int {
    c10::DeviceAllocator* allocator = nullptr;
    if (int code = usable(0, &allocator); code != TOMA_SHIM_OK) {
      return code;
    }
    if (allocator->initialized()) {
      allocator->emptyCache();
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_allocator_config_get(toma_shim_allocator_config* out) {
  return guarded([&]() -> int {
    using Config = c10::CachingAllocator::AcceleratorAllocatorConfig;
    *out = toma_shim_allocator_config{};
    out->large_segment_size = static_cast<int64_t>(Config::large_segment_size());
    const size_t split = Config::max_split_size();
    out->max_split_size = split == std::numeric_limits<size_t>::max() ? -1 : static_cast<int64_t>(split);
    out->max_non_split_rounding_size = static_cast<int64_t>(Config::max_non_split_rounding_size());
    out->garbage_collection_threshold = Config::garbage_collection_threshold();
    out->expandable_segments = Config::use_expandable_segments() ? 1 : 0;
    const auto& divisions = Config::roundup_power2_divisions();
    for (size_t i = 0; i < 16 && i < divisions.size(); ++i) {
      out->roundup_power2_divisions[i] = static_cast<int64_t>(divisions[i]);
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_allocator_settings_set(const char* settings) {
  return guarded([&]() -> int {
    c10::CachingAllocator::setAllocatorSettings(std::string(settings));
    return TOMA_SHIM_OK;
  });
}

// libtorch's default generator of the CPU (`device` < 0) or of a CUDA ordinal.
at::Generator default_generator(int64_t device) {
  if (device < 0) {
    return at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CPU));
  }
  return at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

int toma_shim_generator_state(int64_t device, uint8_t* buf, int64_t cap, int64_t* size) {
  return guarded([&]() -> int {
    at::Generator gen = default_generator(device);
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    const int64_t n = state.numel() * static_cast<int64_t>(state.element_size());
    *size = n;
    if (n <= cap) {
      std::memcpy(buf, state.data_ptr(), static_cast<size_t>(n));
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_set_generator_state(int64_t device, const uint8_t* buf, int64_t size) {
  return guarded([&]() -> int {
    at::Generator gen = default_generator(device);
    at::Tensor state = at::detail::empty_cpu({size}, c10::ScalarType::Byte);
    std::memcpy(state.data_ptr(), buf, static_cast<size_t>(size));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
    return TOMA_SHIM_OK;
  });
}

int toma_shim_backward(void* const* tensors, void* const* grads, int64_t n) {
  return guarded([&]() -> int {
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> seeds;
    roots.reserve(static_cast<size_t>(n));
    seeds.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      roots.push_back(*static_cast<at::Tensor*>(tensors[i]));
      seeds.push_back(*static_cast<at::Tensor*>(grads[i]));
    }
    torch::autograd::backward(roots, seeds);
    return TOMA_SHIM_OK;
  });
}

int toma_shim_grad_enabled(void) {
  // A thread-local read: no exception to catch.
  return c10::GradMode::is_enabled() ? 1 : 0;
}

int toma_shim_clear_grad(void* tensor) {
  return guarded([&]() -> int {
    static_cast<at::Tensor*>(tensor)->mutable_grad().reset();
    return TOMA_SHIM_OK;
  });
}

int toma_shim_tensor_facts(void* tensor, toma_shim_tensor_info* out) {
  return guarded([&]() -> int {
    const at::Tensor& t = *static_cast<at::Tensor*>(tensor);
    const int64_t dim = t.dim();
    if (dim > TOMA_SHIM_MAX_DIMS) return fail(TOMA_SHIM_ERROR, "more dimensions than the shim reads");
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    out->dim = dim;
    for (int64_t i = 0; i < dim; ++i) {
      out->sizes[i] = sizes[i];
      out->strides[i] = strides[i];
    }
    out->dtype = static_cast<int32_t>(t.scalar_type());
    out->device_type = static_cast<int32_t>(t.device().type());
    out->device_index = t.device().index();
    out->requires_grad = t.requires_grad() ? 1 : 0;
    out->is_leaf = t.is_leaf() ? 1 : 0;
    // Asked of what requires a gradient only (a parameter's identity), as tch would be.
    out->data_ptr = t.requires_grad() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : 0;
    return TOMA_SHIM_OK;
  });
}

int toma_shim_view_base(void* tensor, void** base, int64_t* offset, int64_t* base_offset) {
  return guarded([&]() -> int {
    const at::Tensor& t = *static_cast<at::Tensor*>(tensor);
    *base = nullptr;
    *offset = 0;
    *base_offset = 0;
    // `_base()` is the root of a chain of views; a view made under no_grad requires no
    // gradient, so only autograd's own views reach the test of the base.
    if (t.requires_grad() && !t.is_leaf() && t.is_view()) {
      const at::Tensor root(t._base());
      if (root.defined() && root.is_leaf() && root.requires_grad()) {
        *base = new at::Tensor(root);
        *offset = t.storage_offset();
        *base_offset = root.storage_offset();
      }
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_storage_use(void* tensor, int64_t* use_count, int64_t* nbytes) {
  return guarded([&]() -> int {
    const at::Tensor& t = *static_cast<at::Tensor*>(tensor);
    *use_count = 0;
    *nbytes = 0;
    if (t.defined() && t.has_storage()) {
      *use_count = static_cast<int64_t>(t.storage().use_count());
      *nbytes = static_cast<int64_t>(t.storage().nbytes());
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_grad_defined(void* tensor, int* defined) {
  return guarded([&]() -> int {
    *defined = static_cast<at::Tensor*>(tensor)->grad().defined() ? 1 : 0;
    return TOMA_SHIM_OK;
  });
}

int toma_shim_autocast_state(int device_type, int* enabled, int* dtype) {
  return guarded([&]() -> int {
    const auto type = static_cast<c10::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(type) ? 1 : 0;
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(type));
    return TOMA_SHIM_OK;
  });
}

int toma_shim_autocast_set(int device_type, int enabled, int dtype, int nest) {
  return guarded([&]() -> int {
    const auto type = static_cast<c10::DeviceType>(device_type);
    at::autocast::set_autocast_enabled(type, enabled != 0);
    at::autocast::set_autocast_dtype(type, static_cast<c10::ScalarType>(dtype));
    if (nest > 0) {
      at::autocast::increment_nesting();
    } else if (nest < 0 && at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cpu_capability(char* buf, int64_t cap, int64_t* size) {
  return guarded([&]() -> int {
    const std::string capability = at::get_cpu_capability();
    *size = static_cast<int64_t>(capability.size());
    if (*size <= cap) {
      std::memcpy(buf, capability.data(), capability.size());
    }
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_snapshot(int64_t device, toma_shim_segment* segments, int64_t segment_cap,
                            int64_t* segments_out, toma_shim_block* blocks, int64_t block_cap,
                            int64_t* blocks_out) {
  return guarded([&]() -> int {
    *segments_out = 0;
    *blocks_out = 0;
#ifndef TOMA_SHIM_CUDA_HEADERS
    (void)device, (void)segments, (void)segment_cap, (void)blocks, (void)block_cap;
    return fail(TOMA_SHIM_NO_CUDA, "toma's shim was built without CUDA's headers (cuda_runtime_api.h): no allocator snapshot");
#else
    c10::DeviceAllocator* allocator = nullptr;
    if (int code = usable(device, &allocator); code != TOMA_SHIM_OK) {
      return code;
    }
    if (!allocator->initialized()) {
      return TOMA_SHIM_OK;
    }
    // libtorch registers a CUDAAllocator for CUDA (the native one, cudaMallocAsync's, or a
    // pluggable one); cudaMallocAsync's snapshot throws, which `guarded` reports.
    auto* cuda = static_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator*>(allocator);
    const auto info = cuda->snapshot({0, 0}, /*include_traces=*/false);
    int64_t n = 0;
    int64_t b = 0;
    for (const auto& seg : info.segments) {
      if (seg.device != static_cast<c10::DeviceIndex>(device)) {
        continue;
      }
      if (n < segment_cap) {
        const bool is_private = seg.owner_private_pool_id.first != 0 || seg.owner_private_pool_id.second != 0;
        segments[n] = toma_shim_segment{static_cast<uint64_t>(seg.address),
                                        static_cast<uint64_t>(reinterpret_cast<uintptr_t>(seg.stream)),
                                        b,
                                        static_cast<int64_t>(seg.blocks.size()),
                                        seg.is_large ? 1 : 0,
                                        seg.is_expandable ? 1 : 0,
                                        is_private ? 1 : 0,
                                        0};
      }
      for (const auto& block : seg.blocks) {
        if (b < block_cap) {
          blocks[b] = toma_shim_block{static_cast<int64_t>(block.size), block.allocated ? 1 : (block.active ? 2 : 0), 0};
        }
        ++b;
      }
      ++n;
    }
    *segments_out = n;
    *blocks_out = b;
    return TOMA_SHIM_OK;
#endif
  });
}

const char* toma_shim_last_error(void) {
  return last_error.c_str();
}

}  // extern "C"

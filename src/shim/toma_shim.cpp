// See toma_shim.h. Only c10 headers: the CUDA pieces are reached through registries that
// libtorch_cuda fills when it is loaded, so nothing here needs CUDA to build or to run.
#include "toma_shim.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <exception>
#include <string>

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

}  // namespace

extern "C" {

int toma_shim_cuda_device_count(int64_t* count) {
  return guarded([&]() -> int {
    const char* why = "";
    *count = cuda_device_count(&why);
    return TOMA_SHIM_OK;
  });
}

int toma_shim_cuda_current_device(int64_t* device) {
  return guarded([&]() -> int {
    const char* why = "";
    if (cuda_device_count(&why) == 0) {
      return fail(TOMA_SHIM_NO_CUDA, why);
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

const char* toma_shim_last_error(void) {
  return last_error.c_str();
}

}  // extern "C"

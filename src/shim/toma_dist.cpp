// See toma_dist.h.
#include "toma_dist.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef TOMA_DIST_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

struct toma_dist_store {
  c10::intrusive_ptr<c10d::Store> store;
};

struct toma_dist_group {
#ifdef TOMA_DIST_GLOO
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#endif
};

namespace {

thread_local std::string last_error;

int fail(int code, const char* what) noexcept {
  try {
    last_error = what;
  } catch (...) {
    // No memory for the message: the code still says what happened.
  }
  return code;
}

// While toma's own store calls run, c10d's warnings stay off stderr: a peer that went away makes
// c10d log the failure with a C++ backtrace, and toma returns the same text as an error. An
// explicit TORCH_CPP_LOG_LEVEL is the user's choice and is left alone.
struct QuietC10d {
  // Calls from several threads nest: the first saves the level, the last restores it.
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }
  static int depth;
  static int saved;
  bool quiet = std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr;
  QuietC10d() {
    if (!quiet) return;
    std::lock_guard<std::mutex> guard(lock());
    if (depth++ == 0) {
      saved = FLAGS_caffe2_log_level;
      if (FLAGS_caffe2_log_level < 2) FLAGS_caffe2_log_level = 2;
    }
  }
  ~QuietC10d() {
    if (!quiet) return;
    std::lock_guard<std::mutex> guard(lock());
    if (--depth == 0) FLAGS_caffe2_log_level = saved;
  }
};
int QuietC10d::depth = 0;
int QuietC10d::saved = 0;

// Runs `body`, turning every exception into a code: nothing may unwind into Rust. c10's own
// messages lose their C++ backtrace (a timeout is a normal failure, not a crash report).
template <typename F>
int guarded(F&& body) noexcept {
  try {
    QuietC10d quiet;
    last_error.clear();
    return body();
  } catch (const c10::DistStoreError& e) {
    std::string what = e.what_without_backtrace();
    const bool timeout = what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos;
    return fail(timeout ? TOMA_DIST_TIMEOUT : TOMA_DIST_ERROR, what.c_str());
  } catch (const c10::DistNetworkError& e) {
    std::string what = e.what_without_backtrace();
    const bool timeout = what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos;
    return fail(timeout ? TOMA_DIST_TIMEOUT : TOMA_DIST_ERROR, what.c_str());
  } catch (const c10::Error& e) {
    return fail(TOMA_DIST_ERROR, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(TOMA_DIST_ERROR, e.what());
  } catch (...) {
    return fail(TOMA_DIST_ERROR, "unknown C++ exception");
  }
}

std::vector<std::string> key_list(const char* const* keys, size_t n) {
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.emplace_back(keys[i]);
  return out;
}

}  // namespace

extern "C" {

int toma_dist_store_connect(const char* host, uint16_t port, int is_server, int64_t timeout_ms,
                            toma_dist_store** out) {
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = is_server != 0;
    // toma's own join step says which rank is missing; the server waits for nobody.
    options.waitWorkers = false;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    *out = new toma_dist_store{std::move(store)};
    return TOMA_DIST_OK;
  });
}

void toma_dist_store_free(toma_dist_store* store) {
  try {
    delete store;
  } catch (...) {
    // A destructor that throws has nothing left to tell.
  }
}

int toma_dist_store_set(toma_dist_store* store, const char* key, const uint8_t* value, size_t len) {
  return guarded([&] {
    store->store->set(std::string(key), std::vector<uint8_t>(value, value + len));
    return TOMA_DIST_OK;
  });
}

int toma_dist_store_add(toma_dist_store* store, const char* key, int64_t delta, int64_t* value) {
  return guarded([&] {
    *value = store->store->add(std::string(key), delta);
    return TOMA_DIST_OK;
  });
}

int toma_dist_store_wait(toma_dist_store* store, const char* const* keys, size_t n, int64_t timeout_ms) {
  return guarded([&] {
    store->store->wait(key_list(keys, n), std::chrono::milliseconds(timeout_ms));
    return TOMA_DIST_OK;
  });
}

int toma_dist_store_check(toma_dist_store* store, const char* const* keys, size_t n, int* all_exist) {
  return guarded([&] {
    *all_exist = store->store->check(key_list(keys, n)) ? 1 : 0;
    return TOMA_DIST_OK;
  });
}

int toma_dist_store_delete(toma_dist_store* store, const char* key) {
  return guarded([&] {
    store->store->deleteKey(std::string(key));
    return TOMA_DIST_OK;
  });
}

int toma_dist_store_multi_get(toma_dist_store* store, const char* const* keys, size_t n,
                              void (*sink)(void*, size_t, const uint8_t*, size_t), void* ctx) {
  return guarded([&] {
    auto values = store->store->multiGet(key_list(keys, n));
    for (size_t i = 0; i < values.size(); ++i) sink(ctx, i, values[i].data(), values[i].size());
    return TOMA_DIST_OK;
  });
}

int toma_dist_gloo_new(toma_dist_store* store, const char* prefix, int64_t rank, int64_t world_size,
                       int64_t timeout_ms, toma_dist_group** out) {
#ifdef TOMA_DIST_GLOO
  return guarded([&] {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = std::chrono::milliseconds(timeout_ms);
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), store->store);
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(rank),
                                                            static_cast<int>(world_size), options);
    *out = new toma_dist_group{std::move(gloo)};
    return TOMA_DIST_OK;
  });
#else
  (void)store;
  (void)prefix;
  (void)rank;
  (void)world_size;
  (void)timeout_ms;
  (void)out;
  return fail(TOMA_DIST_NO_GLOO, "toma was built without gloo's headers (scripts/ensure-gloo-headers.sh)");
#endif
}

void toma_dist_group_free(toma_dist_group* group) {
  try {
    delete group;
  } catch (...) {
  }
}

int toma_dist_all_reduce_sum(toma_dist_group* group, void* const* tensors, size_t n) {
#ifdef TOMA_DIST_GLOO
  return guarded([&] {
    // One flat buffer per (dtype, device): one collective each, not one per parameter.
    std::map<std::tuple<int, int, int>, std::vector<at::Tensor*>> buckets;
    for (size_t i = 0; i < n; ++i) {
      auto* t = static_cast<at::Tensor*>(tensors[i]);
      const auto device = t->device();
      buckets[{static_cast<int>(t->scalar_type()), static_cast<int>(device.type()), device.index()}].push_back(t);
    }
    for (auto& [_, members] : buckets) {
      std::vector<at::Tensor> flat_parts;
      flat_parts.reserve(members.size());
      for (auto* t : members) flat_parts.push_back(t->reshape({-1}));
      std::vector<at::Tensor> flat{at::cat(flat_parts)};
      group->gloo->allreduce(flat)->wait();
      int64_t offset = 0;
      for (auto* t : members) {
        const int64_t numel = t->numel();
        t->copy_(flat[0].narrow(0, offset, numel).view_as(*t));
        offset += numel;
      }
    }
    return TOMA_DIST_OK;
  });
#else
  (void)group;
  (void)tensors;
  (void)n;
  return fail(TOMA_DIST_NO_GLOO, "toma was built without gloo's headers (scripts/ensure-gloo-headers.sh)");
#endif
}

const char* toma_dist_last_error(void) { return last_error.c_str(); }

}  // extern "C"

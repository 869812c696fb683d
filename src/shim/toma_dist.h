// C interface to PyTorch's c10d for toma::dist (src/dist/): a TCPStore client or server (the
// store torchrun's agent hosts), and a Gloo process group over it for gradient all-reduce.
//
// Compiled only with feature `dist`. The Gloo half needs gloo's headers, which the PyPI wheel
// lacks (scripts/ensure-gloo-headers.sh fetches Debian's); without them it is left out and
// toma_dist_gloo_new reports TOMA_DIST_NO_GLOO.
//
// Every function catches every exception and reports failure by its return code; none throws.
// Messages are c10's without its C++ backtrace.
#ifndef TOMA_DIST_H
#define TOMA_DIST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TOMA_DIST_OK = 0,
  // c10d threw; toma_dist_last_error() has its message.
  TOMA_DIST_ERROR = 1,
  // A wait ran out of time (c10d's DistStoreError on wait, or a timed-out socket).
  TOMA_DIST_TIMEOUT = 2,
  // Built without gloo's headers: no Gloo process group.
  TOMA_DIST_NO_GLOO = 3,
};

typedef struct toma_dist_store toma_dist_store;
typedef struct toma_dist_group toma_dist_group;

// Connects to the TCPStore at host:port (as a client, retrying until `timeout_ms`), or, with
// `is_server`, hosts it on `port` and connects to it. Waits for no other rank.
int toma_dist_store_connect(const char* host, uint16_t port, int is_server, int64_t timeout_ms,
                            toma_dist_store** out);
void toma_dist_store_free(toma_dist_store* store);

int toma_dist_store_set(toma_dist_store* store, const char* key, const uint8_t* value, size_t len);
// Adds `delta` to the integer at `key` (0 when absent) and gives the new value.
int toma_dist_store_add(toma_dist_store* store, const char* key, int64_t delta, int64_t* value);
// Waits until every key exists, at most `timeout_ms`.
int toma_dist_store_wait(toma_dist_store* store, const char* const* keys, size_t n, int64_t timeout_ms);
// Whether every key exists (no wait).
int toma_dist_store_check(toma_dist_store* store, const char* const* keys, size_t n, int* all_exist);
int toma_dist_store_delete(toma_dist_store* store, const char* key);
// Reads every key (each must exist), handing value i to `sink(ctx, i, data, len)`.
int toma_dist_store_multi_get(toma_dist_store* store, const char* const* keys, size_t n,
                              void (*sink)(void* ctx, size_t index, const uint8_t* data, size_t len),
                              void* ctx);

// A Gloo process group of `world_size` ranks over `store`, its keys under `prefix`. Blocks until
// every rank has joined, at most `timeout_ms` (also the timeout of each collective).
int toma_dist_gloo_new(toma_dist_store* store, const char* prefix, int64_t rank, int64_t world_size,
                       int64_t timeout_ms, toma_dist_group** out);
void toma_dist_group_free(toma_dist_group* group);
// Sums `tensors` (tch's tensor handles, at::Tensor*) across the ranks, in place. Tensors of one
// dtype and device travel as one flat buffer.
int toma_dist_all_reduce_sum(toma_dist_group* group, void* const* tensors, size_t n);

// Why the last call on this thread did not return TOMA_DIST_OK ("" after a success). Valid until
// the next call on this thread.
const char* toma_dist_last_error(void);

#ifdef __cplusplus
}
#endif

#endif

/* The thread pool the native kernels share (native_pool.c, its own library: see
 * attnserve.native.build). `pool_run` splits `items` into chunks of `chunk` items and runs
 * `task(job, first, end)` on each; the caller works too and returns once every chunk is done.
 */
#ifndef ATTNSERVE_NATIVE_POOL_H
#define ATTNSERVE_NATIVE_POOL_H
#include <stdint.h>

typedef void (*pool_task)(const void *job, int64_t first, int64_t end);

/* Up to `threads` threads (the caller and threads - 1 workers) run the chunks. */
void pool_run(int threads, int64_t items, int64_t chunk, pool_task task, const void *job);

#endif

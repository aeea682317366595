/* A thread pool for the native kernels that degrades gracefully on a loaded machine.
 *
 * OpenMP's static split waits at its barrier for every thread's share: when another process
 * deschedules one thread, the call waits for it a whole time slice. Here the work is many small
 * chunks taken one at a time from an atomic ticket, the caller takes chunks too, and it waits
 * only for chunks another thread has already started: a worker that is late (asleep,
 * descheduled) finds no chunks left and the caller has done them. Workers spin briefly
 * between calls (yielding the core to anything else runnable), then sleep on a condition
 * variable.
 *
 * The ticket is (generation << 32) | next chunk: a worker claims a chunk with a compare-and-swap
 * that fails once the caller has moved to a later call, so a late worker never runs a chunk of
 * a call that is over. One call runs at a time; a call made while another runs (another thread,
 * or from inside a task) runs all its chunks on its own thread.
 */
#include "native_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define MAX_WORKERS 63
#define SPIN_NS 200000 /* how long an idle worker stays awake for the next call */

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_int sleepers;
static int started; /* workers created (under run_lock) */

/* The current call: written by its caller before the generation is published. */
static atomic_uint_fast64_t ticket;
static atomic_uint generation;
static atomic_int_fast64_t chunks, done;
static atomic_int helpers; /* workers 0..helpers-1 take part */
static pool_task call_task;
static const void *call_job;
static int64_t call_items, call_chunk;

static inline uint32_t ticket_generation(uint64_t t) { return (uint32_t)(t >> 32); }

/* Claims the next chunk of call `gen`; -1 when none is left or the call is over. */
static int64_t claim(uint32_t gen) {
    uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
    for (;;) {
        if (ticket_generation(t) != gen) return -1;
        const int64_t index = (int64_t)(t & 0xFFFFFFFFu);
        if (index >= atomic_load_explicit(&chunks, memory_order_relaxed)) return -1;
        if (atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return index;
    }
}

/* Runs chunks of call `gen` until none is left (the call's fields hold while a chunk of it
 * is claimed and not done: its caller waits for it). */
static void work(uint32_t gen) {
    for (int64_t index; (index = claim(gen)) >= 0;) {
        const int64_t first = index * call_chunk;
        const int64_t end = first + call_chunk < call_items ? first + call_chunk : call_items;
        call_task(call_job, first, end);
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next generation after `seen`: spinning a while, then asleep. */
static uint32_t next_call(uint32_t seen) {
    const int64_t until = now_ns() + SPIN_NS;
    for (int spins = 0;; spins++) {
        const uint32_t gen = atomic_load_explicit(&generation, memory_order_acquire);
        if (gen != seen) return gen;
        _mm_pause();
        if (spins % 64 == 63) {
            if (now_ns() > until) break;
            sched_yield();
        }
    }
    pthread_mutex_lock(&sleep_lock);
    atomic_fetch_add(&sleepers, 1);
    uint32_t gen;
    while ((gen = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &sleep_lock);
    atomic_fetch_sub(&sleepers, 1);
    pthread_mutex_unlock(&sleep_lock);
    return gen;
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&generation);
    for (;;) {
        seen = next_call(seen);
        if (id < atomic_load_explicit(&helpers, memory_order_relaxed)) work(seen);
    }
    return NULL;
}

/* Workers 0..count-1 exist (as many as could be created). */
static void start_workers(int count) {
    for (; started < count; started++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, worker, (void *)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (failed) break;
    }
}

/* A forked child has none of the parent's workers (and maybe a lock taken mid-call). */
static void after_fork_in_child(void) {
    pthread_mutex_init(&run_lock, NULL);
    pthread_mutex_init(&sleep_lock, NULL);
    pthread_cond_init(&wake, NULL);
    atomic_store(&sleepers, 0);
    started = 0;
}

__attribute__((constructor)) static void register_fork_handler(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

static void run_inline(int64_t items, int64_t chunk, pool_task task, const void *job) {
    for (int64_t first = 0; first < items; first += chunk)
        task(job, first, first + chunk < items ? first + chunk : items);
}

void pool_run(int threads, int64_t items, int64_t chunk, pool_task task, const void *job) {
    if (items <= 0) return;
    if (chunk < 1) chunk = 1;
    const int64_t count = (items + chunk - 1) / chunk;
    if (threads <= 1 || count <= 1 || count > 0xFFFFFFFFu ||
        pthread_mutex_trylock(&run_lock) != 0) {
        run_inline(items, chunk, task, job);
        return;
    }
    start_workers(threads - 1 < MAX_WORKERS ? threads - 1 : MAX_WORKERS);
    call_task = task;
    call_job = job;
    call_items = items;
    call_chunk = chunk;
    atomic_store_explicit(&chunks, count, memory_order_relaxed);
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    atomic_store_explicit(&helpers, threads - 1, memory_order_relaxed);
    const uint32_t gen = atomic_load(&generation) + 1;
    atomic_store(&ticket, (uint64_t)gen << 32);
    atomic_store(&generation, gen);
    if (atomic_load(&sleepers) > 0) {
        pthread_mutex_lock(&sleep_lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&sleep_lock);
    }
    work(gen);
    for (int spins = 0; atomic_load_explicit(&done, memory_order_acquire) < count; spins++) {
        _mm_pause();
        if (spins % 64 == 63) sched_yield();
    }
    pthread_mutex_unlock(&run_lock);
}

/* The replay of a CPU graph (attnserve.worker.graphs.cpu): its recorded kernel calls made in order
 * from C, without returning to Python between them. Call i is `functions[i](slots +
 * starts[i])`, a kernel's `_packed` entry point (native_packed.h). Returns 0, or i + 1 for the
 * first call that returned a nonzero status (the calls after it are not made). */
#include <stdint.h>

typedef int (*packed_call)(const int64_t *slots);

int64_t replay_calls(int64_t count, const int64_t *functions, const int64_t *starts,
                     const int64_t *slots) {
    for (int64_t i = 0; i < count; i++)
        if (((packed_call)(intptr_t)functions[i])(slots + starts[i]) != 0) return i + 1;
    return 0;
}

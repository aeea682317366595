/* Kernel entry points with their arguments packed into int64 slots, for replaying a CPU graph
 * from C (graph.c): every kernel `NAME` that a graph may record has `NAME_packed(const
 * int64_t *slots)`, which unpacks its arguments in order and calls it. A pointer is its address,
 * an integer itself, a float its IEEE bits in the low 32 bits (attnserve.native.calls packs
 * them from the kernel's ctypes argtypes). Returns the kernel's status (0: done). */
#ifndef ATTNSERVE_NATIVE_PACKED_H
#define ATTNSERVE_NATIVE_PACKED_H
#include <stdint.h>
#include <string.h>

#define SLOT_PTR(type, slot) ((type *)(intptr_t)(slot))

static inline float slot_float(int64_t slot) {
    const uint32_t bits = (uint32_t)slot;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#endif

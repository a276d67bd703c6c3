/* PD_LAYOUT_CPU_X16: the rows of a weight rearranged, 16 at a time, so that
 * a kernel finds the same 4-byte word of 16 rows' blocks in one 64-byte
 * line (cpu_internal.h states the arrangement; simd_x16_avx512.c computes
 * with it). Packing is a transpose of words within each group's block, in
 * place; unpacking one row is what get_rows and the tests need. */
#include "kernels/cpu/cpu_internal.h"

/* Where byte o (even) of row i's block sits in a packed block of bb bytes. */
static inline size_t x16_offset(size_t bb, size_t o, size_t i) {
    const size_t words = bb / 4;
    return o < 4 * words ? ((o / 4) * CPU_X16 + i) * 4 + o % 4 : 4 * words * CPU_X16 + 2 * i;
}

void cpu_x16_pack(pd_type t, uint8_t *data, int64_t rows, size_t row_bytes, uint8_t *tmp) {
    const size_t bb = pd_type_get((uint32_t)t)->type_size, nb = row_bytes / bb;
    for (int64_t g = 0; g + CPU_X16 <= rows; g += CPU_X16) {
        uint8_t *grp = data + (size_t)g * row_bytes;
        for (size_t b = 0; b < nb; b++)
            for (size_t i = 0; i < CPU_X16; i++)
                for (size_t o = 0; o < bb; o += o + 4 <= bb ? 4 : 2)
                    memcpy(tmp + b * CPU_X16 * bb + x16_offset(bb, o, i), grp + i * row_bytes + b * bb + o,
                           o + 4 <= bb ? 4 : 2);
        memcpy(grp, tmp, CPU_X16 * row_bytes);
    }
}

void cpu_x16_row(pd_type t, const uint8_t *data, int64_t rows, size_t row_bytes, int64_t r, uint8_t *out) {
    if (r >= rows / CPU_X16 * CPU_X16) {
        memcpy(out, data + (size_t)r * row_bytes, row_bytes);
        return;
    }
    const size_t bb = pd_type_get((uint32_t)t)->type_size, nb = row_bytes / bb, i = (size_t)(r % CPU_X16);
    const uint8_t *grp = data + (size_t)(r - r % CPU_X16) * row_bytes;
    for (size_t b = 0; b < nb; b++)
        for (size_t o = 0; o < bb; o += o + 4 <= bb ? 4 : 2)
            memcpy(out + b * bb + o, grp + b * CPU_X16 * bb + x16_offset(bb, o, i), o + 4 <= bb ? 4 : 2);
}

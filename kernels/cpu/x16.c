/* PD_LAYOUT_CPU_X16: the rows of a weight rearranged, 16 at a time, so that
 * a kernel finds the same 4-byte word of 16 rows' blocks in one 64-byte
 * line (cpu_internal.h states the arrangement; simd_x16_avx512.c computes
 * with it). Packing is a transpose of words within each group's block, in
 * place; unpacking one row is what get_rows and the tests need. */
#include "kernels/cpu/cpu_internal.h"

/* Bytes of a block before its words: q8_0's d. */
static size_t x16_head(pd_type t) { return t == PD_TYPE_Q8_0 ? 2 : 0; }

/* Copy row i's block of bb bytes (at row_block; head bytes, words, then a
 * 2-byte tail if bb - head is not whole words) into its places in the
 * group's packed block (at packed) if `pack`, else back out of them. */
static void x16_block(uint8_t *packed, uint8_t *row_block, size_t bb, size_t head, size_t i, bool pack) {
    const size_t words = (bb - head) / 4;
    if (head) {
        uint8_t *p = packed + 2 * i;
        memcpy(pack ? p : row_block, pack ? row_block : p, 2);
        packed += 2 * CPU_X16;
        row_block += 2;
    }
    for (size_t k = 0; k < words; k++) {
        uint8_t *p = packed + (k * CPU_X16 + i) * 4, *r = row_block + 4 * k;
        memcpy(pack ? p : r, pack ? r : p, 4);
    }
    if ((bb - head) % 4) {
        uint8_t *p = packed + 4 * words * CPU_X16 + 2 * i, *r = row_block + 4 * words;
        memcpy(pack ? p : r, pack ? r : p, 2);
    }
}

void cpu_x16_pack(pd_type t, uint8_t *data, int64_t rows, size_t row_bytes, uint8_t *tmp) {
    const size_t bb = pd_type_get((uint32_t)t)->type_size, nb = row_bytes / bb;
    for (int64_t g = 0; g + CPU_X16 <= rows; g += CPU_X16) {
        uint8_t *grp = data + (size_t)g * row_bytes;
        for (size_t i = 0; i < CPU_X16; i++)
            for (size_t b = 0; b < nb; b++)
                x16_block(tmp + b * CPU_X16 * bb, grp + i * row_bytes + b * bb, bb, x16_head(t), i, true);
        memcpy(grp, tmp, CPU_X16 * row_bytes);
    }
}

void cpu_x16_row(pd_type t, const uint8_t *data, int64_t rows, size_t row_bytes, int64_t r, uint8_t *out) {
    if (r >= rows / CPU_X16 * CPU_X16) {
        memcpy(out, data + (size_t)r * row_bytes, row_bytes);
        return;
    }
    const size_t bb = pd_type_get((uint32_t)t)->type_size, nb = row_bytes / bb, i = (size_t)(r % CPU_X16);
    uint8_t *grp = (uint8_t *)(uintptr_t)(data + (size_t)(r - r % CPU_X16) * row_bytes); /* only read */
    for (size_t b = 0; b < nb; b++) x16_block(grp + b * CPU_X16 * bb, out + b * bb, bb, x16_head(t), i, false);
}

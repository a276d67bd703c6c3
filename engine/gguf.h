/* engine/gguf.h: GGUF files: the reader (mmap, typed metadata, tensor table), the printer and the writer.
 * Part of engine's public contract (engine/engine.h includes every part). */
#ifndef PD_ENGINE_GGUF_H
#define PD_ENGINE_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * GGUF reader
 *
 * The file is mmap'd; strings and array payloads point into the mapping and
 * stay valid until pd_gguf_close(). Every count, length, offset and type read
 * from the file is checked against the file size before use, so a malformed
 * file yields PD_EFORMAT with a message naming the field and byte offset.
 * ------------------------------------------------------------------------ */

#define PD_GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define PD_GGUF_DEFAULT_ALIGNMENT 32
#define PD_GGUF_MAX_DIMS 4
#define PD_GGUF_MAX_ARRAY_DEPTH 8 /* nested arrays deeper than this are refused */

typedef enum pd_gguf_vtype {
    PD_GGUF_UINT8 = 0,
    PD_GGUF_INT8 = 1,
    PD_GGUF_UINT16 = 2,
    PD_GGUF_INT16 = 3,
    PD_GGUF_UINT32 = 4,
    PD_GGUF_INT32 = 5,
    PD_GGUF_FLOAT32 = 6,
    PD_GGUF_BOOL = 7,
    PD_GGUF_STRING = 8,
    PD_GGUF_ARRAY = 9,
    PD_GGUF_UINT64 = 10,
    PD_GGUF_INT64 = 11,
    PD_GGUF_FLOAT64 = 12,
    PD_GGUF_VTYPE_COUNT = 13
} pd_gguf_vtype;

const char *pd_gguf_vtype_name(pd_gguf_vtype t);

/* A length-delimited string inside the mapping (not NUL-terminated). */
typedef struct pd_str {
    const char *ptr;
    uint64_t len;
} pd_str;

typedef struct pd_gguf_value pd_gguf_value;
struct pd_gguf_value {
    pd_gguf_vtype type;
    union {
        uint64_t u;  /* UINT8/16/32/64, BOOL (0/1) */
        int64_t i;   /* INT8/16/32/64 */
        double f;    /* FLOAT32/64 */
        pd_str str;  /* STRING */
        struct {
            pd_gguf_vtype elem_type;
            uint64_t n;
            /* Fixed-size elements: raw little-endian payload, possibly
             * unaligned; read with the pd_gguf_arr_* accessors. */
            const uint8_t *data;
            /* STRING elements: n entries. */
            const pd_str *strs;
            /* ARRAY elements: n nested values. */
            const pd_gguf_value *items;
        } arr;
    };
};

typedef struct pd_gguf_kv {
    char *key; /* NUL-terminated copy */
    pd_gguf_value value;
} pd_gguf_kv;

typedef struct pd_gguf_tensor {
    char *name; /* NUL-terminated copy */
    uint32_t n_dims;
    uint64_t ne[PD_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension; unused dims are 1 */
    pd_type type;
    uint64_t offset;  /* relative to the start of the data section */
    uint64_t n_elems;
    uint64_t n_bytes;
    const uint8_t *data; /* inside the mapping */
} pd_gguf_tensor;

typedef struct pd_gguf pd_gguf;

/* Open and validate a GGUF v2/v3 file, mapped from the page cache. */
int pd_gguf_open(const char *path, pd_gguf **out, pd_error *err);
/* The same, read into private huge-page memory (pd_load_file): what the
 * CPU computes from, since decode streams the weights at memory speed. */
int pd_gguf_load(const char *path, pd_gguf **out, pd_error *err);
/* For a file opened with pd_gguf_load: let its tensor data be written in
 * place (the model loader rearranges weights for the CPU backend), or make
 * it read-only again. PD_EINVAL for a mapped file. */
int pd_gguf_set_writable(pd_gguf *g, bool writable, pd_error *err);
/* Parse a GGUF image already in memory (not copied; must outlive the handle).
 * Used by the fuzzer and by tests. */
int pd_gguf_open_memory(const void *data, size_t size, pd_gguf **out, pd_error *err);
void pd_gguf_close(pd_gguf *g);

uint32_t pd_gguf_version(const pd_gguf *g);
uint64_t pd_gguf_alignment(const pd_gguf *g);
uint64_t pd_gguf_data_offset(const pd_gguf *g); /* file offset of the data section */
uint64_t pd_gguf_file_size(const pd_gguf *g);

size_t pd_gguf_kv_count(const pd_gguf *g);
const pd_gguf_kv *pd_gguf_kv_at(const pd_gguf *g, size_t i);
/* NULL when absent. */
const pd_gguf_value *pd_gguf_find(const pd_gguf *g, const char *key);

size_t pd_gguf_tensor_count(const pd_gguf *g);
const pd_gguf_tensor *pd_gguf_tensor_at(const pd_gguf *g, size_t i);
const pd_gguf_tensor *pd_gguf_find_tensor(const pd_gguf *g, const char *name);

/* Typed getters. They return PD_ENOTFOUND if the key is absent and
 * PD_EFORMAT if it has an incompatible type or an out-of-range value
 * (integers convert between widths when the value fits). */
int pd_gguf_get_u64(const pd_gguf *g, const char *key, uint64_t *out, pd_error *err);
int pd_gguf_get_u32(const pd_gguf *g, const char *key, uint32_t *out, pd_error *err);
int pd_gguf_get_i64(const pd_gguf *g, const char *key, int64_t *out, pd_error *err);
int pd_gguf_get_f32(const pd_gguf *g, const char *key, float *out, pd_error *err);
int pd_gguf_get_bool(const pd_gguf *g, const char *key, bool *out, pd_error *err);
int pd_gguf_get_str(const pd_gguf *g, const char *key, pd_str *out, pd_error *err);
/* Array of the given element type (PD_GGUF_ARRAY key). */
int pd_gguf_get_arr(const pd_gguf *g, const char *key, pd_gguf_vtype elem_type,
                    const pd_gguf_value **out, pd_error *err);

/* Element accessors for fixed-size arrays (caller checks i < n and type). */
float pd_gguf_arr_f32(const pd_gguf_value *arr, uint64_t i);
int32_t pd_gguf_arr_i32(const pd_gguf_value *arr, uint64_t i);
/* Any integer element type, widened. */
int64_t pd_gguf_arr_int(const pd_gguf_value *arr, uint64_t i);

/* Model fingerprint: SHA-256 over the header, metadata and tensor table bytes
 * exactly as stored (not the weights): cheap and stable across runs. */
void pd_gguf_fingerprint(const pd_gguf *g, uint8_t out[PD_SHA256_LEN]);

/* Print metadata and tensor table in a human-readable form (prefixctl inspect).
 * Long arrays are abbreviated to their first `max_array_items` items. */
void pd_gguf_print(const pd_gguf *g, void *file /* FILE* */, size_t max_array_items);

/* ------------------------------------------------------------------------
 * GGUF writer (test models, tools)
 *
 * Collects metadata and tensors in memory, then writes a v3 file with the
 * requested alignment. Keys and tensor names are copied.
 * ------------------------------------------------------------------------ */

typedef struct pd_gguf_writer pd_gguf_writer;

int pd_gguf_writer_new(pd_gguf_writer **out, pd_error *err);
void pd_gguf_writer_free(pd_gguf_writer *w);
int pd_gguf_writer_set_u32(pd_gguf_writer *w, const char *key, uint32_t v, pd_error *err);
int pd_gguf_writer_set_i32(pd_gguf_writer *w, const char *key, int32_t v, pd_error *err);
int pd_gguf_writer_set_u64(pd_gguf_writer *w, const char *key, uint64_t v, pd_error *err);
int pd_gguf_writer_set_f32(pd_gguf_writer *w, const char *key, float v, pd_error *err);
int pd_gguf_writer_set_bool(pd_gguf_writer *w, const char *key, bool v, pd_error *err);
int pd_gguf_writer_set_str(pd_gguf_writer *w, const char *key, const char *v, pd_error *err);
/* Array of fixed-size elements (elem_type not STRING/ARRAY), n elements of
 * native little-endian data. */
int pd_gguf_writer_set_arr(pd_gguf_writer *w, const char *key, pd_gguf_vtype elem_type,
                           const void *data, uint64_t n, pd_error *err);
/* Array of strings given as pd_str (lengths explicit, so NUL bytes survive). */
int pd_gguf_writer_set_arr_str(pd_gguf_writer *w, const char *key, const pd_str *strs,
                               uint64_t n, pd_error *err);
/* Copy one key (any type, nested arrays included) from an open file. */
int pd_gguf_writer_copy_kv(pd_gguf_writer *w, const pd_gguf_kv *kv, pd_error *err);
/* Add a tensor; `data` holds n_bytes of already-encoded data of `type` and is
 * copied. ne has n_dims entries (ne[0] contiguous). */
int pd_gguf_writer_add_tensor(pd_gguf_writer *w, const char *name, pd_type type,
                              uint32_t n_dims, const uint64_t *ne, const void *data,
                              pd_error *err);
/* Add a tensor whose bytes are produced at write time, so multi-gigabyte
 * models are streamed to disk instead of held in memory. `fill` must write
 * exactly n_bytes (the encoded size of the tensor) into dst. */
typedef int (*pd_gguf_fill_fn)(void *ctx, const char *name, void *dst, uint64_t n_bytes,
                               pd_error *err);
int pd_gguf_writer_add_tensor_lazy(pd_gguf_writer *w, const char *name, pd_type type,
                                   uint32_t n_dims, const uint64_t *ne, pd_gguf_fill_fn fill,
                                   void *ctx, pd_error *err);
/* Write the file (atomically: temp file + rename). alignment 0 = default 32. */
int pd_gguf_writer_write(pd_gguf_writer *w, const char *path, uint32_t alignment, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif

/* GGUF reader: well-formed files read back exactly, malformed ones are
 * refused with a message that names the problem, and never crash. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"

/* ---- a hand-built sample file with every value type ------------------- */

typedef struct sample {
    th_buf b;
    size_t at_version, at_n_tensors, at_n_kv;
    size_t at_u8_type;     /* value type field of "test.u8" */
    size_t at_str_len;     /* length field of the "general.architecture" value */
    size_t at_strs_count;  /* element count of "test.strs" */
    size_t at_strs_etype;  /* element type of "test.strs" */
    size_t at_nested_count;
    size_t at_t0_ndims, at_t0_ne0, at_t0_ne1, at_t0_type, at_t0_offset;
    size_t at_t1_name_len, at_t1_offset;
    size_t data_start;
} sample;

static void kv_header(th_buf *b, const char *key, uint32_t type) {
    th_buf_str(b, key);
    th_buf_u32(b, type);
}

static void build_sample(sample *s, uint32_t version) {
    memset(s, 0, sizeof *s);
    th_buf *b = &s->b;
    th_buf_u32(b, PD_GGUF_MAGIC);
    s->at_version = b->len;
    th_buf_u32(b, version);
    s->at_n_tensors = b->len;
    th_buf_u64(b, 2);
    s->at_n_kv = b->len;
    th_buf_u64(b, 16);

    th_buf_str(b, "general.architecture");
    th_buf_u32(b, PD_GGUF_STRING);
    s->at_str_len = b->len;
    th_buf_str(b, "llama");
    th_buf_str(b, "test.u8");
    s->at_u8_type = b->len;
    th_buf_u32(b, PD_GGUF_UINT8);
    th_buf_u8(b, 200);
    kv_header(b, "test.i8", PD_GGUF_INT8);
    th_buf_u8(b, (uint8_t)-3);
    kv_header(b, "test.u16", PD_GGUF_UINT16);
    th_buf_u8(b, 0x34), th_buf_u8(b, 0x12);
    kv_header(b, "test.i16", PD_GGUF_INT16);
    th_buf_u8(b, 0xfe), th_buf_u8(b, 0xff);
    kv_header(b, "test.u32", PD_GGUF_UINT32);
    th_buf_u32(b, 4000000000u);
    kv_header(b, "test.i32", PD_GGUF_INT32);
    th_buf_u32(b, (uint32_t)-123456);
    kv_header(b, "test.f32", PD_GGUF_FLOAT32);
    th_buf_f32(b, 0.25f);
    kv_header(b, "test.bool", PD_GGUF_BOOL);
    th_buf_u8(b, 1);
    kv_header(b, "test.u64", PD_GGUF_UINT64);
    th_buf_u64(b, 0xfedcba9876543210ull);
    kv_header(b, "test.i64", PD_GGUF_INT64);
    th_buf_u64(b, (uint64_t)-5);
    kv_header(b, "test.f64", PD_GGUF_FLOAT64);
    double d = -1.0e300;
    th_buf_bytes(b, &d, 8);

    kv_header(b, "test.strs", PD_GGUF_ARRAY);
    s->at_strs_etype = b->len;
    th_buf_u32(b, PD_GGUF_STRING);
    s->at_strs_count = b->len;
    th_buf_u64(b, 3);
    th_buf_str(b, "a");
    th_buf_str(b, "bc");
    th_buf_str(b, "");

    kv_header(b, "test.nested", PD_GGUF_ARRAY);
    th_buf_u32(b, PD_GGUF_ARRAY);
    s->at_nested_count = b->len;
    th_buf_u64(b, 2);
    th_buf_u32(b, PD_GGUF_INT32);
    th_buf_u64(b, 2);
    th_buf_u32(b, 1);
    th_buf_u32(b, 2);
    th_buf_u32(b, PD_GGUF_INT32);
    th_buf_u64(b, 1);
    th_buf_u32(b, (uint32_t)-3);

    kv_header(b, "test.f32s", PD_GGUF_ARRAY);
    th_buf_u32(b, PD_GGUF_FLOAT32);
    th_buf_u64(b, 2);
    th_buf_f32(b, 1.5f);
    th_buf_f32(b, -2.0f);

    kv_header(b, "test.empty", PD_GGUF_ARRAY);
    th_buf_u32(b, PD_GGUF_UINT64);
    th_buf_u64(b, 0);

    /* tensor "a": f32 [4 x 2] at 0 (32 bytes); tensor "b": q8_0 [32] at 32 (34 bytes) */
    th_buf_str(b, "a");
    s->at_t0_ndims = b->len;
    th_buf_u32(b, 2);
    s->at_t0_ne0 = b->len;
    th_buf_u64(b, 4);
    s->at_t0_ne1 = b->len;
    th_buf_u64(b, 2);
    s->at_t0_type = b->len;
    th_buf_u32(b, PD_TYPE_F32);
    s->at_t0_offset = b->len;
    th_buf_u64(b, 0);
    s->at_t1_name_len = b->len;
    th_buf_str(b, "b");
    th_buf_u32(b, 1);
    th_buf_u64(b, 32);
    th_buf_u32(b, PD_TYPE_Q8_0);
    s->at_t1_offset = b->len;
    th_buf_u64(b, 32);

    th_buf_pad(b, 32);
    s->data_start = b->len;
    for (int i = 0; i < 8; i++) th_buf_f32(b, (float)i - 3.5f);
    for (int i = 0; i < 34; i++) th_buf_u8(b, (uint8_t)(i * 7));
}

static void patch_u32(sample *s, size_t at, uint32_t v) {
    for (int i = 0; i < 4; i++) s->b.data[at + i] = (uint8_t)(v >> (8 * i));
}
static void patch_u64(sample *s, size_t at, uint64_t v) {
    for (int i = 0; i < 8; i++) s->b.data[at + i] = (uint8_t)(v >> (8 * i));
}

/* Open a copy of exactly len bytes, so ASan sees any read past the end. */
static int open_exact(const uint8_t *data, size_t len, pd_gguf **g, pd_error *err) {
    uint8_t *copy = malloc(len ? len : 1);
    cr_assert(copy);
    if (len) memcpy(copy, data, len);
    int rc = pd_gguf_open_memory(copy, len, g, err);
    if (rc == PD_OK) {
        /* Walk everything the reader handed out; it must all be readable. */
        for (size_t i = 0; i < pd_gguf_kv_count(*g); i++) (void)pd_gguf_kv_at(*g, i)->key[0];
        FILE *devnull = fopen("/dev/null", "w");
        pd_gguf_print(*g, devnull, 1000);
        fclose(devnull);
        for (size_t i = 0; i < pd_gguf_tensor_count(*g); i++) {
            const pd_gguf_tensor *t = pd_gguf_tensor_at(*g, i);
            volatile uint8_t sink = 0;
            for (uint64_t k = 0; k < t->n_bytes; k++) sink ^= t->data[k];
            (void)sink;
        }
        pd_gguf_close(*g);
        *g = NULL;
    }
    free(copy);
    return rc;
}

static void expect_error(sample *s, int code, const char *needle) {
    pd_gguf *g = NULL;
    pd_error err = {0};
    int rc = open_exact(s->b.data, s->b.len, &g, &err);
    cr_assert_eq(rc, code, "expected status %d, got %d (%s)", code, rc, err.msg);
    cr_assert(strstr(err.msg, needle), "message '%s' should mention '%s'", err.msg, needle);
    th_buf_free(&s->b);
}

/* ---- well-formed files ------------------------------------------------ */

Test(gguf, sample_reads_back_every_type) {
    sample s;
    build_sample(&s, 3);
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_version(g), 3);
    cr_assert_eq(pd_gguf_kv_count(g), 16);
    cr_assert_eq(pd_gguf_alignment(g), 32);
    cr_assert_eq(pd_gguf_data_offset(g), s.data_start);

    pd_str str;
    cr_assert_eq(pd_gguf_get_str(g, "general.architecture", &str, &err), PD_OK);
    cr_assert(str.len == 5 && memcmp(str.ptr, "llama", 5) == 0);
    cr_assert_eq(pd_gguf_find(g, "test.u8")->u, 200);
    cr_assert_eq(pd_gguf_find(g, "test.i8")->i, -3);
    cr_assert_eq(pd_gguf_find(g, "test.u16")->u, 0x1234);
    cr_assert_eq(pd_gguf_find(g, "test.i16")->i, -2);
    cr_assert_eq(pd_gguf_find(g, "test.u32")->u, 4000000000u);
    cr_assert_eq(pd_gguf_find(g, "test.i32")->i, -123456);
    cr_assert_float_eq(pd_gguf_find(g, "test.f32")->f, 0.25, 0);
    cr_assert_eq(pd_gguf_find(g, "test.bool")->u, 1);
    cr_assert_eq(pd_gguf_find(g, "test.u64")->u, 0xfedcba9876543210ull);
    cr_assert_eq(pd_gguf_find(g, "test.i64")->i, -5);
    cr_assert_float_eq(pd_gguf_find(g, "test.f64")->f, -1.0e300, 0);

    const pd_gguf_value *arr;
    cr_assert_eq(pd_gguf_get_arr(g, "test.strs", PD_GGUF_STRING, &arr, &err), PD_OK);
    cr_assert_eq(arr->arr.n, 3);
    cr_assert(arr->arr.strs[1].len == 2 && memcmp(arr->arr.strs[1].ptr, "bc", 2) == 0);
    cr_assert_eq(arr->arr.strs[2].len, 0);
    cr_assert_eq(pd_gguf_get_arr(g, "test.nested", PD_GGUF_ARRAY, &arr, &err), PD_OK);
    cr_assert_eq(arr->arr.n, 2);
    cr_assert_eq(arr->arr.items[0].arr.n, 2);
    cr_assert_eq(pd_gguf_arr_i32(&arr->arr.items[0], 1), 2);
    cr_assert_eq(pd_gguf_arr_int(&arr->arr.items[1], 0), -3);
    cr_assert_eq(pd_gguf_get_arr(g, "test.f32s", PD_GGUF_FLOAT32, &arr, &err), PD_OK);
    cr_assert_float_eq(pd_gguf_arr_f32(arr, 1), -2.0f, 0);
    cr_assert_eq(pd_gguf_get_arr(g, "test.empty", PD_GGUF_UINT64, &arr, &err), PD_OK);
    cr_assert_eq(arr->arr.n, 0);

    cr_assert_eq(pd_gguf_tensor_count(g), 2);
    const pd_gguf_tensor *a = pd_gguf_find_tensor(g, "a"), *b = pd_gguf_find_tensor(g, "b");
    cr_assert(a && b);
    cr_assert_eq(a->n_dims, 2);
    cr_assert(a->ne[0] == 4 && a->ne[1] == 2 && a->ne[2] == 1 && a->ne[3] == 1);
    cr_assert_eq(a->n_elems, 8);
    cr_assert_eq(a->n_bytes, 32);
    float f;
    memcpy(&f, a->data + 4 * 7, 4);
    cr_assert_float_eq(f, 3.5f, 0);
    cr_assert_eq(b->type, PD_TYPE_Q8_0);
    cr_assert_eq(b->n_bytes, 34);
    cr_assert_eq(b->data, (const uint8_t *)s.b.data + s.data_start + 32);
    cr_assert_null(pd_gguf_find_tensor(g, "c"));
    cr_assert_null(pd_gguf_find(g, "test.nope"));
    pd_gguf_close(g);
    th_buf_free(&s.b);
}

Test(gguf, version_2_is_read) {
    sample s;
    build_sample(&s, 2);
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_version(g), 2);
    pd_gguf_close(g);
    th_buf_free(&s.b);
}

Test(gguf, typed_getters_convert_and_refuse) {
    sample s;
    build_sample(&s, 3);
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK);
    uint32_t u32;
    uint64_t u64;
    int64_t i64;
    float f;
    bool bl;
    pd_str str;
    const pd_gguf_value *arr;
    cr_assert_eq(pd_gguf_get_u32(g, "test.u8", &u32, &err), PD_OK);
    cr_assert_eq(u32, 200);
    cr_assert_eq(pd_gguf_get_u32(g, "test.u64", &u32, &err), PD_EFORMAT, "u64 too big for u32");
    cr_assert(strstr(err.msg, "test.u64"));
    cr_assert_eq(pd_gguf_get_u64(g, "test.i64", &u64, &err), PD_EFORMAT, "negative to unsigned");
    cr_assert_eq(pd_gguf_get_i64(g, "test.u64", &i64, &err), PD_EFORMAT, "u64 above INT64_MAX");
    cr_assert_eq(pd_gguf_get_i64(g, "test.i32", &i64, &err), PD_OK);
    cr_assert_eq(i64, -123456);
    cr_assert_eq(pd_gguf_get_f32(g, "test.u32", &f, &err), PD_OK);
    cr_assert_eq(pd_gguf_get_bool(g, "test.bool", &bl, &err), PD_OK);
    cr_assert(bl);
    cr_assert_eq(pd_gguf_get_bool(g, "test.u8", &bl, &err), PD_EFORMAT);
    cr_assert_eq(pd_gguf_get_str(g, "test.u8", &str, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "expected str"));
    cr_assert_eq(pd_gguf_get_str(g, "missing.key", &str, &err), PD_ENOTFOUND);
    cr_assert(strstr(err.msg, "missing.key"));
    cr_assert_eq(pd_gguf_get_arr(g, "test.strs", PD_GGUF_INT32, &arr, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "arr[str]"), "%s", err.msg);
    pd_gguf_close(g);
    th_buf_free(&s.b);
}

Test(gguf, fingerprint_covers_metadata_not_weights) {
    sample s;
    build_sample(&s, 3);
    pd_gguf *g = NULL;
    pd_error err = {0};
    uint8_t fp1[32], fp2[32], fp3[32], fp4[32];
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK);
    pd_gguf_fingerprint(g, fp1);
    pd_gguf_close(g);
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK);
    pd_gguf_fingerprint(g, fp2);
    pd_gguf_close(g);
    cr_assert_arr_eq(fp1, fp2, 32, "same bytes, same fingerprint");

    s.b.data[s.data_start] ^= 0x40; /* a weight byte */
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK);
    pd_gguf_fingerprint(g, fp3);
    pd_gguf_close(g);
    cr_assert_arr_eq(fp1, fp3, 32, "weights are not part of the fingerprint");

    s.b.data[s.at_u8_type + 4] ^= 1; /* the value of test.u8 */
    cr_assert_eq(pd_gguf_open_memory(s.b.data, s.b.len, &g, &err), PD_OK);
    pd_gguf_fingerprint(g, fp4);
    pd_gguf_close(g);
    cr_assert_arr_neq(fp1, fp4, 32, "metadata changes the fingerprint");
    th_buf_free(&s.b);
}

Test(gguf, alignment_from_metadata) {
    /* 0 tensors is legal (vocab-only files); alignment 64 moves the data start. */
    th_buf b = {0};
    th_buf_u32(&b, PD_GGUF_MAGIC);
    th_buf_u32(&b, 3);
    th_buf_u64(&b, 1);
    th_buf_u64(&b, 1);
    kv_header(&b, "general.alignment", PD_GGUF_UINT32);
    th_buf_u32(&b, 64);
    th_buf_str(&b, "w");
    th_buf_u32(&b, 1);
    th_buf_u64(&b, 16);
    th_buf_u32(&b, PD_TYPE_F16);
    th_buf_u64(&b, 0);
    th_buf_pad(&b, 64);
    size_t data = b.len;
    for (int i = 0; i < 32; i++) th_buf_u8(&b, (uint8_t)i);
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open_memory(b.data, b.len, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_alignment(g), 64);
    cr_assert_eq(pd_gguf_data_offset(g), data);
    cr_assert_eq(pd_gguf_data_offset(g) % 64, 0);
    cr_assert_eq(pd_gguf_find_tensor(g, "w")->n_bytes, 32);
    pd_gguf_close(g);
    th_buf_free(&b);
}

Test(gguf, missing_file_names_the_path) {
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open("/nonexistent/model.gguf", &g, &err), PD_EIO);
    cr_assert(strstr(err.msg, "/nonexistent/model.gguf"), "%s", err.msg);
    cr_assert_null(g);
}

Test(gguf, real_stories260k) {
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "%s", err.msg);
    uint32_t v;
    cr_assert_eq(pd_gguf_get_u32(g, "llama.embedding_length", &v, &err), PD_OK);
    cr_assert_eq(v, 64);
    cr_assert_eq(pd_gguf_get_u32(g, "llama.block_count", &v, &err), PD_OK);
    cr_assert_eq(v, 5);
    cr_assert_eq(pd_gguf_tensor_count(g), 48);
    const pd_gguf_tensor *t = pd_gguf_find_tensor(g, "token_embd.weight");
    cr_assert(t && t->type == PD_TYPE_F32 && t->ne[0] == 64 && t->ne[1] == 512);
    t = pd_gguf_find_tensor(g, "blk.4.ffn_down.weight");
    cr_assert(t && t->ne[0] == 172 && t->ne[1] == 64);
    const pd_gguf_value *toks;
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK);
    cr_assert_eq(toks->arr.n, 512);
    cr_assert(toks->arr.strs[1].len == 3 && memcmp(toks->arr.strs[1].ptr, "<s>", 3) == 0);
    /* The last tensor ends inside the file and the data section is aligned. */
    cr_assert_eq(pd_gguf_data_offset(g) % 32, 0);
    uint8_t fp[32];
    char hex[65];
    pd_gguf_fingerprint(g, fp);
    pd_hex(fp, 32, hex);
    pd_gguf_close(g);
    /* Stable across runs: this value is the SHA-256 of the file's first 14176 bytes. */
    cr_assert_str_eq(hex, "6d1305921b546d1384a3a7de9a511136fca0c8a25e2f7ed477531694a66b3f2b");
}

Test(gguf, real_vocab_files_open) {
    TH_REQUIRE_SHARED();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/vocab", th_shared_models());
    DIR *d = opendir(dir);
    cr_assert(d);
    int opened = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 5 || strcmp(e->d_name + n - 5, ".gguf") != 0) continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        pd_gguf *g = NULL;
        pd_error err = {0};
        cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "%s: %s", e->d_name, err.msg);
        const pd_gguf_value *toks;
        cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK,
                     "%s: %s", e->d_name, err.msg);
        cr_assert_gt(toks->arr.n, 1000);
        pd_gguf_close(g);
        opened++;
    }
    closedir(d);
    cr_assert_geq(opened, 12);
}

/* ---- malformed files -------------------------------------------------- */

Test(gguf_malformed, every_truncation_is_refused) {
    sample s;
    build_sample(&s, 3);
    for (size_t len = 0; len < s.b.len; len++) {
        pd_gguf *g = NULL;
        pd_error err = {0};
        int rc = open_exact(s.b.data, len, &g, &err);
        cr_assert_eq(rc, PD_EFORMAT, "prefix of %zu/%zu bytes: status %d (%s)", len, s.b.len, rc, err.msg);
        cr_assert(strstr(err.msg, "truncat") || strstr(err.msg, "beyond the end") ||
                      strstr(err.msg, "cannot hold") || strstr(err.msg, "claims") || strstr(err.msg, "not a GGUF"),
                  "prefix %zu: unhelpful message '%s'", len, err.msg);
    }
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(open_exact(s.b.data, s.b.len, &g, &err), PD_OK, "%s", err.msg);
    th_buf_free(&s.b);
}

Test(gguf_malformed, every_byte_corruption_is_survived) {
    /* Any single corrupted byte either still parses or is refused; under ASan
     * this proves no out-of-bounds access on any path. */
    sample s;
    build_sample(&s, 3);
    static const uint8_t patterns[] = {0x00, 0xff, 0x80, 0x7f, 0x01, 0x40};
    int refused = 0;
    for (size_t pos = 0; pos < s.data_start; pos++) {
        uint8_t orig = s.b.data[pos];
        for (size_t k = 0; k < sizeof patterns; k++) {
            if (patterns[k] == orig) continue;
            s.b.data[pos] = patterns[k];
            pd_gguf *g = NULL;
            pd_error err = {0};
            int rc = open_exact(s.b.data, s.b.len, &g, &err);
            if (rc != PD_OK) {
                refused++;
                cr_assert(err.msg[0] != '\0', "refusal at byte %zu has no message", pos);
            }
        }
        s.b.data[pos] = orig;
    }
    cr_assert_gt(refused, 100);
    th_buf_free(&s.b);
}

Test(gguf_malformed, bad_magic) {
    sample s;
    build_sample(&s, 3);
    s.b.data[0] = 'X';
    expect_error(&s, PD_EFORMAT, "not a GGUF file");
}

Test(gguf_malformed, unsupported_versions) {
    sample s;
    build_sample(&s, 1);
    expect_error(&s, PD_EUNSUPPORTED, "version 1");
    build_sample(&s, 4);
    expect_error(&s, PD_EUNSUPPORTED, "version 4");
    build_sample(&s, 3);
    patch_u32(&s, s.at_version, 0x03000000u);
    expect_error(&s, PD_EUNSUPPORTED, "big-endian");
}

Test(gguf_malformed, huge_counts) {
    sample s;
    build_sample(&s, 3);
    patch_u64(&s, s.at_n_kv, UINT64_MAX);
    expect_error(&s, PD_EFORMAT, "metadata entries");
    build_sample(&s, 3);
    patch_u64(&s, s.at_n_tensors, 1ull << 40);
    expect_error(&s, PD_EFORMAT, "tensors");
    build_sample(&s, 3);
    patch_u64(&s, s.at_strs_count, 1ull << 61);
    expect_error(&s, PD_EFORMAT, "test.strs");
    build_sample(&s, 3);
    patch_u64(&s, s.at_nested_count, UINT64_MAX / 2);
    expect_error(&s, PD_EFORMAT, "test.nested");
    build_sample(&s, 3);
    patch_u64(&s, s.at_str_len, UINT64_MAX);
    expect_error(&s, PD_EFORMAT, "claims");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t1_name_len, 1ull << 62);
    expect_error(&s, PD_EFORMAT, "tensor name");
    /* n_kv one too many: the next "key" is read out of the tensor table and
     * runs off the end or into garbage, never past the buffer. */
    build_sample(&s, 3);
    patch_u64(&s, s.at_n_kv, 17);
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_neq(open_exact(s.b.data, s.b.len, &g, &err), PD_OK);
    th_buf_free(&s.b);
}

Test(gguf_malformed, huge_dimensions_overflow) {
    sample s;
    build_sample(&s, 3);
    patch_u64(&s, s.at_t0_ne0, 1ull << 40);
    patch_u64(&s, s.at_t0_ne1, 1ull << 40);
    expect_error(&s, PD_EFORMAT, "overflows");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t0_ne0, UINT64_MAX);
    expect_error(&s, PD_EFORMAT, "tensor 'a'");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t0_ne0, 1ull << 30); /* fine arithmetic, but far beyond the file */
    expect_error(&s, PD_EFORMAT, "beyond the end");
}

Test(gguf_malformed, nesting_too_deep) {
    th_buf b = {0};
    th_buf_u32(&b, PD_GGUF_MAGIC);
    th_buf_u32(&b, 3);
    th_buf_u64(&b, 0);
    th_buf_u64(&b, 1);
    kv_header(&b, "deep", PD_GGUF_ARRAY);
    for (int i = 0; i < 20; i++) {
        th_buf_u32(&b, PD_GGUF_ARRAY);
        th_buf_u64(&b, 1);
    }
    th_buf_u32(&b, PD_GGUF_UINT8);
    th_buf_u64(&b, 0);
    sample s = {.b = b};
    expect_error(&s, PD_EFORMAT, "nested deeper");
}

Test(gguf_malformed, bad_types) {
    sample s;
    build_sample(&s, 3);
    patch_u32(&s, s.at_u8_type, 13);
    expect_error(&s, PD_EFORMAT, "value type 13");
    build_sample(&s, 3);
    patch_u32(&s, s.at_strs_etype, 99);
    expect_error(&s, PD_EFORMAT, "element type 99");
    build_sample(&s, 3);
    patch_u32(&s, s.at_t0_type, 99);
    expect_error(&s, PD_EUNSUPPORTED, "type 99");
    build_sample(&s, 3);
    patch_u32(&s, s.at_t0_type, 4); /* Q4_2: removed from ggml long ago */
    expect_error(&s, PD_EUNSUPPORTED, "tensor 'a'");
    build_sample(&s, 3);
    patch_u32(&s, s.at_t0_type, PD_TYPE_Q4_K); /* row of 4 is not a multiple of 256 */
    expect_error(&s, PD_EFORMAT, "block size");
    build_sample(&s, 3);
    patch_u32(&s, s.at_t0_ndims, 0);
    expect_error(&s, PD_EFORMAT, "n_dims = 0");
    build_sample(&s, 3);
    patch_u32(&s, s.at_t0_ndims, 5);
    expect_error(&s, PD_EFORMAT, "n_dims = 5");
}

Test(gguf_malformed, bad_offsets) {
    sample s;
    build_sample(&s, 3);
    patch_u64(&s, s.at_t0_offset, 8);
    expect_error(&s, PD_EFORMAT, "alignment");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t1_offset, 64);
    expect_error(&s, PD_EFORMAT, "beyond the end");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t1_offset, UINT64_MAX - 31); /* offset + size wraps around */
    expect_error(&s, PD_EFORMAT, "beyond the end");
    build_sample(&s, 3);
    patch_u64(&s, s.at_t1_offset, 0); /* on top of tensor a */
    expect_error(&s, PD_EFORMAT, "overlap");
}

Test(gguf_malformed, bad_alignment_and_duplicates) {
    for (uint32_t bad = 0; bad < 2; bad++) {
        th_buf b = {0};
        th_buf_u32(&b, PD_GGUF_MAGIC);
        th_buf_u32(&b, 3);
        th_buf_u64(&b, 0);
        th_buf_u64(&b, 1);
        kv_header(&b, "general.alignment", bad ? PD_GGUF_UINT64 : PD_GGUF_UINT32);
        if (bad) th_buf_u64(&b, 32);
        else th_buf_u32(&b, 48);
        sample s = {.b = b};
        expect_error(&s, PD_EFORMAT, bad ? "expected u32" : "power of two");
    }
    th_buf b = {0};
    th_buf_u32(&b, PD_GGUF_MAGIC);
    th_buf_u32(&b, 3);
    th_buf_u64(&b, 0);
    th_buf_u64(&b, 2);
    kv_header(&b, "k", PD_GGUF_UINT8);
    th_buf_u8(&b, 1);
    kv_header(&b, "k", PD_GGUF_UINT8);
    th_buf_u8(&b, 2);
    sample s = {.b = b};
    expect_error(&s, PD_EFORMAT, "duplicate metadata key 'k'");

    build_sample(&s, 3);
    s.b.data[s.at_t1_name_len + 8] = 'a'; /* tensor "b" renamed "a" */
    expect_error(&s, PD_EFORMAT, "duplicate tensor name 'a'");
}

Test(gguf_malformed, nul_in_key) {
    th_buf b = {0};
    th_buf_u32(&b, PD_GGUF_MAGIC);
    th_buf_u32(&b, 3);
    th_buf_u64(&b, 0);
    th_buf_u64(&b, 1);
    th_buf_u64(&b, 3);
    th_buf_bytes(&b, "a\0b", 3);
    th_buf_u32(&b, PD_GGUF_UINT8);
    th_buf_u8(&b, 1);
    sample s = {.b = b};
    expect_error(&s, PD_EFORMAT, "NUL byte");
}

/* Inputs the fuzzer once crashed on (or that we keep as seeds) must parse or
 * be refused cleanly. */
Test(gguf_malformed, fuzz_regressions) {
    const char *root = getenv("PD_SOURCE_ROOT");
    cr_assert(root, "PD_SOURCE_ROOT is not set (run through meson test)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/fuzz/regressions", root);
    DIR *d = opendir(dir);
    cr_assert(d, "cannot open %s", dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        char *data = NULL;
        size_t len = 0;
        pd_error err = {0};
        cr_assert_eq(pd_read_file(path, &data, &len, &err), PD_OK, "%s", err.msg);
        pd_gguf *g = NULL;
        int rc = open_exact((const uint8_t *)data, len, &g, &err);
        cr_assert(rc == PD_OK || err.msg[0], "%s: refused without a message", e->d_name);
        free(data);
        n++;
    }
    closedir(d);
    cr_assert_gt(n, 0, "no regression inputs in %s", dir);
}

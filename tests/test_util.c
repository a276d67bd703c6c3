/* util: error messages, SHA-256, file mapping. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "util/util.h"

Test(util, errorf_returns_code_and_formats) {
    pd_error err = {0};
    cr_assert_eq(pd_errorf(&err, PD_EFORMAT, "key '%s' at %d", "x", 7), PD_EFORMAT);
    cr_assert_eq(err.code, PD_EFORMAT);
    cr_assert_str_eq(err.msg, "key 'x' at 7");
    cr_assert_eq(pd_errorf(NULL, PD_EIO, "ignored"), PD_EIO, "a NULL error struct is allowed");
}

Test(util, error_prefix_keeps_the_message_terminated) {
    pd_error err = {0};
    pd_errorf(&err, PD_EIO, "inner");
    pd_error_prefix(&err, "outer %d", 2);
    cr_assert_str_eq(err.msg, "outer 2: inner");
    char big[600];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    pd_errorf(&err, PD_EIO, "%s", big);
    pd_error_prefix(&err, "ctx");
    cr_assert_eq(strlen(err.msg), sizeof err.msg - 1);
    cr_assert(strncmp(err.msg, "ctx: xxx", 8) == 0);
}

Test(util, sha256_known_vectors) {
    uint8_t d[32];
    char hex[65];
    pd_error err;
    cr_assert_eq(pd_sha256_buf("abc", 3, d, &err), PD_OK);
    pd_hex(d, 32, hex);
    cr_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    cr_assert_eq(pd_sha256_buf("", 0, d, &err), PD_OK);
    pd_hex(d, 32, hex);
    cr_assert_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    /* Incremental equals one-shot. */
    pd_sha256 h;
    uint8_t d2[32];
    cr_assert_eq(pd_sha256_init(&h, &err), PD_OK);
    pd_sha256_update(&h, "a", 1);
    pd_sha256_update(&h, "bc", 2);
    pd_sha256_final(&h, d2);
    pd_sha256_buf("abc", 3, d, &err);
    cr_assert_arr_eq(d, d2, 32);
}

Test(util, map_and_read_files) {
    char *dir = th_mkdtemp();
    char path[600];
    snprintf(path, sizeof path, "%s/f", dir);
    FILE *f = fopen(path, "w");
    fputs("hello", f);
    fclose(f);
    pd_mapped_file m;
    pd_error err = {0};
    cr_assert_eq(pd_map_file(path, &m, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(m.size, 5);
    cr_assert(memcmp(m.data, "hello", 5) == 0);
    pd_unmap_file(&m);
    char *buf;
    size_t len;
    cr_assert_eq(pd_read_file(path, &buf, &len, &err), PD_OK);
    cr_assert_str_eq(buf, "hello");
    free(buf);
    cr_assert_eq(pd_map_file(dir, &m, &err), PD_EINVAL, "a directory is not a file");
    cr_assert(strstr(err.msg, "not a regular file"));
    snprintf(path, sizeof path, "%s/missing", dir);
    cr_assert_eq(pd_map_file(path, &m, &err), PD_EIO);
    cr_assert(strstr(err.msg, "missing"));
    cr_assert_eq(pd_load_file(path, &m, &err), PD_EIO);
    cr_assert_eq(pd_load_file(dir, &m, &err), PD_EINVAL, "a directory is not a file");
    th_rmtree(dir);
    free(dir);
}

Test(util, load_file_copies_into_aligned_read_only_memory) {
    char *dir = th_mkdtemp();
    char path[600];
    snprintf(path, sizeof path, "%s/f", dir);
    /* larger than a huge page and not a multiple of one */
    const size_t n = ((size_t)5 << 20) + 12345;
    uint8_t *want = malloc(n);
    cr_assert_not_null(want);
    for (size_t i = 0; i < n; i++) want[i] = (uint8_t)(i * 2654435761u >> 13);
    FILE *f = fopen(path, "wb");
    cr_assert_eq(fwrite(want, 1, n, f), n);
    fclose(f);
    pd_mapped_file m, mm;
    pd_error err = {0};
    cr_assert_eq(pd_load_file(path, &m, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_map_file(path, &mm, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(m.size, n);
    cr_assert_eq((uintptr_t)m.data % ((uintptr_t)2 << 20), 0, "2 MiB aligned for huge pages");
    cr_assert(memcmp(m.data, want, n) == 0);
    cr_assert(memcmp(mm.data, want, n) == 0);
    /* a copy: rewriting the file does not change it */
    f = fopen(path, "wb");
    fputs("x", f);
    fclose(f);
    cr_assert(memcmp(m.data, want, n) == 0);
    pd_unmap_file(&m);
    pd_unmap_file(&mm);
    cr_assert_null(m.data);
    /* an empty file is an empty answer */
    f = fopen(path, "wb");
    fclose(f);
    cr_assert_eq(pd_load_file(path, &m, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(m.size, 0);
    pd_unmap_file(&m);
    free(want);
    th_rmtree(dir);
    free(dir);
}

Test(util, strbuf_appends_counts_and_truncates) {
    char buf[8];
    pd_strbuf b = {buf, sizeof buf, 0};
    pd_strbuf_printf(&b, "%s", "abc");
    pd_strbuf_printf(&b, "%d", 1234);
    cr_assert_str_eq(buf, "abc1234");
    cr_assert_eq(b.len, 7);
    pd_strbuf_printf(&b, "%s", "xyz"); /* does not fit: truncated, still counted */
    cr_assert_str_eq(buf, "abc1234");
    cr_assert_eq(b.len, 10);
    pd_strbuf_printf(&b, "more");
    cr_assert_eq(b.len, 14);
    cr_assert_str_eq(buf, "abc1234");
}

/* The growable string against what snprintf writes, across its small and
 * large printf paths and many appends. */
Test(util, sbuf_appends_like_snprintf) {
    pd_sbuf b = {0};
    cr_assert_str_eq(pd_sbuf_str(&b), "");
    char want[8192];
    size_t off = 0;
    for (int i = 0; i < 200; i++) {
        pd_sbuf_printf(&b, "%d:%s;", i, i % 50 == 0 ? "a long piece of text to pass the 256-byte path of printf ..........."
                                                        "..............................................................."
                                                        "..............................................................."
                                                        "..............................................................."
                                                      : "x");
        off += (size_t)snprintf(want + off, sizeof want - off, "%d:%s;", i,
                                i % 50 == 0 ? "a long piece of text to pass the 256-byte path of printf ..........."
                                              "..............................................................."
                                              "..............................................................."
                                              "..............................................................."
                                            : "x");
        pd_sbuf_putn(&b, "ab", 1);
        want[off++] = 'a';
        want[off] = '\0';
    }
    pd_sbuf_puts(&b, "end");
    memcpy(want + off, "end", 4);
    cr_assert_not(b.oom);
    cr_assert_eq(b.len, strlen(want));
    cr_assert_str_eq(pd_sbuf_str(&b), want);
    free(b.p);
}

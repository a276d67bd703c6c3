/* util: the bottom of the stack. Error reporting, hashing, the logger and
 * small helpers that every other folder may use. Depends on OpenSSL
 * (SHA-256), jansson (JSON log lines) and libsystemd (journal lines). */
#ifndef PD_UTIL_H
#define PD_UTIL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: 0 is success, every failure is negative. */
enum {
    PD_OK = 0,
    PD_EINVAL = -1,       /* bad argument or bad user input */
    PD_EIO = -2,          /* the operating system said no (open, mmap, read) */
    PD_ENOMEM = -3,       /* allocation failed */
    PD_EFORMAT = -4,      /* a file or record is malformed */
    PD_ENOTFOUND = -5,    /* a key, token or file does not exist */
    PD_EUNSUPPORTED = -6, /* valid, but not something we implement */
    PD_ERANGE = -7,       /* a value is outside its allowed range */
    PD_EUNAVAILABLE = -8, /* the service is stopping or not ready yet: retry later or elsewhere */
    PD_EBUSY = -9,        /* a queue is full: the same request may succeed shortly */
    PD_EDEVICE = -10,     /* the GPU failed (a sticky CUDA error): nothing runs there until the process restarts */
};

/* Every fallible function takes one of these and, on failure, leaves a
 * message a user can act on: what failed, where, and why. */
typedef struct pd_error {
    int code;
    char msg[512];
} pd_error;

/* Fill err (if not NULL) and return code, so callers can write
 * `return pd_errorf(err, PD_EFORMAT, "...", ...);`. */
int pd_errorf(pd_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int pd_verrorf(pd_error *err, int code, const char *fmt, va_list ap);
/* Prepend context to an existing message: "ctx: old message". */
int pd_error_prefix(pd_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *pd_status_name(int code);

/* SHA-256 (OpenSSL EVP). Incremental, so callers can hash several parts. */
#define PD_SHA256_LEN 32
typedef struct pd_sha256 {
    void *evp; /* EVP_MD_CTX* */
} pd_sha256;
int pd_sha256_init(pd_sha256 *h, pd_error *err);
void pd_sha256_update(pd_sha256 *h, const void *data, size_t len);
void pd_sha256_final(pd_sha256 *h, uint8_t out[PD_SHA256_LEN]);
/* One-shot convenience. */
int pd_sha256_buf(const void *data, size_t len, uint8_t out[PD_SHA256_LEN], pd_error *err);
/* Lower-case hex of n bytes into out (2n+1 bytes). */
void pd_hex(const uint8_t *bytes, size_t n, char *out);

/* A whole file in memory, read-only: mapped (pages shared with the page
 * cache) or copied. */
typedef struct pd_mapped_file {
    const uint8_t *data;
    size_t size;
    void *region;       /* what pd_unmap_file unmaps */
    size_t region_size;
    bool copied;        /* read into memory of our own (pd_load_file) */
} pd_mapped_file;
int pd_map_file(const char *path, pd_mapped_file *out, pd_error *err);
/* Read the file into private anonymous memory, 2 MiB aligned and marked
 * for transparent huge pages: streaming reads of it (a decode step reads
 * every weight once) run at full memory bandwidth, where a page-cache
 * mapping of 4 KiB pages costs a third of it in TLB misses and prefetch
 * streams that stop at every page. Costs the read at open and the memory
 * of a copy (the page cache's pages stay reclaimable). */
int pd_load_file(const char *path, pd_mapped_file *out, pd_error *err);
/* Let a file read by pd_load_file be written (in place, by the owner) or
 * make it read-only again; PD_EINVAL for a mapping of the file itself. */
int pd_mapped_file_set_writable(pd_mapped_file *m, bool writable, pd_error *err);
void pd_unmap_file(pd_mapped_file *m);

/* Read a whole stream/file into a malloc'd, NUL-terminated buffer. */
int pd_read_stream(void *file /* FILE* */, char **out, size_t *len, pd_error *err);
int pd_read_file(const char *path, char **out, size_t *len, pd_error *err);

/* prefix + 24 random characters of [A-Za-z0-9] (getrandom; a clock-seeded
 * sequence when the kernel has no entropy yet: ids need only tell apart). */
void pd_random_id(char *out, size_t cap, const char *prefix);

/* A growable string: appends never fail one by one; on allocation failure
 * it stays failed (oom) and the caller reports PD_ENOMEM once at the end.
 * p is NUL-terminated once anything was appended; free(p) when done. */
typedef struct pd_sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} pd_sbuf;
void pd_sbuf_putn(pd_sbuf *b, const char *s, size_t n);
void pd_sbuf_puts(pd_sbuf *b, const char *s);
__attribute__((format(printf, 2, 3))) void pd_sbuf_printf(pd_sbuf *b, const char *fmt, ...);
/* The text so far (never NULL). */
const char *pd_sbuf_str(const pd_sbuf *b);

/* snprintf-style appending to a fixed buffer: len counts everything
 * written (as snprintf's return value would), buf holds what fits and is
 * always NUL-terminated when cap > 0. */
typedef struct pd_strbuf {
    char *buf;
    size_t cap, len;
} pd_strbuf;
__attribute__((format(printf, 2, 3))) void pd_strbuf_printf(pd_strbuf *b, const char *fmt, ...);

/* ---- logging ----------------------------------------------------------------
 * One logger for every layer: a plain value set once from the configuration
 * (log.level, log.format) and handed down by const pointer through each
 * layer's options, so nothing global changes after start-up. A NULL logger
 * writes nothing (library use, tests). One function formats every line:
 *
 *   text:    2026-01-02T03:04:05.678Z prefixd: [warning: |error: |debug: ]msg key=value key="two words"
 *   json:    {"ts":"2026-01-02T03:04:05.678Z","level":"info","msg":"...","key":value,...}
 *   journal: sd_journal_send: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER=prefixd and
 *            each field as KEY=value (upper-cased); a text line on the sink
 *            when the journal cannot be reached.
 *
 * Each line is written with one call, so lines of concurrent threads never
 * mix. */
typedef enum pd_log_level {
    PD_LOG_ERROR = 0,
    PD_LOG_WARN = 1,
    PD_LOG_INFO = 2,
    PD_LOG_DEBUG = 3,
} pd_log_level;

typedef enum pd_log_format {
    PD_LOG_TEXT = 0,
    PD_LOG_JSON = 1,
    PD_LOG_JOURNAL = 2,
} pd_log_format;

typedef struct pd_logger {
    pd_log_level level;   /* lines of this level or more severe are written */
    pd_log_format format;
    FILE *sink;           /* text and json lines (NULL = stderr) */
} pd_logger;

typedef enum pd_log_field_type { PD_LOG_FIELD_STR, PD_LOG_FIELD_INT, PD_LOG_FIELD_NUM } pd_log_field_type;

/* A structured field of a line; key: [a-z0-9_]+. A NULL string field is
 * left out. */
typedef struct pd_log_field {
    const char *key;
    pd_log_field_type type;
    const char *s;
    int64_t i;
    double d;
} pd_log_field;

#define PD_LOG_STR(k, v) ((pd_log_field){.key = (k), .type = PD_LOG_FIELD_STR, .s = (v)})
#define PD_LOG_INT(k, v) ((pd_log_field){.key = (k), .type = PD_LOG_FIELD_INT, .i = (int64_t)(v)})
#define PD_LOG_NUM(k, v) ((pd_log_field){.key = (k), .type = PD_LOG_FIELD_NUM, .d = (double)(v)})

/* Whether a line of this level would be written (skip building costly ones). */
bool pd_log_enabled(const pd_logger *lg, pd_log_level level);
/* A line with fields (n may be 0). */
void pd_log_fields(const pd_logger *lg, pd_log_level level, const char *msg, const pd_log_field *fields, size_t n);
/* A printf-style line without fields. */
__attribute__((format(printf, 3, 4))) void pd_log(const pd_logger *lg, pd_log_level level, const char *fmt, ...);
void pd_vlog(const pd_logger *lg, pd_log_level level, const char *fmt, va_list ap);
/* Whether journald's socket is there to take PD_LOG_JOURNAL lines. */
bool pd_log_journal_available(void);

/* Seconds on the monotonic clock, for measuring elapsed time. */
double pd_now_seconds(void);

/* splitmix64 (Vigna): advances *state and returns 64 well-mixed bits. Tiny,
 * seedable and the same on every platform, which is what seeded scores,
 * sketches and test data need (not a cryptographic generator). */
static inline uint64_t pd_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One splitmix64 step from x, as a hash: a bijection of 64-bit values. */
static inline uint64_t pd_mix64(uint64_t x) { return pd_splitmix64(&x); }

/* Overflow-checked size arithmetic: return 0 on overflow. */
static inline int pd_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline int pd_add_ok(uint64_t a, uint64_t b, uint64_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

#ifdef __cplusplus
}
#endif
#endif

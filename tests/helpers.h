/* Shared test helpers: where the real model files are, scratch directories. */
#ifndef PD_TEST_HELPERS_H
#define PD_TEST_HELPERS_H

#include <stdbool.h>
#include <stddef.h>

/* Path of ../shared/models (from $PD_SHARED_MODELS), or NULL when the folder
 * is absent, in which case tests that need it call cr_skip_test(). */
const char *th_shared_models(void);
/* th_shared_models()/rel into buf; returns buf, or NULL if the file is absent. */
const char *th_shared_file(const char *rel, char *buf, size_t cap);
/* A fresh temporary directory (mkdtemp), malloc'd: th_rmtree() it, then free() it. */
char *th_mkdtemp(void);
void th_rmtree(const char *dir);
/* Run a shell command, capturing stdout (malloc'd) and the exit status. */
int th_run(const char *cmd, char **out);
/* A SmolLM2-shaped 6-layer Q8_0 model with the llama-spm vocabulary (EOS id
 * 2), generated into dir/slow.gguf: slow enough that 1500 tokens, or
 * compressing a 3000-token prefix, take about a second or more. Skips the
 * test when the shared vocabulary is absent. path gets the file name. */
void th_slow_model(const char *dir, char *path, size_t cap);
/* Flip bit 6 of byte `at` of every occurrence of pat (len bytes) in file
 * path, in place; returns how many there were. */
int th_flip_in_file(const char *path, const void *pat, size_t len, size_t at);
/* The same with a printf-style command line (at most 8 KiB). */
__attribute__((format(printf, 2, 3))) int th_runf(char **out, const char *fmt, ...);
/* Quantize the GGUF src into dst as ftype ("Q5_K_M", "IQ4_XS", ...) with
 * llama.cpp's own llama-quantize (../shared/peer, beside the models). Skips
 * the running test when the binary is absent or this CPU cannot run it (it
 * is built for AVX-512); fails it when llama-quantize reports an error. */
void th_llama_quantize(const char *src, const char *dst, const char *ftype);
/* The tokenizer of a GGUF under ../shared/models (rel, e.g.
 * "vocab/ggml-vocab-phi-3.gguf"); skips the running test when it is absent.
 * pd_tokenizer_free it. */
struct pd_tokenizer;
struct pd_tokenizer *th_shared_tokenizer(const char *rel);
/* The tokenizer of the GGUF at path (failing the test if it cannot load). */
struct pd_tokenizer *th_tokenizer(const char *path);
/* Skip the running test with a message when the shared models are absent. */
#define TH_REQUIRE_SHARED()                                                                   \
    do {                                                                                      \
        if (!th_shared_models())                                                              \
            cr_skip_test("../shared/models is absent (set PD_SHARED_MODELS); skipping");      \
    } while (0)
/* Skip the running test unless cuda:0 is cudaemu: faults are injected only
 * into the emulator (CUDAEMU_FAIL_*). */
void th_require_cudaemu(void);



/* ---- the real daemon, for integration tests --------------------------------- */
#include <sys/types.h>

/* A free TCP port on the loopback interface. */
int th_free_port(void);
/* Start $PD_PREFIXD with `args` plus --set server.port=<a free port>, its
 * stderr appended to `log`; wait until GET /health is 200. Fails the test
 * when prefixd exits first (showing its log) or never becomes healthy.
 * Returns the pid; *port gets the port. */
pid_t th_daemon_start(const char *args, const char *log, int *port);
/* Send sig to a started daemon (pid > 0) and wait; returns the wait status,
 * or -1 when pid is not running. *pid becomes 0. */
int th_daemon_stop(pid_t *pid, int sig);
/* An HTTP request with curl to 127.0.0.1:port. json (may be NULL) is sent
 * as the body, written to `body_file` first; auth (may be NULL) as a bearer
 * token. Returns the HTTP status; the body in *out (malloc'd). */
int th_http(int port, const char *method, const char *path, const char *json, const char *auth,
            const char *body_file, char **out);

/* The value of one series in Prometheus text ("name{labels} value" lines),
 * or -1 when the series is absent. */
double th_metric(const char *text, const char *series);

/* A growable byte buffer for hand-building binary files (GGUF images). */
#include <stdint.h>
typedef struct th_buf {
    uint8_t *data;
    size_t len, cap;
} th_buf;
void th_buf_bytes(th_buf *b, const void *p, size_t n);
void th_buf_u8(th_buf *b, uint8_t v);
void th_buf_u32(th_buf *b, uint32_t v);
void th_buf_u64(th_buf *b, uint64_t v);
void th_buf_f32(th_buf *b, float v);
void th_buf_str(th_buf *b, const char *s); /* GGUF string: u64 length + bytes */
void th_buf_pad(th_buf *b, size_t alignment);
void th_buf_free(th_buf *b);
#endif

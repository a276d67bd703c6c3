/* serve-bench: load generator for a real prefixd over raw sockets.
 *
 * For each configuration it starts its own prefixd (fork/exec) on a free
 * loopback port with a fresh prefix store, drives it with HTTP/1.0 requests
 * (Content-Length bodies; the server closes the connection at the end, so
 * the SSE body arrives unchunked) and stops it with SIGTERM:
 *
 *   1. time to first token (mean, p50, p99 over --requests streaming
 *      requests of one token: the first SSE event then carries it even when
 *      its text is empty) for a prompt that starts with a ~--prefix-tokens prefix
 *      registered with `prefixctl compress` at each --retentions value,
 *      against the same prompt with "cache":"off" (full prefill);
 *   2. decode tokens/s, aggregate and per client, with each --clients
 *      count of concurrent streaming clients (end-of-generation tokens are
 *      banned with logit_bias so every client decodes --gen tokens).
 *
 *   serve-bench --model M.gguf --prefixctl PATH --prefixd PATH [options]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "util/util.h"

#define MAX_LIST 16
#define MAX_BANNED 16

typedef struct bench {
    const char *model, *prefixctl, *prefixd, *policy;
    int threads, requests, gen, prefix_tokens, max_batch;
    int clients[MAX_LIST];
    size_t n_clients;
    double retentions[MAX_LIST];
    size_t n_retentions;
    char dir[256];          /* scratch directory (mkdtemp) */
    char *prefix_text;      /* ~prefix_tokens tokens of English */
    char banned[256];       /* logit_bias JSON object banning end-of-generation tokens */
} bench;

/* One running prefixd. */
typedef struct server {
    pid_t pid;
    int port;
    char log[512];
} server;

/* What one HTTP exchange gave. */
typedef struct reply {
    int status;
    double t_start, t_first, t_end; /* send, first SSE event, end of body */
    long completion_tokens;          /* from usage; -1 when absent */
    bool done;                       /* streaming: saw data: [DONE] */
    bool prefix_used;
} reply;

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &l) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static bool send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* The integer after `"key":` (optional spaces) in s; -1 when absent. */
static long json_int_after(const char *s, const char *key) {
    const char *p = strstr(s, key);
    if (!p) return -1;
    p += strlen(key);
    while (*p == ' ' || *p == ':') p++;
    return strtol(p, NULL, 10);
}

/* One request: method + path, optional JSON body. Reads the whole reply
 * (HTTP/1.0: until the server closes), timing the first SSE event. The body
 * (without headers) is returned in *body_out when not NULL. Returns 0, or
 * -1 on a socket failure (errno-style message printed). */
static int http(int port, const char *method, const char *path, const char *json, reply *r, char **body_out) {
    memset(r, 0, sizeof *r);
    r->completion_tokens = -1;
    if (body_out) *body_out = NULL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {.tv_sec = 300}; /* a stuck server must not hang the benchmark */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    size_t jlen = json ? strlen(json) : 0;
    char head[512];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\n\r\n", method, path, jlen);
    r->t_start = pd_now_seconds();
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || hn < 0 || (size_t)hn >= sizeof head ||
        !send_all(fd, head, (size_t)hn) || (jlen && !send_all(fd, json, jlen))) {
        close(fd);
        return -1;
    }
    size_t cap = 16384, len = 0, scan = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return -1;
    }
    int rc = 0;
    for (;;) {
        if (cap - len < 4096) {
            if (cap > SIZE_MAX / 2) {
                rc = -1;
                break;
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                rc = -1;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            rc = -1;
            break;
        }
        if (k == 0) break;
        len += (size_t)k;
        buf[len] = '\0';
        if (r->t_first == 0) {
            /* Look from a little before the previous end: the marker may straddle two reads. */
            if (strstr(buf + scan, "data: {")) r->t_first = pd_now_seconds();
            scan = len > 8 ? len - 8 : 0;
        }
    }
    r->t_end = pd_now_seconds();
    close(fd);
    if (rc) {
        free(buf);
        return rc;
    }
    buf[len] = '\0';
    if (strncmp(buf, "HTTP/1.", 7) == 0) r->status = atoi(buf + 9);
    char *body = strstr(buf, "\r\n\r\n");
    body = body ? body + 4 : buf + len;
    r->done = strstr(body, "data: [DONE]") != NULL;
    r->completion_tokens = json_int_after(body, "\"completion_tokens\"");
    r->prefix_used = strstr(body, "\"prefix\":{") || strstr(body, "\"prefix\": {");
    if (body_out) {
        *body_out = strdup(body);
        if (!*body_out) rc = -1;
    }
    free(buf);
    return rc;
}

/* ---- child processes ------------------------------------------------------------ */

/* fork/exec argv with stdout and stderr into log (appending). */
static pid_t spawn(char *const argv[], const char *log) {
    pid_t pid = fork();
    if (pid != 0) return pid;
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
    }
    execv(argv[0], argv);
    fprintf(stderr, "serve-bench: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

static void print_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) fputs(line, stderr);
    fclose(f);
}

/* Register the prefix text in store (a fresh directory) at retention. */
static int compress_prefix(const bench *b, const char *store, double retention) {
    char text[300], ret[32], log[300];
    snprintf(text, sizeof text, "%s/prefix.txt", b->dir);
    snprintf(ret, sizeof ret, "%g", retention);
    snprintf(log, sizeof log, "%s/prefixctl.log", b->dir);
    char *argv[] = {(char *)b->prefixctl, "compress", "--model", (char *)b->model, "--policy", (char *)b->policy,
                    "--retention", ret, "--text", text, "--store", (char *)store, NULL};
    pid_t pid = spawn(argv, log);
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "serve-bench: prefixctl compress failed:\n");
        print_file(log);
        return -1;
    }
    return 0;
}

static int start_server(const bench *b, const char *store, server *s) {
    s->port = free_port();
    if (s->port < 0) return -1;
    snprintf(s->log, sizeof s->log, "%s/prefixd.log", b->dir);
    char a_model[600], a_port[64], a_store[400], a_threads[64], a_batch[64];
    snprintf(a_model, sizeof a_model, "model.path=%s", b->model);
    snprintf(a_port, sizeof a_port, "server.port=%d", s->port);
    snprintf(a_store, sizeof a_store, "cache.path=%s", store);
    snprintf(a_threads, sizeof a_threads, "model.n_threads=%d", b->threads);
    snprintf(a_batch, sizeof a_batch, "scheduler.max_batch=%d", b->max_batch);
    /* No automatic cache: the repeated prompts would be served from its
     * exact blocks, and this measures registered prefixes against a full
     * prefill (tools/bench-peer.sh part 3 measures the automatic cache). */
    char *argv[] = {(char *)b->prefixd, "--set", a_model, "--set", a_port, "--set", a_store, "--set", a_threads,
                    "--set", a_batch, "--set", "cache.auto_mb=0", "--set", "cache.map_size_mb=1024",
                    "--set", "server.model_names=x", NULL};
    s->pid = spawn(argv, s->log);
    if (s->pid < 0) return -1;
    /* Ready when /health says 200 (bounded: a minute). */
    for (int i = 0; i < 1200; i++) {
        reply r;
        if (http(s->port, "GET", "/health", NULL, &r, NULL) == 0 && r.status == 200) return 0;
        int st;
        if (waitpid(s->pid, &st, WNOHANG) == s->pid) {
            fprintf(stderr, "serve-bench: prefixd exited before it was ready:\n");
            print_file(s->log);
            s->pid = 0;
            return -1;
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "serve-bench: prefixd did not become healthy within a minute\n");
    return -1;
}

static void stop_server(server *s) {
    if (s->pid <= 0) return;
    kill(s->pid, SIGTERM);
    int st;
    waitpid(s->pid, &st, 0);
    s->pid = 0;
}

/* ---- statistics ------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted v[0..n). */
static double percentile(const double *v, int n, double p) {
    int k = (int)(p / 100.0 * n + 0.999999);
    if (k < 1) k = 1;
    if (k > n) k = n;
    return v[k - 1];
}

/* ---- 1. time to first token ---------------------------------------------------------- */

static int bench_ttft(bench *b, double retention, bool off) {
    char store[300];
    snprintf(store, sizeof store, "%s/store-%s-%g", b->dir, off ? "off" : "on", retention);
    if (!off && compress_prefix(b, store, retention)) return -1;
    server s = {0};
    if (start_server(b, store, &s)) return -1;
    size_t cap = strlen(b->prefix_text) + 512;
    char *json = malloc(cap);
    double *ttft = calloc((size_t)b->requests, sizeof *ttft);
    int rc = json && ttft ? 0 : -1;
    int hits = 0;
    /* The same prompt every time: the prefix then a short question. Warm-up
     * first (hot tier, page cache), then the measured requests. */
    for (int i = -1; !rc && i < b->requests; i++) {
        snprintf(json, cap,
                 "{\"model\":\"x\",\"prompt\":\"%s Then what happened?\",\"max_tokens\":1,\"temperature\":0,"
                 "\"stream\":true,\"stream_options\":{\"include_usage\":true}%s}",
                 b->prefix_text, off ? ",\"cache\":\"off\"" : "");
        reply r;
        if (http(s.port, "POST", "/v1/completions", json, &r, NULL) || r.status != 200 || !r.done || !r.t_first) {
            fprintf(stderr, "serve-bench: a request failed (HTTP %d)\n", r.status);
            rc = -1;
            break;
        }
        if (i < 0) continue;
        ttft[i] = r.t_first - r.t_start;
        hits += r.prefix_used;
    }
    stop_server(&s);
    if (!rc) {
        double sum = 0;
        for (int i = 0; i < b->requests; i++) sum += ttft[i];
        qsort(ttft, (size_t)b->requests, sizeof *ttft, cmp_double);
        char label[64];
        if (off) snprintf(label, sizeof label, "no prefix (cache off)");
        else snprintf(label, sizeof label, "prefix, retention %.2f", retention);
        printf("  %-24s %9.2f %9.2f %9.2f   %d/%d\n", label, 1e3 * sum / b->requests,
               1e3 * percentile(ttft, b->requests, 50), 1e3 * percentile(ttft, b->requests, 99), hits, b->requests);
        fflush(stdout);
    }
    free(json);
    free(ttft);
    return rc;
}

/* ---- 2. decode throughput -------------------------------------------------------------- */

typedef struct client {
    int port;
    int id;
    const bench *b;
    reply r;
    int rc;
} client;

static void *client_main(void *arg) {
    client *c = arg;
    char json[1024];
    snprintf(json, sizeof json,
             "{\"model\":\"x\",\"prompt\":\"Once upon a time, child %d\",\"max_tokens\":%d,\"temperature\":1,"
             "\"seed\":%d,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"logit_bias\":%s}",
             c->id, c->b->gen, c->id + 1, c->b->banned);
    c->rc = http(c->port, "POST", "/v1/completions", json, &c->r, NULL);
    if (!c->rc && (c->r.status != 200 || !c->r.done || c->r.completion_tokens <= 0)) c->rc = -1;
    return NULL;
}

static int bench_decode(bench *b, int n_clients) {
    char store[300];
    snprintf(store, sizeof store, "%s/store-decode-%d", b->dir, n_clients);
    server s = {0};
    if (start_server(b, store, &s)) return -1;
    client *cl = calloc((size_t)n_clients, sizeof *cl);
    pthread_t *th = calloc((size_t)n_clients, sizeof *th);
    int rc = cl && th ? 0 : -1;
    /* Warm-up: one short request. */
    reply w;
    if (!rc && (http(s.port, "POST", "/v1/completions", "{\"model\":\"x\",\"prompt\":\"Hi\",\"max_tokens\":2}", &w,
                     NULL) || w.status != 200))
        rc = -1;
    int started = 0;
    double t0 = pd_now_seconds();
    for (int i = 0; !rc && i < n_clients; i++) {
        cl[i] = (client){.port = s.port, .id = i, .b = b};
        if (pthread_create(&th[i], NULL, client_main, &cl[i]) != 0) rc = -1;
        else started++;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    double t1 = pd_now_seconds();
    stop_server(&s);
    long total = 0;
    double per_sum = 0, per_min = 1e30, ttft_sum = 0;
    for (int i = 0; !rc && i < n_clients; i++) {
        if (cl[i].rc) {
            fprintf(stderr, "serve-bench: client %d failed (HTTP %d)\n", i, cl[i].r.status);
            rc = -1;
            break;
        }
        long n = cl[i].r.completion_tokens;
        total += n;
        /* Decode rate: tokens after the first over the time after the first. */
        double dt = cl[i].r.t_end - cl[i].r.t_first;
        double rate = dt > 0 && n > 1 ? (double)(n - 1) / dt : 0;
        per_sum += rate;
        if (rate < per_min) per_min = rate;
        ttft_sum += cl[i].r.t_first - cl[i].r.t_start;
    }
    if (!rc)
        printf("  %7d %10ld %12.1f %14.1f %12.1f %12.1f\n", n_clients, total, (double)total / (t1 - t0),
               per_sum / n_clients, per_min, 1e3 * ttft_sum / n_clients);
    fflush(stdout);
    free(cl);
    free(th);
    return rc;
}

/* ---- setup ------------------------------------------------------------------------------- */

/* Sentences repeated until the text has at least target tokens; checks that
 * the full prompt's tokens start with the prefix's (else the store lookup
 * could not match). Also fills the logit_bias that bans end-of-generation. */
static int prepare_text(bench *b) {
    static const char *const sentences[] = {
        "Once upon a time, there was a little girl named Lily.", " She loved to play outside in the sunshine.",
        " One day, she saw a big tree with a red ball in it.", " She wanted the ball very much.",
        " Her friend Tom came to help her.", " They found a long stick and tried to reach the ball.",
        " The wind was strong and the leaves were falling.", " Lily laughed and ran around the tree.",
        " At last the ball fell down into the soft grass.", " They played together until the sun went down.",
    };
    pd_error err = {0};
    pd_gguf *g = NULL;
    pd_tokenizer *t = NULL;
    if (pd_gguf_open(b->model, &g, &err) || pd_tokenizer_load(g, &t, &err)) {
        fprintf(stderr, "serve-bench: %s: %s\n", b->model, err.msg);
        pd_gguf_close(g);
        return -1;
    }
    pd_gguf_close(g);
    size_t cap = 1 << 16, len = 0;
    char *text = calloc(cap, 1);
    int rc = text ? 0 : -1;
    size_t n_tok = 0;
    pd_tokenize_opts o = {.add_special = true};
    for (size_t i = 0; !rc && n_tok < (size_t)b->prefix_tokens; i++) {
        const char *s = sentences[i % (sizeof sentences / sizeof sentences[0])];
        size_t sl = strlen(s);
        if (len + sl + 2 >= cap) {
            fprintf(stderr, "serve-bench: --prefix-tokens %d needs more text than this tool carries\n",
                    b->prefix_tokens);
            rc = -1;
            break;
        }
        if (i > 0 && s[0] != ' ') text[len++] = ' ';
        memcpy(text + len, s, sl);
        len += sl;
        text[len] = '\0';
        pd_token *ids = NULL;
        if (pd_tokenize(t, text, len, o, &ids, &n_tok, &err)) rc = -1;
        free(ids);
    }
    /* The full prompt must start with the prefix's tokens. */
    pd_token *a = NULL, *full = NULL;
    size_t na = 0, nf = 0;
    char *prompt = rc ? NULL : malloc(len + 64);
    if (!rc && prompt) {
        snprintf(prompt, len + 64, "%s Then what happened?", text);
        if (pd_tokenize(t, text, len, o, &a, &na, &err) || pd_tokenize(t, prompt, strlen(prompt), o, &full, &nf, &err))
            rc = -1;
        else if (nf <= na || memcmp(a, full, na * sizeof *a) != 0)
            fprintf(stderr, "serve-bench: warning: the prompt's tokens do not start with the prefix's; "
                            "lookups will miss\n");
    }
    if (rc && err.msg[0]) fprintf(stderr, "serve-bench: %s\n", err.msg);
    free(a);
    free(full);
    free(prompt);
    /* Ban the end-of-generation tokens so every client decodes --gen tokens. */
    size_t bl = (size_t)snprintf(b->banned, sizeof b->banned, "{");
    int n_banned = 0;
    for (int32_t id = 0; !rc && id < pd_tokenizer_n_vocab(t) && n_banned < MAX_BANNED; id++) {
        if (!pd_tokenizer_is_eog(t, id)) continue;
        int k = snprintf(b->banned + bl, sizeof b->banned - bl, "%s\"%d\":-100", n_banned ? "," : "", (int)id);
        if (k < 0 || (size_t)k >= sizeof b->banned - bl - 2) break;
        bl += (size_t)k;
        n_banned++;
    }
    snprintf(b->banned + bl, sizeof b->banned - bl, "}");
    pd_tokenizer_free(t);
    if (rc) {
        free(text);
        return rc;
    }
    char path[300];
    snprintf(path, sizeof path, "%s/prefix.txt", b->dir);
    FILE *f = fopen(path, "w");
    if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "serve-bench: cannot write %s\n", path);
        free(text);
        return -1;
    }
    b->prefix_text = text;
    b->prefix_tokens = (int)n_tok;
    return 0;
}

static size_t parse_ints(const char *s, int *out, size_t cap) {
    size_t n = 0;
    char *end;
    while (n < cap && *s) {
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 1024) return 0;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return 0;
    }
    return n;
}

static size_t parse_doubles(const char *s, double *out, size_t cap) {
    size_t n = 0;
    char *end;
    while (n < cap && *s) {
        double v = strtod(s, &end);
        if (end == s || !(v > 0 && v <= 1)) return 0;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return 0;
    }
    return n;
}

static void usage(FILE *f) {
    fprintf(f, "Usage: serve-bench --model M.gguf --prefixctl PATH --prefixd PATH [options]\n"
               "  --threads N          compute threads of prefixd (default 2)\n"
               "  --requests R         measured requests per TTFT configuration (default 20)\n"
               "  --prefix-tokens N    prefix length in tokens, at least (default 400)\n"
               "  --retentions LIST    prefix retentions (default 1,0.5,0.25)\n"
               "  --policy SPEC        compression policy (default knorm)\n"
               "  --clients LIST       concurrent streaming clients (default 1,8,32)\n"
               "  --gen N              tokens each client decodes (default 64)\n"
               "  --max-batch N        scheduler.max_batch (default 32)\n");
}

int main(int argc, char **argv) {
    bench b = {.policy = "knorm", .threads = 2, .requests = 20, .gen = 64, .prefix_tokens = 400, .max_batch = 32,
               .clients = {1, 8, 32}, .n_clients = 3, .retentions = {1, 0.5, 0.25}, .n_retentions = 3};
    static const struct option lo[] = {
        {"model", required_argument, NULL, 'm'},     {"prefixctl", required_argument, NULL, 'c'},
        {"prefixd", required_argument, NULL, 'd'},   {"threads", required_argument, NULL, 't'},
        {"requests", required_argument, NULL, 'r'},  {"prefix-tokens", required_argument, NULL, 'p'},
        {"retentions", required_argument, NULL, 'R'}, {"policy", required_argument, NULL, 'P'},
        {"clients", required_argument, NULL, 'C'},   {"gen", required_argument, NULL, 'g'},
        {"max-batch", required_argument, NULL, 'b'}, {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'm': b.model = optarg; break;
        case 'c': b.prefixctl = optarg; break;
        case 'd': b.prefixd = optarg; break;
        case 't': b.threads = atoi(optarg); break;
        case 'r': b.requests = atoi(optarg); break;
        case 'p': b.prefix_tokens = atoi(optarg); break;
        case 'P': b.policy = optarg; break;
        case 'g': b.gen = atoi(optarg); break;
        case 'b': b.max_batch = atoi(optarg); break;
        case 'C':
            if (!(b.n_clients = parse_ints(optarg, b.clients, MAX_LIST))) {
                fprintf(stderr, "serve-bench: --clients: give counts 1..1024 separated by commas\n");
                return 2;
            }
            break;
        case 'R':
            if (!(b.n_retentions = parse_doubles(optarg, b.retentions, MAX_LIST))) {
                fprintf(stderr, "serve-bench: --retentions: give values in (0, 1] separated by commas\n");
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!b.model || !b.prefixctl || !b.prefixd || b.threads < 1 || b.requests < 1 || b.gen < 2 ||
        b.prefix_tokens < 8 || b.max_batch < 1) {
        usage(stderr);
        return 2;
    }
    snprintf(b.dir, sizeof b.dir, "/tmp/serve-bench.XXXXXX");
    if (!mkdtemp(b.dir)) {
        fprintf(stderr, "serve-bench: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    int rc = prepare_text(&b);
    if (!rc) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        printf("serve-bench: %s, %ld CPUs, prefixd --threads %d, max_batch %d\n", b.model, ncpu, b.threads,
               b.max_batch);
        printf("\nTime to first token, prompt = %d-token prefix + 5 tokens, policy %s, %d requests after 1 warm-up\n",
               b.prefix_tokens, b.policy, b.requests);
        printf("  %-24s %9s %9s %9s   %s\n", "configuration", "mean ms", "p50 ms", "p99 ms", "prefix used");
        fflush(stdout);
        rc = bench_ttft(&b, 1, true);
        for (size_t i = 0; !rc && i < b.n_retentions; i++) rc = bench_ttft(&b, b.retentions[i], false);
    }
    if (!rc) {
        printf("\nDecode, %d tokens per client (end-of-generation banned), streaming, temperature 1\n", b.gen);
        printf("  %7s %10s %12s %14s %12s %12s\n", "clients", "tokens", "aggr tok/s", "mean/client", "min/client",
               "mean ttft ms");
        fflush(stdout);
        for (size_t i = 0; !rc && i < b.n_clients; i++) rc = bench_decode(&b, b.clients[i]);
    }
    free(b.prefix_text);
    /* Remove the scratch directory (stores, logs, prefix text). */
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", b.dir);
    if (system(cmd) != 0) fprintf(stderr, "serve-bench: could not remove %s\n", b.dir);
    return rc ? 1 : 0;
}

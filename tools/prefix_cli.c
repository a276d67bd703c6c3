/* `prefixctl prefix ...`: the daemon's admin API (docs/api.md, "Admin API")
 * from the command line, over a minimal HTTP/1.1 client (one request per
 * connection, Content-Length or chunked answers).
 *
 * prefixctl does not link a JSON library: requests are built with escaped
 * strings (the --messages and --segments files are sent as they are, and
 * the daemon validates them), and answers are printed as the daemon sends
 * them, with only the few fields needed for polling picked out. */
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "tools/tools.h"

#define PROG "prefixctl prefix"
#define MAX_ANSWER (64u << 20) /* a list of many prefixes is still far below this */

static void usage(FILE *f) {
    fprintf(f,
            "Usage: prefixctl prefix [--url URL] [--token T] COMMAND\n"
            "\n"
            "Manage the stored prefixes of a running prefixd through its admin API.\n"
            "\n"
            "Commands:\n"
            "  add (--text FILE | --messages FILE.json | --segments FILE.json)\n"
            "      [--policy SPEC] [--retention R | --quality TAU] [--namespace NS]\n"
            "      [--pin] [--dtype f32|f16|bf16] [--no-wait]\n"
            "      [--spans-auto] [--keep-text PHRASE]...\n"
            "                 spans for fair=1 from the text's turns, paragraphs or sentences;\n"
            "                 phrases whose every occurrence is never evicted\n"
            "                 register a prefix (stored as f16 unless --dtype says otherwise);\n"
            "                 waits for the job (progress on stderr)\n"
            "                 and prints the stored prefix as JSON\n"
            "  list [--namespace NS]  the stored prefixes (JSON)\n"
            "  show ID        one prefix (JSON)\n"
            "  delete ID      delete a prefix\n"
            "  job ID         a registration job's status (JSON)\n"
            "\n"
            "Options:\n"
            "  --url URL      the admin listener (default http://127.0.0.1:8080)\n"
            "  --token T      admin.token (default: $PREFIXD_ADMIN_TOKEN)\n"
            "  -h, --help     print this help\n"
            "\n"
            "--messages: a JSON array of {\"role\",\"content\"} whose leading system\n"
            "message(s) become the prefix. --segments: a JSON array of\n"
            "{\"name\",\"text\",\"keep\"}; kept segments are never compressed.\n"
            "Exit status: 0 ok, 1 failure (the daemon's message on stderr), 2 bad usage.\n");
}

/* ---- a growable string ------------------------------------------------------ */

typedef struct buf {
    char *p;
    size_t len, cap;
    bool oom;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (n > SIZE_MAX / 2 - b->len - 1) {
        b->oom = true;
        return;
    }
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void buf_str(buf *b, const char *s) {
    buf_add(b, s, strlen(s));
}

__attribute__((format(printf, 2, 3))) static void buf_fmt(buf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) b->oom = true;
    else buf_add(b, tmp, (size_t)n);
}

/* A JSON string literal. */
static void buf_json_str(buf *b, const char *s, size_t n) {
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            buf_add(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            buf_add(b, esc, 6);
        } else {
            buf_add(b, (const char *)&s[i], 1);
        }
    }
    buf_add(b, "\"", 1);
}

static int read_file(const char *path, buf *out) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, PROG ": cannot open %s: %s\n", path, strerror(errno));
        return 1;
    }
    char chunk[65536];
    size_t n;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) buf_add(out, chunk, n);
    int bad = ferror(f);
    fclose(f);
    if (bad || out->oom) {
        fprintf(stderr, PROG ": cannot read %s%s\n", path, out->oom ? ": out of memory" : "");
        return 1;
    }
    if (memchr(out->p ? out->p : "", '\0', out->len)) {
        fprintf(stderr, PROG ": %s contains NUL bytes; give a UTF-8 text file\n", path);
        return 1;
    }
    return 0;
}

/* ---- picking fields out of the daemon's compact JSON -------------------------- */

/* The value after "key": (the first occurrence), or NULL. */
static const char *json_field(const char *j, const char *key) {
    char pat[80];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = j ? strstr(j, pat) : NULL;
    return p ? p + strlen(pat) : NULL;
}

/* A string value, unescaped (\uXXXX beyond ASCII becomes '?'), into out. */
static bool json_str(const char *j, const char *key, char *out, size_t cap) {
    const char *p = json_field(j, key);
    if (!p || *p != '"' || cap == 0) return false;
    size_t k = 0;
    for (p++; *p && *p != '"'; p++) {
        char c = *p;
        if (c == '\\' && p[1]) {
            p++;
            switch (*p) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                int used = 0;
                if (sscanf(p + 1, "%4x%n", &v, &used) == 1 && used == 4) p += 4;
                c = v < 0x80 ? (char)v : '?';
                break;
            }
            default: c = *p; break;
            }
        }
        if (k + 1 < cap) out[k++] = c;
    }
    out[k] = '\0';
    return true;
}

static bool json_num(const char *j, const char *key, double *out) {
    const char *p = json_field(j, key);
    if (!p) return false;
    char *end = NULL;
    *out = strtod(p, &end);
    return end != p;
}

/* The object value of key as a new string (brackets matched outside strings). */
static char *json_object_text(const char *j, const char *key) {
    const char *p = json_field(j, key);
    if (!p || *p != '{') return NULL;
    int depth = 0;
    bool in_str = false;
    for (const char *q = p; *q; q++) {
        if (in_str) {
            if (*q == '\\' && q[1]) q++;
            else if (*q == '"') in_str = false;
        } else if (*q == '"') {
            in_str = true;
        } else if (*q == '{') {
            depth++;
        } else if (*q == '}' && --depth == 0) {
            return strndup(p, (size_t)(q - p + 1));
        }
    }
    return NULL;
}

/* ---- HTTP/1.1 ------------------------------------------------------------------ */

typedef struct client {
    char host[256];
    char port[8];
    char token[512];
} client;

static int parse_url(const char *url, client *c) {
    const char *p = url;
    if (strncmp(p, "http://", 7) == 0) p += 7;
    else if (strstr(p, "://")) {
        fprintf(stderr, PROG ": --url %s: only http:// is supported (put TLS in front with a proxy)\n", url);
        return 2;
    }
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof c->host) {
        fprintf(stderr, PROG ": --url %s: no host name\n", url);
        return 2;
    }
    memcpy(c->host, p, hl);
    c->host[hl] = '\0';
    p += hl;
    snprintf(c->port, sizeof c->port, "80");
    if (*p == ':') {
        char *end = NULL;
        long port = strtol(p + 1, &end, 10);
        if (end == p + 1 || port < 1 || port > 65535 || (*end && *end != '/')) {
            fprintf(stderr, PROG ": --url %s: the port must be 1..65535\n", url);
            return 2;
        }
        snprintf(c->port, sizeof c->port, "%ld", port);
        p = end;
    }
    if (*p && strcmp(p, "/") != 0) {
        fprintf(stderr, PROG ": --url %s: give the server only (http://HOST:PORT), not a path\n", url);
        return 2;
    }
    return 0;
}

static int connect_to(const client *c) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(c->host, c->port, &hints, &res);
    if (rc) {
        fprintf(stderr, PROG ": %s: %s\n", c->host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, saved = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        fprintf(stderr, PROG ": cannot connect to %s:%s: %s (is prefixd running with admin.token set?)\n", c->host,
                c->port, strerror(saved ? saved : ECONNREFUSED));
    return fd;
}

static bool send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* Decode a chunked body in place; false when malformed. */
static bool dechunk(char *body, size_t len, size_t *out_len) {
    size_t r = 0, w = 0;
    for (;;) {
        char *end = NULL;
        if (r >= len) return false;
        unsigned long long n = strtoull(body + r, &end, 16);
        if (end == body + r) return false;
        char *crlf = strstr(end, "\r\n"); /* chunk extensions are skipped */
        if (!crlf) return false;
        r = (size_t)(crlf - body) + 2;
        if (n == 0) break;
        if (n > len - r) return false;
        memmove(body + w, body + r, (size_t)n);
        w += (size_t)n;
        r += (size_t)n + 2;
    }
    body[w] = '\0';
    *out_len = w;
    return true;
}

/* One request; *status and the body (malloc'd, NUL-terminated) on success.
 * The connection is closed by the server after the answer (Connection:
 * close), so the answer is everything read until EOF. */
static int http(const client *c, const char *method, const char *path, const char *body, int *status, char **out) {
    *out = NULL;
    buf req = {0};
    buf_fmt(&req, "%s %s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\nAccept: application/json\r\n", method, path,
            c->host, c->port);
    if (c->token[0]) {
        buf_str(&req, "Authorization: Bearer ");
        buf_str(&req, c->token);
        buf_str(&req, "\r\n");
    }
    if (body) buf_fmt(&req, "Content-Type: application/json\r\nContent-Length: %zu\r\n", strlen(body));
    buf_str(&req, "\r\n");
    if (body) buf_str(&req, body);
    if (req.oom) {
        free(req.p);
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    int fd = connect_to(c);
    if (fd < 0) {
        free(req.p);
        return 1;
    }
    bool sent = send_all(fd, req.p, req.len);
    free(req.p);
    buf ans = {0};
    char chunk[16384];
    ssize_t n = 0;
    while (sent && !ans.oom && ans.len < MAX_ANSWER) {
        n = recv(fd, chunk, sizeof chunk, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        buf_add(&ans, chunk, (size_t)n);
    }
    close(fd);
    int maj = 0, min = 0;
    char *sep = ans.p ? strstr(ans.p, "\r\n\r\n") : NULL;
    if (!sent || n < 0 || ans.oom || !sep || sscanf(ans.p, "HTTP/%d.%d %d", &maj, &min, status) != 3) {
        fprintf(stderr, PROG ": no valid HTTP answer from %s:%s%s\n", c->host, c->port,
                ans.oom ? " (out of memory)" : "");
        free(ans.p);
        return 1;
    }
    *sep = '\0';
    char *b = sep + 4;
    size_t blen = ans.len - (size_t)(b - ans.p);
    bool chunked = false;
    long long clen = -1;
    for (char *line = strstr(ans.p, "\r\n"); line; line = strstr(line, "\r\n")) {
        line += 2;
        if (strncasecmp(line, "Transfer-Encoding:", 18) == 0) chunked = strcasestr(line, "chunked") != NULL;
        else if (strncasecmp(line, "Content-Length:", 15) == 0) clen = strtoll(line + 15, NULL, 10);
    }
    if (chunked) {
        if (!dechunk(b, blen, &blen)) {
            fprintf(stderr, PROG ": malformed chunked answer from %s:%s\n", c->host, c->port);
            free(ans.p);
            return 1;
        }
    } else if (clen >= 0) {
        if ((unsigned long long)clen > blen) {
            fprintf(stderr, PROG ": the answer from %s:%s was cut short\n", c->host, c->port);
            free(ans.p);
            return 1;
        }
        blen = (size_t)clen;
    }
    memmove(ans.p, b, blen);
    ans.p[blen] = '\0';
    *out = ans.p;
    return 0;
}

/* A request whose answer must be 2xx; the daemon's message otherwise. */
static int call(const client *c, const char *method, const char *path, const char *body, int *status, char **out) {
    int st = 0;
    if (http(c, method, path, body, &st, out)) return 1;
    if (status) *status = st;
    if (st >= 200 && st < 300) return 0;
    char msg[1024];
    if (!json_str(*out, "message", msg, sizeof msg)) snprintf(msg, sizeof msg, "%.1000s", *out);
    fprintf(stderr, PROG ": HTTP %d: %s\n", st, msg);
    if (st == 404 && strstr(*out, "\"no such route\"")) fprintf(stderr, PROG ": is the admin API enabled "
                                                               "(admin.token), and is --url its listener?\n");
    free(*out);
    *out = NULL;
    return 1;
}

static int print_answer(char *body) {
    if (body && body[0]) printf("%s\n", body);
    free(body);
    return fflush(stdout) == 0 ? 0 : 1;
}

/* ---- add --------------------------------------------------------------------- */

#define MAX_KEEP_TEXT 64 /* the admin API's limit */

typedef struct add_opts {
    const char *text, *messages, *segments, *policy, *ns, *dtype;
    double retention, quality;
    bool pin, no_wait, spans_auto;
    const char *keep_text[MAX_KEEP_TEXT];
    int n_keep_text;
} add_opts;

static void progress(bool tty, const char *phase, double frac, char *last_phase, size_t cap) {
    if (tty) {
        int w = 30, k = (int)(frac * w + 0.5);
        if (k < 0) k = 0;
        if (k > w) k = w;
        fprintf(stderr, "\r[%.*s%*s] %3d%% %-20s", k, "##############################", w - k, "",
                (int)(frac * 100 + 0.5), phase);
    } else if (strcmp(phase, last_phase) != 0) {
        fprintf(stderr, "%s\n", phase);
    }
    snprintf(last_phase, cap, "%s", phase);
}

static int cmd_add(const client *c, const add_opts *o) {
    int given = (o->text != NULL) + (o->messages != NULL) + (o->segments != NULL);
    if (given != 1) {
        fprintf(stderr, PROG " add: give exactly one of --text, --messages, --segments\n");
        return 2;
    }
    if (o->retention > 0 && o->quality > 0) {
        fprintf(stderr, PROG " add: give --retention or --quality, not both\n");
        return 2;
    }
    buf file = {0}, body = {0};
    int rc = read_file(o->text ? o->text : o->messages ? o->messages : o->segments, &file);
    if (rc) {
        free(file.p);
        return rc;
    }
    buf_str(&body, "{");
    if (o->text) {
        buf_str(&body, "\"text\":");
        buf_json_str(&body, file.p ? file.p : "", file.len);
    } else {
        /* Sent as written; the daemon validates it and names what is wrong. */
        buf_str(&body, o->messages ? "\"messages\":" : "\"segments\":");
        buf_add(&body, file.p ? file.p : "", file.len);
    }
    free(file.p);
    if (o->policy) {
        buf_str(&body, ",\"policy\":");
        buf_json_str(&body, o->policy, strlen(o->policy));
    }
    if (o->retention > 0) buf_fmt(&body, ",\"retention\":%.17g", o->retention);
    if (o->quality > 0) buf_fmt(&body, ",\"quality\":%.17g", o->quality);
    if (o->ns) {
        buf_str(&body, ",\"namespace\":");
        buf_json_str(&body, o->ns, strlen(o->ns));
    }
    if (o->pin) buf_str(&body, ",\"pin\":true");
    if (o->dtype) {
        buf_str(&body, ",\"dtype\":");
        buf_json_str(&body, o->dtype, strlen(o->dtype));
    }
    if (o->spans_auto) buf_str(&body, ",\"spans\":\"auto\"");
    for (int i = 0; i < o->n_keep_text; i++) {
        buf_str(&body, i ? "," : ",\"keep_text\":[");
        buf_json_str(&body, o->keep_text[i], strlen(o->keep_text[i]));
        if (i == o->n_keep_text - 1) buf_str(&body, "]");
    }
    buf_str(&body, ",\"wait\":false}");
    if (body.oom) {
        free(body.p);
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    char *ans = NULL;
    rc = call(c, "POST", "/admin/v1/prefixes", body.p, NULL, &ans);
    free(body.p);
    if (rc) return rc;
    double id = 0;
    if (!json_num(ans, "job_id", &id) || id < 1) {
        fprintf(stderr, PROG ": the daemon answered without a job id: %s\n", ans);
        free(ans);
        return 1;
    }
    char path[64];
    snprintf(path, sizeof path, "/admin/v1/jobs/%llu", (unsigned long long)id);
    if (o->no_wait) return print_answer(ans);
    free(ans);
    bool tty = isatty(STDERR_FILENO);
    char last[64] = "";
    for (;;) {
        if (call(c, "GET", path, NULL, NULL, &ans)) return 1;
        char state[32] = "", phase[64] = "";
        double frac = 0;
        json_str(ans, "state", state, sizeof state);
        json_str(ans, "phase", phase, sizeof phase);
        json_num(ans, "progress", &frac);
        progress(tty, phase[0] ? phase : state, frac, last, sizeof last);
        if (strcmp(state, "done") == 0 || strcmp(state, "failed") == 0) {
            if (tty) fputc('\n', stderr);
            if (strcmp(state, "failed") == 0) {
                char err[1024] = "";
                json_str(ans, "error", err, sizeof err);
                fprintf(stderr, PROG ": job %llu failed: %s\n", (unsigned long long)id, err);
                free(ans);
                return 1;
            }
            char *prefix = json_object_text(ans, "prefix");
            free(ans);
            if (!prefix) {
                fprintf(stderr, PROG ": job %llu is done but the answer has no prefix\n", (unsigned long long)id);
                return 1;
            }
            return print_answer(prefix);
        }
        free(ans);
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* ---- the command ----------------------------------------------------------------- */

static bool is_prefix_id(const char *s) {
    if (strlen(s) != 64) return false;
    for (const char *p = s; *p; p++)
        if (!strchr("0123456789abcdefABCDEF", *p)) return false;
    return true;
}

int pd_prefix_cli(int argc, char **argv) {
    enum { O_URL = 256, O_TOKEN, O_TEXT, O_MESSAGES, O_SEGMENTS, O_POLICY, O_RETENTION, O_QUALITY, O_NS, O_PIN,
           O_DTYPE, O_NO_WAIT, O_SPANS_AUTO, O_KEEP_TEXT };
    static const struct option longopts[] = {
        {"url", required_argument, NULL, O_URL},
        {"token", required_argument, NULL, O_TOKEN},
        {"text", required_argument, NULL, O_TEXT},
        {"messages", required_argument, NULL, O_MESSAGES},
        {"segments", required_argument, NULL, O_SEGMENTS},
        {"policy", required_argument, NULL, O_POLICY},
        {"retention", required_argument, NULL, O_RETENTION},
        {"quality", required_argument, NULL, O_QUALITY},
        {"namespace", required_argument, NULL, O_NS},
        {"pin", no_argument, NULL, O_PIN},
        {"dtype", required_argument, NULL, O_DTYPE},
        {"no-wait", no_argument, NULL, O_NO_WAIT},
        {"spans-auto", no_argument, NULL, O_SPANS_AUTO},
        {"keep-text", required_argument, NULL, O_KEEP_TEXT},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *url = "http://127.0.0.1:8080", *token = getenv("PREFIXD_ADMIN_TOKEN");
    add_opts ao = {0};
    int ch;
    optind = 0; /* glibc: start over, whatever parsed argv before */
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        char *end = NULL;
        switch (ch) {
        case O_URL: url = optarg; break;
        case O_TOKEN: token = optarg; break;
        case O_TEXT: ao.text = optarg; break;
        case O_MESSAGES: ao.messages = optarg; break;
        case O_SEGMENTS: ao.segments = optarg; break;
        case O_POLICY: ao.policy = optarg; break;
        case O_NS: ao.ns = optarg; break;
        case O_PIN: ao.pin = true; break;
        case O_DTYPE: ao.dtype = optarg; break;
        case O_NO_WAIT: ao.no_wait = true; break;
        case O_SPANS_AUTO: ao.spans_auto = true; break;
        case O_KEEP_TEXT:
            if (ao.n_keep_text == MAX_KEEP_TEXT) {
                fprintf(stderr, PROG ": at most %d --keep-text phrases\n", MAX_KEEP_TEXT);
                return 2;
            }
            ao.keep_text[ao.n_keep_text++] = optarg;
            break;
        case O_RETENTION:
            ao.retention = strtod(optarg, &end);
            if (end == optarg || *end || !(ao.retention > 0 && ao.retention <= 1)) {
                fprintf(stderr, PROG ": --retention %s: give a fraction in (0, 1]\n", optarg);
                return 2;
            }
            break;
        case O_QUALITY:
            ao.quality = strtod(optarg, &end);
            if (end == optarg || *end || !(ao.quality >= 1)) {
                fprintf(stderr, PROG ": --quality %s: give the largest NLL ratio allowed (>= 1, e.g. 1.05)\n",
                        optarg);
                return 2;
            }
            break;
        case 'h': usage(stdout); return 0;
        default: fprintf(stderr, "Try 'prefixctl prefix --help'.\n"); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    const char *arg = optind + 1 < argc ? argv[optind + 1] : NULL;
    int want_args = strcmp(cmd, "show") == 0 || strcmp(cmd, "delete") == 0 || strcmp(cmd, "job") == 0 ? 1 : 0;
    if (argc - optind - 1 != want_args) {
        fprintf(stderr, PROG " %s: %s\nTry 'prefixctl prefix --help'.\n", cmd,
                want_args ? "give exactly one ID" : "takes no arguments");
        return 2;
    }
    client c = {0};
    int rc = parse_url(url, &c);
    if (rc) return rc;
    if (!token || !token[0]) {
        fprintf(stderr, PROG ": no admin token: give --token or set PREFIXD_ADMIN_TOKEN (admin.token)\n");
        return 1;
    }
    if (strlen(token) >= sizeof c.token) {
        fprintf(stderr, PROG ": the admin token is longer than %zu bytes\n", sizeof c.token - 1);
        return 2;
    }
    snprintf(c.token, sizeof c.token, "%s", token);
    char path[256], *ans = NULL;
    if (strcmp(cmd, "add") == 0) return cmd_add(&c, &ao);
    if (strcmp(cmd, "list") == 0) {
        buf p = {0};
        buf_str(&p, "/admin/v1/prefixes");
        if (ao.ns) {
            /* Percent-encode the namespace for the query string. */
            buf_str(&p, "?namespace=");
            for (const unsigned char *s = (const unsigned char *)ao.ns; *s; s++) {
                if ((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
                    strchr("-_.~", *s))
                    buf_add(&p, (const char *)s, 1);
                else
                    buf_fmt(&p, "%%%02X", *s);
            }
        }
        rc = p.oom ? 1 : call(&c, "GET", p.p, NULL, NULL, &ans);
        free(p.p);
        return rc ? 1 : print_answer(ans);
    }
    if (strcmp(cmd, "show") == 0 || strcmp(cmd, "delete") == 0) {
        if (!is_prefix_id(arg)) {
            fprintf(stderr, PROG " %s: '%s' is not a prefix id (64 hex digits, see 'list')\n", cmd, arg);
            return 2;
        }
        snprintf(path, sizeof path, "/admin/v1/prefixes/%s", arg);
        bool del = strcmp(cmd, "delete") == 0;
        if (call(&c, del ? "DELETE" : "GET", path, NULL, NULL, &ans)) return 1;
        if (!del) return print_answer(ans);
        free(ans);
        printf("deleted %s\n", arg);
        return fflush(stdout) == 0 ? 0 : 1;
    }
    if (strcmp(cmd, "job") == 0) {
        char *end = NULL;
        unsigned long long id = strtoull(arg, &end, 10);
        if (end == arg || *end || id == 0 || arg[0] == '-') {
            fprintf(stderr, PROG " job: '%s' is not a job id (a positive number)\n", arg);
            return 2;
        }
        snprintf(path, sizeof path, "/admin/v1/jobs/%llu", id);
        return call(&c, "GET", path, NULL, NULL, &ans) ? 1 : print_answer(ans);
    }
    fprintf(stderr, PROG ": unknown command '%s'\nTry 'prefixctl prefix --help'.\n", cmd);
    return 2;
}

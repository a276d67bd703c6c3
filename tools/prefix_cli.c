/* `prefixctl prefix ...`: the daemon's admin API (docs/api.md, "Admin API")
 * from the command line. HTTP(S) is libcurl's (TLS, redirects refused,
 * proxies from the usual environment variables: http_proxy, https_proxy,
 * no_proxy); JSON is jansson's, both ways. Answers are printed as the
 * daemon sends them; only the polling fields of a job are read. */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>
#include <jansson.h>

#include "tools/tools.h"

#define PROG "prefixctl prefix"
#define MAX_ANSWER (64u << 20)    /* a list of many prefixes is still far below this */
#define CONNECT_TIMEOUT_S 30L     /* a listener that does not answer the handshake */
#define POLL_INTERVAL_NS (200L * 1000 * 1000)

static void usage(FILE *f) {
    fprintf(f,
            "Usage: prefixctl prefix [--url URL] [--token T] [--cacert FILE] COMMAND\n"
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
            "  pin ID, unpin ID  never evict it by the store's size limit, or again allow it (JSON)\n"
            "  job ID         a registration job's status (JSON)\n"
            "\n"
            "Options:\n"
            "  --url URL      the admin listener, http:// or https:// (default http://127.0.0.1:8080);\n"
            "                 proxies from http_proxy, https_proxy and no_proxy\n"
            "  --token T      admin.token (default: $PREFIXD_ADMIN_TOKEN)\n"
            "  --cacert FILE  trust the CA certificates in FILE for https (default: the system's)\n"
            "  -h, --help     print this help\n"
            "\n"
            "--messages: a JSON array of {\"role\",\"content\"} whose leading system\n"
            "message(s) become the prefix. --segments: a JSON array of\n"
            "{\"name\",\"text\",\"keep\"}; kept segments are never compressed.\n"
            "Exit status: 0 ok, 1 failure (the daemon's message on stderr), 2 bad usage.\n");
}

/* ---- HTTP ---------------------------------------------------------------------- */

typedef struct client {
    CURL *curl;
    char *base;                 /* scheme://host[:port], no trailing slash */
    char *auth;                 /* "Authorization: Bearer ..." */
    const char *cacert;
} client;

typedef struct answer {
    char *p;
    size_t len;
    bool too_big, oom;
} answer;

static size_t on_data(char *data, size_t size, size_t nmemb, void *ctx) {
    answer *a = ctx;
    const size_t n = size * nmemb;
    if (n > MAX_ANSWER - a->len) {
        a->too_big = true;
        return 0; /* libcurl stops with CURLE_WRITE_ERROR */
    }
    char *np = realloc(a->p, a->len + n + 1);
    if (!np) {
        a->oom = true;
        return 0;
    }
    memcpy(np + a->len, data, n);
    a->p = np;
    a->len += n;
    a->p[a->len] = '\0';
    return n;
}

/* The server part of --url: http or https, a host, an optional port, no
 * path, query or credentials. A URL without a scheme is http. */
static int parse_url(const char *url, client *c) {
    CURLU *u = curl_url();
    char *scheme = NULL, *host = NULL, *port = NULL, *path = NULL, *query = NULL, *user = NULL;
    int rc = 2;
    if (!u) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    /* libcurl's default scheme would be https; prefixd's listeners are http. */
    char *full = NULL;
    if (!strstr(url, "://") && asprintf(&full, "http://%s", url) < 0) full = NULL;
    CURLUcode uc = curl_url_set(u, CURLUPART_URL, full ? full : url, CURLU_NON_SUPPORT_SCHEME);
    free(full);
    if (uc) {
        fprintf(stderr, PROG ": --url %s: %s (give http://HOST:PORT or https://HOST:PORT)\n", url,
                curl_url_strerror(uc));
        goto out;
    }
    curl_url_get(u, CURLUPART_SCHEME, &scheme, 0);
    curl_url_get(u, CURLUPART_HOST, &host, 0);
    curl_url_get(u, CURLUPART_PORT, &port, 0);
    curl_url_get(u, CURLUPART_PATH, &path, 0);
    curl_url_get(u, CURLUPART_QUERY, &query, 0);
    curl_url_get(u, CURLUPART_USER, &user, 0);
    if (!scheme || (strcmp(scheme, "http") != 0 && strcmp(scheme, "https") != 0)) {
        fprintf(stderr, PROG ": --url %s: only http:// and https:// are supported\n", url);
        goto out;
    }
    if (!host || !host[0]) {
        fprintf(stderr, PROG ": --url %s: no host name\n", url);
        goto out;
    }
    if ((path && strcmp(path, "/") != 0 && path[0]) || query || user) {
        fprintf(stderr, PROG ": --url %s: give the server only (%s://HOST:PORT), not a path, query or user\n", url,
                scheme);
        goto out;
    }
    /* The host as curl prints it keeps IPv6 brackets. */
    const size_t need = strlen(scheme) + strlen(host) + (port ? strlen(port) : 0) + 8;
    if (!(c->base = malloc(need))) {
        fprintf(stderr, PROG ": out of memory\n");
        rc = 1;
        goto out;
    }
    snprintf(c->base, need, "%s://%s%s%s", scheme, host, port ? ":" : "", port ? port : "");
    rc = 0;
out:
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
    curl_free(path);
    curl_free(query);
    curl_free(user);
    curl_url_cleanup(u);
    return rc;
}

/* Why a transfer failed, with what to check. */
static void transfer_failed(const client *c, CURLcode cc, const char *detail, const answer *a) {
    const char *why = detail[0] ? detail : curl_easy_strerror(cc);
    if (a->too_big) {
        fprintf(stderr, PROG ": the answer from %s is larger than %u MiB\n", c->base, MAX_ANSWER >> 20);
        return;
    }
    if (a->oom) {
        fprintf(stderr, PROG ": out of memory reading the answer from %s\n", c->base);
        return;
    }
    switch (cc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
        fprintf(stderr, PROG ": cannot resolve the host of %s: %s\n", c->base, why);
        break;
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
        fprintf(stderr, PROG ": cannot connect to %s: %s (is prefixd running with admin.token set, and is --url its "
                        "listener?)\n", c->base, why);
        break;
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
        fprintf(stderr, PROG ": TLS with %s failed: %s (prefixd itself serves plain http: use http:// for it, or "
                        "--cacert for a TLS proxy's certificate)\n", c->base, why);
        break;
    default: fprintf(stderr, PROG ": request to %s failed: %s\n", c->base, why); break;
    }
}

/* One request; body (a JSON document) may be NULL. On success *status and
 * the answer (malloc'd, NUL-terminated, possibly empty). */
static int http(client *c, const char *method, const char *path, const char *body, long *status, char **out) {
    *out = NULL;
    char *url = malloc(strlen(c->base) + strlen(path) + 1);
    if (!url) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    strcpy(url, c->base);
    strcat(url, path);
    struct curl_slist *headers = NULL, *h;
    answer a = {0};
    char detail[CURL_ERROR_SIZE] = "";
    CURL *e = c->curl;
    curl_easy_reset(e);
    bool ok = (h = curl_slist_append(headers, "Accept: application/json")) != NULL && (headers = h) &&
              (h = curl_slist_append(headers, c->auth)) != NULL && (headers = h);
    if (ok && body) ok = (h = curl_slist_append(headers, "Content-Type: application/json")) != NULL && (headers = h);
    /* No "Expect: 100-continue" round trip before large bodies. */
    if (ok && body) ok = (h = curl_slist_append(headers, "Expect:")) != NULL && (headers = h);
    if (!ok) {
        curl_slist_free_all(headers);
        free(url);
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    if (strcmp(method, "GET") == 0) curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    if (body) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    }
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &a);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, detail);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT, CONNECT_TIMEOUT_S);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L); /* the token must not travel elsewhere */
    curl_easy_setopt(e, CURLOPT_USERAGENT, "prefixctl/" PREFIXD_VERSION);
    if (c->cacert) curl_easy_setopt(e, CURLOPT_CAINFO, c->cacert);
    CURLcode cc = curl_easy_perform(e);
    curl_slist_free_all(headers);
    free(url);
    if (cc != CURLE_OK) {
        transfer_failed(c, cc, detail, &a);
        free(a.p);
        return 1;
    }
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, status);
    *out = a.p ? a.p : strdup("");
    if (!*out) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    return 0;
}

/* The daemon's answer as JSON; NULL (with a message) when it is not. */
static json_t *parse_answer(const client *c, const char *text) {
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    if (!j) fprintf(stderr, PROG ": the answer from %s is not JSON (%s): %.200s\n", c->base, je.text, text);
    return j;
}

/* A request whose answer must be 2xx; the daemon's message otherwise. */
static int call(client *c, const char *method, const char *path, const char *body, char **out) {
    long st = 0;
    if (http(c, method, path, body, &st, out)) return 1;
    if (st >= 200 && st < 300) return 0;
    /* {"error": {"message", "type", "param", "code"}} (docs/api.md, "Errors"). */
    json_t *j = json_loads(*out, 0, NULL);
    json_t *error = json_object_get(j, "error");
    const char *msg = json_string_value(json_object_get(error, "message"));
    if (msg) fprintf(stderr, PROG ": HTTP %ld: %s\n", st, msg);
    else fprintf(stderr, PROG ": HTTP %ld: %.1000s\n", st, *out);
    /* A 404 without an error code is a route the server does not have; a
     * missing prefix or job carries one. */
    if (st == 404 && error && !json_is_string(json_object_get(error, "code")))
        fprintf(stderr, PROG ": is the admin API enabled (admin.token), and is --url its listener?\n");
    json_decref(j);
    free(*out);
    *out = NULL;
    return 1;
}

static int print_text(const char *text) {
    if (text && text[0]) printf("%s\n", text);
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

static int read_file(const char *path, char **out, size_t *len) {
    pd_error err = {0};
    if (pd_read_file(path, out, len, &err)) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    return 0;
}

/* The "text" of a registration: the file as a JSON string (UTF-8 only). */
static json_t *text_value(const char *path) {
    char *text = NULL;
    size_t len = 0;
    if (read_file(path, &text, &len)) return NULL;
    json_t *s = memchr(text, '\0', len) ? NULL : json_stringn(text, len);
    free(text);
    if (!s) fprintf(stderr, PROG ": %s is not UTF-8 text (or contains NUL bytes); give a UTF-8 text file\n", path);
    return s;
}

/* --messages / --segments: the file's JSON; the daemon checks its shape. */
static json_t *json_file_value(const char *path) {
    json_error_t je;
    json_t *j = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!j) fprintf(stderr, PROG ": %s:%d:%d: %s\n", path, je.line, je.column, je.text);
    return j;
}

static json_t *add_body(const add_opts *o) {
    json_t *body = json_object(), *v = NULL;
    if (!body) return NULL;
    if (o->text) v = text_value(o->text);
    else v = json_file_value(o->messages ? o->messages : o->segments);
    if (!v) goto fail;
    if (json_object_set_new(body, o->text ? "text" : o->messages ? "messages" : "segments", v)) goto oom;
    if (o->policy && json_object_set_new(body, "policy", json_string(o->policy))) goto oom;
    if (o->retention > 0 && json_object_set_new(body, "retention", json_real(o->retention))) goto oom;
    if (o->quality > 0 && json_object_set_new(body, "quality", json_real(o->quality))) goto oom;
    if (o->ns && json_object_set_new(body, "namespace", json_string(o->ns))) goto oom;
    if (o->pin && json_object_set_new(body, "pin", json_true())) goto oom;
    if (o->dtype && json_object_set_new(body, "dtype", json_string(o->dtype))) goto oom;
    if (o->spans_auto && json_object_set_new(body, "spans", json_string("auto"))) goto oom;
    if (o->n_keep_text > 0) {
        json_t *keep = json_array();
        if (json_object_set_new(body, "keep_text", keep)) goto oom;
        for (int i = 0; i < o->n_keep_text; i++)
            if (json_array_append_new(keep, json_string(o->keep_text[i]))) {
                fprintf(stderr, PROG ": --keep-text '%s' is not UTF-8\n", o->keep_text[i]);
                goto fail;
            }
    }
    if (json_object_set_new(body, "wait", json_false())) goto oom;
    return body;
oom:
    /* json_string of an argument that is not UTF-8 fails the same way. */
    fprintf(stderr, PROG ": out of memory, or an option value that is not UTF-8\n");
fail:
    json_decref(body);
    return NULL;
}

/* Poll the job until it is done or failed; print the stored prefix. */
static int wait_job(client *c, json_int_t id) {
    char path[64];
    snprintf(path, sizeof path, "/admin/v1/jobs/%lld", (long long)id);
    pd_progress line;
    pd_progress_init(&line);
    for (;;) {
        char *text = NULL;
        if (call(c, "GET", path, NULL, &text)) {
            pd_progress_end(&line);
            return 1;
        }
        json_t *j = parse_answer(c, text);
        free(text);
        if (!j) {
            pd_progress_end(&line);
            return 1;
        }
        const char *state = json_string_value(json_object_get(j, "state"));
        const char *phase = json_string_value(json_object_get(j, "phase"));
        const double frac = json_number_value(json_object_get(j, "progress"));
        if (!state) state = "";
        pd_progress_update(&line, phase && phase[0] ? phase : state, frac);
        if (strcmp(state, "done") == 0 || strcmp(state, "failed") == 0) {
            pd_progress_end(&line);
            int rc = 1;
            if (strcmp(state, "failed") == 0) {
                const char *why = json_string_value(json_object_get(j, "error"));
                fprintf(stderr, PROG ": job %lld failed: %s\n", (long long)id, why ? why : "(no message)");
            } else {
                json_t *prefix = json_object_get(j, "prefix");
                char *out = json_is_object(prefix) ? json_dumps(prefix, JSON_COMPACT) : NULL;
                if (out) rc = print_text(out);
                else fprintf(stderr, PROG ": job %lld is done but the answer has no prefix\n", (long long)id);
                free(out);
            }
            json_decref(j);
            return rc;
        }
        json_decref(j);
        struct timespec ts = {0, POLL_INTERVAL_NS};
        nanosleep(&ts, NULL);
    }
}

static int cmd_add(client *c, const add_opts *o) {
    int given = (o->text != NULL) + (o->messages != NULL) + (o->segments != NULL);
    if (given != 1) {
        fprintf(stderr, PROG " add: give exactly one of --text, --messages, --segments\n");
        return 2;
    }
    if (o->retention > 0 && o->quality > 0) {
        fprintf(stderr, PROG " add: give --retention or --quality, not both\n");
        return 2;
    }
    json_t *body = add_body(o);
    if (!body) return 1;
    char *text = json_dumps(body, JSON_COMPACT | JSON_REAL_PRECISION(17));
    json_decref(body);
    if (!text) {
        fprintf(stderr, PROG ": out of memory\n");
        return 1;
    }
    char *ans = NULL;
    int rc = call(c, "POST", "/admin/v1/prefixes", text, &ans);
    free(text);
    if (rc) return rc;
    json_t *j = parse_answer(c, ans);
    const json_int_t id = json_integer_value(json_object_get(j, "job_id"));
    json_decref(j);
    if (id < 1) {
        fprintf(stderr, PROG ": the daemon answered without a job id: %s\n", ans);
        free(ans);
        return 1;
    }
    if (o->no_wait) rc = print_text(ans);
    free(ans);
    return o->no_wait ? rc : wait_job(c, id);
}

/* ---- the command ----------------------------------------------------------------- */

static bool is_prefix_id(const char *s) {
    if (strlen(s) != 64) return false;
    for (const char *p = s; *p; p++)
        if (!strchr("0123456789abcdefABCDEF", *p)) return false;
    return true;
}

/* GET, DELETE or the list: print the answer, or for DELETE a line. */
static int cmd_simple(client *c, const char *cmd, const char *arg, const add_opts *ao) {
    char path[256], *ans = NULL;
    int rc;
    if (strcmp(cmd, "list") == 0) {
        char *ns = ao->ns ? curl_easy_escape(c->curl, ao->ns, 0) : NULL;
        if (ao->ns && !ns) {
            fprintf(stderr, PROG ": out of memory\n");
            return 1;
        }
        char *list_path = malloc(sizeof "/admin/v1/prefixes?namespace=" + (ns ? strlen(ns) : 0));
        if (!list_path) rc = 1;
        else {
            strcpy(list_path, "/admin/v1/prefixes");
            if (ns) strcat(strcat(list_path, "?namespace="), ns);
            rc = call(c, "GET", list_path, NULL, &ans);
        }
        curl_free(ns);
        free(list_path);
    } else if (strcmp(cmd, "job") != 0) { /* show, delete, pin, unpin: one prefix */
        if (!is_prefix_id(arg)) {
            fprintf(stderr, PROG " %s: '%s' is not a prefix id (64 hex digits, see 'list')\n", cmd, arg);
            return 2;
        }
        snprintf(path, sizeof path, "/admin/v1/prefixes/%s", arg);
        const bool del = strcmp(cmd, "delete") == 0, pin = strcmp(cmd, "pin") == 0, unpin = strcmp(cmd, "unpin") == 0;
        const char *method = del ? "DELETE" : pin || unpin ? "PATCH" : "GET";
        const char *body = pin ? "{\"pinned\":true}" : unpin ? "{\"pinned\":false}" : NULL;
        if ((rc = call(c, method, path, body, &ans)) == 0 && del) {
            free(ans);
            printf("deleted %s\n", arg);
            return fflush(stdout) == 0 ? 0 : 1;
        }
    } else {
        char *end = NULL;
        errno = 0;
        unsigned long long id = strtoull(arg, &end, 10);
        if (end == arg || *end || id == 0 || arg[0] == '-' || errno) {
            fprintf(stderr, PROG " job: '%s' is not a job id (a positive number)\n", arg);
            return 2;
        }
        snprintf(path, sizeof path, "/admin/v1/jobs/%llu", id);
        rc = call(c, "GET", path, NULL, &ans);
    }
    if (rc) return 1;
    rc = print_text(ans);
    free(ans);
    return rc;
}

int pd_prefix_cli(int argc, char **argv) {
    enum { O_URL = 256, O_TOKEN, O_CACERT, O_TEXT, O_MESSAGES, O_SEGMENTS, O_POLICY, O_RETENTION, O_QUALITY, O_NS,
           O_PIN, O_DTYPE, O_NO_WAIT, O_SPANS_AUTO, O_KEEP_TEXT };
    static const struct option longopts[] = {
        {"url", required_argument, NULL, O_URL},
        {"token", required_argument, NULL, O_TOKEN},
        {"cacert", required_argument, NULL, O_CACERT},
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
    const char *url = "http://127.0.0.1:8080", *token = getenv("PREFIXD_ADMIN_TOKEN"), *cacert = NULL;
    add_opts ao = {0};
    int ch;
    optind = 0; /* glibc: start over, whatever parsed argv before */
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        char *end = NULL;
        switch (ch) {
        case O_URL: url = optarg; break;
        case O_TOKEN: token = optarg; break;
        case O_CACERT: cacert = optarg; break;
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
    static const char *const known[] = {"add", "list", "show", "delete", "pin", "unpin", "job"};
    bool is_known = false;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) is_known = is_known || strcmp(cmd, known[i]) == 0;
    if (!is_known) {
        fprintf(stderr, PROG ": unknown command '%s'\nTry 'prefixctl prefix --help'.\n", cmd);
        return 2;
    }
    int want_args = strcmp(cmd, "add") != 0 && strcmp(cmd, "list") != 0 ? 1 : 0;
    if (argc - optind - 1 != want_args) {
        fprintf(stderr, PROG " %s: %s\nTry 'prefixctl prefix --help'.\n", cmd,
                want_args ? "give exactly one ID" : "takes no arguments");
        return 2;
    }
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        fprintf(stderr, PROG ": libcurl failed to initialise\n");
        return 1;
    }
    client c = {.cacert = cacert};
    int rc = parse_url(url, &c);
    if (!rc && (!token || !token[0])) {
        fprintf(stderr, PROG ": no admin token: give --token or set PREFIXD_ADMIN_TOKEN (admin.token)\n");
        rc = 1;
    }
    if (!rc && strpbrk(token, "\r\n")) {
        fprintf(stderr, PROG ": the admin token contains a line break\n");
        rc = 2;
    }
    if (!rc) {
        const size_t need = sizeof "Authorization: Bearer " + strlen(token);
        c.curl = curl_easy_init();
        c.auth = malloc(need);
        if (!c.curl || !c.auth) {
            fprintf(stderr, PROG ": out of memory\n");
            rc = 1;
        } else {
            snprintf(c.auth, need, "Authorization: Bearer %s", token);
        }
    }
    if (!rc) rc = strcmp(cmd, "add") == 0 ? cmd_add(&c, &ao) : cmd_simple(&c, cmd, arg, &ao);
    if (c.curl) curl_easy_cleanup(c.curl);
    free(c.auth);
    free(c.base);
    curl_global_cleanup();
    return rc;
}

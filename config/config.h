/* config: the daemon's settings, read from an INI file (inih) and
 * `--set section.key=value` overrides, checked, and frozen into one plain
 * struct that the rest of the daemon reads and never writes.
 *
 * Loading is all-or-nothing: a function that fails leaves the caller's
 * pd_config exactly as it was. Every message names the key and where the
 * bad value came from ("prefixd.conf:12: server.port = 70000 is out of range
 * (1..65535)", "--set: ..."). Secrets (server.api_key, admin.token) are never
 * echoed in messages. docs/configuration.md describes every key. */
#ifndef PD_CONFIG_H
#define PD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The longest line a config file may have, not counting the line ending.
 * inih reads lines into a fixed buffer (200 bytes in its default build) and
 * silently splits longer ones, so we refuse them instead. String values are
 * limited so that `key = value` always fits, which keeps the output of
 * pd_config_print() readable by pd_config_load_*(). */
#define PD_CONFIG_LINE_MAX 197
/* Capacity of every string field, terminator included. */
#define PD_CONFIG_STR_CAP (PD_CONFIG_LINE_MAX + 1)

/* Where the model computes (model.device). The values equal pd_device_kind's
 * in kernels/kernels.h; config does not depend on kernels/, so the daemon
 * converts between the two. */
typedef enum pd_backend_kind {
    PD_BACKEND_CPU = 0,
    PD_BACKEND_CUDA = 1,
    PD_BACKEND_AUTO = 2, /* CUDA device 0 when the build has CUDA and one is present, else CPU */
} pd_backend_kind;

/* The longest text of a model.device value ("cuda:255"), terminator included. */
#define PD_CONFIG_DEVICE_TEXT_CAP 16

/* Element type of the KV cache (model.kv_type). The engine's is a pd_type
 * (kernels/kernels.h); config does not depend on kernels/, so the daemon
 * converts between the two. */
typedef enum pd_kv_cache_type {
    PD_KV_CACHE_F16 = 0, /* IEEE half: half the KV memory per token (default) */
    PD_KV_CACHE_F32 = 1,
} pd_kv_cache_type;

/* What a node does in the shared tier (cluster.role). The values equal
 * pd_cluster_role's in cluster/cluster.h; config does not depend on
 * cluster/, so the daemon converts between the two. */
typedef enum pd_cluster_role_cfg {
    PD_CLUSTER_ROLE_MEMBER = 0,    /* publishes its registrations and fetches the others' */
    PD_CLUSTER_ROLE_PUBLISHER = 1, /* publishes only */
    PD_CLUSTER_ROLE_CONSUMER = 2,  /* fetches only */
} pd_cluster_role_cfg;

/* pd_log_level and pd_log_format (log.level, log.format) are util/util.h's:
 * the logger every layer uses lives there. */

/* Plain values only: a pd_config can be copied with `=` and needs no free. */
typedef struct pd_config {
    struct {
        char listen[PD_CONFIG_STR_CAP]; /* IP address or host name */
        int port;
        int threads;                    /* HTTP worker threads; 0 = number of CPUs */
        int64_t max_body_bytes;
        int request_timeout_s;          /* 0 = no limit */
        int idle_timeout_s;             /* a connection silent this long is closed */
        int max_connections;
        int max_connections_per_client; /* per client address; 0 = no limit */
        int shutdown_grace_s;           /* SIGTERM: time in-flight requests get to finish */
        char api_key[PD_CONFIG_STR_CAP]; /* "" = no authentication */
        char api_keys_file[PD_CONFIG_STR_CAP]; /* KEY NAMESPACE lines; "" = none */
        char model_names[PD_CONFIG_STR_CAP]; /* NAME[,NAME...] the API answers to; "" = the model id */
        char cors_origins[PD_CONFIG_STR_CAP]; /* ORIGIN[,ORIGIN...] or "*" browsers may call from; "" = no CORS */
        bool metrics;                   /* serve GET /metrics */
        bool metrics_auth;              /* /metrics needs the API key too */
    } server;
    struct {
        char token[PD_CONFIG_STR_CAP];  /* "" = admin API disabled */
        char listen[PD_CONFIG_STR_CAP];
        int port;                       /* 0 = share the public listener */
    } admin;
    struct {
        char path[PD_CONFIG_STR_CAP];   /* GGUF file */
        int n_ctx;                      /* 0 = the model's trained context */
        /* model.device: "cpu", "cuda" (= cuda:0), "cuda:N" or "auto", read
         * into a kind and, for cuda, the device index N (0..255; 0 for cpu
         * and auto, and ignored there). */
        pd_backend_kind device;
        int device_index;
        int n_threads;                  /* compute threads; 0 = number of CPUs */
        pd_kv_cache_type kv_type;       /* KV rows in memory (and the type stored prefixes are read as) */
        bool mmap;                      /* CPU: map the GGUF file instead of reading it into memory */
        bool cuda_graphs;               /* CUDA: launch each decode step as one recorded graph */
    } model;
    struct {
        char path[PD_CONFIG_STR_CAP];   /* LMDB environment directory */
        int64_t map_size_mb;
        int64_t hot_tier_mb;            /* 0 = no in-memory tier */
        int64_t auto_mb;                /* exact KV of recent prompts in RAM; 0 = no automatic cache */
        bool auto_persist;              /* automatic blocks also in the store (up to auto_mb), kept across restarts */
        int page_tokens;
    } cache;
    struct {
        char policy[PD_CONFIG_STR_CAP]; /* policy spec, e.g. compactor:retention=0.25 */
        int min_prefix_tokens;
        double quality_budget;          /* 0 = off, else max NLL ratio (>= 1) */
    } compression;
    struct {
        int max_batch;
        int max_queue;
    } scheduler;
    struct {
        char redis_url[PD_CONFIG_STR_CAP]; /* "" = no shared tier */
        char password[PD_CONFIG_STR_CAP];  /* Redis AUTH; "" = the URL's, if any */
        pd_cluster_role_cfg role;
        char key_prefix[PD_CONFIG_STR_CAP];
        int timeout_ms;                 /* connect and per-command timeout */
        int chunk_mb;                   /* a record is split into Redis values of at most this */
    } cluster;
    struct {
        pd_log_level level;
        pd_log_format format;
    } log;
} pd_config;

/* Fill every field with its documented default. The result validates. */
void pd_config_defaults(pd_config *c);

/* Apply the keys in an INI file (or NUL-terminated text) on top of *c.
 * Keys not mentioned keep their current values. `origin` names the text in
 * messages (a file name, or e.g. "<string>"). Unknown sections and keys, a
 * key given twice, malformed lines and bad values are errors. */
int pd_config_load_file(pd_config *c, const char *path, pd_error *err);
int pd_config_load_string(pd_config *c, const char *text, const char *origin, pd_error *err);

/* Apply one "section.key=value" override (the argument of --set). Values are
 * parsed and range-checked exactly as in a file. */
int pd_config_set(pd_config *c, const char *assignment, pd_error *err);

/* Check every value again (for configs built in code) and the rules that
 * involve more than one key. Call once, on the final config. */
int pd_config_validate(const pd_config *c, pd_error *err);

/* Write *c as INI; loading the output yields an equal config. Secrets are
 * written too: the output is as sensitive as the config file. Returns
 * PD_EIO when the stream reports a write error. */
int pd_config_print(const pd_config *c, FILE *f, pd_error *err);

/* Field-by-field equality (strings compared as strings). */
bool pd_config_equal(const pd_config *a, const pd_config *b);

/* Canonical names, as written in the config file. pd_backend_kind_name
 * gives the kind alone ("cpu", "cuda", "auto"); pd_config_device_text the
 * whole model.device value ("cpu", "cuda:1", "auto") into buf (at least
 * PD_CONFIG_DEVICE_TEXT_CAP bytes). */
const char *pd_backend_kind_name(pd_backend_kind b);
const char *pd_kv_cache_type_name(pd_kv_cache_type t); /* "f16", "f32" */
void pd_config_device_text(const pd_config *c, char *buf, size_t cap);
const char *pd_log_level_name(pd_log_level l);
const char *pd_log_format_name(pd_log_format f);

#ifdef __cplusplus
}
#endif
#endif

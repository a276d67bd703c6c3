/* `prefixctl store`: inspect and maintain a compressed prefix store.
 *
 *   prefixctl store --dir DIR list
 *   prefixctl store --dir DIR show ID
 *   prefixctl store --dir DIR verify [--repair]
 *   prefixctl store --dir DIR delete ID | pin ID | unpin ID
 *   prefixctl store --dir DIR stats
 *   prefixctl store --dir DIR salvage NEW_DIR
 *
 * An ID is the full 64-digit hex id or a unique prefix of it (at least 8
 * digits). Exit status: 0 ok, 1 failure (including corrupt records found by
 * verify and not repaired, and records salvage had to leave behind), 2 usage
 * error. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache.h"
#include "tools/tools.h"

#define MIN_ID_DIGITS 8

static void store_usage(FILE *f) {
    fputs("usage: prefixctl store --dir DIR COMMAND\n"
          "\n"
          "commands:\n"
          "  list                 one line per stored prefix\n"
          "  show ID              everything the record says, with per-layer kept counts\n"
          "  verify [--repair]    check every header and page checksum; --repair deletes\n"
          "                       corrupt records (exit status 1 while any remain)\n"
          "  delete ID            delete a prefix\n"
          "  pin ID | unpin ID    exempt a prefix from (or return it to) size-limit eviction\n"
          "  stats                prefixes, stored bytes, map use, automatic blocks\n"
          "  salvage NEW_DIR      copy every record whose checksums verify into a new store\n"
          "                       (for a truncated or damaged data.mdb; the source is only read)\n"
          "\n"
          "options:\n"
          "  --dir DIR            the store's LMDB directory (cache.path in the config)\n"
          "  --map-size-mb N      map size to open with (default 1024; LMDB never maps less\n"
          "                       than the data already stored)\n"
          "\n"
          "ID is the full 64-digit hex id or a unique prefix of at least 8 digits.\n",
          f);
}

/* "12.3 MiB": binary units, one decimal above a KiB. */
static const char *human_size(uint64_t n, char buf[32]) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (n < 1024) {
        snprintf(buf, 32, "%" PRIu64 " B", n);
        return buf;
    }
    double v = (double)n / 1024.0;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, 32, "%.1f %s", v, units[u]);
    return buf;
}

static const char *when(int64_t t, char buf[32]) {
    if (t <= 0) return "never";
    time_t tt = (time_t)t;
    struct tm tm;
    if (!localtime_r(&tt, &tm) || strftime(buf, 32, "%Y-%m-%d %H:%M:%S", &tm) == 0)
        snprintf(buf, 32, "%" PRId64, t);
    return buf;
}

static double kept_pct(const pd_prefix_info *in) {
    double full = (double)in->n_layer * (double)in->n_head_kv * (double)in->n_tokens;
    return full > 0 ? 100.0 * (double)in->kept_rows / full : 0.0;
}

static int store_fail(const pd_error *err) {
    fprintf(stderr, "prefixctl store: %s\n", err->msg);
    return 1;
}

/* ---- resolving an id or a unique prefix of one ----------------------- */

typedef struct resolve_ctx {
    const char *hex; /* lower case */
    size_t len;
    pd_prefix_id found;
    int matches;
} resolve_ctx;

static int resolve_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    resolve_ctx *c = ctx;
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    if (strncmp(hex, c->hex, c->len) == 0) {
        if (c->matches == 0) c->found = *id;
        c->matches++;
    }
    return 0;
}

/* Returns 0, 1 (failure, reported) or 2 (usage, reported). */
static int resolve_id(pd_store *s, const char *arg, pd_prefix_id *out) {
    pd_error err = {0};
    size_t len = strlen(arg);
    char lower[PD_PREFIX_ID_HEX];
    if (len < MIN_ID_DIGITS || len > PD_PREFIX_ID_HEX - 1) {
        fprintf(stderr, "prefixctl store: \"%s\" is not an id: give the 64 hex digits or a unique prefix of at least %d\n",
                arg, MIN_ID_DIGITS);
        return 2;
    }
    for (size_t i = 0; i < len; i++) {
        char ch = arg[i];
        if (ch >= 'A' && ch <= 'F') ch = (char)(ch - 'A' + 'a');
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) {
            fprintf(stderr, "prefixctl store: \"%s\" is not an id: '%c' is not a hex digit\n", arg, arg[i]);
            return 2;
        }
        lower[i] = ch;
    }
    lower[len] = '\0';
    if (len == PD_PREFIX_ID_HEX - 1) {
        if (pd_prefix_id_parse(lower, out, &err) != PD_OK) {
            fprintf(stderr, "prefixctl store: %s\n", err.msg);
            return 2;
        }
        return 0;
    }
    resolve_ctx c = {.hex = lower, .len = len};
    if (pd_store_list(s, resolve_visit, &c, &err) != PD_OK) return store_fail(&err);
    if (c.matches == 0) {
        fprintf(stderr, "prefixctl store: no stored prefix has an id starting with %s\n", lower);
        return 1;
    }
    if (c.matches > 1) {
        fprintf(stderr, "prefixctl store: %d stored prefixes have ids starting with %s; give more digits\n",
                c.matches, lower);
        return 1;
    }
    *out = c.found;
    return 0;
}

/* ---- commands ------------------------------------------------------- */

typedef struct list_ctx {
    int64_t n, corrupt;
    uint64_t bytes;
} list_ctx;

static int list_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    list_ctx *c = ctx;
    char hex[PD_PREFIX_ID_HEX], size[32], used[32];
    pd_prefix_id_hex(id, hex);
    hex[16] = '\0';
    c->n++;
    if (!info) {
        c->corrupt++;
        printf("%-16s  CORRUPT: %s\n", hex, why ? why : "unreadable header");
        return 0;
    }
    c->bytes += info->bytes;
    printf("%-16s  %7d  %6.1f%%  %-5s  %10s  %-16s  %-6s  %s\n", hex, info->n_tokens, kept_pct(info),
           pd_kv_dtype_name(info->dtype), human_size(info->bytes, size), info->ns[0] ? info->ns : "-",
           info->pinned ? "yes" : "no", when(info->last_used, used));
    return 0;
}

static int cmd_list(pd_store *s) {
    pd_error err = {0};
    list_ctx c = {0};
    printf("%-16s  %7s  %7s  %-5s  %10s  %-16s  %-6s  %s\n", "ID", "TOKENS", "KEPT", "DTYPE", "SIZE", "NAMESPACE",
           "PINNED", "LAST USED");
    if (pd_store_list(s, list_visit, &c, &err) != PD_OK) return store_fail(&err);
    char size[32];
    printf("%" PRId64 " prefix%s, %s", c.n, c.n == 1 ? "" : "es", human_size(c.bytes, size));
    if (c.corrupt) printf(", %" PRId64 " corrupt (run verify --repair to delete them)", c.corrupt);
    printf("\n");
    pd_store_stats st; /* automatic blocks are not prefixes: a count, not rows */
    if (pd_store_stats_get(s, &st, &err) == PD_OK && st.auto_blocks)
        printf("(and %" PRId64 " automatic block%s, %s, not listed; cache.auto_persist)\n", st.auto_blocks,
               st.auto_blocks == 1 ? "" : "s", human_size(st.auto_bytes, size));
    return c.corrupt ? 1 : 0;
}

static void print_number(const char *name, double v) {
    if (isnan(v)) printf(" %s unknown", name);
    else printf(" %s %.4g", name, v);
}

static int cmd_show(pd_store *s, const pd_prefix_id *id) {
    pd_error err = {0};
    pd_prefix_info in;
    if (pd_store_info(s, id, &in, &err) != PD_OK) return store_fail(&err);
    char hex[PD_PREFIX_ID_HEX], fp[2 * PD_SHA256_LEN + 1], size[32], t1[32], t2[32];
    pd_prefix_id_hex(&in.id, hex);
    pd_hex(in.fingerprint, PD_SHA256_LEN, fp);
    printf("id:          %s\n", hex);
    printf("model:       %s\n", fp);
    printf("spec:        %s\n", in.spec[0] ? in.spec : "-");
    printf("namespace:   %s\n", in.ns[0] ? in.ns : "-");
    printf("shape:       %d layers x %d kv heads x %d head dim\n", in.n_layer, in.n_head_kv, in.head_dim);
    printf("dtype:       %s\n", pd_kv_dtype_name(in.dtype));
    printf("tokens:      %d\n", in.n_tokens);
    printf("kept rows:   %" PRId64 " of %" PRId64 " (%.1f%%)\n", in.kept_rows,
           (int64_t)in.n_layer * in.n_head_kv * in.n_tokens, kept_pct(&in));
    printf("quality:    ");
    print_number("retention", in.quality.retention);
    print_number("tau", in.quality.tau);
    print_number("nll_full", in.quality.nll_full);
    print_number("nll_ratio", in.quality.nll_ratio);
    printf("\n");
    printf("created:     %s\n", when(in.created_at, t1));
    printf("last used:   %s\n", when(in.last_used, t2));
    printf("size:        %s (%" PRIu64 " bytes)\n", human_size(in.bytes, size), in.bytes);
    printf("pinned:      %s\n", in.pinned ? "yes" : "no");

    /* The full read verifies every page and gives the per-stream counts. */
    pd_prefix_ref *r = NULL;
    if (pd_store_get(s, id, &r, &err) != PD_OK) {
        fprintf(stderr, "prefixctl store: the header is intact but the data are not: %s\n", err.msg);
        return 1;
    }
    const pd_kv_prefix *kv = pd_prefix_ref_kv(r);
    const pd_token *tok = pd_prefix_ref_tokens(r);
    printf("token ids:  ");
    int32_t show = in.n_tokens < 16 ? in.n_tokens : 16;
    for (int32_t i = 0; i < show; i++) printf(" %d", tok[i]);
    printf("%s\n", show < in.n_tokens ? " ..." : "");
    printf("kept per layer (per kv head):\n");
    for (int l = 0; l < in.n_layer; l++) {
        int64_t sum = 0;
        printf("  layer %3d:", l);
        for (int h = 0; h < in.n_head_kv; h++) {
            int64_t n = pd_kv_prefix_stream(kv, l, h, NULL, NULL, NULL);
            sum += n;
            printf(" %" PRId64, n);
        }
        double full = (double)in.n_head_kv * (double)in.n_tokens;
        printf("  (%.1f%%)\n", full > 0 ? 100.0 * (double)sum / full : 0.0);
    }
    pd_prefix_ref_release(r);
    return 0;
}

static int verify_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    printf("corrupt: %s: %s\n", hex, why ? why : "checksum mismatch");
    return 0;
}

static int cmd_verify(pd_store *s, bool repair) {
    pd_error err = {0};
    pd_store_verify_report rep = {0};
    if (pd_store_verify(s, repair, verify_visit, NULL, &rep, &err) != PD_OK) return store_fail(&err);
    const int64_t prefixes = rep.checked - rep.auto_checked;
    printf("checked %" PRId64 " prefix%s", prefixes, prefixes == 1 ? "" : "es");
    if (rep.auto_checked)
        printf(" and %" PRId64 " automatic block%s", rep.auto_checked, rep.auto_checked == 1 ? "" : "s");
    printf(": %" PRId64 " corrupt, %" PRId64 " deleted\n", rep.corrupt, rep.deleted);
    if (rep.corrupt > rep.deleted) {
        if (!repair) fprintf(stderr, "prefixctl store: corrupt records found; run verify --repair to delete them\n");
        return 1;
    }
    return 0;
}

static int salvage_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)info;
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    printf("dropped: %s: %s\n", hex, why ? why : "checksum mismatch");
    return 0;
}

/* Runs on the directory itself, not an open store: a damaged store may not
 * open at all. */
static int cmd_salvage(const char *dir, const char *new_dir, uint64_t map_mb) {
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = new_dir;
    if (map_mb) o.map_size = map_mb << 20;
    pd_error err = {0};
    pd_store_salvage_report rep;
    if (pd_store_salvage(dir, &o, salvage_visit, NULL, &rep, &err) != PD_OK) return store_fail(&err);
    char b[32];
    if (rep.truncated) printf("data.mdb was truncated: %s missing\n", human_size(rep.missing_bytes, b));
    printf("salvaged %" PRId64 " of %" PRId64 " prefix%s (%s) into %s; %" PRId64 " dropped\n", rep.copied, rep.checked,
           rep.checked == 1 ? "" : "es", human_size(rep.bytes, b), new_dir, rep.dropped);
    return rep.dropped ? 1 : 0;
}

static int cmd_stats(pd_store *s) {
    pd_error err = {0};
    pd_store_stats st;
    if (pd_store_stats_get(s, &st, &err) != PD_OK) return store_fail(&err);
    char a[32], b[32];
    printf("prefixes:    %" PRId64 " (%" PRId64 " pinned)\n", st.prefixes, st.pinned);
    printf("stored:      %s (%" PRIu64 " bytes)\n", human_size(st.bytes, a), st.bytes);
    printf("map:         %s used of %s (%.1f%%)\n", human_size(st.map_used, a), human_size(st.map_size, b),
           st.map_size ? 100.0 * (double)st.map_used / (double)st.map_size : 0.0);
    if (st.max_bytes) printf("size limit:  %s\n", human_size(st.max_bytes, a));
    else printf("size limit:  none\n");
    printf("automatic:   %" PRId64 " block%s, %s (%" PRIu64 " bytes; cache.auto_persist)\n", st.auto_blocks,
           st.auto_blocks == 1 ? "" : "s", human_size(st.auto_bytes, a), st.auto_bytes);
    return 0;
}

int pd_store_cli(int argc, char **argv) {
    const char *dir = NULL;
    const char *pos[3] = {NULL, NULL, NULL};
    int n_pos = 0;
    bool repair = false;
    uint64_t map_mb = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            store_usage(stdout);
            return 0;
        } else if (strcmp(a, "--dir") == 0 || strcmp(a, "--map-size-mb") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "prefixctl store: %s needs a value\n", a);
                return 2;
            }
            const char *v = argv[++i];
            if (a[2] == 'd') {
                dir = v;
            } else {
                char *end = NULL;
                unsigned long long mb = strtoull(v, &end, 10);
                if (!*v || *end || mb == 0 || mb > (UINT64_MAX >> 20)) {
                    fprintf(stderr, "prefixctl store: --map-size-mb wants a positive number of MiB, not \"%s\"\n", v);
                    return 2;
                }
                map_mb = mb;
            }
        } else if (strncmp(a, "--dir=", 6) == 0) {
            dir = a + 6;
        } else if (strcmp(a, "--repair") == 0) {
            repair = true;
        } else if (a[0] == '-' && a[1]) {
            fprintf(stderr, "prefixctl store: unknown option %s\n", a);
            store_usage(stderr);
            return 2;
        } else if (n_pos < 3) {
            pos[n_pos++] = a;
        } else {
            fprintf(stderr, "prefixctl store: too many arguments\n");
            return 2;
        }
    }
    if (!dir || !*dir) {
        fputs("prefixctl store: --dir DIR is required (the store's directory, cache.path in the config)\n", stderr);
        store_usage(stderr);
        return 2;
    }
    if (n_pos == 0) {
        fputs("prefixctl store: no command given\n", stderr);
        store_usage(stderr);
        return 2;
    }
    const char *cmd = pos[0];
    bool wants_id = strcmp(cmd, "show") == 0 || strcmp(cmd, "delete") == 0 || strcmp(cmd, "pin") == 0 ||
                    strcmp(cmd, "unpin") == 0;
    if (strcmp(cmd, "salvage") == 0) {
        if (n_pos != 2) {
            fputs("prefixctl store salvage: expected exactly one NEW_DIR (where the new store goes)\n", stderr);
            return 2;
        }
        return cmd_salvage(dir, pos[1], map_mb);
    }
    bool no_arg = strcmp(cmd, "list") == 0 || strcmp(cmd, "verify") == 0 || strcmp(cmd, "stats") == 0;
    if (!wants_id && !no_arg) {
        fprintf(stderr, "prefixctl store: unknown command \"%s\"\n", cmd);
        store_usage(stderr);
        return 2;
    }
    if (wants_id && n_pos != 2) {
        fprintf(stderr, "prefixctl store %s: expected exactly one ID\n", cmd);
        return 2;
    }
    if (no_arg && n_pos != 1) {
        fprintf(stderr, "prefixctl store %s: unexpected argument \"%s\"\n", cmd, pos[1]);
        return 2;
    }
    if (repair && strcmp(cmd, "verify") != 0) {
        fputs("prefixctl store: --repair goes with verify only\n", stderr);
        return 2;
    }

    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    if (map_mb) o.map_size = map_mb << 20;
    /* Only the commands that change the store open it for writing. */
    o.read_only = !(wants_id && strcmp(cmd, "show") != 0) && !repair;
    pd_store *s = NULL;
    pd_error err = {0};
    if (pd_store_open(&o, &s, &err) != PD_OK) return store_fail(&err);

    int rc;
    pd_prefix_id id;
    if (wants_id && (rc = resolve_id(s, pos[1], &id)) != 0) {
        pd_store_close(s);
        return rc;
    }
    char hex[PD_PREFIX_ID_HEX];
    if (wants_id) pd_prefix_id_hex(&id, hex);
    if (strcmp(cmd, "list") == 0) {
        rc = cmd_list(s);
    } else if (strcmp(cmd, "show") == 0) {
        rc = cmd_show(s, &id);
    } else if (strcmp(cmd, "verify") == 0) {
        rc = cmd_verify(s, repair);
    } else if (strcmp(cmd, "stats") == 0) {
        rc = cmd_stats(s);
    } else if (strcmp(cmd, "delete") == 0) {
        rc = pd_store_delete(s, &id, &err) == PD_OK ? 0 : store_fail(&err);
        if (rc == 0) printf("deleted %s\n", hex);
    } else {
        bool pin = strcmp(cmd, "pin") == 0;
        rc = pd_store_pin(s, &id, pin, &err) == PD_OK ? 0 : store_fail(&err);
        if (rc == 0) printf("%s %s\n", pin ? "pinned" : "unpinned", hex);
    }
    pd_store_close(s);
    return rc;
}

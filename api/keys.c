/* API keys and the namespace each one selects (server.api_key and
 * server.api_keys_file).
 *
 * The file has one `KEY NAMESPACE` pair per line (whitespace separated,
 * `#` starts a comment, a line with a key alone selects namespace ""). It
 * holds secrets, so a file others can read is refused, like ssh does with
 * a private key. Keys are compared in constant time, every key against the
 * presented token, so the time taken says nothing about which key is close. */
#include <errno.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "api/api.h"

#define KEY_MAX 255

typedef struct key_entry {
    char key[KEY_MAX + 1];
    char ns[PD_PREFIX_NS_MAX];
} key_entry;

struct pd_api_keys {
    key_entry *v;
    size_t n;
};

static int add_key(pd_api_keys *k, const char *key, const char *ns, pd_error *err) {
    key_entry *v = realloc(k->v, (k->n + 1) * sizeof *v);
    if (!v) return pd_errorf(err, PD_ENOMEM, "out of memory for API keys");
    k->v = v;
    snprintf(v[k->n].key, sizeof v[k->n].key, "%s", key);
    snprintf(v[k->n].ns, sizeof v[k->n].ns, "%s", ns);
    k->n++;
    return PD_OK;
}

static int load_file(pd_api_keys *k, const char *path, pd_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) return pd_errorf(err, PD_EIO, "server.api_keys_file '%s': %s", path, strerror(errno));
    struct stat st;
    int rc = PD_OK;
    if (fstat(fileno(f), &st) != 0) {
        rc = pd_errorf(err, PD_EIO, "server.api_keys_file '%s': %s", path, strerror(errno));
        goto done;
    }
    if (st.st_mode & 077) {
        rc = pd_errorf(err, PD_EINVAL,
                       "server.api_keys_file '%s' is readable by %s (mode %04o) and holds secrets: chmod 600 it "
                       "(owned by the service user)",
                       path, st.st_mode & 004 ? "everyone" : "its group", (unsigned)(st.st_mode & 07777));
        goto done;
    }
    char line[1024];
    for (int no = 1; !rc && fgets(line, sizeof line, f); no++) {
        if (!strchr(line, '\n') && !feof(f)) {
            rc = pd_errorf(err, PD_EINVAL, "%s:%d: the line is longer than %zu bytes", path, no, sizeof line - 2);
            break;
        }
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char *save = NULL, *key = strtok_r(line, " \t\r\n", &save);
        if (!key) continue;
        char *ns = strtok_r(NULL, " \t\r\n", &save), *extra = strtok_r(NULL, " \t\r\n", &save);
        if (extra)
            rc = pd_errorf(err, PD_EINVAL, "%s:%d: expected 'KEY NAMESPACE', found a third field", path, no);
        else if (strlen(key) > KEY_MAX)
            rc = pd_errorf(err, PD_EINVAL, "%s:%d: the key is longer than %d bytes", path, no, KEY_MAX);
        else if (ns && strlen(ns) >= PD_PREFIX_NS_MAX)
            rc = pd_errorf(err, PD_EINVAL, "%s:%d: the namespace is longer than %d bytes", path, no,
                           PD_PREFIX_NS_MAX - 1);
        else
            for (size_t i = 0; i < k->n && !rc; i++)
                if (strcmp(k->v[i].key, key) == 0)
                    rc = pd_errorf(err, PD_EINVAL, "%s:%d: the key is listed twice", path, no);
        if (!rc) rc = add_key(k, key, ns ? ns : "", err);
    }
    if (!rc && ferror(f)) rc = pd_errorf(err, PD_EIO, "reading server.api_keys_file '%s' failed", path);
    if (!rc && k->n == 0) rc = pd_errorf(err, PD_EINVAL, "server.api_keys_file '%s' lists no key", path);
done:
    fclose(f);
    return rc;
}

int pd_api_keys_load(const char *api_key, const char *keys_file, pd_api_keys **out, pd_error *err) {
    *out = NULL;
    pd_api_keys *k = calloc(1, sizeof *k);
    if (!k) return pd_errorf(err, PD_ENOMEM, "out of memory for API keys");
    int rc = PD_OK;
    if (api_key && api_key[0]) {
        if (strlen(api_key) > KEY_MAX) rc = pd_errorf(err, PD_EINVAL, "server.api_key is longer than %d bytes", KEY_MAX);
        else rc = add_key(k, api_key, "", err);
    }
    if (!rc && keys_file && keys_file[0]) rc = load_file(k, keys_file, err);
    if (rc) {
        pd_api_keys_free(k);
        return rc;
    }
    *out = k;
    return PD_OK;
}

void pd_api_keys_free(pd_api_keys *k) {
    if (!k) return;
    if (k->v) OPENSSL_cleanse(k->v, k->n * sizeof *k->v);
    free(k->v);
    free(k);
}

bool pd_api_keys_required(const pd_api_keys *k) { return k && k->n > 0; }

const char *pd_api_keys_match(const pd_api_keys *k, const char *token) {
    if (!k || !token) return NULL;
    const size_t n = strlen(token);
    const char *ns = NULL;
    for (size_t i = 0; i < k->n; i++) { /* no early exit: every key costs the same */
        const size_t m = strlen(k->v[i].key);
        const bool same = n == m && CRYPTO_memcmp(token, k->v[i].key, n) == 0;
        if (same && !ns) ns = k->v[i].ns;
    }
    return ns;
}

#include "util.h"

#include <openssl/evp.h>

int pd_sha256_init(pd_sha256 *h, pd_error *err) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return pd_errorf(err, PD_ENOMEM, "sha256: cannot allocate an OpenSSL digest context");
    if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return pd_errorf(err, PD_EIO, "sha256: OpenSSL refused to initialise SHA-256");
    }
    h->evp = ctx;
    return PD_OK;
}

void pd_sha256_update(pd_sha256 *h, const void *data, size_t len) {
    if (len) EVP_DigestUpdate((EVP_MD_CTX *)h->evp, data, len);
}

void pd_sha256_final(pd_sha256 *h, uint8_t out[PD_SHA256_LEN]) {
    unsigned int n = 0;
    EVP_DigestFinal_ex((EVP_MD_CTX *)h->evp, out, &n);
    EVP_MD_CTX_free((EVP_MD_CTX *)h->evp);
    h->evp = NULL;
}

int pd_sha256_buf(const void *data, size_t len, uint8_t out[PD_SHA256_LEN], pd_error *err) {
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) return rc;
    pd_sha256_update(&h, data, len);
    pd_sha256_final(&h, out);
    return PD_OK;
}

void pd_hex(const uint8_t *bytes, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * n] = '\0';
}

/* Small Unicode helpers shared by the tokenizers: UTF-8 coding, the
 * whitespace set llama.cpp uses, and GPT-2's byte <-> code point map. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

int32_t tk_utf8_decode(const unsigned char *s, size_t n, size_t *i) {
    size_t p = *i;
    unsigned c = s[p];
    if (c < 0x80) {
        *i = p + 1;
        return (int32_t)c;
    }
    size_t need;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) need = 1, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) need = 2, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) need = 3, cp = c & 0x07, min = 0x10000;
    else {
        *i = p + 1;
        return -1;
    }
    if (p + need >= n) { /* truncated */
        *i = p + 1;
        return -1;
    }
    for (size_t k = 1; k <= need; k++) {
        unsigned cc = s[p + k];
        if ((cc & 0xC0) != 0x80) {
            *i = p + 1;
            return -1;
        }
        cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        *i = p + 1;
        return -1;
    }
    *i = p + need + 1;
    return (int32_t)cp;
}

size_t tk_utf8_encode(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | ((cp >> 18) & 0x07));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

bool tk_is_whitespace(uint32_t cp) {
    if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
    if (cp < 0x85) return false;
    switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F:
    case 0x3000:
        return true;
    default:
        return cp >= 0x2000 && cp <= 0x200A;
    }
}

/* GPT-2 maps the printable bytes !..~, ¡..¬ and ®..ÿ to themselves and the
 * other 68 bytes, in order, to U+0100.. */
static bool byte_is_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tk_byte_to_cp(uint8_t b) {
    if (byte_is_printable(b)) return b;
    /* count the non-printable bytes below b */
    unsigned n;
    if (b <= 0x20) n = b;                      /* 0x00..0x20: 33 bytes */
    else if (b <= 0xA0) n = 33 + (b - 0x7F);   /* 0x7F..0xA0: 34 bytes */
    else n = 33 + 34;                          /* 0xAD */
    return 256 + n;
}

int tk_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    unsigned n = cp - 256;
    if (n < 33) return (int)n;
    if (n < 67) return (int)(0x7F + (n - 33));
    return 0xAD;
}

int32_t tk_split_symbols(const char *s, size_t len, tk_sym *sym) {
    int32_t n_sym = 0;
    for (size_t off = 0; off < len;) {
        size_t cl = tk_utf8_len((unsigned char)s[off]);
        if (cl > len - off) cl = len - off;
        sym[n_sym].off = (uint32_t)off;
        sym[n_sym].n = (uint32_t)cl;
        sym[n_sym].prev = n_sym - 1;
        off += cl;
        sym[n_sym].next = off == len ? -1 : n_sym + 1;
        n_sym++;
    }
    return n_sym;
}

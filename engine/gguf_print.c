/* Human-readable dump of a GGUF file (prefixctl inspect). */
#include "engine/engine.h"

#include <inttypes.h>
#include <stdio.h>

#define MAX_STRING_SHOWN 200

static void print_str(FILE *f, const pd_str *s) {
    fputc('"', f);
    uint64_t shown = s->len < MAX_STRING_SHOWN ? s->len : MAX_STRING_SHOWN;
    for (uint64_t i = 0; i < shown; i++) {
        unsigned char ch = (unsigned char)s->ptr[i];
        if (ch == '"' || ch == '\\') fprintf(f, "\\%c", ch);
        else if (ch == '\n') fputs("\\n", f);
        else if (ch == '\t') fputs("\\t", f);
        else if (ch < 0x20 || ch == 0x7f) fprintf(f, "\\x%02x", ch);
        else fputc(ch, f); /* UTF-8 passes through */
    }
    fputc('"', f);
    if (shown < s->len) fprintf(f, "... (%" PRIu64 " bytes)", s->len);
}

static void print_value(FILE *f, const pd_gguf_value *v, size_t max_items);

static void print_array(FILE *f, const pd_gguf_value *v, size_t max_items) {
    uint64_t n = v->arr.n, shown = n < max_items ? n : max_items;
    fprintf(f, "[%s x %" PRIu64 "] [", pd_gguf_vtype_name(v->arr.elem_type), n);
    for (uint64_t i = 0; i < shown; i++) {
        if (i) fputs(", ", f);
        switch (v->arr.elem_type) {
        case PD_GGUF_STRING: print_str(f, &v->arr.strs[i]); break;
        case PD_GGUF_ARRAY: print_value(f, &v->arr.items[i], max_items); break;
        case PD_GGUF_FLOAT32: fprintf(f, "%g", pd_gguf_arr_f32(v, i)); break;
        case PD_GGUF_FLOAT64: {
            double d;
            __builtin_memcpy(&d, v->arr.data + 8 * i, 8);
            fprintf(f, "%g", d);
            break;
        }
        case PD_GGUF_BOOL: fputs(pd_gguf_arr_int(v, i) ? "true" : "false", f); break;
        case PD_GGUF_UINT64: fprintf(f, "%" PRIu64, (uint64_t)pd_gguf_arr_int(v, i)); break;
        default: fprintf(f, "%" PRId64, pd_gguf_arr_int(v, i)); break;
        }
    }
    if (shown < n) fprintf(f, ", ... %" PRIu64 " more", n - shown);
    fputc(']', f);
}

static void print_value(FILE *f, const pd_gguf_value *v, size_t max_items) {
    switch (v->type) {
    case PD_GGUF_UINT8: case PD_GGUF_UINT16: case PD_GGUF_UINT32: case PD_GGUF_UINT64:
        fprintf(f, "%" PRIu64, v->u);
        break;
    case PD_GGUF_INT8: case PD_GGUF_INT16: case PD_GGUF_INT32: case PD_GGUF_INT64:
        fprintf(f, "%" PRId64, v->i);
        break;
    case PD_GGUF_FLOAT32: case PD_GGUF_FLOAT64: fprintf(f, "%g", v->f); break;
    case PD_GGUF_BOOL: fputs(v->u ? "true" : "false", f); break;
    case PD_GGUF_STRING: print_str(f, &v->str); break;
    case PD_GGUF_ARRAY: print_array(f, v, max_items); break;
    default: fputs("?", f); break;
    }
}

void pd_gguf_print(const pd_gguf *g, void *file, size_t max_array_items) {
    FILE *f = file;
    uint8_t fp[PD_SHA256_LEN];
    char hex[2 * PD_SHA256_LEN + 1];
    pd_gguf_fingerprint(g, fp);
    pd_hex(fp, sizeof fp, hex);

    uint64_t total_elems = 0, total_bytes = 0;
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        total_elems += pd_gguf_tensor_at(g, i)->n_elems;
        total_bytes += pd_gguf_tensor_at(g, i)->n_bytes;
    }
    fprintf(f, "GGUF version %" PRIu32 ", %zu metadata keys, %zu tensors\n", pd_gguf_version(g),
            pd_gguf_kv_count(g), pd_gguf_tensor_count(g));
    fprintf(f, "file size %" PRIu64 " bytes, alignment %" PRIu64 ", data at offset %" PRIu64 "\n",
            pd_gguf_file_size(g), pd_gguf_alignment(g), pd_gguf_data_offset(g));
    fprintf(f, "parameters %" PRIu64 " (%" PRIu64 " bytes of tensor data)\n", total_elems, total_bytes);
    fprintf(f, "fingerprint %s\n", hex);

    fputs("\nmetadata:\n", f);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        fprintf(f, "  %-44s %-4s ", kv->key, pd_gguf_vtype_name(kv->value.type));
        print_value(f, &kv->value, max_array_items);
        fputc('\n', f);
    }

    fputs("\ntensors:\n", f);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        const pd_type_traits *tr = pd_type_get(t->type);
        char shape[128];
        int len = 0;
        for (uint32_t d = 0; d < t->n_dims; d++)
            len += snprintf(shape + len, sizeof shape - (size_t)len, "%s%" PRIu64, d ? " x " : "", t->ne[d]);
        fprintf(f, "  %-40s %-5s [%s] offset %" PRIu64 " bytes %" PRIu64 "\n", t->name, tr ? tr->name : "?",
                shape, t->offset, t->n_bytes);
    }
}

/* The element-type table: what GGUF calls each type and how it is laid out. */
#include "kernels/kernels.h"

#include <strings.h>

static const pd_type_traits type_table[PD_TYPE_COUNT] = {
    [PD_TYPE_F32] = {"f32", 1, 4, true, true},
    [PD_TYPE_F16] = {"f16", 1, 2, true, true},
    [PD_TYPE_Q4_0] = {"q4_0", 32, 18, true, true},
    [PD_TYPE_Q4_1] = {"q4_1", 32, 20, true, true},
    [PD_TYPE_Q5_0] = {"q5_0", 32, 22, true, true},
    [PD_TYPE_Q5_1] = {"q5_1", 32, 24, true, true},
    [PD_TYPE_Q8_0] = {"q8_0", 32, 34, true, true},
    [PD_TYPE_Q8_1] = {"q8_1", 32, 36, false, false},
    [PD_TYPE_Q2_K] = {"q2_k", PD_QK_K, 84, true, true},
    [PD_TYPE_Q3_K] = {"q3_k", PD_QK_K, 110, true, true},
    [PD_TYPE_Q4_K] = {"q4_k", PD_QK_K, 144, true, true},
    [PD_TYPE_Q5_K] = {"q5_k", PD_QK_K, 176, true, true},
    [PD_TYPE_Q6_K] = {"q6_k", PD_QK_K, 210, true, true},
    [PD_TYPE_Q8_K] = {"q8_k", PD_QK_K, 292, false, false},
    [PD_TYPE_IQ2_XXS] = {"iq2_xxs", PD_QK_K, 66, false, false},
    [PD_TYPE_IQ2_XS] = {"iq2_xs", PD_QK_K, 74, false, false},
    [PD_TYPE_IQ3_XXS] = {"iq3_xxs", PD_QK_K, 98, false, false},
    [PD_TYPE_IQ1_S] = {"iq1_s", PD_QK_K, 50, false, false},
    [PD_TYPE_IQ4_NL] = {"iq4_nl", 32, 18, true, true},
    [PD_TYPE_IQ3_S] = {"iq3_s", PD_QK_K, 110, false, false},
    [PD_TYPE_IQ2_S] = {"iq2_s", PD_QK_K, 82, false, false},
    [PD_TYPE_IQ4_XS] = {"iq4_xs", PD_QK_K, 136, true, true},
    [PD_TYPE_I8] = {"i8", 1, 1, false, false},
    [PD_TYPE_I16] = {"i16", 1, 2, false, false},
    [PD_TYPE_I32] = {"i32", 1, 4, false, false},
    [PD_TYPE_I64] = {"i64", 1, 8, false, false},
    [PD_TYPE_F64] = {"f64", 1, 8, false, false},
    [PD_TYPE_IQ1_M] = {"iq1_m", PD_QK_K, 56, false, false},
    [PD_TYPE_BF16] = {"bf16", 1, 2, true, true},
    [31] = {"q4_0_4_4", 32, 18, false, false},
    [32] = {"q4_0_4_8", 32, 18, false, false},
    [33] = {"q4_0_8_8", 32, 18, false, false},
    [PD_TYPE_TQ1_0] = {"tq1_0", PD_QK_K, 54, false, false},
    [PD_TYPE_TQ2_0] = {"tq2_0", PD_QK_K, 66, false, false},
    [36] = {"iq4_nl_4_4", 32, 18, false, false},
    [37] = {"iq4_nl_4_8", 32, 18, false, false},
    [38] = {"iq4_nl_8_8", 32, 18, false, false},
};

const pd_type_traits *pd_type_get(uint32_t type) {
    if (type >= PD_TYPE_COUNT || !type_table[type].name) return NULL;
    return &type_table[type];
}

int pd_type_from_name(const char *name, pd_type *out, pd_error *err) {
    for (uint32_t t = 0; t < PD_TYPE_COUNT; t++) {
        if (type_table[t].name && strcasecmp(type_table[t].name, name) == 0) {
            *out = (pd_type)t;
            return PD_OK;
        }
    }
    return pd_errorf(err, PD_ENOTFOUND,
                     "unknown tensor type '%s' (known: f32, f16, bf16, q8_0, q4_0, q4_k, q6_k, ...)",
                     name);
}

int pd_type_row_size(pd_type t, uint64_t n, uint64_t *out, pd_error *err) {
    const pd_type_traits *tr = pd_type_get((uint32_t)t);
    if (!tr) return pd_errorf(err, PD_EINVAL, "unknown tensor type id %u", (unsigned)t);
    if (n % tr->block_size != 0)
        return pd_errorf(err, PD_EFORMAT, "%llu elements is not a multiple of the %s block size %u",
                         (unsigned long long)n, tr->name, tr->block_size);
    if (!pd_mul_ok(n / tr->block_size, tr->type_size, out))
        return pd_errorf(err, PD_ERANGE, "%llu elements of %s overflow 64 bits", (unsigned long long)n,
                         tr->name);
    return PD_OK;
}

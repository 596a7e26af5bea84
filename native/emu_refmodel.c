/* The reference model's loops over a vocabulary and over an embedding row (see
 * emu_refmodel.h). */
#include "emu_refmodel.h"

void ref_logits_row(uint32_t h, uint16_t *row, size_t vocab) {
    for (size_t v = 0; v < vocab; v++)
        row[v] = ref_logit_bf16(h, (uint32_t)v);
}

uint32_t ref_embed_word(const uint8_t *row, size_t nbytes) {
    uint32_t sum = 0;
    for (size_t i = 0; i < nbytes; i++)
        sum += ref_fmix32((uint32_t)i * 256u + row[i]);
    return ref_fmix32(sum);
}

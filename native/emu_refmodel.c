/* The reference model's vocabulary-wide loop (see emu_refmodel.h). */
#include "emu_refmodel.h"

void ref_logits_row(uint32_t h, uint16_t *row, size_t vocab) {
    for (size_t v = 0; v < vocab; v++)
        row[v] = ref_logit_bf16(h, (uint32_t)v);
}

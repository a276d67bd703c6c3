/* engine: model files (GGUF), tokenizers, models and the forward pass, chat
 * templates, sampling and generation.
 *
 * The folder's public contract, in parts a reader can hold; include the
 * part you need, or this file for all of them. Nothing outside engine/
 * includes engine's private headers. */
#ifndef PD_ENGINE_H
#define PD_ENGINE_H

#include "engine/gguf.h"      /* GGUF reader, printer, writer */
#include "engine/tokenizer.h" /* tokenizers */
#include "engine/chat.h"      /* chat templates */
#include "engine/model.h"     /* models, KV caches and prefixes, forward, NLL, perplexity */
#include "engine/sampling.h"  /* sampler, stop strings, generation */

#endif

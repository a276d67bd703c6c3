/* kernels: tensor element types and the compute backends behind them.
 *
 * The folder's public contract, in two parts; include the one you need, or
 * this file for both. The backends' internals (the ops table) are in
 * kernels/backend_impl.h, for kernels/ only. */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H

#include "kernels/types.h"   /* element types, quantization, fp16/bf16, thread pool */
#include "kernels/backend.h" /* the compute backend and its operations */

#endif

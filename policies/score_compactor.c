/* placeholder: filled in by its owner */
#include "policies/policies.h"
typedef int pd_placeholder_score_compactor;

/* placeholder: filled in by its owner */
#include "cache/cache.h"
typedef int pd_placeholder_lookup;

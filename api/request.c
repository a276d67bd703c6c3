/* placeholder: filled in by its owner */
#include "util/util.h"
typedef int pd_placeholder_request;

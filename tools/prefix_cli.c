/* placeholder: filled in by its owner */
#include "tools/tools.h"
typedef int pd_placeholder_prefix_cli;

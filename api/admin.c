/* placeholder: filled in by its owner */
#include "api/api.h"
typedef int pd_placeholder_admin;

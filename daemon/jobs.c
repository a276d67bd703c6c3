/* placeholder: filled in by its owner */
#include "daemon/daemon.h"
typedef int pd_placeholder_jobs;

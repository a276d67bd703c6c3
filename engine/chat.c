/* placeholder: filled in by its owner */
#include "engine/engine.h"
typedef int pd_placeholder_chat;

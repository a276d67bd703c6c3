/* Progress of long CLI work on stderr (pd_progress in tools/tools.h). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tools/tools.h"

#define BAR_WIDTH 30

void pd_progress_init(pd_progress *p) {
    memset(p, 0, sizeof *p);
    p->tty = isatty(STDERR_FILENO) == 1;
    p->shown_pct = -1;
}

void pd_progress_update(pd_progress *p, const char *phase, double fraction) {
    if (!p || !phase) return;
    const bool new_phase = strcmp(p->phase, phase) != 0;
    if (!(fraction >= 0)) fraction = 0; /* NaN too */
    if (fraction > 1) fraction = 1;
    const int pct = (int)(fraction * 100 + 0.5);
    if (p->tty) {
        /* Redraw only when something visible changed (or it was cleared). */
        if (p->drawn && !new_phase && pct == p->shown_pct) return;
        const int k = (int)(fraction * BAR_WIDTH + 0.5);
        fprintf(stderr, "\r[%.*s%*s] %3d%% %-32.32s", k, "##############################", BAR_WIDTH - k, "", pct,
                phase);
        p->drawn = true;
    } else if (new_phase) {
        fprintf(stderr, "%s\n", phase);
    }
    fflush(stderr);
    p->shown_pct = pct;
    snprintf(p->phase, sizeof p->phase, "%s", phase);
}

void pd_progress_end(pd_progress *p) {
    if (!p) return;
    if (p->tty && p->drawn) {
        fputs("\r\033[K", stderr); /* erase the line: what follows is the result */
        fflush(stderr);
    }
    p->drawn = false;
}

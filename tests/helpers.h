/* Shared test helpers: where the real model files are, scratch directories. */
#ifndef PD_TEST_HELPERS_H
#define PD_TEST_HELPERS_H

#include <stdbool.h>
#include <stddef.h>

/* Path of ../shared/models (from $PD_SHARED_MODELS), or NULL when the folder
 * is absent, in which case tests that need it call cr_skip_test(). */
const char *th_shared_models(void);
/* th_shared_models()/rel into buf; returns buf, or NULL if the file is absent. */
const char *th_shared_file(const char *rel, char *buf, size_t cap);
/* A fresh temporary directory (mkdtemp); removed by th_rmtree. */
char *th_mkdtemp(void);
void th_rmtree(const char *dir);
/* Run a shell command, capturing stdout (malloc'd) and the exit status. */
int th_run(const char *cmd, char **out);
/* Skip the running test with a message when the shared models are absent. */
#define TH_REQUIRE_SHARED()                                                                   \
    do {                                                                                      \
        if (!th_shared_models())                                                              \
            cr_skip_test("../shared/models is absent (set PD_SHARED_MODELS); skipping");      \
    } while (0)

#endif

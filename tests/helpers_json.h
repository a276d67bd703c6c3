/* Test helpers for reading the daemon's JSON answers (jansson); apart from
 * helpers.h so suites with names of their own that clash with jansson's do
 * not see it. */
#ifndef PD_TEST_HELPERS_JSON_H
#define PD_TEST_HELPERS_JSON_H

#include <jansson.h>

/* `text` parsed as JSON; fails the test, showing the text, when it is not. */
json_t *th_json_parse(const char *text);
/* The integer at obj.a, or obj.a.b when b is not NULL; fails the test when
 * there is none. */
json_int_t th_json_int(json_t *obj, const char *a, const char *b);

#endif

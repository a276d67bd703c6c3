/* The logger (util.h): one function, emit(), turns a level, a message and
 * fields into a text line, a JSON object or a journal entry. */
#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <systemd/sd-journal.h>
#include <time.h>
#include <unistd.h>

#include "util/util.h"

/* A log line longer than this is cut (a message is one line, not a dump). */
#define LINE_MAX_BYTES 8192
/* The most fields one line carries (an access line has about 16). */
#define FIELDS_MAX 32

bool pd_log_enabled(const pd_logger *lg, pd_log_level level) { return lg && level <= lg->level; }

static const char *level_name(pd_log_level level) {
    switch (level) {
    case PD_LOG_ERROR: return "error";
    case PD_LOG_WARN: return "warn";
    case PD_LOG_INFO: return "info";
    case PD_LOG_DEBUG: return "debug";
    }
    return "info";
}

/* The text format keeps the "prefixd: " lines it has always had; info
 * lines carry no level word. */
static const char *text_level_prefix(pd_log_level level) {
    switch (level) {
    case PD_LOG_ERROR: return "error: ";
    case PD_LOG_WARN: return "warning: ";
    case PD_LOG_DEBUG: return "debug: ";
    case PD_LOG_INFO: break;
    }
    return "";
}

/* syslog priorities, as the journal's PRIORITY field wants them. */
static int journal_priority(pd_log_level level) {
    switch (level) {
    case PD_LOG_ERROR: return 3;
    case PD_LOG_WARN: return 4;
    case PD_LOG_INFO: return 6;
    case PD_LOG_DEBUG: return 7;
    }
    return 6;
}

/* RFC 3339, UTC, milliseconds: 2026-01-02T03:04:05.678Z */
static void timestamp(char *buf, size_t cap) {
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03ldZ", now.tv_nsec / 1000000);
}

static void format_number(const pd_log_field *f, char *buf, size_t cap) {
    if (f->type == PD_LOG_FIELD_INT) snprintf(buf, cap, "%lld", (long long)f->i);
    else snprintf(buf, cap, "%.6g", f->d);
}

/* logfmt: a value with a space, quote, '=' or control byte (or an empty
 * one) is quoted, with \" \\ \n \t and \xNN escapes. */
static void text_value(pd_strbuf *b, const char *v) {
    bool plain = *v != '\0';
    for (const unsigned char *c = (const unsigned char *)v; *c && plain; c++)
        plain = *c > ' ' && *c != '"' && *c != '=' && *c != '\\' && *c != 0x7f;
    if (plain) {
        pd_strbuf_printf(b, "%s", v);
        return;
    }
    pd_strbuf_printf(b, "\"");
    for (const unsigned char *c = (const unsigned char *)v; *c; c++) {
        if (*c == '"' || *c == '\\') pd_strbuf_printf(b, "\\%c", *c);
        else if (*c == '\n') pd_strbuf_printf(b, "\\n");
        else if (*c == '\t') pd_strbuf_printf(b, "\\t");
        else if (*c < ' ' || *c == 0x7f) pd_strbuf_printf(b, "\\x%02x", *c);
        else pd_strbuf_printf(b, "%c", *c);
    }
    pd_strbuf_printf(b, "\"");
}

static void write_line(const pd_logger *lg, const char *line, size_t len) {
    FILE *f = lg->sink ? lg->sink : stderr;
    /* One locked call per line (stdio locks the stream per call). */
    fwrite(line, 1, len, f);
    fflush(f);
}

static void emit_text(const pd_logger *lg, pd_log_level level, const char *msg, const pd_log_field *fields,
                      size_t n) {
    char line[LINE_MAX_BYTES], ts[40], num[48];
    pd_strbuf b = {.buf = line, .cap = sizeof line - 1}; /* room for the newline */
    timestamp(ts, sizeof ts);
    pd_strbuf_printf(&b, "%s prefixd: %s%s", ts, text_level_prefix(level), msg);
    for (size_t i = 0; i < n; i++) {
        const pd_log_field *f = &fields[i];
        if (f->type == PD_LOG_FIELD_STR && !f->s) continue;
        pd_strbuf_printf(&b, " %s=", f->key);
        if (f->type == PD_LOG_FIELD_STR) {
            text_value(&b, f->s);
        } else {
            format_number(f, num, sizeof num);
            pd_strbuf_printf(&b, "%s", num);
        }
    }
    size_t len = b.len < b.cap ? b.len : b.cap - 1;
    line[len++] = '\n';
    write_line(lg, line, len);
}

/* A JSON string of s; bytes that are not valid UTF-8 become '?' (jansson
 * refuses invalid UTF-8, and a log line must not be lost over one byte). */
static json_t *json_text(const char *s) {
    json_t *j = json_string(s);
    if (j) return j;
    char *copy = strdup(s);
    if (!copy) return NULL;
    for (unsigned char *c = (unsigned char *)copy; *c; c++)
        if (*c >= 0x80) *c = '?';
    j = json_string(copy);
    free(copy);
    return j;
}

static void emit_json(const pd_logger *lg, pd_log_level level, const char *msg, const pd_log_field *fields,
                      size_t n) {
    char ts[40];
    timestamp(ts, sizeof ts);
    json_t *o = json_object();
    if (!o) return;
    json_object_set_new(o, "ts", json_string(ts));
    json_object_set_new(o, "level", json_string(level_name(level)));
    json_object_set_new(o, "msg", json_text(msg));
    for (size_t i = 0; i < n; i++) {
        const pd_log_field *f = &fields[i];
        json_t *v = f->type == PD_LOG_FIELD_STR ? (f->s ? json_text(f->s) : NULL)
                    : f->type == PD_LOG_FIELD_INT ? json_integer((json_int_t)f->i)
                                                  : json_real(f->d);
        if (v) json_object_set_new(o, f->key, v);
    }
    char *text = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    json_decref(o);
    if (!text) return;
    size_t len = strlen(text);
    char *line = realloc(text, len + 2);
    if (!line) {
        free(text);
        return;
    }
    line[len++] = '\n';
    line[len] = '\0';
    write_line(lg, line, len);
    free(line);
}

/* journald's native socket (sd_journal_send's; systemd.journal-fields(7)). */
#define JOURNAL_SOCKET "/run/systemd/journal/socket"

bool pd_log_journal_available(void) { return access(JOURNAL_SOCKET, W_OK) == 0; }

/* sd_journal_sendv with one "KEY=value" per field; the text line on the
 * sink when the journal is not there (not under systemd, or in a
 * container without its socket: sd_journal_send then drops the entry and
 * reports success, so the socket is looked for first). */
static void emit_journal(const pd_logger *lg, pd_log_level level, const char *msg, const pd_log_field *fields,
                         size_t n) {
    enum { FIXED = 3 };
    char entries[FIXED + FIELDS_MAX][LINE_MAX_BYTES / 8];
    struct iovec iov[FIXED + FIELDS_MAX];
    size_t k = 0;
    char message[LINE_MAX_BYTES];
    snprintf(message, sizeof message, "MESSAGE=%s", msg);
    iov[k++] = (struct iovec){.iov_base = message, .iov_len = strlen(message)};
    snprintf(entries[k], sizeof entries[k], "PRIORITY=%d", journal_priority(level));
    iov[k] = (struct iovec){.iov_base = entries[k], .iov_len = strlen(entries[k])};
    k++;
    snprintf(entries[k], sizeof entries[k], "SYSLOG_IDENTIFIER=prefixd");
    iov[k] = (struct iovec){.iov_base = entries[k], .iov_len = strlen(entries[k])};
    k++;
    for (size_t i = 0; i < n && i < FIELDS_MAX; i++) {
        const pd_log_field *f = &fields[i];
        if (f->type == PD_LOG_FIELD_STR && !f->s) continue;
        char *e = entries[k];
        size_t cap = sizeof entries[0], len = 0;
        /* Journal field names: upper-case letters, digits and '_'. */
        for (const char *c = f->key; *c && len + 2 < cap; c++)
            e[len++] = isalnum((unsigned char)*c) ? (char)toupper((unsigned char)*c) : '_';
        e[len++] = '=';
        if (f->type == PD_LOG_FIELD_STR) snprintf(e + len, cap - len, "%s", f->s);
        else format_number(f, e + len, cap - len);
        iov[k] = (struct iovec){.iov_base = e, .iov_len = strlen(e)};
        k++;
    }
    if (!pd_log_journal_available() || sd_journal_sendv(iov, (int)k) < 0) emit_text(lg, level, msg, fields, n);
}

void pd_log_fields(const pd_logger *lg, pd_log_level level, const char *msg, const pd_log_field *fields,
                   size_t n) {
    if (!pd_log_enabled(lg, level)) return;
    if (n > FIELDS_MAX) n = FIELDS_MAX;
    switch (lg->format) {
    case PD_LOG_JSON: emit_json(lg, level, msg, fields, n); return;
    case PD_LOG_JOURNAL: emit_journal(lg, level, msg, fields, n); return;
    case PD_LOG_TEXT: break;
    }
    emit_text(lg, level, msg, fields, n);
}

void pd_vlog(const pd_logger *lg, pd_log_level level, const char *fmt, va_list ap) {
    if (!pd_log_enabled(lg, level)) return;
    char msg[LINE_MAX_BYTES / 2];
    vsnprintf(msg, sizeof msg, fmt, ap);
    pd_log_fields(lg, level, msg, NULL, 0);
}

void pd_log(const pd_logger *lg, pd_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pd_vlog(lg, level, fmt, ap);
    va_end(ap);
}

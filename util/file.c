#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Open a regular file; *size 0 is a valid, empty answer. */
static int open_regular(const char *path, int *fd_out, size_t *size, pd_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_errorf(err, PD_EIO, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return pd_errorf(err, PD_EIO, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return pd_errorf(err, PD_EINVAL, "'%s' is not a regular file", path);
    }
    *fd_out = fd;
    *size = (size_t)st.st_size;
    return PD_OK;
}

int pd_map_file(const char *path, pd_mapped_file *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    int fd;
    size_t size;
    int rc = open_regular(path, &fd, &size, err);
    if (rc) return rc;
    if (size == 0) { /* mmap of 0 bytes fails; an empty map is still a valid answer */
        close(fd);
        return PD_OK;
    }
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return pd_errorf(err, PD_EIO, "cannot mmap '%s': %s", path, strerror(e));
    out->data = p;
    out->size = size;
    out->region = p;
    out->region_size = size;
    return PD_OK;
}

#define HUGE_PAGE ((size_t)2 << 20)

int pd_load_file(const char *path, pd_mapped_file *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    int fd;
    size_t size;
    int rc = open_regular(path, &fd, &size, err);
    if (rc) return rc;
    if (size == 0) {
        close(fd);
        return PD_OK;
    }
    /* one huge page of slack to align the start */
    const size_t len = ((size + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)) + HUGE_PAGE;
    void *region = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) {
        int e = errno;
        close(fd);
        return pd_errorf(err, PD_ENOMEM, "cannot allocate %zu MiB to load '%s': %s", size >> 20, path, strerror(e));
    }
    uint8_t *data = (uint8_t *)(((uintptr_t)region + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    (void)madvise(data, len - HUGE_PAGE, MADV_HUGEPAGE); /* advice: fine if the kernel says no */
    for (size_t off = 0; off < size;) {
        const ssize_t r = pread(fd, data + off, size - off, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : 0;
            close(fd);
            munmap(region, len);
            return e ? pd_errorf(err, PD_EIO, "cannot read '%s': %s", path, strerror(e))
                     : pd_errorf(err, PD_EIO, "'%s' shrank while it was read", path);
        }
        off += (size_t)r;
    }
    close(fd);
    if (mprotect(region, len, PROT_READ) != 0) { /* as read-only as a mapping */
        int e = errno;
        munmap(region, len);
        return pd_errorf(err, PD_EIO, "mprotect: %s", strerror(e));
    }
    out->data = data;
    out->size = size;
    out->region = region;
    out->region_size = len;
    out->copied = true;
    return PD_OK;
}

int pd_mapped_file_set_writable(pd_mapped_file *m, bool writable, pd_error *err) {
    if (!m->copied) return pd_errorf(err, PD_EINVAL, "a file mapped from the page cache cannot be written in place");
    if (mprotect(m->region, m->region_size, writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0)
        return pd_errorf(err, PD_EIO, "mprotect: %s", strerror(errno));
    return PD_OK;
}

void pd_unmap_file(pd_mapped_file *m) {
    if (m->region && m->region_size) munmap(m->region, m->region_size);
    memset(m, 0, sizeof *m);
}

int pd_read_stream(void *file, char **out, size_t *len, pd_error *err) {
    FILE *f = file;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf) return pd_errorf(err, PD_ENOMEM, "out of memory reading input");
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return pd_errorf(err, PD_ENOMEM, "out of memory reading input (%zu bytes so far)", n);
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        return pd_errorf(err, PD_EIO, "read error: %s", strerror(errno));
    }
    buf[n] = '\0';
    *out = buf;
    if (len) *len = n;
    return PD_OK;
}

int pd_read_file(const char *path, char **out, size_t *len, pd_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errorf(err, PD_EIO, "cannot open '%s': %s", path, strerror(errno));
    int rc = pd_read_stream(f, out, len, err);
    fclose(f);
    if (rc) pd_error_prefix(err, "%s", path);
    return rc;
}

double pd_now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int pd_map_file(const char *path, pd_mapped_file *out, pd_error *err) {
    out->data = NULL;
    out->size = 0;
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
    if (st.st_size == 0) { /* mmap of 0 bytes fails; an empty map is still a valid answer */
        close(fd);
        return PD_OK;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return pd_errorf(err, PD_EIO, "cannot mmap '%s': %s", path, strerror(e));
    out->data = p;
    out->size = (size_t)st.st_size;
    return PD_OK;
}

void pd_unmap_file(pd_mapped_file *m) {
    if (m->data && m->size) munmap((void *)m->data, m->size);
    m->data = NULL;
    m->size = 0;
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

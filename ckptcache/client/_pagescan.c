/* The loops of a save's pass over its watched storages: the write-protect scans
 * (ckptcache/client/_watch.py says what a scan proves) and the comparison of the partial edge
 * pages of the storages it may skip (ckptcache/client/_unchanged.py says why); this file
 * only loops.
 *
 * A save does both once per watched storage before it copies. From Python that is a call and
 * its arguments' packing per storage, several microseconds each against a kernel walk or a
 * compare of a few: a state of a few hundred watched storages paid milliseconds of its stall
 * for the loops. Here they are C, called through ctypes (which releases the interpreter lock).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>

/* struct pm_scan_arg of <linux/fs.h> (Linux 6.7), spelled out: older headers lack it. */
struct scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct page_region {
    uint64_t start, end, categories;
};

#define SCAN_WP_MATCHING (1ULL << 0)
#define SCAN_CHECK_WPASYNC (1ULL << 1)
#define PAGE_IS_WRITTEN (1ULL << 1)
#define PAGEMAP_SCAN _IOWR('f', 16, struct scan_arg)
#define REGIONS 64

/* Scan each [ranges[2i], ranges[2i+1]) for pages written since its last scan, protecting them
 * again as they are reported. out[3i] is 0, or the errno of a scan that failed (the range then
 * counts as written whole); out[3i+1], out[3i+2] the lowest start and highest end of the pages
 * found written (both 0: none). Returns 0. */
int ckptcache_scan_written(int pagemap, size_t n, const uint64_t *ranges, uint64_t *out)
{
    struct page_region vec[REGIONS];
    for (size_t i = 0; i < n; i++) {
        uint64_t start = ranges[2 * i], end = ranges[2 * i + 1], lo = 0, hi = 0, status = 0;
        for (;;) {
            struct scan_arg arg = {
                .size = sizeof arg, .flags = SCAN_WP_MATCHING | SCAN_CHECK_WPASYNC,
                .start = start, .end = end, .vec = (uint64_t)(uintptr_t)vec,
                .vec_len = REGIONS, .category_mask = PAGE_IS_WRITTEN,
                .return_mask = PAGE_IS_WRITTEN,
            };
            int found = ioctl(pagemap, PAGEMAP_SCAN, &arg);
            if (found < 0) {
                status = (uint64_t)errno;
                break;
            }
            for (int r = 0; r < found; r++) {
                if (lo == 0 && hi == 0)
                    lo = vec[r].start;
                if (vec[r].start < lo)
                    lo = vec[r].start;
                if (vec[r].end > hi)
                    hi = vec[r].end;
            }
            /* The regions' table was full: go on from where the walk stopped. */
            if (arg.walk_end >= end || arg.walk_end <= start)
                break;
            start = arg.walk_end;
        }
        out[3 * i] = status;
        out[3 * i + 1] = status ? 0 : lo;
        out[3 * i + 2] = status ? 0 : hi;
    }
    return 0;
}

/* For each row (the storage's bytes in the segment, the storage's address, its size): whether
 * its partial first and last pages (the bytes before the first and after the last whole page
 * of `page` bytes) equal the segment's there. out[i] is 1 where both are equal. */
void ckptcache_edges_equal(size_t n, const uint64_t *rows, uint8_t *out, uint64_t page)
{
    for (size_t i = 0; i < n; i++) {
        const unsigned char *held = (const unsigned char *)(uintptr_t)rows[3 * i];
        uint64_t address = rows[3 * i + 1], nbytes = rows[3 * i + 2];
        uint64_t start = (address + page - 1) / page * page, end = (address + nbytes) / page * page;
        uint64_t head = start - address, tail = address + nbytes - end;
        out[i] = memcmp(held, (const void *)(uintptr_t)address, head) == 0
                 && memcmp(held + nbytes - tail, (const void *)(uintptr_t)end, tail) == 0;
    }
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagescan",
    "A save's write-protect scans and edge comparisons in one call each (called through "
    "ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__pagescan(void)
{
    return PyModule_Create(&module);
}

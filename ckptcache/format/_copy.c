/* A save's copy into a mapped segment: runs of bytes copied with non-temporal stores.
 *
 * A checkpoint's bytes are written once and not read again by the trainer: ordinary stores
 * first read every destination cache line (read-for-ownership) and then evict the lines the
 * trainer's own data sat in. Streaming stores write whole lines without reading them, so a
 * copy of a state larger than the last-level cache moves about half the memory traffic.
 * glibc's memmove switches to them only for single copies above a threshold derived from the
 * cache size (hundreds of MiB on some VMs); docs/per-tensor-cost.md has the figures.
 *
 * The functions are called through ctypes (which releases the interpreter lock for the call);
 * the module object exists only so that setuptools builds and installs the file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14; older headers lack the name */
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#define CKPT_X86 1
#endif

/* Runs shorter than this are copied by memcpy: the stores of a small run are cheap either way,
 * and a streaming store of a partial line costs more than a cached one. */
#define STREAM_MIN_BYTES (32u << 10)

#ifdef CKPT_X86
__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 128; n -= 128, dst += 128, src += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    memcpy(dst, src, n);
}

static void stream_sse2(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#endif

/* Which copy ckptcache_copy_runs uses here: 2 AVX2 streaming stores, 1 SSE2 streaming
 * stores, 0 memcpy alone (not x86-64). */
int ckptcache_copy_kind(void)
{
#ifdef CKPT_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    return 0;
#endif
}

/* ckptcache_copy_kind(), taken when the module is imported (before any copy thread runs). */
static int copy_kind = -1;

/* Copy ``count`` runs, each three uint64 (destination address, source address, bytes);
 * runs must not overlap. Every store is globally ordered before the function returns (the
 * caller then hands the segment to the daemon, another process). */

void ckptcache_copy_runs(const uint64_t *runs, size_t count)
{
#ifdef CKPT_X86
    int kind = copy_kind >= 0 ? copy_kind : ckptcache_copy_kind();
    int streamed = 0;
#endif
    for (size_t i = 0; i < count; i++) {
        char *dst = (char *)(uintptr_t)runs[3 * i];
        const char *src = (const char *)(uintptr_t)runs[3 * i + 1];
        size_t n = (size_t)runs[3 * i + 2];
#ifdef CKPT_X86
        if (n >= STREAM_MIN_BYTES) {
            if (kind == 2)
                stream_avx2(dst, src, n);
            else
                stream_sse2(dst, src, n);
            streamed = 1;
            continue;
        }
#endif
        memcpy(dst, src, n);
    }
#ifdef CKPT_X86
    if (streamed)
        _mm_sfence(); /* streaming stores are weakly ordered: fence them before returning */
#endif
}

/* Fault in the page tables of [addr, addr + len) ``step`` bytes at a time
 * (MADV_POPULATE_READ): the process's address-space lock is free between steps, so the
 * trainer's mmap and munmap calls do not wait for the whole range, and the loop runs in one
 * ctypes call, without the interpreter lock (a loop in Python took it back between steps,
 * waiting up to a switch interval each time beside a busy thread). ``stop`` (may be NULL) is
 * read before every step: another thread sets it to have the loop end after the step under
 * way (a save that wants the mapping now populates the rest on its copy threads). Returns the
 * bytes populated from ``addr`` on, all of ``len`` unless stopped or refused by the kernel
 * (the rest is then left to fault in when touched). */
size_t ckptcache_populate_until(char *addr, size_t len, size_t step, const volatile int *stop)
{
    size_t done = 0;
    while (done < len) {
        if (stop != NULL && *stop)
            break;
        size_t n = len - done < step ? len - done : step;
        if (madvise(addr + done, n, MADV_POPULATE_READ) != 0)
            break;
        done += n;
    }
    return done;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy",
    "Streaming-store copy of a save's runs, and page tables populated a step at a time "
    "(called through ctypes).", -1, NULL,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    copy_kind = ckptcache_copy_kind();
    return PyModule_Create(&module);
}

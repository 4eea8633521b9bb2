/* A decode step's memory traffic alone: the bytes of a model's products read in the step's pattern, with no
 * arithmetic but a sum, by 2 threads (OpenMP): the ceiling a decode step's products could stream at on this machine.
 * Built and run by benchmarks/bench_step_stream.py (read its docstring).
 *
 * Four ways, interleaved round by round in one process so a slow spell of a shared machine hits each:
 *   products, 4 KiB pages: each product's bytes split in two halves, one per thread, a barrier after each product
 *     (as decode_step.c does), 2 KB software prefetch ahead (as the row kernels do); memory advised NOHUGEPAGE;
 *   products, 2 MiB pages: the same over memory advised MADV_HUGEPAGE (tracer/load/weight_arena.py);
 *   one run, 4 KiB / 2 MiB pages: all the bytes as one array, halved between the threads, no barrier.
 * argv: rounds, then the product sizes in bytes (a step's order). Prints one line per way: median and p10 ms and
 * GB/s, then this process's AnonHugePages. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE (2u << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* bytes [a, b) of w (a, b multiples of 32) folded into acc by integer adds, 128 bytes a round into four independent
   accumulators, prefetching 2 KB ahead. Four integer chains so that the loop's own latency cannot be what is timed:
   one fp32 add chain allows ~32 bytes per 3 cycles a core, near what a fast machine's memory delivers (Zen 5 VM,
   2 threads: 49-51 GB/s with it, 51-53 with these; BENCHMARKS "Tenth session"). */
static __m256i sum_range(const uint8_t *w, size_t a, size_t b, __m256i acc) {
    __m256i acc1 = _mm256_setzero_si256(), acc2 = acc1, acc3 = acc1;
    size_t i = a;
    for (; i + 128 <= b; i += 128) {
        _mm_prefetch((const char *)w + i + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)w + i + 2048 + 64, _MM_HINT_T0);
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(w + i)));
        acc1 = _mm256_add_epi32(acc1, _mm256_loadu_si256((const __m256i *)(w + i + 32)));
        acc2 = _mm256_add_epi32(acc2, _mm256_loadu_si256((const __m256i *)(w + i + 64)));
        acc3 = _mm256_add_epi32(acc3, _mm256_loadu_si256((const __m256i *)(w + i + 96)));
    }
    for (; i + 32 <= b; i += 32) acc = _mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(w + i)));
    return _mm256_add_epi32(_mm256_add_epi32(acc, acc1), _mm256_add_epi32(acc2, acc3));
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const int rounds = atoi(argv[1]), n = argc - 2;
    size_t *sizes = malloc(sizeof(size_t) * n), total = 0;
    for (int i = 0; i < n; i++) total += sizes[i] = (size_t)atoll(argv[2 + i]) / 32 * 32;
    const size_t span = (total + (size_t)n * 64 + 2 * HUGE) / HUGE * HUGE;
    uint8_t *base[2];
    size_t *offset = malloc(sizeof(size_t) * n);
    for (int huge = 0; huge < 2; huge++) {
        base[huge] = aligned_alloc(HUGE, span);
        madvise(base[huge], span, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
        memset(base[huge], 1, span);
    }
    size_t at = 0; /* size_t: a 7B step's 3.75 GB would overflow an int */
    for (int i = 0; i < n; i++) { /* back to back, 64-byte aligned, as the arena places them */
        offset[i] = at;
        at = (offset[i] + sizes[i] + 63) / 64 * 64;
    }
    double *seconds[4];
    for (int w = 0; w < 4; w++) seconds[w] = malloc(sizeof(double) * rounds);
    volatile int sink = 0;
    for (int r = 0; r < rounds; r++)
        for (int way = 0; way < 4; way++) {
            const int huge = way & 1, one_run = way >> 1;
            const uint8_t *mem = base[huge];
            const double start = now();
#pragma omp parallel num_threads(2)
            {
                const int t = omp_get_thread_num();
                __m256i acc = _mm256_setzero_si256();
                if (one_run) {
                    const size_t end = offset[n - 1] + sizes[n - 1];
                    acc = sum_range(mem, end * t / 2 / 32 * 32, t ? end : end / 2 / 32 * 32, acc);
                } else {
                    for (int p = 0; p < n; p++) {
                        const size_t half = sizes[p] / 2 / 32 * 32;
                        acc = sum_range(mem + offset[p], t ? half : 0, t ? sizes[p] : half, acc);
#pragma omp barrier
                    }
                }
                int lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, acc);
#pragma omp atomic
                sink += lanes[0];
            }
            seconds[way][r] = now() - start;
        }
    const char *names[4] = {"products, 4 KiB pages", "products, 2 MiB pages", "one run, 4 KiB pages",
                            "one run, 2 MiB pages"};
    for (int w = 0; w < 4; w++) {
        qsort(seconds[w], rounds, sizeof(double), by_value);
        const double med = seconds[w][rounds / 2], p10 = seconds[w][rounds / 10];
        printf("%-22s %.1f MB  median %.2f ms (%.1f GB/s)  p10 %.2f ms (%.1f GB/s)\n", names[w], total / 1e6,
               med * 1e3, total / med / 1e9, p10 * 1e3, total / p10 / 1e9);
    }
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (f != NULL && fgets(line, sizeof line, f))
        if (strncmp(line, "AnonHugePages:", 14) == 0) fputs(line, stdout);
    return 0;
}

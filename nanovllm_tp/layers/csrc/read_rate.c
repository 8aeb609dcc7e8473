/* The machine's read rate, for bench/bandwidth.py: every thread streams its own contiguous share of a buffer many
 * times the last-level cache, 256 bytes a step into four independent vector accumulators (no arithmetic chain to
 * wait on); the Python side times calls over a few stream counts and prefetch distances and keeps the best. A
 * torch sum (the earlier measure) reads through its reduction and its own thread split: on an AMD EPYC with two
 * threads it read 30-32 GB/s where this reads 34-36. GCC's vector extension: the compiler's widest vectors for
 * -march=native, no intrinsics, so it builds on any CPU.
 */
#include <stdint.h>
#include <string.h>

typedef uint64_t lanes __attribute__((vector_size(64), aligned(1)));

#define STREAM_MAX 16

/* XOR of the buffer's 64-byte lines into one word (so that no read is optimised away). Each of `threads` threads
 * takes a contiguous share and reads it as `streams` (1..STREAM_MAX) equal parts side by side, 256 bytes of each
 * in turn: on an AMD EPYC (Zen 4) two threads read 33-35 GB/s as 4-8 streams each against 30-32 as one, the
 * hardware prefetchers following several streams at once. `ahead` > 0 also prefetches each stream that many bytes
 * in front into L2 (the linear kernels' hint). Bytes past the last whole 256 of each part are not read. */
uint64_t read_stream(const uint8_t *buf, int64_t bytes, int threads, int streams, int64_t ahead)
{
    uint64_t result = 0;
    const int64_t steps = bytes / 256;
    streams = streams < 1 ? 1 : streams > STREAM_MAX ? STREAM_MAX : streams;
    #pragma omp parallel num_threads(threads) reduction(^ : result)
    {
        int id = 0, count = 1;
#ifdef _OPENMP
        extern int omp_get_thread_num(void), omp_get_num_threads(void);
        id = omp_get_thread_num();
        count = omp_get_num_threads();
#endif
        const int64_t first = steps * id / count, last = steps * (id + 1) / count, per = (last - first) / streams;
        lanes a = {0}, b = {0}, c = {0}, d = {0};
        for (int64_t s = 0; s < per; s++)
            for (int j = 0; j < streams; j++) {
                const uint8_t *p = buf + (first + j * per + s) * 256;
                if (ahead)
                    for (int line = 0; line < 256; line += 64) __builtin_prefetch(p + ahead + line, 0, 2);
                lanes v0, v1, v2, v3;
                memcpy(&v0, p, 64);
                memcpy(&v1, p + 64, 64);
                memcpy(&v2, p + 128, 64);
                memcpy(&v3, p + 192, 64);
                a ^= v0, b ^= v1, c ^= v2, d ^= v3;
            }
        a ^= b ^ c ^ d;
        for (int i = 0; i < 8; i++) result ^= a[i];
    }
    return result;
}

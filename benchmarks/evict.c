/* Cache eviction for benchmarks/ggml_side_by_side.py (built by it with the
 * system C compiler into its cache directory; never part of torch_bq).
 *
 * Reading a buffer larger than the last-level cache does not reliably evict a
 * weight that was read many times before: on a Zen 5 a 64 MiB read left most of
 * an 8 MiB weight in its 32 MiB L3 (a call took 164-186 us against 160 us warm
 * and 248 us after this eviction). A decode step reads each layer's weight once
 * per token from memory, so the benchmark evicts every weight line by line.
 */
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Writes back and invalidates the cache lines of [p, p + n) in every level; 0 where this
 * CPU architecture has no user-level instruction for it (nothing done). */
int bq_evict(const void *p, size_t n) {
  const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63);
  const char *end = (const char *)p + n;
#if defined(__x86_64__) || defined(__i386__)
  for (; line < end; line += 64) _mm_clflush(line);
  _mm_mfence();
  return 1;
#elif defined(__aarch64__)
  for (; line < end; line += 64) __asm__ volatile("dc civac, %0" : : "r"(line) : "memory");
  __asm__ volatile("dsb ish" : : : "memory");
  return 1;
#else
  (void)line;
  (void)end;
  return 0;
#endif
}

/* A small C shim over llama.cpp's ggml, for benchmarks/ggml_side_by_side.py.
 *
 * It is built by that script against a ggml source tree in its cache (never
 * committed), once per ISA, each build statically linked into its own shared
 * library with ggml's symbols hidden, so two builds can be loaded into one
 * Python process and timed in the same run as torch_bq.
 *
 * One handle holds one quantized weight W [N, K] (ggml's q8_0 or mxfp4, put
 * in ggml's CPU "repack" buffer when ggml has a repacked layout for the type
 * on this CPU, as llama.cpp does by default) and, per row count M, a graph
 * y = mul_mat(W, x) with x f32 [M, K]; bq_run computes it once.
 *
 * With huge_pages set, the weight's buffer is advised onto 2 MiB pages before
 * the weight is written into it (what torch's THP_MEM_ALLOC_ENABLE=1 does for
 * torch's own large allocations), so that both sides can be compared on
 * 2 MiB pages as well as on 4 KiB ones.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#define BQ_MAX_GRAPHS 64

typedef struct {
  int64_t m;
  struct ggml_context *ctx;
  ggml_backend_buffer_t buf;
  struct ggml_cgraph *graph;
  struct ggml_tensor *x, *y;
} bq_graph;

typedef struct {
  ggml_backend_t backend;
  struct ggml_context *wctx;
  ggml_backend_buffer_t wbuf;
  struct ggml_tensor *w;
  int64_t n, k;
  int repacked;
  int huge_pages;
  bq_graph graphs[BQ_MAX_GRAPHS];
  int n_graphs;
} bq_handle;

static ggml_backend_buffer_type_t repack_buffer_type(void) {
  ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  if (dev == NULL) return NULL;
  ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
  ggml_backend_dev_get_extra_bufts_t get =
      (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
  if (get == NULL) return NULL;
  for (ggml_backend_buffer_type_t *b = get(dev); b != NULL && *b != NULL; ++b) {
    if (strstr(ggml_backend_buft_name(*b), "REPACK") != NULL) return *b;
  }
  return NULL;
}

/* ISA flags ggml-cpu was compiled with, as a bit set (see ggml_side_by_side.py). */
int bq_isa_flags(void) {
  return (ggml_cpu_has_avx2() << 0) | (ggml_cpu_has_fma() << 1) | (ggml_cpu_has_f16c() << 2) |
         (ggml_cpu_has_avx512() << 3) | (ggml_cpu_has_avx512_vnni() << 4) | (ggml_cpu_has_avx512_bf16() << 5) |
         (ggml_cpu_has_avx_vnni() << 6);
}

/* madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside the buffer; 1 if advised. */
static int advise_huge_pages(ggml_backend_buffer_t buf) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = (uintptr_t)2 << 20;
  const uintptr_t base = (uintptr_t)ggml_backend_buffer_get_base(buf);
  const uintptr_t start = (base + huge - 1) & ~(huge - 1);
  const uintptr_t end = (base + ggml_backend_buffer_get_size(buf)) & ~(huge - 1);
  return end > start && madvise((void *)start, end - start, MADV_HUGEPAGE) == 0;
#else
  (void)buf;
  return 0;
#endif
}

/* type: 0 = q8_0, 1 = mxfp4. w: float32 [n, k] (k a multiple of 32), quantized here. */
void *bq_create(int type, int64_t n, int64_t k, const float *w, int n_threads, int allow_repack, int huge_pages) {
  const enum ggml_type t = type == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_MXFP4;
  bq_handle *h = calloc(1, sizeof *h);
  h->n = n;
  h->k = k;
  h->backend = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(h->backend, n_threads);
  struct ggml_init_params params = {ggml_tensor_overhead() * 2, NULL, true};
  h->wctx = ggml_init(params);
  h->w = ggml_new_tensor_2d(h->wctx, t, k, n);
  ggml_backend_buffer_type_t buft = allow_repack ? repack_buffer_type() : NULL;
  h->wbuf = buft ? ggml_backend_alloc_ctx_tensors_from_buft(h->wctx, buft) : NULL;
  h->repacked = h->wbuf != NULL && h->w->extra != NULL;
  if (h->wbuf != NULL && !h->repacked) {  /* no repacked layout for this type here */
    ggml_backend_buffer_free(h->wbuf);
    h->wbuf = NULL;
    ggml_free(h->wctx);
    h->wctx = ggml_init(params);
    h->w = ggml_new_tensor_2d(h->wctx, t, k, n);
  }
  if (h->wbuf == NULL) h->wbuf = ggml_backend_alloc_ctx_tensors(h->wctx, h->backend);
  h->huge_pages = huge_pages && advise_huge_pages(h->wbuf);
  const size_t bytes = ggml_row_size(t, k) * (size_t)n;
  void *q = malloc(bytes);
  ggml_quantize_chunk(t, w, q, 0, n, k, NULL);
  ggml_backend_tensor_set(h->w, q, 0, bytes);  /* repacks when the buffer is the repack type */
  free(q);
  return h;
}

int bq_repacked(void *handle) { return ((bq_handle *)handle)->repacked; }

int bq_huge_pages(void *handle) { return ((bq_handle *)handle)->huge_pages; }

/* The weight's buffer (ggml's repacked layout where it has one), for the caller to evict. */
void bq_weight_buffer(void *handle, void **base, size_t *size) {
  bq_handle *h = handle;
  *base = ggml_backend_buffer_get_base(h->wbuf);
  *size = ggml_backend_buffer_get_size(h->wbuf);
}

static bq_graph *graph_for(bq_handle *h, int64_t m) {
  for (int i = 0; i < h->n_graphs; ++i)
    if (h->graphs[i].m == m) return &h->graphs[i];
  if (h->n_graphs == BQ_MAX_GRAPHS) return NULL;
  bq_graph *g = &h->graphs[h->n_graphs++];
  struct ggml_init_params params = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
  g->m = m;
  g->ctx = ggml_init(params);
  g->x = ggml_new_tensor_2d(g->ctx, GGML_TYPE_F32, h->k, m);
  g->y = ggml_mul_mat(g->ctx, h->w, g->x);
  g->graph = ggml_new_graph(g->ctx);
  ggml_build_forward_expand(g->graph, g->y);
  g->buf = ggml_backend_alloc_ctx_tensors(g->ctx, h->backend);
  return g;
}

/* x: float32 [m, k]; copied into the graph's input (untimed by the caller). */
int bq_set_input(void *handle, int64_t m, const float *x) {
  bq_graph *g = graph_for(handle, m);
  if (g == NULL) return -1;
  ggml_backend_tensor_set(g->x, x, 0, ggml_nbytes(g->x));
  return 0;
}

/* One y = W x for the m-row graph (the timed call). */
int bq_run(void *handle, int64_t m) {
  bq_handle *h = handle;
  bq_graph *g = graph_for(h, m);
  if (g == NULL) return -1;
  return ggml_backend_graph_compute(h->backend, g->graph) == GGML_STATUS_SUCCESS ? 0 : -2;
}

/* y: float32 [m, n] from the last bq_run of the m-row graph. */
int bq_get_output(void *handle, int64_t m, float *y) {
  bq_graph *g = graph_for(handle, m);
  if (g == NULL) return -1;
  ggml_backend_tensor_get(g->y, y, 0, ggml_nbytes(g->y));
  return 0;
}

void bq_free(void *handle) {
  bq_handle *h = handle;
  for (int i = 0; i < h->n_graphs; ++i) {
    ggml_backend_buffer_free(h->graphs[i].buf);
    ggml_free(h->graphs[i].ctx);
  }
  ggml_backend_buffer_free(h->wbuf);
  ggml_free(h->wctx);
  ggml_backend_free(h->backend);
  free(h);
}

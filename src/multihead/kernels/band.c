/* Attention under a relative mask (one that depends on q - kv alone: causal, sliding windows,
 * their intersections), float32, forward only, on the CPU: the native band engine of
 * multihead.kernels.band (`band`), compiled on first use by multihead.kernels.native.
 *
 * Why a kernel of our own: a sliding window keeps a narrow band of the (T, S) scores, and
 * torch's flash kernel can only be handed rectangles of it (the fused tile engine's band
 * calls), with its per-call allocations and a merge of the pieces' outputs; the band is
 * compute-bound and every query block's keys stay in the L2, so one pass per block that
 * holds its accumulators in L1 and skips whole tiles the mask hides runs at the FMA rate and
 * gives each thread the same kind of work.
 *
 * The layout keeps the query rows in the vector lanes throughout, so the online softmax never
 * reduces across lanes: per block of BQ = RV * VW query rows of one head, Q^T (D, BQ) scaled,
 * then per tile of up to BK keys the scores S^T (keys, BQ) = K Q^T (a key's element broadcast
 * against a row vector of Q^T), the mask where the tile is not whole (a key's allowed rows are
 * a contiguous run of `allowed`: allowed[i - j + S - 1] for row i and key j), the running max
 * and sum per lane, and O^T (D, BQ) += V^T P^T (a value's element broadcast against a vector
 * of P^T). The block ends as O = (O^T)^T / l.
 *
 * Layout: q (B, H, T, D) with element strides per batch row, head and query; k, v (B, Hkv,
 * S, D) with strides per batch row, head and key (every last dim contiguous); out (B, H, T,
 * D) contiguous; `allowed` T + S - 1 bytes, the mask at each q - kv from 1 - T to S - 1
 * (bottom-right aligned: query i sits at position i + S - T, so row i and key j read
 * allowed[i - j + S - 1]).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define RV 4         /* row vectors per query block */
#define BQ (RV * VW) /* query rows per block */
#define BK 64        /* keys per tile */
#define KR 4         /* keys per register tile of the scores: KR x RV accumulators */
#define DR 4         /* value columns per register tile of O^T: DR x RV accumulators */
#define MAXD 256

typedef unsigned char vb __attribute__((vector_size(VW)));

/* A thread's buffers for its blocks (160 KiB at D = 256 with AVX-512: allocated once per thread
 * and call, not on a stack whose size OMP_STACKSIZE may have set small) */
struct work {
  float qT[MAXD * BQ];
  float oT[MAXD * BQ];
  float pT[BK * BQ];
  vi keep[BK][RV];
};

/* One block of rows [i0, i0 + nr) of one head: writes out rows (nr, D) and says whether one
 * of them is not finite or zero throughout (the NaN rule's first look). One function, its
 * passes (scores, mask, softmax, values) in order: split into always-inline parts, GCC gave
 * the same bits a little slower; revisit with a compiler that lays them out alike. */
static inline __attribute__((always_inline)) int block(const float *q, long qt, const float *k, long ks,
                                                       const float *v, long vs, long i0, int nr, long S,
                                                       const int D, float scale, const unsigned char *allowed,
                                                       const long *count, long dlo, long dhi, float *out,
                                                       struct work *w) {
  float *restrict qT = w->qT, *restrict oT = w->oT, *restrict pT = w->pT;
  vi(*keep)[RV] = w->keep;
  vf m[RV], l[RV];
  for (int d = 0; d < D; d++)
    for (int r = 0; r < BQ; r++) qT[d * BQ + r] = r < nr ? q[(i0 + r) * qt + d] * scale : 0.f;
  memset(oT, 0, sizeof(float) * D * BQ);
  for (int rv = 0; rv < RV; rv++) { m[rv] = (vf){0} - INFINITY; l[rv] = (vf){0}; }
  /* the keys some row of the block may attend: j in [i + S - 1 - dhi, i + S - 1 - dlo] */
  const long jlo = i0 + S - 1 - dhi > 0 ? i0 + S - 1 - dhi : 0;
  const long jhi = i0 + nr - 1 + S - 1 - dlo + 1 < S ? i0 + nr - 1 + S - 1 - dlo + 1 : S;
  for (long j0 = jlo; j0 < jhi; j0 += BK) {
    const int c = jhi - j0 < BK ? (int)(jhi - j0) : BK;
    const long lo = i0 - (j0 + c - 1) + S - 1, hi = i0 + nr - 1 - j0 + S - 1; /* the tile's q - kv */
    const long kept = count[hi + 1] - count[lo];
    if (kept == 0) continue;
    const int whole = kept == hi - lo + 1;
    /* scores: KR keys by RV row vectors, a key's element broadcast against Q^T's row vectors */
    int j = 0;
    for (; j + KR <= c; j += KR) {
      vf a[KR][RV];
      for (int t = 0; t < KR; t++)
        for (int rv = 0; rv < RV; rv++) a[t][rv] = (vf){0};
      const float *kj = k + (j0 + j) * ks;
      for (int d = 0; d < D; d++) {
        vf y[RV];
        for (int rv = 0; rv < RV; rv++) y[rv] = ld(qT + d * BQ + rv * VW);
        for (int t = 0; t < KR; t++) {
          const float x = kj[t * ks + d];
          for (int rv = 0; rv < RV; rv++) a[t][rv] += x * y[rv];
        }
      }
      for (int t = 0; t < KR; t++)
        for (int rv = 0; rv < RV; rv++) st(pT + (j + t) * BQ + rv * VW, a[t][rv]);
    }
    for (; j < c; j++) {
      vf a[RV];
      for (int rv = 0; rv < RV; rv++) a[rv] = (vf){0};
      const float *kj = k + (j0 + j) * ks;
      for (int d = 0; d < D; d++)
        for (int rv = 0; rv < RV; rv++) a[rv] += kj[d] * ld(qT + d * BQ + rv * VW);
      for (int rv = 0; rv < RV; rv++) st(pT + j * BQ + rv * VW, a[rv]);
    }
    /* the mask where the tile is not whole: -inf where a row may not attend the key */
    if (!whole)
      for (j = 0; j < c; j++)
        for (int rv = 0; rv < RV; rv++) {
          vb bytes;
          memcpy(&bytes, allowed + i0 + rv * VW - (j0 + j) + S - 1, VW);
          keep[j][rv] = (vi)(__builtin_convertvector(bytes, vi) != 0);
          const vf s = ld(pT + j * BQ + rv * VW);
          st(pT + j * BQ + rv * VW, (vf)(((vi)s & keep[j][rv]) | ((vi)((vf){0} - INFINITY) & ~keep[j][rv])));
        }
    /* the online softmax per lane: a row with no key yet keeps max -inf and weighs its keys 0 */
    vf corr[RV];
    for (int rv = 0; rv < RV; rv++) {
      vf mx = m[rv];
      for (j = 0; j < c; j++) mx = vmax(mx, ld(pT + j * BQ + rv * VW));
      const vi none = (vi)(mx == (vf){0} - INFINITY);
      const vf base = (vf)((vi)mx & ~none); /* 0 where the row has no key: exp(-inf - 0) = 0 */
      corr[rv] = vexp(m[rv] - base);
      corr[rv] = (vf)((vi)corr[rv] & ~(vi)(m[rv] == (vf){0} - INFINITY)); /* nothing summed yet */
      m[rv] = mx;
      vf sum = (vf){0};
      for (j = 0; j < c; j++) {
        vf p = vexp(ld(pT + j * BQ + rv * VW) - base);
        if (!whole) p = (vf)((vi)p & keep[j][rv]); /* exactly 0, not exp(-87) */
        st(pT + j * BQ + rv * VW, p);
        sum += p;
      }
      l[rv] = l[rv] * corr[rv] + sum;
    }
    /* values: DR columns by RV row vectors of O^T, a value's element broadcast against P^T */
    for (int d0 = 0; d0 < D; d0 += DR) {
      vf a[DR][RV];
      for (int t = 0; t < DR; t++)
        for (int rv = 0; rv < RV; rv++) a[t][rv] = ld(oT + (d0 + t) * BQ + rv * VW) * corr[rv];
      for (j = 0; j < c; j++) {
        const float *vj = v + (j0 + j) * vs + d0;
        vf p[RV];
        for (int rv = 0; rv < RV; rv++) p[rv] = ld(pT + j * BQ + rv * VW);
        for (int t = 0; t < DR; t++)
          for (int rv = 0; rv < RV; rv++) a[t][rv] += vj[t] * p[rv];
      }
      for (int t = 0; t < DR; t++)
        for (int rv = 0; rv < RV; rv++) st(oT + (d0 + t) * BQ + rv * VW, a[t][rv]);
    }
  }
  /* out = (O^T)^T / l; a row with no key is 0 (and flagged, as the NaN rule's look would),
   * so is a row whose sum is NaN: flagged, the caller's NaN rule recomputes it */
  float inv[BQ];
  for (int rv = 0; rv < RV; rv++)
    for (int i = 0; i < VW; i++) inv[rv * VW + i] = l[rv][i] > 0.f ? 1.f / l[rv][i] : 0.f;
  int bad = 0;
  for (int r = 0; r < nr; r++) {
    int nonzero = 0;
    for (int d = 0; d < D; d++) {
      const float x = oT[d * BQ + r] * inv[r];
      out[r * D + d] = x;
      nonzero |= x != 0.f;
      bad |= !(x - x == 0.f);
    }
    bad |= !nonzero;
  }
  return bad;
}

static int run(const float *q, long qt, const float *k, long ks, const float *v, long vs, long i0, int nr, long S,
               int D, float scale, const unsigned char *allowed, const long *count, long dlo, long dhi, float *out,
               struct work *w) {
  switch (D) { /* the usual head widths get their own unrolled copy */
  case 32: return block(q, qt, k, ks, v, vs, i0, nr, S, 32, scale, allowed, count, dlo, dhi, out, w);
  case 64: return block(q, qt, k, ks, v, vs, i0, nr, S, 64, scale, allowed, count, dlo, dhi, out, w);
  case 128: return block(q, qt, k, ks, v, vs, i0, nr, S, 128, scale, allowed, count, dlo, dhi, out, w);
  default: return block(q, qt, k, ks, v, vs, i0, nr, S, D, scale, allowed, count, dlo, dhi, out, w);
  }
}

/* The query rows of the kernel's block: a call with fewer rows than this computes padded ones. */
int mh_band_rows(void) { return BQ; }

/* softmax(q k^T * scale, where allowed) v for every head: q (B, H, T, D), k, v (B, Hkv, S,
 * D) by their strides, H a multiple of Hkv, into out (B, H, T, D) contiguous, on `threads`
 * threads (blocks of BQ rows taken in turn). Returns 0; 1 where a row of out is not finite or
 * is zero throughout (the NaN rule's first look, done here); -1 where the arguments are out
 * of what the kernel takes (the caller checks them first: a last guard); -2 where its
 * buffers could not be allocated. */
int mh_band(const float *q, long qb, long qh, long qt, const float *k, long kb, long kh, long ks, const float *v,
            long vb, long vh, long vs, int B, int H, int Hkv, long T, long S, int D, float scale,
            const unsigned char *allowed, float *out, int threads) {
  if (B < 1 || H < 1 || Hkv < 1 || H % Hkv || T < 1 || S < 1 || D <= 0 || D > MAXD || D % DR || threads < 1)
    return -1;
  const long n = T + S - 1;
  /* allowed with BQ zero bytes on each side (the last block's padded rows read past it), and
   * its prefix counts: a tile is whole, empty or neither by one subtraction */
  unsigned char *a = calloc(n + 2 * BQ, 1);
  long *count = malloc(sizeof(long) * (n + 1));
  if (!a || !count) { free(a); free(count); return -2; }
  memcpy(a + BQ, allowed, n);
  long dlo = -1, dhi = -1;
  count[0] = 0;
  for (long i = 0; i < n; i++) {
    count[i + 1] = count[i] + (allowed[i] != 0);
    if (allowed[i]) { if (dlo < 0) dlo = i; dhi = i; }
  }
  const long blocks = (T + BQ - 1) / BQ, items = (long)B * H * blocks;
  int bad = 0, nomem = 0;
  if (dlo < 0) { /* no pair may attend: every row is 0 */
    memset(out, 0, sizeof(float) * B * H * T * D);
    bad = 1;
  } else {
#pragma omp parallel num_threads(threads) reduction(| : bad, nomem)
    {
      struct work *w = aligned_alloc(64, sizeof(struct work));
      nomem |= w == NULL;
#pragma omp for schedule(dynamic, 1)
      for (long it = 0; it < items; it++) {
        const long bh = it / blocks, i0 = (it % blocks) * BQ;
        const int b = (int)(bh / H), h = (int)(bh % H), kvh = h / (H / Hkv);
        const int nr = T - i0 < BQ ? (int)(T - i0) : BQ;
        if (w)
          bad |= run(q + b * qb + h * qh, qt, k + b * kb + kvh * kh, ks, v + b * vb + kvh * vh, vs, i0, nr, S, D,
                     scale, a + BQ, count, dlo, dhi, out + (bh * T + i0) * D, w);
      }
      free(w);
    }
  }
  free(a);
  free(count);
  return nomem ? -2 : bad;
}

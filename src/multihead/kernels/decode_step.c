/* One plain decode step (a few query rows per K/V head, no mask), float32, on the CPU: the
 * native engine of multihead.kernels.decode (`native`), compiled on first use by
 * multihead.kernels.native with the machine's own vector width (-march=native).
 *
 * Why a kernel of our own: the step reads every key and value once and does little with
 * each, so it should run at the memory's streaming rate. torch's flash kernel and the two
 * BLAS calls of the `gemm` engine spend more time per byte than the memory needs on some
 * cores (the V pass `(G, S) @ (S, D)` with G = 4 runs a BLAS small-M kernel that copies its
 * operand), and a step whose compute takes as long as its reads does not hide them. Here a
 * block of CH keys is scored with the G query rows held in L1 and the scores reduced by a
 * shuffle tree, its softmax is folded into a running one (FlashAttention's online softmax),
 * and its values are accumulated with the rows' outputs in registers, while each pass
 * prefetches the K or V rows a few dozen keys on. On one core the reads hide part of the
 * compute, not all of it (docs/benchmarks.md, "The decode kernel's reads and compute").
 *
 * Layout: q (B, H, T, D) with element strides per batch row, head and query (the last dim
 * contiguous), unscaled; the G = H / Hkv * T rows of a K/V head are its query heads' queries,
 * scaled and padded with zero rows to a multiple of 4 in a buffer of the item's own. K and V
 * element strides per batch row, head and key (the last dim contiguous); out (B, H, T, D)
 * contiguous. Items are (batch row, K/V head, key part): with P parts each part writes its
 * normalised output and log-sum-exp to a work buffer and the parts are merged by their
 * log-sum-exp. How many threads and parts: `mh_decode_step`.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "vec.h"

#define KEYS (VW / 4) /* keys scored at once, by 4 query rows: VW sums, one shuffle tree */
#define CH 64         /* keys per block: its K and V rows stay in L1 between the passes */
/* How far ahead each pass prefetches its own stream, in keys (6 KiB of K or V at D = 64,
 * 12 KiB at D = 128). A core's hardware prefetchers do not run far enough ahead of a loop that
 * computes between its reads to keep the memory busy; the prefetches do, and each pass
 * issues them for its own stream so that neither stream goes idle while the other pass runs.
 * Near, not a block or more: a line fetched much earlier than its use is evicted from L1
 * again by the block's other rows before the pass reaches it, and then costs a second read.
 * Measured distances: docs/benchmarks-decode.md, "The third engine". */
#define AHEAD 24
#define MAXG 32
#define MAXD 512

/* merge two vectors of blocks of 2b lanes into one of blocks of b lanes: each block the sum of
 * its halves, x's blocks first; VW vectors merged level by level end as their VW sums in order */
#if VW == 16
#define M1(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                  __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define M2(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define M3(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
                  __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define M4(x, y) (__builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
                  __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
static inline vf sums(const vf *a) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; i++) b[i] = M1(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; i++) c[i] = M2(b[2 * i], b[2 * i + 1]);
  for (int i = 0; i < 2; i++) d[i] = M3(c[2 * i], c[2 * i + 1]);
  return M4(d[0], d[1]);
}
#else
#define M1(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + \
                  __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define M2(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + \
                  __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15))
#define M3(x, y) (__builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + \
                  __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15))
static inline vf sums(const vf *a) {
  vf b[4], c[2];
  for (int i = 0; i < 4; i++) b[i] = M1(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; i++) c[i] = M2(b[2 * i], b[2 * i + 1]);
  return M3(c[0], c[1]);
}
#endif

/* One K/V head over keys [0, S): G rows (a multiple of 4) computed, the first `kept` written
 * to out (kept, D) normalised, their lse to lse[0, kept). Inlined per head width so that D is
 * a constant and every inner loop unrolls with its accumulators in registers. */
static inline __attribute__((always_inline)) void head(const float *q, const float *k, long ks, const float *v,
                                                       long vs, long S, int G, int kept, const int D, float *out,
                                                       float *lse) {
  float acc[MAXG * MAXD] __attribute__((aligned(64)));
  float sc[MAXG][CH] __attribute__((aligned(64)));
  float m[MAXG], l[MAXG];
  const int nd = D / VW;                              /* vectors per row */
  const int cb = nd < 16 ? nd : 16;                   /* vectors per value column block */
  const int rows = 16 / cb > 4 ? 4 : 16 / cb;         /* query rows per value tile: <= 16 accumulators */
  for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
  for (int i = 0; i < G * D; i++) acc[i] = 0.f;
  for (long s0 = 0; s0 < S; s0 += CH) {
    const int c = S - s0 < CH ? (int)(S - s0) : CH;
    const float *kb = k + s0 * ks, *vb = v + s0 * vs;
    /* scores: KEYS keys by 4 rows, VW dot products reduced by one shuffle tree */
    for (int g0 = 0; g0 < G; g0 += 4) {
      const float *q0 = q + (long)g0 * D;
      int j = 0;
      for (; j + KEYS <= c; j += KEYS) {
        if (g0 == 0 && s0 + AHEAD + j + KEYS <= S) /* K rows AHEAD keys on, while this block computes */
          for (int t = 0; t < KEYS; t++)
            for (int i = 0; i < D; i += 16) __builtin_prefetch(kb + (AHEAD + j + t) * ks + i);
        vf a[4 * KEYS];
        for (int t = 0; t < 4 * KEYS; t++) a[t] = (vf){0};
        for (int i = 0; i < D; i += VW) { /* each load feeds 4 FMAs: 4 q and KEYS key vectors */
          vf y[4];
          for (int r = 0; r < 4; r++) y[r] = ld(q0 + r * D + i);
          for (int t = 0; t < KEYS; t++) {
            vf x = ld(kb + (j + t) * ks + i);
            /* one load for the four FMAs: left to itself GCC folds the load into each FMA,
             * four reads of the same vector that compete with the loop's other loads */
            __asm__("" : "+v"(x));
            for (int r = 0; r < 4; r++) a[r * KEYS + t] += x * y[r];
          }
        }
        /* each row's KEYS sums are KEYS adjacent lanes: one copy a row, not a lane at a time */
        float s[VW] __attribute__((aligned(64)));
        st(s, sums(a));
        for (int r = 0; r < 4; r++) __builtin_memcpy(&sc[g0 + r][j], s + r * KEYS, KEYS * sizeof(float));
      }
      for (; j < c; j++)
        for (int r = 0; r < 4; r++) {
          vf a = {0};
          for (int i = 0; i < D; i += VW) a += ld(kb + j * ks + i) * ld(q0 + r * D + i);
          sc[g0 + r][j] = hsum(a);
        }
    }
    /* the online softmax: rescale what is accumulated where the block raises a row's max */
    for (int g = 0; g < G; g++) {
      float mx = m[g];
      int j = 0;
      if (c >= VW) {
        vf vm = ld(&sc[g][0]);
        for (j = VW; j + VW <= c; j += VW) vm = vmax(vm, ld(&sc[g][j]));
        for (int i = 0; i < VW; i++) mx = vm[i] > mx ? vm[i] : mx;
      }
      for (; j < c; j++) mx = sc[g][j] > mx ? sc[g][j] : mx;
      if (mx > m[g]) {
        const float corr = m[g] == -INFINITY ? 0.f : expf(m[g] - mx);
        l[g] *= corr;
        for (int d = 0; d < D; d++) acc[g * D + d] *= corr;
        m[g] = mx;
      }
      mx = m[g];
      vf t = {0};
      j = 0;
      for (; j + VW <= c; j += VW) {
        const vf e = vexp(ld(&sc[g][j]) - mx);
        st(&sc[g][j], e);
        t += e;
      }
      float u = hsum(t);
      for (; j < c; j++) { sc[g][j] = expf(sc[g][j] - mx); u += sc[g][j]; }
      l[g] += u;
    }
    /* values: `rows` rows by `cb` vectors of a value row in registers, the block's rows in order */
    for (int d0 = 0; d0 < D; d0 += cb * VW)
      for (int g0 = 0; g0 < G; g0 += rows) {
        vf a[4][16];
        for (int r = 0; r < rows; r++)
          for (int b = 0; b < cb; b++) a[r][b] = ld(acc + (g0 + r) * D + d0 + b * VW);
        for (int j = 0; j < c; j++) {
          const float *vr = vb + j * vs + d0;
          if (d0 == 0 && g0 == 0 && s0 + AHEAD + j < S) /* and V rows, while its values accumulate */
            for (int i = 0; i < D; i += 16) __builtin_prefetch(vb + (AHEAD + j) * vs + i);
          for (int b = 0; b < cb; b++) {
            const vf x = ld(vr + b * VW);
            for (int r = 0; r < rows; r++) a[r][b] += sc[g0 + r][j] * x;
          }
        }
        for (int r = 0; r < rows; r++)
          for (int b = 0; b < cb; b++) st(acc + (g0 + r) * D + d0 + b * VW, a[r][b]);
      }
  }
  for (int g = 0; g < kept; g++) {
    const float inv = 1.f / l[g];
    for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv;
    lse[g] = m[g] + logf(l[g]);
  }
}

static void part(const float *q, const float *k, long ks, const float *v, long vs, long S, int G, int kept, int D,
                 float *out, float *lse) {
  switch (D) { /* the usual head widths get their own unrolled copy */
  case 32: head(q, k, ks, v, vs, S, G, kept, 32, out, lse); break;
  case 64: head(q, k, ks, v, vs, S, G, kept, 64, out, lse); break;
  case 128: head(q, k, ks, v, vs, S, G, kept, 128, out, lse); break;
  case 256: head(q, k, ks, v, vs, S, G, kept, 256, out, lse); break;
  default: head(q, k, ks, v, vs, S, G, kept, D, out, lse);
  }
}

/* The vector width this library was compiled for: the caller's checks of D read it. */
int mh_vector_width(void) { return VW; }

/* Whether any of `rows` rows of n floats (row starts `stride` floats apart) holds a value that
 * is not finite or is zero throughout: the NaN rule's first look at a kernel's output
 * (multihead.functional._nan_or_zero_row), without a tensor op's dispatch. */
int mh_bad_rows(const float *p, long rows, long n, long stride) {
  for (long r = 0; r < rows; r++) {
    const float *x = p + r * stride;
    int nonzero = 0, bad = 0;
    for (long i = 0; i < n; i++) {
      nonzero |= x[i] != 0.f;
      bad |= !(x[i] - x[i] == 0.f); /* NaN or an infinity */
    }
    if (bad || !nonzero) return 1;
  }
  return 0;
}

static int gcd(int a, int b) { while (b) { const int t = a % b; a = b; b = t; } return a; }

/* One step: q (B, Hkv * Gh, T, D) over k, v (B, Hkv, S, D) into out (B, Hkv * Gh, T, D),
 * scores scaled by `scale`, on up to `threads` threads: as many as have `grain` floats of K
 * and V each (the caller's rule, decode._GRAIN), and where the B * Hkv heads do not divide among them, each head's keys in P parts
 * (the fewest that give every thread the same share). Returns 0; 1 where a row of out is not
 * finite or is zero throughout (the NaN rule's first look, `mh_bad_rows`, done here so the
 * caller need not call again); -1 where the arguments are out of what the kernel takes (the
 * caller checks them first: a last guard, never a wrong answer); -2 where the parts' work
 * buffer could not be allocated. */
int mh_decode_step(const float *q, long qb, long qh, long qt, const float *k, long kb, long kh, long ks,
                   const float *v, long vb, long vh, long vs, int B, int Hkv, int Gh, int T, long S, int D,
                   float scale, float *out, int threads, long grain) {
  const int G = Gh * T, G4 = (G + 3) / 4 * 4, n = B * Hkv;
  if (B < 1 || Hkv < 1 || Gh < 1 || T < 1 || G4 > MAXG || D <= 0 || D > MAXD || D % VW || S < 1 || threads < 1 ||
      grain < 1)
    return -1;
  const long grains = (long)n * S * 2 * D / grain;
  const int used = grains < threads ? (grains > 1 ? (int)grains : 1) : threads;
  const int parts = n % used == 0 ? 1 : (used / gcd(n, used) < S ? used / gcd(n, used) : (int)S);
  const int items = n * parts;
  float *work = NULL;
  if (parts > 1 && !(work = malloc(sizeof(float) * (size_t)items * G4 * (D + 1))))
    return -2;
#pragma omp parallel for schedule(static) num_threads(used)
  for (int i = 0; i < items; i++) {
    const int h = i / parts, p = i % parts, b = h / Hkv, kvh = h % Hkv;
    /* part p holds keys [p S / P, (p + 1) S / P): none empty where S >= P (ceil-sized parts
     * would leave the last one empty at S = 4, P = 3, and an empty part's output is 0/0) */
    const long lo = p * S / parts, len = (p + 1) * S / parts - lo;
    float qs[G4 * D] __attribute__((aligned(64)));
    for (int g = 0; g < G4; g++)
      for (int d = 0; d < D; d++)
        qs[g * D + d] = g < G ? q[b * qb + ((long)kvh * Gh + g / T) * qh + (g % T) * qt + d] * scale : 0.f;
    float lse[MAXG];
    float *o = parts == 1 ? out + (long)h * G * D : work + (long)i * G4 * (D + 1);
    part(qs, k + b * kb + kvh * kh + lo * ks, ks, v + b * vb + kvh * vh + lo * vs, vs, len, G4, parts == 1 ? G : G4,
         D, o, parts == 1 ? lse : o + (long)G4 * D);
  }
  if (parts > 1) {
    for (int h = 0; h < n; h++) /* merge the parts by their log-sum-exp */
      for (int g = 0; g < G; g++) {
        float mx = -INFINITY, wsum = 0.f;
        for (int p = 0; p < parts; p++) {
          const float x = work[((long)h * parts + p) * G4 * (D + 1) + (long)G4 * D + g];
          mx = x > mx ? x : mx;
        }
        float *o = out + ((long)h * G + g) * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        for (int p = 0; p < parts; p++) {
          const float *w = work + ((long)h * parts + p) * G4 * (D + 1);
          const float e = expf(w[(long)G4 * D + g] - mx);
          wsum += e;
          for (int d = 0; d < D; d++) o[d] += e * w[(long)g * D + d];
        }
        for (int d = 0; d < D; d++) o[d] /= wsum;
      }
    free(work);
  }
  return mh_bad_rows(out, (long)n * G, D, D);
}

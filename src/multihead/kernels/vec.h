/* What the native kernels share (decode_step.c, band.c): the vector type of the machine's
 * widest float vectors (-march=native: 16 lanes with AVX-512, else 8), loads and stores
 * that take any alignment, and the lane-wise max and exp of the online softmax. */
#ifndef MULTIHEAD_VEC_H
#define MULTIHEAD_VEC_H

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int vi __attribute__((vector_size(VW * 4)));

static inline vf ld(const float *p) { vf x; __builtin_memcpy(&x, p, sizeof x); return x; }
static inline void st(float *p, vf x) { __builtin_memcpy(p, &x, sizeof x); }
static inline float hsum(vf x) { float s = 0; for (int i = 0; i < VW; i++) s += x[i]; return s; }

/* lane-wise selects (GCC's C has vector compares, not ?:); a NaN in x stays: both keep x
 * where the compare is false */
static inline vf vmax(vf x, vf y) { const vi lt = (vi)(x < y); return (vf)(((vi)y & lt) | ((vi)x & ~lt)); }

/* exp(x) for x <= 0 (scores less their running max): 2^n p(r), x = n ln2 + r, with Cephes'
 * single-precision polynomial (within 2 ulp); below -87 it is exp(-87), 1.6e-38, which a sum
 * holding exp(0) = 1 does not see (a masked score that must weigh exactly 0 is selected
 * away by its caller); a NaN stays NaN (a NaN score reaches its row). Rounding by adding
 * and taking away 1.5 * 2^23 keeps every step a vector op (n is at most 126 in size). */
static inline vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f;
  x = vmax(x, lo);
  const vf big = (vf){0} + 12582912.0f;
  vf n = (x * 1.44269504088896341f + big) - big;
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf s;
  __builtin_memcpy(&s, &e, sizeof s);
  return p * s;
}

#endif

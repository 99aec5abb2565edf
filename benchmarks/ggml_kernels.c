/* A shim over llama.cpp's libggml-cpu.so for benchmarks/ggml_kernels.py: ggml's own
 * one-row products (vec_dot, one output row at a time, as llama.cpp's matrix-vector
 * product calls them) of Q4_K, Q6_K and Q8_0 weights, the activation row quantized
 * first as ggml does (q8_K for the K-quants, q8_0 for Q8_0). Compiled at run time by
 * the benchmark (cc -O2 -shared), linked against the llama.cpp build's libraries; the
 * product itself never needs it. */
#include <stddef.h>
#include <stdint.h>

typedef void (*vec_dot_t)(int n, float *s, size_t bs, const void *vx, size_t bx,
                          const void *vy, size_t by, int nrc);
void ggml_vec_dot_q4_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q6_K_q8_K(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void ggml_vec_dot_q8_0_q8_0(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void quantize_row_q8_K(const float *x, void *y, int64_t k);
void quantize_row_q8_0(const float *x, void *y, int64_t k);
void ggml_cpu_init(void);

void shim_init(void) { ggml_cpu_init(); }

/* out[r] = x . row r of the nrows rows of row_bytes bytes at w (n values a row);
 * fmt: 4 Q4_K, 6 Q6_K, 8 Q8_0; y: room for the quantized activations (n / 256 * 292
 * bytes covers both q8_K and q8_0). Returns 0, or -1 for an unknown fmt. */
int shim_rows(int fmt, int n, int nrows, const uint8_t *w, size_t row_bytes,
              const float *x, uint8_t *y, float *out) {
    vec_dot_t f;
    if (fmt == 4 || fmt == 6) {
        quantize_row_q8_K(x, y, n);
        f = fmt == 4 ? ggml_vec_dot_q4_K_q8_K : ggml_vec_dot_q6_K_q8_K;
    } else if (fmt == 8) {
        quantize_row_q8_0(x, y, n);
        f = ggml_vec_dot_q8_0_q8_0;
    } else {
        return -1;
    }
    for (int r = 0; r < nrows; r++) f(n, out + r, 0, w + (size_t)r * row_bytes, 0, y, 0, 1);
    return 0;
}

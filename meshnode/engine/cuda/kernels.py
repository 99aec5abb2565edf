"""CUDA C source of the stage kernels and the launch geometry of each.

One thread block per row (norms, softmax, embedding) or per (head, query row)
(attention), one warp per output feature (matmul); reductions go through shared memory,
but the matmul's, which is a warp's; every sum is float32. The source keeps to plain C++
with no headers so that the same text compiles with NVRTC (through CuPy) and with a host
C++ compiler for the CPU emulation in ``tests/engine/test_ops_emulated.py``; the
device-only parts are the half-precision conversions (PTX ``cvt``) and the warp sum
(shuffles), each with a host twin in the emulation (the warp sum's adds in the same order).

Positions and the KV cache are read from a device "step" table, ``int64 [rows, STEP]``,
one row per new row of the forward: ``[position, rows T of a head's cache, K base address,
V base address, kept row, block table address]``. The rows of a batch belong to several
sequences, each with its own cache and positions; row ``i``'s column 4 is the new row
whose output is the ``i``-th output of the last layer (each sequence keeps its last
``out_rows`` rows). A cache is ``[L, Hkv, T, D]`` read through its sequence's block table
(``int64``, on the device): position ``p`` of a head is its row ``table[p / KV_BLOCK]
KV_BLOCK + p % KV_BLOCK`` (``kv_row``), a block of a stage's pool
(:mod:`meshnode.engine.kv_pages`; a contiguous cache's table is the identity, its row is
the position). So a captured CUDA graph replays for any positions, any sequences' caches
and any blocks they hold: only the step table, the inputs and (when they changed) the
block tables are rewritten before a replay.

Weights of a matmul decode in units of 32 values (``UNIT``): a Q8_0 block, one eighth of
a Q4_K super-block, or 32 consecutive floats, each read in four parts of 8 (``PART``).
``F::part(row, u, k, w)`` writes the 8 floats of part ``k`` of unit ``u`` of a row, and
``unit<F>`` the unit's 32 (those structs are :mod:`.format_source`'s part of the source);
the matmul, the embedding gather and the dequantize kernel all use them, so each format's
block math is written once (and mirrored in NumPy by
:func:`meshnode.engine.cuda.formats.decode_units`).
"""

from __future__ import annotations

from meshnode.engine.cuda.format_source import FORMATS_SOURCE
from meshnode.engine.cuda.formats import CPP_NAME
from meshnode.engine.kv_cache import KV_BLOCK

__all__ = [
    "BLOCK",
    "GEMV_BLOCK",
    "GEMV_WARPS",
    "KV_BLOCK",
    "MAX_BATCH_ROWS",
    "MAX_HEAD_DIM",
    "MAX_ROWS",
    "SOURCE",
    "STEP",
    "UNIT",
    "flat_grid",
    "gemv_grid",
    "gemv_rows",
    "template_names",
]

BLOCK = 256  # threads of the row/head kernels (a power of two: tree reductions)
GEMV_WARPS = 4  # output features of a gemv block, a warp each
GEMV_BLOCK = 32 * GEMV_WARPS  # threads of a gemv block
PART = 8  # values of a unit one gemv lane decodes (four lanes read a unit side by side)
# Rows a matvec pass holds in registers (its ``acc`` array), and the most new rows of one
# sequence that take the fixed-buffer path (decode 1, verify windows and short prompt
# chunks <= 16); a longer prompt is a prefill (cuBLAS matmul on expanded weights).
MAX_ROWS = 16
GEMV_ROWS = (1, 4, MAX_ROWS)  # rows a gemv pass holds, by template instance
# Rows of one fixed-buffer forward: every sequence of a batch together (16 sequences with a
# 4-row verify window each). The matvec runs them in passes of MAX_ROWS over one read of
# a weight row; a larger batch is cut into forwards of at most this many rows.
MAX_BATCH_ROWS = 64
STEP = 6  # columns of the step table (see the module docstring)
MAX_HEAD_DIM = 256  # the attention kernel keeps one query head in shared memory
UNIT = 32  # values per decode unit (see the module docstring)

FORMATS = tuple(CPP_NAME.values())  # the format structs, from the format rows
KV_TYPES = ("float", "u16")  # the KV cache in float32, or float16 bits

SOURCE = r"""
#define MN_BLOCK 256
#define MN_MAX_ROWS 16
#define MN_MAX_HEAD_DIM 256
#define MN_UNIT 32
#define MN_PART 8
#ifndef MN_GEMV_WARPS  // (benchmarks/gpu_gemv.py compiles other widths beside this one)
#define MN_GEMV_WARPS 4
#endif
#define MN_STEP 6
#define MN_KV_BLOCK 32

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
// Aligned vector loads (one ld.global.v4 / v2 on the device): the gemv reads a part of a
// weight row and of an activation row with one or two of these.
struct alignas(16) u32x4 { u32 a, b, c, d; };
struct alignas(8) u32x2 { u32 a, b; };
struct alignas(16) f32x4 { float a, b, c, d; };

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bits_to_f32(u32 b) { return __uint_as_float(b); }
#endif

__device__ __forceinline__ float neg_inf() { return bits_to_f32(0xff800000u); }
__device__ __forceinline__ float f16_at(const u8* p) {  // GGML blocks: no alignment
    return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}
"""

SOURCE += (
    FORMATS_SOURCE
    + r"""
// ---- KV cache element access: float32, or float16 bits ------------------------------

__device__ __forceinline__ float kv_load(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, i64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ void kv_store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(u16* p, i64 i, float v) { p[i] = f32_to_f16(v); }

__device__ __forceinline__ void out_store(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void out_store(u16* p, i64 i, float v) { p[i] = f32_to_f16(v); }

// The row of a KV head's cache [T, D] that holds position p of the sequence whose block
// table (step column 5) is `table`: block p / MN_KV_BLOCK sits in slot table[...]. A
// contiguous cache's table is the identity: the row is p.
__device__ __forceinline__ i64 kv_row(const i64* table, i64 p) {
    return table[p / MN_KV_BLOCK] * MN_KV_BLOCK + p % MN_KV_BLOCK;
}

// ---- block reductions (blockDim.x a power of two; red[] holds blockDim.x floats) ----

__device__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();  // red is free again for the caller's next reduction
    return total;
}

__device__ float block_max(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float top = red[0];
    __syncthreads();
    return top;
}

// ---- kernels ----------------------------------------------------------------------

// y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps). Grid: rows; block: MN_BLOCK.
extern "C" __global__ void rms_norm(
    const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
    int n, float eps) {
    __shared__ float red[MN_BLOCK];
    const float* xr = x + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    const float s = sqrtf(block_sum(ss, red) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] / s);
}

// The residual add and the next norm: x[r] += h[r]; y[r] = rms_norm(x[r]). Grid: rows.
extern "C" __global__ void add_rms_norm(
    float* __restrict__ x, const float* __restrict__ h, const float* __restrict__ w,
    float* __restrict__ y, int n, float eps) {
    __shared__ float red[MN_BLOCK];
    float* xr = x + (i64)blockIdx.x * n;
    const float* hr = h + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] + hr[i];
        xr[i] = v;
        ss += v * v;
    }
    const float s = sqrtf(block_sum(ss, red) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] / s);
}

// Row softmax of x [rows, n] in place. Grid: rows; block: MN_BLOCK.
extern "C" __global__ void softmax(float* __restrict__ x, int n) {
    __shared__ float red[MN_BLOCK];
    float* xr = x + (i64)blockIdx.x * n;
    float m = neg_inf();
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, xr[i]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(xr[i] - m);
        xr[i] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = xr[i] / sum;
}

// out[r, i] = silu(gate[r, i]) * up[r, i] for gate_up [rows, 2 I]; grid-stride, flat.
extern "C" __global__ void silu_mul(
    const float* __restrict__ gate_up, float* __restrict__ out, int rows, int inter) {
    const i64 total = (i64)rows * inter;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const i64 r = k / inter, i = k % inter;
        const float g = gate_up[r * 2 * inter + i];
        const float u = gate_up[r * 2 * inter + inter + i];
        out[k] = g / (1.0f + expf(-fmaxf(g, -80.0f))) * u;
    }
}

// out[r, i] = gelu_tanh(gate[r, i]) * up[r, i] (GeGLU) for gate_up [rows, 2 I], in the
// order of ops.gelu_tanh_mul; grid-stride, flat.
extern "C" __global__ void gelu_tanh_mul(
    const float* __restrict__ gate_up, float* __restrict__ out, int rows, int inter) {
    const i64 total = (i64)rows * inter;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const i64 r = k / inter, i = k % inter;
        const float g = gate_up[r * 2 * inter + i];
        const float u = gate_up[r * 2 * inter + inter + i];
        const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
        out[k] = 0.5f * g * (1.0f + tanhf(inner)) * u;
    }
}

// QK-norm: RMSNorm over each query head (weight qw) and key head (weight kw) of
// qkv [n, (H + 2 Hkv) D], in place. Grid: (H + Hkv, n); block: MN_BLOCK.
extern "C" __global__ void qk_norm(
    float* __restrict__ qkv, const float* __restrict__ qw, const float* __restrict__ kw,
    int heads, int kv_heads, int dim, float eps) {
    __shared__ float red[MN_BLOCK];
    const int h = blockIdx.x;
    float* x = qkv + (i64)blockIdx.y * (heads + 2 * kv_heads) * dim + (i64)h * dim;
    const float* w = h < heads ? qw : kw;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += x[i] * x[i];
    const float s = sqrtf(block_sum(ss, red) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) x[i] = w[i] * (x[i] / s);
}

// out[i] = x[step[i, 4]]: the residual rows the last layer keeps (each sequence's last
// out_rows rows), out [rows, n] from x [n_new, n]. Grid: rows; block: MN_BLOCK.
extern "C" __global__ void gather_rows(
    const float* __restrict__ x, const i64* __restrict__ step, float* __restrict__ out, int n) {
    const float* xr = x + step[(i64)blockIdx.x * MN_STEP + 4] * n;
    float* yr = out + (i64)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i];
}

// RoPE (rotate-half pairs i, i + D/2) on the Q and K heads of qkv [n, (H + 2 Hkv) D], row
// r at its position step[r, 0]; Q is rotated in place, K is rotated into row r's cache
// (step[r, 2]) and V copied into its V cache (step[r, 3]): caches [L, Hkv, T, D] with
// T = step[r, 1], layer `layer`, at the row of the position (kv_row, table step[r, 5]).
template <typename KV>
__global__ void rope_store(
    float* __restrict__ qkv, const float* __restrict__ inv_freq, const i64* __restrict__ step,
    int layer, int n, int heads, int kv_heads, int dim) {
    const int half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    const i64 pairs = (i64)n * (heads + kv_heads) * half;
    const i64 copies = (i64)n * kv_heads * dim;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < pairs + copies;
         k += (i64)gridDim.x * blockDim.x) {
        if (k < pairs) {
            const i64 row = k / ((heads + kv_heads) * half);
            const int head = (int)(k / half % (heads + kv_heads)), i = (int)(k % half);
            const i64* st = step + row * MN_STEP;
            const i64 pos = st[0], cap = st[1];
            float* base = qkv + row * width + (i64)head * dim;
            const float f = (float)pos * inv_freq[i];
            const float c = cosf(f), s = sinf(f);
            const float a = base[i], b = base[i + half];
            const float ra = a * c + (-b) * s, rb = b * c + a * s;
            if (head < heads) {
                base[i] = ra;
                base[i + half] = rb;
            } else {
                KV* kc = (KV*)st[2] + (i64)layer * kv_heads * cap * dim;
                const i64 at = ((i64)(head - heads) * cap + kv_row((const i64*)st[5], pos)) * dim;
                kv_store(kc, at + i, ra);
                kv_store(kc, at + i + half, rb);
            }
        } else {
            const i64 c = k - pairs;
            const i64 row = c / (kv_heads * dim);
            const int kh = (int)(c / dim % kv_heads), d = (int)(c % dim);
            const i64* st = step + row * MN_STEP;
            const i64 cap = st[1];
            KV* vc = (KV*)st[3] + (i64)layer * kv_heads * cap * dim;
            const float v = qkv[row * width + (i64)(heads + kv_heads) * dim + (i64)kh * dim + d];
            kv_store(vc, ((i64)kh * cap + kv_row((const i64*)st[5], st[0])) * dim + d, v);
        }
    }
}

// Causal grouped-query attention of `rows` of the n new rows, each reading its own cache
// in place (after rope_store wrote this step's K/V). Grid: (H, rows); block: MN_BLOCK.
// Output row i is new row q = i when rows == n, else q = step[i, 4] (the last layer keeps
// each sequence's last out_rows rows); q is at position p = step[q, 0] and sees keys
// 0 .. p of its cache (the rows before it in its sequence were stored there; position t
// at row kv_row(table, t), table step[q, 5]), or with a
// sliding window > 0 the last `window` of them, p - window < key <= p. One pass
// over the keys in chunks of blockDim with a running max and sum (online softmax), so no
// scratch memory is needed for any context length. out: [rows, H D].
template <typename KV>
__global__ void attention(
    const float* __restrict__ qkv, float* __restrict__ out, const i64* __restrict__ step,
    int layer, int n, int rows, int heads, int kv_heads, int dim, float scale, int window) {
    __shared__ float q[MN_MAX_HEAD_DIM];
    __shared__ float p[MN_BLOCK];
    __shared__ float red[MN_BLOCK];
    const int h = blockIdx.x, i = blockIdx.y, tid = threadIdx.x;
    const int qrow = rows == n ? i : (int)step[(i64)i * MN_STEP + 4];
    const i64* st = step + (i64)qrow * MN_STEP;
    const i64 cap = st[1];
    const i64 len = st[0] + 1;
    const i64 kv_off = ((i64)layer * kv_heads + h / (heads / kv_heads)) * cap * dim;
    const KV* kc = (const KV*)st[2] + kv_off;
    const KV* vc = (const KV*)st[3] + kv_off;
    const i64* table = (const i64*)st[5];
    const int width = (heads + 2 * kv_heads) * dim;
    for (int d = tid; d < dim; d += blockDim.x) q[d] = qkv[(i64)qrow * width + (i64)h * dim + d];
    __syncthreads();
    // Output: thread (d, part) sums the keys t = part (mod parts) of each chunk for dim d.
    const int parts = blockDim.x / dim, d = tid % dim, part = tid / dim;
    float m = neg_inf(), l = 0.0f, acc = 0.0f;
    const i64 lo = window > 0 && len > window ? len - window : 0;
    for (i64 c0 = lo; c0 < len; c0 += blockDim.x) {
        const i64 t = c0 + tid;
        float s = neg_inf();
        if (t < len) {
            float dot = 0.0f;
            const i64 at = kv_row(table, t) * dim;
            for (int e = 0; e < dim; ++e) dot += q[e] * kv_load(kc, at + e);
            s = dot * scale;
        }
        const float new_m = fmaxf(m, block_max(s, red));
        const float pt = t < len ? expf(s - new_m) : 0.0f;
        p[tid] = pt;
        const float corr = expf(m - new_m);  // 0 on the first chunk (m = -inf)
        l = l * corr + block_sum(pt, red);  // block_sum's barriers also publish p[]
        acc *= corr;
        const i64 chunk = len - c0 < (i64)blockDim.x ? len - c0 : (i64)blockDim.x;
        if (part < parts) {
            for (i64 j = part; j < chunk; j += parts) {
                acc += p[j] * kv_load(vc, kv_row(table, c0 + j) * dim + d);
            }
        }
        m = new_m;
        __syncthreads();  // p[] is rewritten by the next chunk
    }
    red[tid] = acc;
    __syncthreads();
    if (part == 0) {
        float total = 0.0f;
        for (int k = 0; k < parts; ++k) total += red[k * dim + d];
        out[((i64)i * heads + h) * dim + d] = total / l;
    }
}

// The sum of v over each warp (32 consecutive threads), in every thread of it. On the
// device, shuffles; in the emulation (tests/engine/test_ops_emulated.py), a tree in
// red[blockDim.x] with barriers. Lane 0 adds in the same order in both (at each step,
// lane 0's partner holds the sum of the tree's node), and lane 0's sum is the one used.
// Every thread of the block must call it (the emulation's barriers).
__device__ __forceinline__ float warp_sum(float v, float* red) {
#ifdef __CUDA_ARCH__
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    return v;
#else
    const int lane = threadIdx.x % 32;
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = 16; s > 0; s >>= 1) {
        if (lane < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const float total = red[threadIdx.x - lane];
    __syncthreads();
    return total;
#endif
}

// y[r, o] = sum_k x[r, k] W[o, k] for decode, verify and batches of them: W [out, in] in
// format F, x on 16 bytes (its parts are read as two aligned float4s). One warp per
// output feature o (MN_GEMV_WARPS of them per block); lane l reads part l % 4 of units
// l / 4, l / 4 + 8, ..., so the four lanes of a unit read its bytes side by side and a
// warp reads eight consecutive units at a time. Rows go in
// passes of R rows (the registers of acc: R is 1, 4 or MN_MAX_ROWS, the launch picks the
// least that holds the rows); in a pass each part of W is decoded once and used for every
// row, and a later pass reads the row of W again from cache. A row's sum is the same
// whatever the other rows are and whatever R is (each row adds its parts in the same
// order): batched rows equal rows run alone. With one row a thread holds few registers,
// and the loop over units is unrolled four times so that more of W's loads are in flight.
// Grid: ceil(out / MN_GEMV_WARPS); block: MN_GEMV_WARPS * 32.
// (1024 threads an SM: at most 64 registers a thread, which it fits in without spilling.)
template <typename F, int R>
__global__ void __launch_bounds__(MN_GEMV_WARPS * 32, 32 / MN_GEMV_WARPS) gemv(
    const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
    int rows, int in, int out) {
    __shared__ float red[MN_GEMV_WARPS * 32];
    const int lane = threadIdx.x % 32;
    const i64 o = (i64)blockIdx.x * MN_GEMV_WARPS + threadIdx.x / 32;
    const bool live = o < out;  // the last block's spare warps still join the sums
    const u8* row = w + (live ? o : 0) * F::row_bytes(in);
    const int k = lane % (MN_UNIT / MN_PART), units = in / MN_UNIT;
    for (int r0 = 0; r0 < rows; r0 += R) {
        const int group = rows - r0 < R ? rows - r0 : R;
        const float* xg = x + (i64)r0 * in + k * MN_PART;
        float acc[R];
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll(R == 1 ? 4 : 1)
        for (int u = lane / (MN_UNIT / MN_PART); live && u < units; u += 32 / (MN_UNIT / MN_PART)) {
            float wp[MN_PART];
            F::part(row, u, k, wp);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < group) {
                    const f32x4* xr = (const f32x4*)(xg + (i64)r * in + (i64)u * MN_UNIT);
                    const f32x4 a = xr[0], b = xr[1];
                    const float xs[MN_PART] = {a.a, a.b, a.c, a.d, b.a, b.b, b.c, b.d};
                    float s = 0.0f;
#pragma unroll
                    for (int j = 0; j < MN_PART; ++j) s += wp[j] * xs[j];
                    acc[r] += s;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < group) {  // the same for every thread of the block: the barriers are safe
                const float total = warp_sum(acc[r], red);
                if (lane == 0 && live) y[(i64)(r0 + r) * out + o] = total;
            }
        }
    }
}

// x[r] = row ids[r] of the table [V, E] in format F, as float32. Grid: rows; block: MN_BLOCK.
template <typename F>
__global__ void embed(
    const u8* __restrict__ table, const int* __restrict__ ids, float* __restrict__ x, int dim) {
    const u8* row = table + (i64)ids[blockIdx.x] * F::row_bytes(dim);
    float* xr = x + (i64)blockIdx.x * dim;
    for (int u = threadIdx.x; u < dim / MN_UNIT; u += blockDim.x) {
        float wu[MN_UNIT];
        unit<F>(row, u, wu);
        for (int j = 0; j < MN_UNIT; ++j) xr[u * MN_UNIT + j] = wu[j];
    }
}

// out [out, in] = W decoded, as float32 or float16 bits (prefill: one layer's weight is
// expanded just before its matmul). Grid-stride over all units.
template <typename F, typename O>
__global__ void dequantize(const u8* __restrict__ w, O* __restrict__ dst, int in, int out) {
    const int per_row = in / MN_UNIT;
    const i64 total = (i64)out * per_row;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total;
         k += (i64)gridDim.x * blockDim.x) {
        const i64 o = k / per_row;
        const int u = (int)(k % per_row);
        float wu[MN_UNIT];
        unit<F>(w + o * F::row_bytes(in), u, wu);
        for (int j = 0; j < MN_UNIT; ++j) out_store(dst, o * in + (i64)u * MN_UNIT + j, wu[j]);
    }
}
"""
)


PLAIN_KERNELS = (
    "rms_norm",
    "add_rms_norm",
    "softmax",
    "silu_mul",
    "gelu_tanh_mul",
    "qk_norm",
    "gather_rows",
)


def template_names() -> list[str]:
    """Every template instance the module compiles (CuPy ``name_expressions``)."""
    names = [f"rope_store<{t}>" for t in KV_TYPES] + [f"attention<{t}>" for t in KV_TYPES]
    names += [f"gemv<{f}, {r}>" for f in FORMATS for r in GEMV_ROWS]
    names += [f"embed<{f}>" for f in FORMATS]
    names += [f"dequantize<{f}, {o}>" for f in FORMATS for o in ("float", "u16")]
    return names


def gemv_rows(rows: int) -> int:
    """The rows a gemv pass holds (its template's ``R``): the least of GEMV_ROWS >= ``rows``,
    else the most."""
    return next((r for r in GEMV_ROWS if r >= rows), GEMV_ROWS[-1])


def gemv_grid(out: int) -> int:
    """Blocks of a gemv of ``out`` output features (a warp each, GEMV_WARPS a block)."""
    return -(-out // GEMV_WARPS)


def flat_grid(total: int, block: int = BLOCK, max_blocks: int = 65535) -> int:
    """Blocks for a grid-stride kernel over ``total`` items (at least one)."""
    return max(1, min(max_blocks, -(-total // block)))

"""CUDA C source of the weight formats the stage's kernels decode (part of
:data:`meshnode.engine.cuda.kernels.SOURCE`, which includes it after its typedefs).

Each format is a struct with ``row_bytes(in)`` and ``part(row, u, k, w)``: the 8 floats
(``MN_PART``) of part ``k`` of 32-value unit ``u`` of a row, read with aligned vector
loads where the format's layout allows; ``unit<F>`` is the unit's four parts. The
matmul, the embedding gather and the dequantize kernel all decode through them, so each
format's block math is written once (and mirrored in NumPy by
:func:`meshnode.engine.cuda.formats.decode_units`).
"""

from __future__ import annotations

__all__ = ["FORMATS_SOURCE"]

FORMATS_SOURCE = r"""
// ---- weight formats: the 8 floats of part k of unit u of one row -------------------
// (values u * 32 + k * 8 .. + 8; the gemv's lanes read a unit's four parts side by side)

// (A part of F32/F16/BF16 weights starts 32/16/16 bytes into its row's 128/64/64-byte
// unit, and rows start on 16 bytes: the vector loads are aligned.)
struct FmtF32 {
    static __device__ i64 row_bytes(int in) { return 4LL * in; }
    static __device__ void part(const u8* row, int u, int k, float* w) {
        const f32x4* p = (const f32x4*)(row + ((i64)u * MN_UNIT + k * MN_PART) * 4);
        const f32x4 a = p[0], b = p[1];
        w[0] = a.a, w[1] = a.b, w[2] = a.c, w[3] = a.d;
        w[4] = b.a, w[5] = b.b, w[6] = b.c, w[7] = b.d;
    }
};

// The eight 16-bit values of four words, low half first.
__device__ __forceinline__ void halves(u32x4 v, u16* h) {
    const u32 words[4] = {v.a, v.b, v.c, v.d};
    for (int i = 0; i < 4; ++i) {
        h[2 * i] = (u16)(words[i] & 0xFFFF);
        h[2 * i + 1] = (u16)(words[i] >> 16);
    }
}

struct FmtF16 {
    static __device__ i64 row_bytes(int in) { return 2LL * in; }
    static __device__ void part(const u8* row, int u, int k, float* w) {
        u16 h[MN_PART];
        halves(*(const u32x4*)(row + ((i64)u * MN_UNIT + k * MN_PART) * 2), h);
        for (int j = 0; j < MN_PART; ++j) w[j] = f16_to_f32(h[j]);
    }
};

// bfloat16 is the top half of a float32; CuPy has no bfloat16 dtype, so the device keeps
// the raw 16-bit patterns in a uint16 array.
struct FmtBF16 {
    static __device__ i64 row_bytes(int in) { return 2LL * in; }
    static __device__ void part(const u8* row, int u, int k, float* w) {
        u16 h[MN_PART];
        halves(*(const u32x4*)(row + ((i64)u * MN_UNIT + k * MN_PART) * 2), h);
        for (int j = 0; j < MN_PART; ++j) w[j] = bits_to_f32((u32)h[j] << 16);
    }
};

// GGML block_q8_0: d (f16), qs[32] (int8); value = d * q. Blocks of 34 bytes sit on even
// addresses only (rows start on 16 bytes): d and the quants are read as 16-bit words.
struct FmtQ8_0 {
    static __device__ i64 row_bytes(int in) { return (i64)(in / 32) * 34; }
    static __device__ void part(const u8* row, int u, int k, float* w) {
        const u16* b = (const u16*)(row + (i64)u * 34);
        const float d = f16_to_f32(b[0]);
        for (int i = 0; i < MN_PART / 2; ++i) {
            const u16 pair = b[1 + k * (MN_PART / 2) + i];
            w[2 * i] = d * (float)(signed char)(pair & 0xFF);
            w[2 * i + 1] = d * (float)(signed char)(pair >> 8);
        }
    }
};

// GGML block_q4_K, 256 values: d, dmin (f16), scales[12] (eight 6-bit scales and mins),
// qs[128]. Unit j of a super-block is its j-th run of 32: scale/min as ggml's
// get_scale_min_k4(j), values in the low (j even) or high (j odd) nibbles of
// qs[32 * (j / 2) ..]; value = d * sc * q - dmin * m (dequantize_row_q4_K).
struct FmtQ4_K {
    static __device__ i64 row_bytes(int in) { return (i64)(in / 256) * 144; }
    static __device__ void part(const u8* row, int u, int k, float* w) {
        const u8* b = row + (i64)(u / 8) * 144;
        const int j = u % 8;
        const u8* s = b + 4;
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        const float dl = f16_at(b) * (float)sc;
        const float ml = f16_at(b + 2) * (float)m;
        // the part's 8 bytes of nibbles, 8-byte aligned (super-blocks of 144 bytes from a
        // row start on 16 bytes)
        const u32x2 v = *(const u32x2*)(b + 16 + (j / 2) * 32 + k * MN_PART);
        const int shift = (j % 2) * 4;
        for (int l = 0; l < MN_PART; ++l) {
            const u32 word = l < 4 ? v.a : v.b;
            const u32 q = (word >> (8 * (l % 4) + shift)) & 0xF;
            w[l] = dl * (float)q - ml;
        }
    }
};

// The 32 floats of unit u of a row: its four parts.
template <typename F>
__device__ __forceinline__ void unit(const u8* row, int u, float* w) {
    for (int k = 0; k < MN_UNIT / MN_PART; ++k) F::part(row, u, k, w + k * MN_PART);
}
"""

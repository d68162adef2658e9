"""E2M1 (NVFP4 element) decode helpers shared by the NVFP4 kernels (Triton device functions).

Both take int32 words of 8 codes (code j of a word in bits 4j..4j+3: element 8w + j of a packed
NVFP4 row, byte b holding elements 2b (low nibble) and 2b + 1 (high), docs/model.md section 12)
and return exact fp32 values times a power of two, which the caller undoes exactly:
* `_e2m1_pair(w, J)`: codes J and J + 4, times 2^-14, by integer bit steps and an fp16 bitcast;
  runs anywhere, the Triton interpreter included.
* `_e2m1_word(w)`: all 8 codes, times 2^-6, through inline PTX (`_E2M1_E4M3_PTX`: the hardware
  e4m3 -> f16 conversion, sm_89+); fewer instructions, but CUDA only (no PTX in the interpreter).
* `_e2m1_bytes(w)` / `_e2m1_bytes_ptx(w)`: all 8 codes, times 2^-14 (the same fp32 values as
  `_e2m1_pair`), through the "byte form": each code becomes the high byte of its fp16, built for
  four codes at once, then paired into fp16x2 registers by byte moves. `_e2m1_bytes` in Triton
  integer ops (anywhere, the interpreter included), `_e2m1_bytes_ptx` the same steps in inline
  PTX (CUDA only: there LLVM cannot narrow the pairs apart, see below).
Users: ftchat/offload/expert_kernels.py (the routed experts), ftchat/kernels/nvfp4_gemv.py.
"""

from __future__ import annotations

from ftchat.kernels import HAS_TRITON, jit as _jit, tl


@_jit
def _e2m1_pair(w, J: tl.constexpr):
    # codes J and J + 4 of int32 words w -> their E2M1 values * 2^-14 as fp32, exact. Each code c
    # becomes the fp16 ((c & 7) << 9) | ((c & 8) << 12) (codes 0 and 1 land on subnormals): shift c
    # to bits 9..12 (the other code to 25..28), then move the sign from bit 12 to 15 by adding 7x it
    v = (w << (9 - 4 * J)) if J < 3 else (w >> 3)
    v = v & 0x1E001E00
    bits = v + 7 * (v & 0x10001000)
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# codes 0..7 of an int32 word -> E2M1 * 2^-6 as fp32, exact, through the hardware e4m3 -> f16
# conversion (sm_89+): each nibble becomes the e4m3 byte s 0 0 e1 e0 m 0 0 (value E2M1 * 2^-6, the
# code 0.5 a subnormal), four per register in two logic ops: odd codes (high nibbles) keep their
# sign at bit 7 and move the magnitude down 2 bits, even codes move up 4 (sign) and 2. Then 4
# e4m3x2 -> f16x2 and 8 f16 -> f32 conversions: ~2.4 instructions per code against ~3 for
# _e2m1_pair. Not in the interpreter (no inline PTX there): the v3 kernels run v2's decode there.
_PTX = """{
.reg .b32 t0, t1, t2, od, ev, h0, h1, h2, h3;
.reg .b16 p0, p1, p2, p3, q0, q1, q2, q3, q4, q5, q6, q7;
shr.b32 t0, $8, 2;
and.b32 t0, t0, 0x1C1C1C1C;
lop3.b32 od, $8, 0x80808080, t0, 0xEA;
shl.b32 t1, $8, 4;
shl.b32 t2, $8, 2;
and.b32 t2, t2, 0x1C1C1C1C;
lop3.b32 ev, t1, 0x80808080, t2, 0xEA;
mov.b32 {p0, p1}, ev;
mov.b32 {p2, p3}, od;
cvt.rn.f16x2.e4m3x2 h0, p0;
cvt.rn.f16x2.e4m3x2 h1, p1;
cvt.rn.f16x2.e4m3x2 h2, p2;
cvt.rn.f16x2.e4m3x2 h3, p3;
mov.b32 {q0, q2}, h0;
mov.b32 {q4, q6}, h1;
mov.b32 {q1, q3}, h2;
mov.b32 {q5, q7}, h3;
cvt.f32.f16 $0, q0;
cvt.f32.f16 $1, q1;
cvt.f32.f16 $2, q2;
cvt.f32.f16 $3, q3;
cvt.f32.f16 $4, q4;
cvt.f32.f16 $5, q5;
cvt.f32.f16 $6, q6;
cvt.f32.f16 $7, q7;
}"""
_E2M1_E4M3_PTX = tl.constexpr(_PTX) if HAS_TRITON else _PTX  # a jit function reads constexprs


@_jit
def _e2m1_word(w):
    # (codes 0..7 of int32 words w) * 2^-6 as 8 fp32 tensors: _E2M1_E4M3_PTX
    return tl.inline_asm_elementwise(_E2M1_E4M3_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)


# ===== the byte-form decode (nvfp4_gemv.py's `byte_dec` tiles) =====
# An E2M1 code c = s e1 e0 m as the fp16 ((c & 7) << 9) | ((c & 8) << 12) (_e2m1_pair's bits, value
# E2M1 * 2^-14; codes 0 and 1 land on fp16 zero / subnormals, which the f16 -> f32 conversion
# keeps exact): its low byte is 0 and its high byte B(c) = (s << 7) | ((c & 7) << 1). Four B at
# once per word, one per byte lane: odd codes (high nibbles) keep their sign at bit 7 and move
# the magnitude down 3, even codes move up 4 (sign) and 1 (magnitude):
#   O = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)   byte b = B(code 2b + 1)   3 instructions
#   E = ((w << 4) & 0x80808080) | ((w << 1) & 0x0E0E0E0E)   byte b = B(code 2b)   4 instructions
# then each fp16x2 pair (codes J, J + 4: bytes 1 and 3 of its register, bytes 0 and 2 zero) is
# one byte move (PRMT on sm_90): codes 0, 4 = E's bytes 0, 2; 1, 5 = O's 0, 2; 2, 6 = E's 1, 3;
# 3, 7 = O's 1, 3. 11 integer instructions and 8 f16 -> f32 conversions a word (2.4 a code)
# against _e2m1_pair's 16 and 8 (3 a code), and no e4m3 conversion (the F2FP pipe that made
# _e2m1_word slow in nvfp4_gemv). In Triton ops LLVM splits a pair back into its halves (the high
# half's `>> 16` is narrowed into its own shift and mask: ~2 more instructions a word, measured
# in sm_90 SASS), hence the PTX form for CUDA.


@_jit
def _f16_pair(bits):
    # int32 fp16x2 bits -> (low half, high half) as fp32, exact
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@_jit
def _e2m1_bytes(w):
    # codes 0..7 of int32 words w -> E2M1 * 2^-14 as 8 fp32 tensors of w's shape, exact (the
    # byte form above; bit-identical to _e2m1_pair's values). (>> is arithmetic on int32: the
    # bits it shifts in at the top fall outside the 0x0E0E0E0E mask. The masks over 2^31 are
    # written as negative int32 literals: 0x80808080 = -2139062144, 0xFF00FF00 = -16711936; a
    # positive literal would promote w to int64.)
    o = (w & -2139062144) | ((w >> 3) & 0x0E0E0E0E)  # byte b: B(code 2b + 1)
    e = ((w << 4) & -2139062144) | ((w << 1) & 0x0E0E0E0E)  # byte b: B(code 2b)
    c0, c4 = _f16_pair((e << 8) & -16711936)
    c1, c5 = _f16_pair((o << 8) & -16711936)
    c2, c6 = _f16_pair(e & -16711936)
    c3, c7 = _f16_pair(o & -16711936)
    return c0, c1, c2, c3, c4, c5, c6, c7


# _e2m1_bytes in PTX: prmt d, a, 0, sel picks byte sel[4i..4i+3] of {a (0-3), 0 (4-7)} for byte i of
# d: 0x2404 -> (a.b0 -> byte 1, a.b2 -> byte 3), 0x3414 -> (a.b1 -> 1, a.b3 -> 3), zeros elsewhere;
# lop3 0xEA = (a & b) | c
_PTX_BYTES = """{
.reg .b32 t, u, o, e, p0, p1, p2, p3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
shr.b32 t, $8, 3;
and.b32 t, t, 0x0E0E0E0E;
lop3.b32 o, $8, 0x80808080, t, 0xEA;
shl.b32 u, $8, 4;
shl.b32 t, $8, 1;
and.b32 t, t, 0x0E0E0E0E;
lop3.b32 e, u, 0x80808080, t, 0xEA;
prmt.b32 p0, e, 0, 0x2404;
prmt.b32 p1, o, 0, 0x2404;
prmt.b32 p2, e, 0, 0x3414;
prmt.b32 p3, o, 0, 0x3414;
mov.b32 {h0, h4}, p0;
mov.b32 {h1, h5}, p1;
mov.b32 {h2, h6}, p2;
mov.b32 {h3, h7}, p3;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4;
cvt.f32.f16 $5, h5;
cvt.f32.f16 $6, h6;
cvt.f32.f16 $7, h7;
}"""
_E2M1_BYTES_PTX = tl.constexpr(_PTX_BYTES) if HAS_TRITON else _PTX_BYTES


@_jit
def _e2m1_bytes_ptx(w):
    # _e2m1_bytes through _E2M1_BYTES_PTX (CUDA only): the same 8 fp32 tensors, bit for bit
    return tl.inline_asm_elementwise(_E2M1_BYTES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)

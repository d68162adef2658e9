"""E2M1 (NVFP4 element) decode helpers shared by the NVFP4 kernels (Triton device functions).

Both take int32 words of 8 codes (code j of a word in bits 4j..4j+3: element 8w + j of a packed
NVFP4 row, byte b holding elements 2b (low nibble) and 2b + 1 (high), docs/model.md section 12)
and return exact fp32 values times a power of two, which the caller undoes exactly:
* `_e2m1_pair(w, J)`: codes J and J + 4, times 2^-14, by integer bit steps and an fp16 bitcast;
  runs anywhere, the Triton interpreter included.
* `_e2m1_word(w)`: all 8 codes, times 2^-6, through inline PTX (`_E2M1_E4M3_PTX`: the hardware
  e4m3 -> f16 conversion, sm_89+); fewer instructions, but CUDA only (no PTX in the interpreter).
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

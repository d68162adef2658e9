"""NVFP4 device helpers shared by the NVFP4 kernels (Triton device functions): the dense GEMV
(ftchat/kernels/nvfp4_gemv.py) and the routed experts' row-loop kernel 1
(ftchat/kernels/routed_experts.py).

E2M1 decode: int32 words of 8 codes (code j of a word in bits 4j..4j+3: element 8w + j of a
packed NVFP4 row, byte b holding elements 2b (low nibble) and 2b + 1 (high), docs/model.md
section 12) become exact fp32 values times 2^-14, which the caller undoes exactly (`_e2m1_pair`,
by integer bit steps and an fp16 bitcast; it runs anywhere, the Triton interpreter included).
The row-loop helpers read a row a chunk at a time as 1-D vectors over its scale groups (a group
a lane at 512 columns and one warp): `_row_chunk` the words and scales of BLOCK_N rows,
`_x_groups` x once for all of them, `_group_sum` a group's 16 products in one fp32 chain.
"""

from __future__ import annotations

from ftchat.kernels import jit as _jit, tl


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


@_jit
def _codes(w):
    # the 8 codes of int32 words w as fp32 tensors of w's shape, code j = element 8w + j, exact
    # E2M1 values times 2^-14
    c0, c4 = _e2m1_pair(w, 0)
    c1, c5 = _e2m1_pair(w, 1)
    c2, c6 = _e2m1_pair(w, 2)
    c3, c7 = _e2m1_pair(w, 3)
    return c0, c1, c2, c3, c4, c5, c6, c7


@_jit
def _x_groups(x_ptr, bi, kg, gg, g_ok, K: tl.constexpr, EVEN_K: tl.constexpr,
              BF16: tl.constexpr):
    # x[bi, 16 (kg + g) + e] for e = 0..15 as a tuple of 16 fp32 [BG] vectors (g in gg): each
    # scale group's 16 elements, read once for all of a program's rows; g_ok: the groups inside
    # the program's columns (unused when EVEN_K). bf16 x as 8 int32 pairs a group (element 2i in
    # the low half): an fp32 whose low 16 bits are zero is the bf16 widened, so `<< 16` and
    # `& 0xFFFF0000` give elements 2i and 2i + 1 exactly in one integer op each (no convert);
    # fp32 x element by element
    xs = ()
    if BF16:
        x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + bi * (K // 2) + 8 * (kg + gg)
        for i in tl.static_range(8):
            if EVEN_K:
                v = tl.load(x32 + i)
            else:
                v = tl.load(x32 + i, mask=g_ok, other=0)
            xs = xs + ((v << 16).to(tl.float32, bitcast=True),
                       (v & -65536).to(tl.float32, bitcast=True))
    else:
        xg = x_ptr + bi * K + 16 * (kg + gg)
        for e in tl.static_range(16):
            if EVEN_K:
                v = tl.load(xg + e)
            else:
                v = tl.load(xg + e, mask=g_ok, other=0.0)
            xs = xs + (v.to(tl.float32),)
    return xs


@_jit
def _group_sum(e, o, xs):
    # a scale group's 16 products summed in fp32: e, o the 8 codes of the group's even and odd
    # word (tuples of [BG] vectors), xs its 16 x vectors (`_x_groups`); one chain of
    # multiply-adds in element order
    acc = e[0] * xs[0]
    for j in tl.static_range(1, 8):
        acc += e[j] * xs[j]
    for j in tl.static_range(8):
        acc += o[j] * xs[8 + j]
    return acc


@_jit
def _row_chunk(wb, sb, row0, c: tl.constexpr, kg0, kge, gg, N4: tl.constexpr, K: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    # chunk c's words [BG, 2] (group g's word pair) and scale bytes [BG] of the BLOCK_N rows
    # row0 + r, as two tuples; wb / sb: row row0's words / scales at the program's first group
    # (every other row and chunk is a constant offset: immediate addresses)
    BG: tl.constexpr = gg.shape[0]
    ws = ()
    ss = ()
    for r in tl.static_range(BLOCK_N):
        wp = wb + (r * (K // 8) + c * 2 * BG)
        sp = sb + (r * (K // 16) + c * BG)
        if EVEN_K and N4 % BLOCK_N == 0:
            ws = ws + (tl.load(wp),)
            ss = ss + (tl.load(sp),)
        else:
            ok = (kg0 + c * BG + gg < kge) & (row0 + r < N4)  # [BG]
            ws = ws + (tl.load(wp, mask=ok[:, None], other=0),)
            ss = ss + (tl.load(sp, mask=ok, other=0),)
    return ws, ss

"""What one program of the NVFP4 decode GEMV accumulates (ftchat/kernels/nvfp4_gemv.py: the design,
the numerics and the tiles that pick a form): acc [BLOCK_N, RB] fp32 over its run of chunks,
before the row globals and the split hand-off.

Three forms for NVFP4 rows and one for the dense tail:
* `_fp4_rows` (tiled): words [BLOCK_N, BLOCK_K/8] decoded once, x loaded per weight per row;
* `_fp4_rows_loop` (`Nvfp4Tiles.rowloop`): the rows one at a time, every tensor 1-D over a chunk's
  scale groups, x read once a chunk (ftchat/kernels/fp4.py's row helpers);
* `_fp4_rows_tc` (`Nvfp4Tiles.tc`): the decoded weights times their scale as bf16 tiles in tl.dot;
* `_dense_rows`: the bf16 / fp32 tail rows, gemv.py's dense dot.
Every form issues its first chunk's weight loads before the PDL wait (weights only).
Legend as nvfp4_gemv.py: RB rows padded, BW = BLOCK_K/8 words, BG = BLOCK_K/16 groups a chunk.
"""

from __future__ import annotations

from ftchat.kernels import jit as _jit, tl
from ftchat.kernels.fp4 import _codes, _group_sum, _row_chunk, _x_groups
from ftchat.kernels.sync import pdl_wait


@_jit
def _program_span(w_ptr, s_ptr, n, s, K: tl.constexpr, KS: tl.constexpr):
    # rows n's word and scale pointers [BLOCK_N, 1], and program s's span of a row: its first
    # word and group (kw0, kg0) and their ends (kwe, kge), clamped to K
    w_rows = w_ptr + n[:, None] * (K // 8)
    s_rows = s_ptr + n[:, None] * (K // 16)
    kw0 = s * (KS // 8)
    kg0 = s * (KS // 16)
    return (w_rows, s_rows, kw0, kg0, tl.minimum(kw0 + KS // 8, K // 8),
            tl.minimum(kg0 + KS // 16, K // 16))


@_jit
def _fp4_chunk(w_rows, s_rows, n_ok, kw, kg, kwe, kge, ww, gg, EVEN_K: tl.constexpr):
    # one chunk's words [BLOCK_N, BW] (from word kw) and scale bytes [BLOCK_N, BG] (from group
    # kg = kw / 2); kwe, kge: the program's bounds (unused when EVEN_K: every chunk lies in K)
    if EVEN_K:
        w = tl.load(w_rows + kw + ww[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(s_rows + kg + gg[None, :], mask=n_ok[:, None], other=0)
    else:
        w = tl.load(w_rows + kw + ww[None, :], mask=n_ok[:, None] & (kw + ww < kwe)[None, :],
                    other=0)
        s = tl.load(s_rows + kg + gg[None, :], mask=n_ok[:, None] & (kg + gg < kge)[None, :],
                    other=0)
    return w, s


@_jit
def _x_code(x_word, j: tl.constexpr, x_ok, EVEN_K: tl.constexpr):
    # x[8w + j] for the chunk's words w as fp32 [BLOCK_N, BW]; x_word: pointers to x[8w]
    if EVEN_K:
        v = tl.load(x_word + j)
    else:
        v = tl.load(x_word + j, mask=x_ok, other=0.0)
    return v.to(tl.float32)


@_jit
def _fp4_rows(w_ptr, s_ptr, x_ptr, n, n_ok, s, K: tl.constexpr, KS: tl.constexpr,
              CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # acc[n, b] = sum over the program's groups of scale[n, grp] * sum_{k in grp} E2M1 w[n, k] *
    # x[b, k], fp32 [BLOCK_N, RB] (no global yet); w_ptr: int32 words [N4, K/8], s_ptr: scale
    # bytes [N4, K/16]
    BW: tl.constexpr = BLOCK_K // 8  # words a chunk row
    BG: tl.constexpr = BLOCK_K // 16  # scale groups a chunk row
    ww = tl.arange(0, BW)
    gg = tl.arange(0, BG)
    bb = tl.arange(0, RB)[None, :]
    w_rows, s_rows, kw0, kg0, kwe, kge = _program_span(w_ptr, s_ptr, n, s, K, KS)
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    w, sc = _fp4_chunk(w_rows, s_rows, n_ok, kw0, kg0, kwe, kge, ww, gg, EVEN_K)
    pdl_wait(PDL)  # the first chunk's weights overlap the previous kernel; x comes after
    for c in tl.static_range(CPP):
        kw = kw0 + c * BW
        if c + 1 < CPP:  # the next chunk's loads go out before this one is decoded
            w_next, sc_next = _fp4_chunk(w_rows, s_rows, n_ok, kw + BW, kg0 + (c + 1) * BG, kwe,
                                         kge, ww, gg, EVEN_K)
        c0, c1, c2, c3, c4, c5, c6, c7 = _codes(w)  # [BLOCK_N, BW] each, once for all rows
        # [BLOCK_N, BG], exact; 2^14 undoes the decode's power of two exactly
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        # x is loaded as [BLOCK_N, BW] (the same address down a column). (Meant to keep the
        # words' layout; sm_90 SASS of the 8 x 512 tiles shows otherwise: Triton gives the x loads
        # a layout of one element a thread and converts the 8 codes to it through shared memory,
        # so x costs a 2-byte load and a conversion per weight per row. The row loop below
        # reads x once a chunk.)
        x_ok = (kw + ww < kwe)[None, :] & n_ok[:, None]
        for bi in tl.static_range(ROWS):
            xw = x_ptr + bi * K + 8 * (kw + ww)[None, :] + 0 * n[:, None]  # -> x[bi, 8w]
            part = c0 * _x_code(xw, 0, x_ok, EVEN_K)  # [BLOCK_N, BW], codes in order 0..7
            part += c1 * _x_code(xw, 1, x_ok, EVEN_K)
            part += c2 * _x_code(xw, 2, x_ok, EVEN_K)
            part += c3 * _x_code(xw, 3, x_ok, EVEN_K)
            part += c4 * _x_code(xw, 4, x_ok, EVEN_K)
            part += c5 * _x_code(xw, 5, x_ok, EVEN_K)
            part += c6 * _x_code(xw, 6, x_ok, EVEN_K)
            part += c7 * _x_code(xw, 7, x_ok, EVEN_K)
            grp = tl.sum(tl.reshape(part, (BLOCK_N, BG, 2)), axis=2)  # [BLOCK_N, BG] group sums
            d = tl.sum(grp * scale, axis=1)  # [BLOCK_N]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
        if c + 1 < CPP:
            w, sc = w_next, sc_next
    return acc


@_jit
def _fp4_rows_loop(w_ptr, s_ptr, x_ptr, p, s, N4: tl.constexpr, K: tl.constexpr,
                   KS: tl.constexpr, CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   BF16: tl.constexpr, PDL: tl.constexpr):
    # _fp4_rows' acc [BLOCK_N, RB] for block p, every tensor 1-D over the chunk's BG groups: each
    # row's words are a [BG, 2] load (a group's pair in one thread: 8 bytes, a group a lane at
    # block_k 512), its 16 codes [BG] vectors, x the same [BG] vectors (`_x_groups`, read once a
    # chunk for all rows), so one layout throughout. All rows' words and scales of a chunk are
    # loaded (the next chunk's too) before the decoding. Per (row, row of x) a [BG] fp32
    # accumulator of group sums (`_group_sum`) times scales over the chunks, summed across the
    # groups once at the end. The decode's power of two is undone on the result: a power of two
    # commutes with every fp32 rounding here (no value near the fp32 range's ends), so exactly
    BG: tl.constexpr = BLOCK_K // 16
    gg = tl.arange(0, BG)
    hh = tl.arange(0, 2)
    kg0 = s * (KS // 16)
    kge = tl.minimum(kg0 + KS // 16, K // 16)
    row0 = p * BLOCK_N
    wb = w_ptr + row0 * (K // 8) + 2 * kg0 + (2 * gg[:, None] + hh[None, :])  # [BG, 2]
    sb = s_ptr + row0 * (K // 16) + kg0 + gg  # [BG]
    ws, ss = _row_chunk(wb, sb, row0, 0, kg0, kge, gg, N4, K, BLOCK_N, EVEN_K)
    pdl_wait(PDL)
    accs = ()  # [BG] fp32, index r * ROWS + bi
    for i in tl.static_range(BLOCK_N * ROWS):
        accs = accs + (tl.zeros([BG], dtype=tl.float32),)
    for c in tl.static_range(CPP):
        if c + 1 < CPP:
            ws_next, ss_next = _row_chunk(wb, sb, row0, c + 1, kg0, kge, gg, N4, K, BLOCK_N,
                                          EVEN_K)
        kg = kg0 + c * BG
        g_ok = kg + gg < kge
        xss = ()
        for bi in tl.static_range(ROWS):
            xss = xss + (_x_groups(x_ptr, bi, kg, gg, g_ok, K, EVEN_K, BF16),)
        nxt = ()
        for r in tl.static_range(BLOCK_N):
            we, wo = tl.split(ws[r])  # [BG] each: words 2g, 2g + 1
            e = _codes(we)
            o = _codes(wo)
            scale = ss[r].to(tl.float8e4nv, bitcast=True).to(tl.float32)
            for bi in tl.static_range(ROWS):
                nxt = nxt + (accs[r * ROWS + bi] + _group_sum(e, o, xss[bi]) * scale,)
        accs = nxt
        if c + 1 < CPP:
            ws, ss = ws_next, ss_next
    rr = tl.arange(0, BLOCK_N)[:, None]
    bb = tl.arange(0, RB)[None, :]
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    for r in tl.static_range(BLOCK_N):
        for bi in tl.static_range(ROWS):
            acc = tl.where((rr == r) & (bb == bi), tl.sum(accs[r * ROWS + bi], axis=0), acc)
    return acc * 16384.0


@_jit
def _fp4_rows_tc(w_ptr, s_ptr, x_ptr, n, n_ok, s, K: tl.constexpr, KS: tl.constexpr,
                 CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TC: tl.constexpr,
                 PDL: tl.constexpr):
    # _fp4_rows' acc [BLOCK_N, RB] (RB = TC_ROWS) on tensor cores: per chunk the codes decode to
    # E2M1 * 2^-14 (bit steps), times 2^14 * their block scale in fp32 (exact: E2M1 has 2 and
    # e4m3 4 significant bits, so the product fits bf16's 8), as bf16 [BLOCK_N, BLOCK_K] in
    # element order; tl.dot with x^T [BLOCK_K, RB] (rows >= ROWS zero) accumulates in fp32
    BW: tl.constexpr = BLOCK_K // 8
    BG: tl.constexpr = BLOCK_K // 16
    ww = tl.arange(0, BW)
    gg = tl.arange(0, BG)
    kk = tl.arange(0, BLOCK_K)
    bb = tl.arange(0, RB)
    w_rows, s_rows, kw0, kg0, kwe, kge = _program_span(w_ptr, s_ptr, n, s, K, KS)
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    w, sc = _fp4_chunk(w_rows, s_rows, n_ok, kw0, kg0, kwe, kge, ww, gg, EVEN_K)
    pdl_wait(PDL)
    for c in tl.static_range(CPP):
        kw = kw0 + c * BW
        if c + 1 < CPP:
            w_next, sc_next = _fp4_chunk(w_rows, s_rows, n_ok, kw + BW, kg0 + (c + 1) * BG, kwe,
                                         kge, ww, gg, EVEN_K)
        c0, c1, c2, c3, c4, c5, c6, c7 = _codes(w)  # [BLOCK_N, BW], E2M1 * 2^-14
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # [BLOCK_N, BG]
        sw = tl.reshape(tl.join(scale, scale), (BLOCK_N, BW))  # word w's group: w // 2
        # element 8w + j: a join adds a last (fastest) dim, so the first join pairs j's top bit
        # and the last its lowest; the reshape keeps row-major order
        q0 = tl.join(tl.join(c0 * sw, c4 * sw), tl.join(c2 * sw, c6 * sw))
        q1 = tl.join(tl.join(c1 * sw, c5 * sw), tl.join(c3 * sw, c7 * sw))
        wt = tl.reshape(tl.join(q0, q1), (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
        k = 8 * kw + kk  # [BLOCK_K] columns of x
        x_ok = (k < 8 * kwe)[:, None] & (bb < ROWS)[None, :]
        xt = tl.load(x_ptr + bb[None, :] * K + k[:, None], mask=x_ok, other=0.0)  # [BLOCK_K, RB]
        if TC == 1:
            acc = tl.dot(wt, xt.to(tl.bfloat16), acc)
        else:  # the interpreter, whose bf16 dot is wrong: the same exact operands in fp32
            acc = tl.dot(wt.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        if c + 1 < CPP:
            w, sc = w_next, sc_next
    return acc


@_jit
def _dense_rows(t_ptr, x_ptr, r, r_ok, s, K: tl.constexpr, KS: tl.constexpr, CPP: tl.constexpr,
                ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # acc[r, b] = sum over the program's columns k of tail[r, k] x[b, k], fp32 [BLOCK_T, RB]
    kk = tl.arange(0, BLOCK_K)
    bb = tl.arange(0, RB)[None, :]
    k0 = s * KS
    k_end = tl.minimum(k0 + KS, K)
    acc = tl.zeros([BLOCK_T, RB], dtype=tl.float32)
    for c in tl.static_range(CPP):
        k = k0 + c * BLOCK_K + kk  # [BLOCK_K]
        k_ok = k < k_end
        if EVEN_K:
            w = tl.load(t_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None], other=0.0)
        else:
            w = tl.load(t_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if c == 0:
            pdl_wait(PDL)  # as in _fp4_rows: after the first weight load
        w = w.to(tl.float32)  # [BLOCK_T, BLOCK_K]
        xk = x_ptr + k[None, :] + 0 * r[:, None]  # [BLOCK_T, BLOCK_K] in w's layout (as above)
        for bi in tl.static_range(ROWS):
            if EVEN_K:
                xb = tl.load(xk + bi * K).to(tl.float32)
            else:
                xb = tl.load(xk + bi * K, mask=k_ok[None, :], other=0.0).to(tl.float32)
            d = tl.sum(w * xb, axis=1)  # [BLOCK_T]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
    return acc

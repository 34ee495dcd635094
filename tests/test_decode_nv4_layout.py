"""The explicit-layout nvfp4 decode (``kernels/decode_nv4.py``, Gluon, GPU only: its numerics are checked
against the float64 reference in tests/test_gpu_kernels.py).  Here, on the CPU: the slot → element maps
it is built on are permutations with the properties the loads rely on, its unpacking PTX produces the
values in the order the maps assume (run by the emulator of tests/test_unpack_ptx.py), and a call it cannot
take is a clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbench.kernels import decode_nv4 as nv4
from kvbench.kernels.formats import E2M1_VALUES

sys.path.insert(0, str(Path(__file__).parent))
from test_unpack_ptx import _e4m3, _f16, run_ptx  # noqa: E402


def test_maps_are_permutations():
    assert sorted(nv4.K_TO_D) == list(range(128))
    assert sorted(nv4.COL_TO_D) == list(range(128))


def test_qk_slots_of_a_thread_are_its_16_bytes_and_a_word_shares_a_block():
    # in the scores' left fragment [tokens, slots], lane c + 4g (c = slot bits 1-2) holds, per token, slots k
    # with (k >> 1) & 3 == c: its elements must be the
    # token's bytes 16c .. 16c+15 (one 128-bit load), and the 8 slots of one register group (word m = k >> 5)
    # one 32-bit word with a single block scale
    for c in range(4):
        ds = [nv4.k_to_d(k) for k in range(128) if (k >> 1) & 3 == c]
        assert sorted(d // 2 for d in ds) == sorted(list(range(16 * c, 16 * c + 16)) * 2)
        for m in range(4):
            dm = [nv4.k_to_d(k) for k in range(128) if (k >> 1) & 3 == c and k >> 5 == m]
            assert sorted(dm) == list(range(32 * c + 8 * m, 32 * c + 8 * m + 8))
            assert len({d // 16 for d in dm}) == 1


def test_pv_columns_of_a_lane_are_8_bytes_of_one_block():
    for g in range(8):
        ds = [nv4.col_to_d(n) for n in range(128) if n & 7 == g]
        assert sorted(ds) == list(range(16 * g, 16 * g + 16))
        for s in range(2):  # the two words 2g, 2g+1
            assert sorted(nv4.col_to_d(n) for n in range(128) if n & 7 == g and n >> 6 == s) == list(
                range(16 * g + 8 * s, 16 * g + 8 * s + 8))


def test_unpack_order_matches_the_maps():
    # pack element (e, h, a) of a K word is nibble 4a + 2e + h; column j of a V word is nibble 2(j mod 4) + j div 4
    for k in range(128):
        e, h, a = k & 1, (k >> 3) & 1, (k >> 4) & 1
        assert nv4.k_to_d(k) % 8 == 4 * a + 2 * e + h
    for n in range(128):
        j = (n >> 3) & 7
        assert nv4.col_to_d(n) % 8 == [0, 2, 4, 6, 1, 3, 5, 7][j]


def test_a_call_it_cannot_take_is_a_clear_error():
    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.kernel_check import make_cache, random_page_table

    gen = torch.Generator().manual_seed(0)
    kc, kbs, ks, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    vc, vbs, vs, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    table = random_page_table([20], 16, 4, gen, "cpu")
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gluon=True: .*CUDA GPU only"):
        paged_decode(q, PagedKV("nvfp4", kc, vc, ks, vs, kbs, vbs), table, torch.tensor([20], dtype=torch.int32),
                     opts=DecodeOptions(gluon=True))


def _e2m1(code: int) -> float:
    v = E2M1_VALUES[code & 7]
    return -v if code & 8 else v


def _halves(r: int):
    return _f16(r), _f16(r >> 16)


@pytest.mark.parametrize("seed", range(3))
def test_k_unpack_ptx_gives_the_slots_values(seed):
    # one word of tokens a ($8) and b ($10) -> 8 f16x2: register j = token (j & 1), nibble pair p = j >> 1,
    # halves e = 0, 1; the value of nibble (p & 1) + 2e + 4(p >> 1) (k_to_d's order) times the block scale
    rng = np.random.default_rng(seed)
    scales = [0x40, 0x08, 0x7E, 0x38]  # e4m3 block scales: 2, 2^-6, 448, 1
    for _ in range(64):
        wa, wb = (int(x) for x in rng.integers(0, 2**32, size=2, dtype=np.uint64))
        sa, sb = (scales[int(i)] for i in rng.integers(0, 4, size=2))
        s16 = [int(np.array([_e4m3(x) * 64], dtype=np.float16).view(np.uint16)[0]) for x in (sa, sb)]
        r = run_ptx(nv4._K_ASM.value, {"$8": wa, "$10": wb, "$24": s16[0] * 0x10001, "$25": s16[1] * 0x10001})
        for j in range(8):
            w, sc = (wa, sa) if j % 2 == 0 else (wb, sb)
            p = j >> 1
            want = [_e2m1((w >> (4 * ((p & 1) + 2 * e + 4 * (p >> 1)))) & 0xF) * _e4m3(sc) for e in (0, 1)]
            assert list(_halves(r[f"${j}"])) == want, (j, hex(w))


@pytest.mark.parametrize("seed", range(3))
def test_v_unpack_ptx_gives_token_pairs_per_column(seed):
    # the same word of tokens t ($8) and u ($9) -> 8 f16x2 (t, u) of nibble [0, 2, 4, 6, 1, 3, 5, 7][j]
    rng = np.random.default_rng(100 + seed)
    for _ in range(64):
        wt, wu = (int(x) for x in rng.integers(0, 2**32, size=2, dtype=np.uint64))
        st, su = (int(x) for x in rng.choice([0x40, 0x08, 0x7E, 0x38], size=2))
        s16 = [int(np.array([_e4m3(x) * 64], dtype=np.float16).view(np.uint16)[0]) for x in (st, su)]
        r = run_ptx(nv4._V_ASM.value, {"$8": wt, "$9": wu, "$24": s16[0] | (s16[1] << 16)})
        for j in range(8):
            nib = [0, 2, 4, 6, 1, 3, 5, 7][j]
            want = [_e2m1((wt >> 4 * nib) & 0xF) * _e4m3(st), _e2m1((wu >> 4 * nib) & 0xF) * _e4m3(su)]
            assert list(_halves(r[f"${j}"])) == want, (j, hex(wt), hex(wu))


@pytest.mark.parametrize("seed", range(3))
def test_byte_permute_unpacking_gives_the_values_times_its_gain(seed):
    # UNPACK=1 (the default): the same outputs in the same order as the e4m3 route, times 2^-8 (``unpack_gain``),
    # exactly: nibbles placed as float16 high bytes (2^-14 times their values), times the scale times 2^6
    rng = np.random.default_rng(200 + seed)
    gain = nv4.unpack_gain(1)
    assert gain == 2.0 ** -8 and nv4.unpack_gain(0) == 1.0
    for _ in range(64):
        wa, wb = (int(x) for x in rng.integers(0, 2**32, size=2, dtype=np.uint64))
        sa, sb = (int(x) for x in rng.choice([0x40, 0x08, 0x7E, 0x38, 0x01], size=2))  # 0x01: 2^-9, subnormal
        s16 = [int(np.array([_e4m3(x) * 64], dtype=np.float16).view(np.uint16)[0]) for x in (sa, sb)]
        k_ref = run_ptx(nv4._K_ASM.value, {"$8": wa, "$10": wb, "$24": s16[0] * 0x10001, "$25": s16[1] * 0x10001})
        k_new = run_ptx(nv4._K_ASM_P.value, {"$8": wa, "$10": wb, "$24": s16[0] * 0x10001, "$25": s16[1] * 0x10001})
        v_ref = run_ptx(nv4._V_ASM.value, {"$8": wa, "$9": wb, "$24": s16[0] | (s16[1] << 16)})
        v_new = run_ptx(nv4._V_ASM_P.value, {"$8": wa, "$9": wb, "$24": s16[0] | (s16[1] << 16)})
        for j in range(8):
            for ref, new in ((k_ref, k_new), (v_ref, v_new)):
                assert [x * gain for x in _halves(ref[f"${j}"])] == list(_halves(new[f"${j}"])), (j, hex(wa), hex(wb))


def test_v_rows_in_shared_memory_are_a_bijection_without_bank_conflicts():
    # _V_SMEM maps each word offset of a stage [128 tokens, 16 words] to one (token, word); a lane's 8-byte read of
    # V's fragment (tokens 2c + e + 8h + 16a + 32w, words 2g, 2g + 1) meets the other 15 lanes of its half-warp in
    # 32 different banks; the copies' 16-byte runs (words 4r .. 4r + 3 of a token) stay contiguous and aligned
    bases = nv4._V_SMEM.value.offset_bases
    where = {}
    for off in range(128 * 16):
        t = w = 0
        for i, (bt, bw) in enumerate(bases):
            if off >> i & 1:
                t, w = t ^ bt, w ^ bw
        where[(t, w)] = off
    assert len(where) == 128 * 16 and set(where) == {(t, w) for t in range(128) for w in range(16)}
    for e, h, a, wp, half in ((e, h, a, wp, half) for e in (0, 1) for h in (0, 1) for a in (0, 1) for wp in range(4)
                              for half in (0, 1)):
        banks = [(where[(2 * c + e + 8 * h + 16 * a + 32 * wp, 2 * g + x)]) % 32 for c in range(4)
                 for g in range(4 * half, 4 * half + 4) for x in (0, 1)]
        assert len(set(banks)) == 32
    for t in range(128):
        for r in range(4):
            offs = [where[(t, 4 * r + x)] for x in range(4)]
            assert offs[0] % 4 == 0 and offs == list(range(offs[0], offs[0] + 4))


def test_the_pipelined_loads_take_block_scales_as_words_only_where_rows_are_aligned():
    from kvbench.kernels._triton_utils import check_cache
    from kvbench.tools.kernel_check import make_cache

    gen = torch.Generator().manual_seed(2)
    kc, kbs, ks, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    vc, vbs, vs, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    k, v = check_cache("k", "nvfp4", kc, kbs, ks, 128), check_cache("v", "nvfp4", vc, vbs, vs, 128)
    assert nv4._scale_words(k, v)
    odd = torch.zeros(kbs.numel() + 1, dtype=kbs.dtype)[1:].view(kbs.shape)  # rows one byte off a word
    k2 = check_cache("k", "nvfp4", kc, odd, ks, 128)
    assert not nv4._scale_words(k2, v)


def test_unsupported_names_the_reason():
    from kvbench.kernels._triton_utils import check_cache
    from kvbench.tools.kernel_check import make_cache

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16)

    def caches(page, d=128, fmt="nvfp4"):
        kc, kbs, ks, _ = make_cache(fmt, 4, page, 2, d, "cpu", gen)
        vc, vbs, vs, _ = make_cache(fmt, 4, page, 2, d, "cpu", gen)
        return check_cache("k", fmt, kc, kbs, ks, d), check_cache("v", fmt, vc, vbs, vs, d)

    kc, vc = caches(16)
    assert "CUDA GPU only" in nv4.unsupported(q, kc, vc, 4, None, "nvfp4")
    assert "pages of a multiple of 16" in nv4.unsupported(q, *caches(8), 4, None, "nvfp4")
    assert "at most 16 query heads" in nv4.unsupported(q, kc, vc, 32, None, "nvfp4")
    assert "float16 / bfloat16 query" in nv4.unsupported(q.float(), kc, vc, 4, None, "nvfp4")
    assert "nvfp4 caches only" in nv4.unsupported(q, kc, vc, 4, None, "fp8_e4m3")
    q64 = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    assert "head dim 128" in nv4.unsupported(q64, *caches(16, 64), 4, None, "nvfp4")

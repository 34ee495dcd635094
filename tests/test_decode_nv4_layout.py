"""The explicit-layout nvfp4 decode (``kernels/decode_nv4.py``, Gluon, GPU only: its numerics are checked
against the float64 reference in tests/test_gpu_kernels.py).  Here, on the CPU: the slot → element maps
it is built on are permutations with the properties the loads rely on, and a call it cannot take is a
clear error."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels import decode_nv4 as nv4


def test_maps_are_permutations():
    assert sorted(nv4.K_TO_D) == list(range(128))
    assert sorted(nv4.COL_TO_D) == list(range(128))


def test_qk_slots_of_a_thread_are_its_16_bytes_and_a_word_shares_a_block():
    # lane c (= slot bits 1-2) holds, per token, slots k with (k >> 1) & 3 == c: its elements must be the
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
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.kernel_check import make_cache, random_page_table

    gen = torch.Generator().manual_seed(0)
    kc, kbs, ks, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    vc, vbs, vs, _ = make_cache("nvfp4", 4, 16, 2, 128, "cpu", gen)
    table = random_page_table([20], 16, 4, gen, "cpu")
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gluon=True: .*CUDA GPU only"):
        paged_decode(q, kc, vc, table, torch.tensor([20], dtype=torch.int32), kv_format="nvfp4", k_scale=ks,
                     v_scale=vs, k_block_scale=kbs, v_block_scale=vbs, gluon=True)

"""The prefill kernel with the query heads of a GQA group packed into one program (``PrefillOptions.pack_gqa``;
Triton CPU interpreter) against the float64 reference and against the unpacked kernel on the same inputs:
every KV format, prefixes of whole and partial tiles, prompts only, sliding window, sinks, fp8 queries, the
split bf16 query over an e4m3 prefix, tensor descriptors for the new tokens, and the refusals.  Outputs are
poisoned with NaN before each run."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvbench.tools import kernel_check as C
from kvbench.kernels.formats import FORMAT_NAMES

FEATURES = [
    # sliding window, sinks, fp8 q, compute dtype
    (None, False, False, torch.float32),
    (21, True, False, torch.bfloat16),
    (None, True, True, torch.float16),
]


def _tol(dtype):
    return C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
def test_packed_prefill_matches_reference_and_unpacked(fmt, window, sinks, q8, dtype):
    # G = 4 (8 query heads over 2 kv heads), 16 rows = 4 tokens x 4 heads per program; new tokens that end mid
    # block (5, 1, 19) and prefixes of whole and partial 16-key tiles
    (plain, packed), ref, label = C._prefill_run(
        fmt, [5, 40, 1, 19], [0, 23, 48, 32], 8, 2, 32, 8, dtype=dtype, window=window, sinks=sinks, q_fp8=q8,
        device="cpu", seed=len(fmt) * 11 + (window or 3),
        variants=[dict(block_m=16, block_n=16), dict(block_m=16, block_n=16, pack_gqa=True)])
    e_plain, e_packed = C.rel_err(plain, ref), C.rel_err(packed, ref)
    assert e_packed <= _tol(dtype), f"{label}: packed {e_packed:.2e}, unpacked {e_plain:.2e}"
    # the same arithmetic per row, in another order of programs: as close to the unpacked output as the
    # compute dtype's rounding of the same values allows
    assert C.rel_err(packed, plain.double()) <= max(1e-6, e_plain), label


@pytest.mark.parametrize("fmt,tma", [("bf16", True), ("fp8_e4m3", True), ("bf16", False)])
def test_packed_prefill_larger_blocks_and_descriptors(fmt, tma):
    # 32 rows = 8 tokens x 4 heads with 16-key tiles over the new tokens and 32-key tiles over the prefix; the
    # new tokens' K / V through tensor descriptors where tma (q by pointers: a packed block spans heads)
    case = C.check_prefill(fmt, [9, 33, 2], [31, 0, 64], 8, 2, 32, 8, dtype=torch.float32, device="cpu", seed=5,
                           block_m=32, block_n=16, block_n_prefix=32, tma=tma, pack_gqa=True)
    assert case.err <= C.TOL[torch.float32], case.line()


def test_packed_prefill_group_of_two_and_prompts_only():
    case = C.check_prefill("fp8_e5m2", [17, 3], [0, 0], 4, 2, 32, 8, dtype=torch.float32, device="cpu", seed=6,
                           block_m=16, block_n=16, pack_gqa=True, max_prefix_len=0)
    assert case.err <= C.TOL[torch.float32], case.line()


def test_packed_prefill_split_query_over_e4m3():
    # a bf16 q over an e4m3 prefix: q split into two e4m3 terms per row (one scale per row, so per head and
    # token when packed), the scores as fp8 dots on the stored K; against converting each K tile
    case = C.check_prefill_q_split([9, 40, 1], [32, 23, 50], 8, 2, 32, 8, window=19, sinks=True, device="cpu",
                                   seed=7, block_m=16, block_n=16, pack_gqa=True)
    assert case.err <= 1e-3, case.line()


def test_pack_gqa_refusals():
    from kvbench.kernels.prefill import _pack

    for hq, hk in ((6, 2), (2, 2)):  # a group of 3 (not a power of two), of 1 (nothing to pack)
        with pytest.raises(ValueError, match=f"got {hq // hk}"):
            C.check_prefill("bf16", [4], [0], hq, hk, 32, 8, dtype=torch.float32, device="cpu", block_m=16,
                            block_n=16, pack_gqa=True)
    with pytest.raises(ValueError, match=r"block_m \(4\)"):
        _pack(True, 8, 4)
    assert _pack(None, 4, 128) == 1 and _pack(False, 4, 128) == 1 and _pack(True, 4, 128) == 4

"""GPU: vLLM's FlashAttention 3 (``tools/vllm_fa3.py``, the anchor of the prefill rows of ``kvbench bench kernels``)
against the float64 reference and against kvbench's ``paged_prefill`` on the same pages, so that the anchor is
known to compute the same attention before its time is compared.  Skipped where the library is not found or the
GPU is not a Hopper; ``KVBENCH_REQUIRE_VLLM_FA3=1`` (a machine that carries it) makes that a failure."""

from __future__ import annotations

import math
import os

import pytest
import torch

from kvbench.kernels import reference as R
from kvbench.kernels import AttentionParams, PagedKV, PrefillOptions, paged_prefill
from kvbench.tools import vllm_fa3
from kvbench.tools.kernel_check import TOL, _attn_inputs, _query, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_fa3():
    if not vllm_fa3.available():
        why = vllm_fa3.find_library()[1] or "not a Hopper GPU"
        if os.environ.get("KVBENCH_REQUIRE_VLLM_FA3") == "1":
            pytest.fail(f"KVBENCH_REQUIRE_VLLM_FA3=1 but vLLM's FA3 is not available: {why}")
        pytest.skip(f"vLLM's FA3: {why}")


def _gather_new(pages, table, prefixes, q_lens, page):
    """The new tokens' rows of the pages (sequence b's positions ``prefix .. prefix + q_len``), packed."""
    rows = []
    for b, (p, n) in enumerate(zip(prefixes, q_lens)):
        pos = torch.arange(p, p + n, device=pages.device)
        rows.append(pages[table[b, pos // page].long(), pos % page])
    return torch.cat(rows)


@pytest.mark.parametrize("fmt,layout", [("bf16", "NHD"), ("bf16", "HND"), ("fp8_e4m3", "HND")])
def test_fa3_matches_the_reference_and_kvbench(fmt, layout):
    hq, hk, d, page = 32, 8, 128, 16
    q_lens, prefixes = [256, 1, 300, 77], [0, 500, 31, 1000]
    gen = torch.Generator().manual_seed(44)
    lens = [a + b for a, b in zip(q_lens, prefixes)]
    kv, table = _attn_inputs(fmt, lens, hk, d, page, "cuda", gen, layout)
    fp8 = fmt == "fp8_e4m3"
    q, qs = _query(gen, (sum(q_lens), hq, d), torch.bfloat16, "cuda", fp8)
    # the new tokens are the pages' own rows (FA3 reads every key from the pages), in compute precision
    kn, vn = (_gather_new(kv[c], table, prefixes, q_lens, page).float() * kv[s].float()[:, None] for c, s in
              (("k_cache", "k_scale"), ("v_cache", "v_scale")))
    kn, vn = kn.to(torch.bfloat16), vn.to(torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    attn, paged = AttentionParams(q_scale=qs), PagedKV(fmt, **kv)
    ref = R.prefill_reference(q, kn, vn, cu.cpu(), paged, table, seq_lens, attn)
    sc = dict(q_scale=qs, k_scale=kv["k_scale"], v_scale=kv["v_scale"]) if fp8 else {}
    fa3 = vllm_fa3.PagedFA3(q, kv["k_cache"], kv["v_cache"], cu, max(q_lens), table, seq_lens, max(lens), **sc)
    fa3.out.fill_(float("nan"))
    got = fa3().clone()
    ours = torch.full(got.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    paged_prefill(q, kn, vn, cu, max(q_lens), paged, table, seq_lens, attn=attn, out=ours,
                  opts=PrefillOptions(max_prefix_len=max(prefixes)))
    e_fa3, e_ours = rel_err(got, ref), rel_err(ours, ref)
    assert math.isfinite(e_fa3) and e_fa3 <= TOL[torch.bfloat16], (e_fa3, e_ours)
    assert math.isfinite(e_ours) and e_ours <= TOL[torch.bfloat16], (e_fa3, e_ours)
    assert rel_err(got, ours.double()) <= 2 * TOL[torch.bfloat16]

"""Paged KV cache: allocator, slot mapping, write/gather, scratch page, capacity (docs/design.md §5)."""

import random

import pytest
import torch

from kvbench.kernels.formats import FORMAT_NAMES, get_format
from kvbench.runtime.config import ConfigError, KVCacheSpec
from kvbench.runtime.kv_cache import (
    OutOfPages,
    PageAllocator,
    PagedKVCache,
    bytes_per_token,
    plan_capacity,
    slots_for_positions,
)


def test_allocator_allocate_free_fragmentation():
    a = PageAllocator(10)
    first = a.allocate(10)
    assert sorted(first) == list(range(10)) and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate(1)
    a.free(first[::2])  # fragment: every other page back
    assert a.num_free == 5
    again = a.allocate(5)
    assert sorted(again) == sorted(first[::2])
    with pytest.raises(ValueError, match="double free"):
        a.free([first[1], first[1]])
    with pytest.raises(ValueError):
        a.free([10])


def test_allocator_random_churn_never_hands_out_a_page_twice():
    rng = random.Random(0)
    a = PageAllocator(64)
    owned: list[list[int]] = []
    for _ in range(500):
        if owned and (rng.random() < 0.45 or not a.can_allocate(8)):
            a.free(owned.pop(rng.randrange(len(owned))))
        else:
            owned.append(a.allocate(rng.randint(1, 8)))
        flat = [p for ps in owned for p in ps]
        assert len(flat) == len(set(flat)) and a.num_used == len(flat)
    for ps in owned:
        a.free(ps)
    assert a.num_free == 64


def test_slot_mapping():
    assert slots_for_positions([5, 2], range(6), 4).tolist() == [20, 21, 22, 23, 8, 9]
    with pytest.raises(IndexError):
        slots_for_positions([5], [4], 4)


@pytest.mark.parametrize("kv_dtype", FORMAT_NAMES)
@pytest.mark.parametrize("per_head", [False, True])
def test_write_then_gather_equals_format_roundtrip(kv_dtype, per_head):
    torch.manual_seed(0)
    L, H, D, P = 3, 2, 32, 4
    spec = KVCacheSpec(L, H, D, kv_dtype, P)
    ks = torch.rand(L, H) + 0.01 if per_head else torch.rand(L) + 0.01
    vs = torch.rand(L, H) + 0.01 if per_head else torch.rand(L) + 0.01
    cache = PagedKVCache(spec, num_pages=16, k_scale=ks, v_scale=vs)
    fmt = get_format(kv_dtype)
    # two sequences with interleaved, non-contiguous pages
    seqs = {}
    for name, n in (("a", 11), ("b", 7)):
        pages = cache.allocator.allocate(-(-n // P))
        seqs[name] = (pages, n, torch.randn(n, H, D) * 3, torch.randn(n, H, D))
    for layer in range(L):
        for pages, n, k, v in seqs.values():
            cache.write(layer, slots_for_positions(pages, range(n), P), k * (layer + 1), v)
    for layer in range(L):
        ksl = cache.k_scale[layer]
        vsl = cache.v_scale[layer]
        for pages, n, k, v in seqs.values():
            kk, vv = cache.gather(layer, pages, n)
            assert torch.equal(kk, fmt.roundtrip(k * (layer + 1), ksl))
            assert torch.equal(vv, fmt.roundtrip(v, vsl))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_padded_slots_write_nothing(kv_dtype, layout):
    spec = KVCacheSpec(1, 2, 32, kv_dtype, 4, layout=layout)
    cache = PagedKVCache(spec, num_pages=4)
    before_k = cache.k_data[0].clone().view(torch.uint8)
    before_bs = None if cache.k_block_scale[0] is None else cache.k_block_scale[0].clone().view(torch.uint8)
    slots = torch.tensor([-1, 5, -1, 6])
    k = torch.randn(4, 2, 32) + 5
    cache.write(0, slots, k, k)
    after = cache.k_data[0].view(torch.uint8).reshape(-1, 2, cache.k_data[0].shape[-1])  # slot order
    scratch = cache.scratch_page * cache.page_size  # padded writes may only touch the scratch page
    changed = [s for s in (after != before_k.reshape(after.shape)).any(dim=(1, 2)).nonzero().flatten().tolist() if s < scratch]
    assert changed == [5, 6]
    if before_bs is not None:
        a = cache.k_block_scale[0].view(torch.uint8).reshape(-1, 2, 2)
        changed_bs = (a != before_bs.reshape(a.shape)).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert [s for s in changed_bs if s < scratch] == [5, 6]
    kk, _ = cache.read_slots(0, torch.tensor([5, 6]))
    assert torch.equal(kk, get_format(kv_dtype).roundtrip(k[[1, 3]], cache.k_scale[0]))


def test_scratch_page_is_never_allocated_and_layout():
    spec = KVCacheSpec(2, 3, 64, "nvfp4", 16)
    cache = PagedKVCache(spec, num_pages=5)
    assert cache.scratch_page == 5
    assert set(cache.allocator.allocate(5)) == set(range(5))
    assert cache.k_data[0].shape == (6, 16, 3, 32) and cache.k_data[0].dtype == torch.uint8
    assert cache.k_block_scale[0].shape == (6, 16, 3, 4)
    assert cache.k_scale.shape == (2, 3) and cache.k_scale.dtype == torch.float32
    assert torch.all(cache.k_block_scale[0].float() > 0)


def test_mla_single_plane():
    spec = KVCacheSpec(2, 1, 576, "fp8_e4m3", 16, mla=True)
    cache = PagedKVCache(spec, num_pages=3)
    assert cache.v_data is cache.k_data and cache.v_scale is cache.k_scale
    assert bytes_per_token(spec) == 2 * 576  # one plane, 1 byte per element


def test_set_scales_in_place_and_validation():
    cache = PagedKVCache(KVCacheSpec(2, 2, 16, "fp8_e4m3"), num_pages=2)
    ptr = cache.k_scale.data_ptr()
    cache.set_scales(torch.tensor([0.5, 2.0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert cache.k_scale.data_ptr() == ptr
    assert cache.k_scale.tolist() == [[0.5, 0.5], [2.0, 2.0]]
    assert cache.v_scale.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(ValueError, match="finite and positive"):
        cache.set_scales(torch.tensor([0.0, 1.0]))


def test_capacity_ratios_exact():
    shapes = [KVCacheSpec(32, 8, 128, f) for f in ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")]
    b = [bytes_per_token(s) for s in shapes]
    assert b[0] == 2 * 32 * 8 * 128 * 2
    assert b[1] / b[0] == 0.5 and b[2] / b[0] == 0.5 and b[3] / b[0] == 9 / 32


def test_plan_capacity():
    spec = KVCacheSpec(32, 8, 128, "bf16", 16)
    plan = plan_capacity(spec, 40 * 2**30, 4096)
    assert plan.bytes_per_token == 131072
    assert plan.num_pages == 40 * 2**30 // (131072 * 16) == 20480
    assert plan.tokens == 327680 and plan.max_concurrency == 20480 // 256 == 80
    fp4 = plan_capacity(KVCacheSpec(32, 8, 128, "nvfp4", 16), 40 * 2**30, 4096)
    assert fp4.num_pages == int(40 * 2**30 // (36864 * 16)) and fp4.max_concurrency == fp4.num_pages // 256
    with pytest.raises(ValueError):
        plan_capacity(spec, 1e9, 0)


def test_spec_validation():
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVCacheSpec(1, 1, 64, "int8")
    with pytest.raises(ConfigError, match="divisible by 16"):
        KVCacheSpec(1, 1, 72, "nvfp4")

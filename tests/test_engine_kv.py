"""Engine mechanism: paged KV bookkeeping (sharing, the hash prefix cache, eviction order), the pool, the
decode copy, the runner's matmuls and the per-sample random draws."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fuseflow.rollout.engine.kv import BlockManager, KVPool, block_hash


def test_allocate_then_cache_hit_reuses_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table, hashes, cached = bm.allocate_prompt(tokens)
    assert (len(table), hashes, cached, bm.num_free) == (3, [], 0, 5)
    # Register the two full blocks as a finished prefill would.
    h0 = bm.register(table[0], None, tuple(tokens[:4]))
    h1 = bm.register(table[1], h0, tuple(tokens[4:8]))
    assert h1 == block_hash(block_hash(None, (0, 1, 2, 3)), (4, 5, 6, 7))
    table2, hashes2, cached2 = bm.allocate_prompt(tokens[:8] + [99, 98, 97])
    assert table2[:2] == table[:2] and hashes2 == [h0, h1] and cached2 == 8
    assert bm.ref[table[0]] == 2 and bm.num_free == 4  # shared blocks cost nothing new


def test_a_fully_cached_prompt_still_leaves_its_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    table, _, _ = bm.allocate_prompt([1, 2, 3, 4])
    bm.register(table[1], bm.register(table[0], None, (1, 2)), (3, 4))
    blocks, _ = bm.cached_prefix([1, 2, 3, 4])
    assert blocks == table[:1]  # block (3, 4) holds the last token, whose logits are needed


def test_different_earlier_tokens_change_the_hash_of_a_later_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    table, _, _ = bm.allocate_prompt([1, 2, 3, 4, 5])
    bm.register(table[1], bm.register(table[0], None, (1, 2)), (3, 4))
    assert bm.cached_prefix([9, 9, 3, 4, 5]) == ([], [])  # same second block, different prefix: no hit


def test_freed_blocks_stay_cached_until_reused_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a, _, _ = bm.allocate_prompt([1, 2, 0])
    bm.register(a[0], None, (1, 2))
    bm.release(a)
    assert bm.num_free == 3 and bm.cached_prefix([1, 2, 7])[0] == [a[0]]
    # Fill the pool: the cached block is handed out last, and its hash is dropped when it is.
    b, _, _ = bm.allocate_prompt([5, 6, 7, 8])
    assert a[0] not in b and bm.cached_prefix([1, 2, 7])[0] == [a[0]]
    bm.append_block()
    assert bm.cached_prefix([1, 2, 7]) == ([], [])


def test_fork_shares_full_blocks_and_gives_a_fresh_partial_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    table, _, _ = bm.allocate_prompt(list(range(6)))
    forked, fresh = bm.fork(table, 6)
    assert forked[0] == table[0] and forked[1] == fresh and fresh not in table
    assert bm.ref[table[0]] == 2 and bm.ref[table[1]] == 1
    aligned, none = bm.fork(table[:1], 4)
    assert aligned == table[:1] and none is None and bm.ref[table[0]] == 3


def test_release_restores_every_block_and_clear_cache_forgets_hashes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    t, _, _ = bm.allocate_prompt([1, 2, 3])
    f, _ = bm.fork(t, 3)
    bm.register(t[0], None, (1, 2))
    bm.release(t)
    bm.release(f)
    assert bm.num_free == 4 and all(r == 0 for r in bm.ref)
    bm.clear_cache()
    assert bm.cached_prefix([1, 2, 3]) == ([], [])


def test_allocation_beyond_the_pool_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    assert not bm.can_allocate([1, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate_prompt([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 2)


def test_pool_write_gather_and_copy_place_tokens_by_block_table() -> None:
    pool = KVPool(num_layers=1, num_blocks=4, block_size=2, n_kv=1, head_dim=3, dtype=torch.float32,
                  device=torch.device("cpu"))
    k = torch.arange(9, dtype=torch.float32).view(3, 1, 3)  # 3 tokens
    # Positions 0, 1, 2 of a sequence whose table is [2, 0]: slots 4, 5, 0.
    pool.write_kv(0, torch.tensor([4, 5, 0]), torch.stack((k, -k), dim=1))  # kv (N, 2, n_kv, hd)
    keys, values = pool.gather(0, torch.tensor([[2, 0]]))  # (1, n_kv, 4, hd)
    assert torch.equal(keys[0, 0, :3], k[:, 0]) and torch.equal(values[0, 0, :3], -k[:, 0])
    pool.copy_blocks([(2, 3)])
    assert torch.equal(pool.gather(0, torch.tensor([[3]]))[0][0, 0], k[:2, 0])


class _Seq:  # the fields DecodeCache reads
    def __init__(self, table: list[int], n: int):
        self.block_table, self.num_computed = table, n


def _pool_with_known_keys() -> KVPool:
    pool = KVPool(num_layers=2, num_blocks=6, block_size=2, n_kv=1, head_dim=1, dtype=torch.float32,
                  device=torch.device("cpu"))
    for layer in range(2):  # key of (block b, offset o) = 10 * b + o (+ 100 per layer); value = -key
        keys = torch.tensor([10.0 * b + o + 100 * layer for b in range(6) for o in range(2)]).view(-1, 1, 1)
        pool.write_kv(layer, torch.arange(12), torch.stack((keys, -keys), dim=1))
    return pool


def test_decode_cache_mirrors_pool_rows_and_stays_compact() -> None:
    from fuseflow.rollout.engine.kv import DecodeCache

    cache = DecodeCache(_pool_with_known_keys(), max_rows=3, capacity=24, granularity=4)
    a, b, c = _Seq([4, 1], 3), _Seq([2], 1), _Seq([5, 0, 3], 5)
    rows = cache.sync([a, b, c], [5, 3, 6])  # final lengths (prompt + max_new_tokens)
    assert sorted(rows) == [0, 1, 2] and rows[2] == 0  # the longest newcomer takes the lowest row
    assert (cache.cap, cache.rows) == (8, 3)
    k, v = cache.view(rows[0], rows[0] + 1, 3)  # every layer: keys (L, n * n_kv, hd, span), values (..., span, hd)
    assert k[1].flatten().tolist() == [140.0, 141.0, 110.0] and v[1].flatten().tolist() == [-140.0, -141.0, -110.0]
    # This step's token of each row (at position num_computed) goes in with one put per layer.
    pos = torch.tensor([0] * 3)
    for i, s in enumerate((a, b, c)):
        pos[rows[i]] = s.num_computed
    new = torch.tensor([7.0, 8.0, 9.0]).view(3, 1, 1, 1).expand(3, 2, 1, 1) * torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    cache.write(cache.write_index(pos)[0], new.contiguous())
    k, v = cache.view(0, 3, 8)
    for r in range(3):
        assert k[0, r, 0, pos[r]] == 7.0 + r and v[0, r, pos[r], 0] == -7.0 - r
    # c leaves: a row from the end moves into its hole; the survivors keep their content.
    before = cache.view(rows[0], rows[0] + 1, 4)[0][0].flatten().tolist()
    rows2 = cache.sync([a, b], [5, 3])
    assert sorted(rows2) == [0, 1] and cache.cap == 8  # 5 of 8 still used: no shrink yet
    assert cache.view(rows2[0], rows2[0] + 1, 4)[0][0].flatten().tolist() == before == [40.0, 41.0, 10.0, 7.0 + rows[0]]
    cache.sync([b], [3])
    assert cache.cap == 4  # the long rows are gone: the copy shrinks, refilled from the pool
    assert cache.view(0, 1, 2)[0][0].flatten().tolist() == [20.0, 21.0]


def test_decode_cache_stays_within_its_capacity_and_leaves_out_the_longest_rows() -> None:
    from fuseflow.rollout.engine.kv import DecodeCache

    cache = DecodeCache(_pool_with_known_keys(), max_rows=3, capacity=16, granularity=4)
    a, b, c = _Seq([4, 1], 3), _Seq([2], 1), _Seq([5, 0, 3], 5)
    # All three need 3 rows of 8 = 24 > 16 tokens; the two shorter fit as 3 rows of 4 = 12.
    rows = cache.sync([a, b, c], [4, 3, 6])
    assert rows[2] is None and sorted(rows[:2]) == [0, 1]
    assert cache.rows * cache.cap <= 16 and cache.buf.numel() <= 2 * 2 * 16  # layers x (k, v) x capacity
    assert cache.view(rows[0], rows[0] + 1, 4)[0][0].flatten().tolist() == [40.0, 41.0, 10.0, 11.0]
    assert DecodeCache(_pool_with_known_keys(), max_rows=3, capacity=0).sync([a, b], [4, 2]) == [None, None]


def test_linears_match_plain_torch_with_and_without_onednn() -> None:
    from fuseflow.rollout.engine.runner import Linears, onednn_available

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, 128, bias=True)  # 50 rows x 256 x 128 is above the oneDNN size threshold
    x, h = torch.randn(50, 256, generator=gen), torch.randn(50, 128, generator=gen)
    assert 50 * 256 * 128 >= Linears.ONEDNN_MIN_MACS
    h0 = h.clone()
    with torch.no_grad():
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        kernels = ["torch"] + (["onednn"] if onednn_available(torch.device("cpu"), torch.float32) else [])
        for kernel in kernels:
            lin = Linears(kernel, torch.device("cpu"), torch.float32)
            assert lin.onednn == (kernel == "onednn")
            torch.testing.assert_close(lin(x, layer), want)
            torch.testing.assert_close(lin.silu(x, layer), torch.nn.functional.silu(want))
            torch.testing.assert_close(lin.add(h, x, layer), h0 + want)
            assert torch.equal(h, h0)  # the residual input is left alone
    with pytest.raises(ValueError, match="auto, onednn or torch"):
        Linears("mkl", torch.device("cpu"), torch.float32)


def test_auto_linears_take_mkl_for_fp32_on_intel_and_onednn_elsewhere(monkeypatch) -> None:
    from fuseflow.rollout.engine import runner

    cpu = torch.device("cpu")
    if not runner.onednn_available(cpu, torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    vendors = [line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")]
    assert runner.cpu_vendor() == (vendors[0] if vendors else "")
    monkeypatch.setattr(runner, "cpu_vendor", lambda: "GenuineIntel")
    assert not runner.Linears("auto", cpu, torch.float32).onednn  # MKL measured faster or even there
    assert runner.Linears("onednn", cpu, torch.float32).onednn  # asked for: still given
    assert runner.Linears("auto", cpu, torch.bfloat16).onednn == runner.onednn_available(cpu, torch.bfloat16)
    monkeypatch.setattr(runner, "cpu_vendor", lambda: "AuthenticAMD")
    assert runner.Linears("auto", cpu, torch.float32).onednn


def test_uniforms_drawn_ahead_equal_scalar_draws_and_export_the_exact_generator_state() -> None:
    from fuseflow.rollout.base import RolloutRequest, SamplingParams
    from fuseflow.rollout.engine.sequence import Sequence

    seq = Sequence(RolloutRequest(0, [1, 2], SamplingParams(seed=7, max_new_tokens=100)))
    ref = torch.Generator().manual_seed(7)
    for i in range(70):  # crosses the 64-draw chunk boundary
        assert seq.next_uniform() == torch.rand((), generator=ref).item()
        if i in (0, 5, 63, 64, 69):
            # The exported state continues exactly after the draws consumed so far.
            other = torch.Generator()
            other.set_state(torch.frombuffer(bytearray(seq.rng_state()), dtype=torch.uint8))
            assert torch.equal(other.get_state(), ref.get_state())

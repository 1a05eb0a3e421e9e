"""Block bookkeeping of the engine's paged KV cache: sharing, the hash prefix cache, eviction order."""

from __future__ import annotations

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
    pool.write(0, torch.tensor([4, 5, 0]), k, -k)
    keys, values = pool.gather(0, torch.tensor([[2, 0]]))  # (1, n_kv, 4, hd)
    assert torch.equal(keys[0, 0, :3], k[:, 0]) and torch.equal(values[0, 0, :3], -k[:, 0])
    pool.copy_blocks([(2, 3)])
    assert torch.equal(pool.gather(0, torch.tensor([[3]]))[0][0, 0], k[:2, 0])


class _Seq:  # the two fields DecodeCache reads
    def __init__(self, table: list[int], n: int):
        self.block_table, self.num_computed = table, n


def test_decode_cache_mirrors_pool_rows_and_stays_compact() -> None:
    from fuseflow.rollout.engine.kv import DecodeCache

    pool = KVPool(num_layers=2, num_blocks=6, block_size=2, n_kv=1, head_dim=1, dtype=torch.float32,
                  device=torch.device("cpu"))
    for layer in range(2):  # key of (block b, offset o) = 10 * b + o (+ 100 per layer); value = -key
        keys = torch.tensor([10.0 * b + o + 100 * layer for b in range(6) for o in range(2)]).view(-1, 1, 1)
        pool.write(layer, torch.arange(12), keys, -keys)
    cache = DecodeCache(pool, max_rows=3, granularity=4)
    a, b, c = _Seq([4, 1], 3), _Seq([2], 1), _Seq([5, 0, 3], 5)
    rows = cache.sync([a, b, c], [4, 2, 6])
    assert sorted(rows) == [0, 1, 2] and rows[2] == 0  # the longest newcomer takes the lowest row
    assert cache.cap == 8
    k, v = cache.view(1, rows[0], rows[0] + 1, 3)  # keys come transposed: (n, n_kv, hd, span)
    assert k.flatten().tolist() == [140.0, 141.0, 110.0] and v.flatten().tolist() == [-140.0, -141.0, -110.0]
    # c leaves: a row from the end moves into its hole; the survivors keep their content.
    cache.write(0, torch.tensor([rows[0]]), torch.tensor([3]), torch.tensor([[[7.0]]]), torch.tensor([[[-7.0]]]))
    rows2 = cache.sync([a, b], [5, 3])
    assert sorted(rows2) == [0, 1]
    k, _ = cache.view(0, rows2[0], rows2[0] + 1, 4)
    assert k.flatten().tolist() == [40.0, 41.0, 10.0, 7.0]
    assert cache.cap == 8  # 5 of 8 still used: no shrink yet
    cache.sync([b], [2])
    assert cache.cap == 4  # the long rows are gone: the mirror shrinks

"""Paged KV storage: a block pool of fixed size (the memory budget) and its bookkeeping.

`BlockManager` is pure Python bookkeeping (which blocks a sequence owns, reference counts,
the hash-based prefix cache); `KVPool` holds the tensors and does the reads and writes.
A sequence's cache is the list of blocks in its block table; position p lives in block
`table[p // block_size]` at offset `p % block_size`. Full blocks are identified by a hash
of all tokens up to their end, so two sequences with the same leading tokens can point
at the same physical block (shared prompts, system prompts, resumed samples).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block, chained to the hash of the block before it (the whole prefix counts)."""
    return hash((parent, tokens))


class BlockManager:
    """Allocates blocks out of a fixed pool, shares them by reference count, caches full ones by hash.

    A freed block that holds a full, hashed block of tokens stays findable in the prefix cache
    until it is handed out again (least recently freed first), so a prompt seen a moment ago,
    or a sample that was preempted, re-uses its KV instead of recomputing it.

    >>> bm = BlockManager(num_blocks=4, block_size=2)
    >>> table, hashes, cached = bm.allocate_prompt([5, 6, 7])   # 2 blocks, nothing cached yet
    >>> (len(table), cached, bm.num_free)
    (2, 0, 2)
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.enable_prefix_cache = num_blocks, block_size, enable_prefix_cache
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.hash_of: dict[int, int] = {}  # block id -> hash of the full block it holds
        self.block_of: dict[int, int] = {}  # hash -> block id (the prefix cache)
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # block id -> its tokens (verifies hash hits)

    @property
    def num_free(self) -> int:
        """Blocks with no owner (reference count 0), ready to hand out; freed blocks the prefix cache can still
        reuse count too (their cached content is dropped when one is taken, least recently freed first)."""
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed: its cached content goes first
        h = self.hash_of.pop(block, None)
        if h is not None:
            self.block_of.pop(h, None)
            self.tokens_of.pop(block, None)
        self.ref[block] = 1
        return block

    def _share(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def cached_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) already holding the longest run of full leading blocks of `tokens`.

        At least one token is always left uncached: the engine needs the last token's logits.
        """
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_cache:
            return blocks, hashes
        parent = None
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self.block_of.get(h)
            if block is None or self.tokens_of[block] != chunk:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def can_allocate(self, tokens: list[int], extra_blocks: int = 0) -> bool:
        """Whether `tokens` fit now (cached leading blocks cost nothing), plus `extra_blocks` more."""
        hit, _ = self.cached_prefix(tokens)
        free_hits = sum(1 for b in hit if self.ref[b] == 0)  # hits sitting in the free list are not free
        return self.blocks_for(len(tokens)) - len(hit) + extra_blocks <= self.num_free - free_hits

    def allocate_prompt(self, tokens: list[int]) -> tuple[list[int], list[int], int]:
        """Block table for `tokens`: cached leading blocks shared, the rest fresh.

        Returns (block table, hashes of the cached blocks, number of cached tokens).
        """
        hit, hashes = self.cached_prefix(tokens)
        need = self.blocks_for(len(tokens)) - len(hit)
        if need > self.num_free - sum(1 for b in hit if self.ref[b] == 0):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for b in hit:
            self._share(b)
        return hit + [self._take() for _ in range(need)], hashes, len(hit) * self.block_size

    def fork(self, table: list[int], num_tokens: int) -> tuple[list[int], int | None]:
        """A copy of `table` holding `num_tokens` positions: full blocks shared, a partial last block fresh.

        Returns (new table, the fresh block whose content the caller must copy from table[-1], or None).
        """
        full = num_tokens // self.block_size
        for b in table[:full]:
            self._share(b)
        if full * self.block_size == num_tokens:
            return list(table[:full]), None
        fresh = self._take()
        return list(table[:full]) + [fresh], fresh

    def append_block(self) -> int:
        """One fresh block for a sequence that grew past its last block."""
        if not self.free:
            raise RuntimeError("KV pool exhausted: preempt a sequence before appending")
        return self._take()

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Record that `block` now holds the full block `tokens` after prefix hash `parent`; returns its hash."""
        h = block_hash(parent, tokens)
        if self.enable_prefix_cache and h not in self.block_of and block not in self.hash_of:
            self.block_of[h], self.hash_of[block], self.tokens_of[block] = block, h, tokens
        return h

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones become free (cached content kept)."""
        for b in reversed(table):  # tail blocks first, so a prompt's head stays cached the longest
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def clear_cache(self) -> None:
        """Forget all cached content (after a weight update the old KV no longer matches the model)."""
        self.hash_of.clear()
        self.block_of.clear()
        self.tokens_of.clear()


class KVPool:
    """All layers' KV in one tensor (L, num_blocks, block_size, 2, n_kv, head_dim): keys at [..., 0, :, :],
    values at [..., 1, :, :].

    A token's keys and values sit side by side, so a layer's new tokens are stored with one
    `index_copy_`, and a block moves in every layer at once. Zero-initialised: masked-out positions
    are read (and multiplied by weight 0), so they must be finite.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size, self.n_kv, self.head_dim = block_size, n_kv, head_dim
        self.data = torch.zeros((num_layers, num_blocks, block_size, 2, n_kv, head_dim), dtype=dtype, device=device)
        self.layers = list(self.data.unbind(0))  # per-layer views (num_blocks, block_size, 2, n_kv, hd)
        self._slots = [t.view(-1, 2, n_kv, head_dim) for t in self.layers]  # per layer (num_blocks * bs, 2, ...)

    def write_kv(self, layer: int, slots: Tensor, kv: Tensor) -> None:
        """Store stacked keys and values kv (N, 2, n_kv, hd) at flat slots (N,) = block * block_size + offset."""
        self._slots[layer].index_copy_(0, slots, kv)

    def gather(self, layer: int, tables: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, n_kv, nb * block_size, hd) of block tables (B, nb), as strided views of one copy."""
        b, nb = tables.shape
        g = self.layers[layer].index_select(0, tables.reshape(-1)).view(b, nb * self.block_size, 2, self.n_kv,
                                                                         self.head_dim)
        return g[:, :, 0].transpose(1, 2), g[:, :, 1].transpose(1, 2)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (forking a partially filled prompt block)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.data.device)
        dst = torch.tensor([d for _, d in pairs], device=self.data.device)
        self.data.index_copy_(1, dst, self.data.index_select(1, src))


class DecodeCache:
    """A contiguous copy of the KV of the sequences being decoded, one row each, within `capacity` tokens.

    Attending over blocks scattered in the pool would copy the whole live KV once per layer per
    step (as HF's growing `torch.cat` cache does). Here a sequence's blocks are copied once, when it
    starts decoding; each new token's KV is written in place, and rows stay compact (a leaving row's
    hole is filled by moving the last row), so attention reads a plain slice with no copy.

    Memory is bounded: the copy holds rows x cap <= `capacity` tokens (the engine's share of its
    KV budget), where cap is the longest final length (prompt + max_new_tokens) of the copied rows,
    rounded up to `granularity`. When the decoding rows do not all fit, the longest ones are left
    out and the runner attends over them straight from the pool (`sync` returns None for them).
    The pool stays the record, so any row can be rebuilt from it; that is how a change of layout
    (cap) is done, with no second buffer (rows are filled one layer at a time, so the temporary is
    one layer's KV of the rows being filled).

    Layout: one tensor (L, 2, rows, n_kv, hd * cap); keys stored transposed (hd, cap), so q @ k^T
    streams along positions (measured ~1.5x faster on CPU than a transposed (cap, hd) view), values
    as (cap, hd). One `put_` per layer stores the step's keys and values of every row.
    """

    def __init__(self, pool: KVPool, max_rows: int, capacity: int, granularity: int = 16):
        if capacity < 0 or max_rows < 1 or granularity < 1:
            raise ValueError(f"DecodeCache needs capacity >= 0, max_rows >= 1, granularity >= 1; got {capacity}, "
                             f"{max_rows}, {granularity}")
        self.pool, self.max_rows, self.capacity, self.granularity = pool, max_rows, capacity, granularity
        self.buf: Tensor | None = None  # (L, 2, rows, n_kv, hd * cap)
        self.keys: Tensor | None = None  # (L, rows, n_kv, hd, cap) view of buf
        self.values: Tensor | None = None  # (L, rows, n_kv, cap, hd) view of buf
        self.rows = self.cap = 0
        self.row_of: dict = {}  # sequence -> its row
        self._base: Tensor | None = None  # (L, rows, 2, n_kv, hd): flat offset of each element at position 0
        self._step: Tensor | None = None  # (2,): offset of one position, for keys and for values

    def _round(self, n: int) -> int:
        return -(-n // self.granularity) * self.granularity

    def reset(self) -> None:
        """Drop the copy (the engine is idle): frees its memory, and the next batch starts from the
        same layout whatever ran before, so a resumed run decodes bit-identically to an uninterrupted one."""
        self.buf = self.keys = self.values = self._base = self._step = None
        self.rows = self.cap = 0
        self.row_of = {}

    def _choose(self, lengths: list[int]) -> list[int]:
        """Indices of the rows to copy: the most rows that fit, shortest first (`lengths`: their final lengths)."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        k = len(order)
        while k and k > min(self.max_rows, self.capacity // self._round(lengths[order[k - 1]])):
            k -= 1
        return order[:k]

    def _layout(self, cap: int) -> None:
        """Re-shape to rows of `cap` positions (the old content is dropped; rows are refilled from the pool)."""
        p, L = self.pool, self.pool.data.shape[0]
        self.buf = self.keys = self.values = None  # free the old layout first: the bound holds during the change too
        self.cap, self.rows = cap, min(self.max_rows, self.capacity // cap)
        kv, hd, r, dev = p.n_kv, p.head_dim, self.rows, p.data.device
        self.buf = torch.zeros((L, 2, r, kv, hd * cap), dtype=p.data.dtype, device=dev)
        self.keys, self.values = self.buf[:, 0].view(L, r, kv, hd, cap), self.buf[:, 1].view(L, r, kv, cap, hd)
        ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
        # Element (l, row, c, h, d) of a step's stacked (rows, 2, n_kv, hd) KV goes to
        # buf[l, c, row, h, d * cap + pos] for keys (c = 0) and buf[l, c, row, h, pos * hd + d] for values.
        start = (((ar(L).view(L, 1, 1, 1, 1) * 2 + ar(2).view(1, 1, 2, 1, 1)) * r + ar(r).view(1, r, 1, 1, 1)) * kv
                 + ar(kv).view(1, 1, 1, kv, 1)) * (hd * cap)
        self._base = start + ar(hd).view(1, 1, 1, 1, hd) * torch.tensor([cap, 1], device=dev).view(1, 1, 2, 1, 1)
        self._step = torch.tensor([1, hd], device=dev)
        self.row_of = {}

    def sync(self, seqs: list, finals: list[int]) -> list[int | None]:
        """Give the copied seqs rows 0..k-1, filling newcomers from the pool; returns each seq's row (None: not copied).

        `finals[i]` is the most positions seqs[i] can ever hold (prompt + max_new_tokens). Rows are
        sized for it, not for the current length, so a growing row never forces a new layout (which
        refills every row from the pool); only a longer newcomer, or the long rows leaving, does.
        """
        chosen = self._choose(finals) if self.capacity else []
        if not chosen:
            self.row_of = {}
            return [None] * len(seqs)
        need = self._round(max(finals[i] for i in chosen))
        # Grow to the longest row; shrink once the long rows are gone (at half use, so no thrashing).
        if need > self.cap or len(chosen) > self.rows or (self.cap > self.granularity and 2 * need <= self.cap):
            self._layout(need)
        assert self.buf is not None and self.keys is not None and self.values is not None
        n = len(chosen)
        live = {seqs[i]: None for i in chosen}
        kept = {s: r for s, r in self.row_of.items() if s in live}
        free = sorted(set(range(n)) - set(kept.values()), reverse=True)
        moves = []
        for s, r in kept.items():
            if r >= n:
                kept[s] = free.pop()
                moves.append((r, kept[s]))
        # Newcomers take the lowest free rows longest first, so rows stay roughly sorted by length
        # and the runner can attend over short rows separately from long ones.
        fills = sorted((s for s in live if s not in kept), key=lambda s: -s.num_computed)
        for s in fills:
            kept[s] = free.pop()
        self.row_of = kept
        dev = self.buf.device
        if moves:
            src = torch.tensor([a for a, _ in moves], device=dev)
            dst = torch.tensor([b for _, b in moves], device=dev)
            self.buf.index_copy_(2, dst, self.buf.index_select(2, src))
        if fills:
            width = max(len(s.block_table) for s in fills)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in fills], device=dev)
            span = min(width * self.pool.block_size, self.cap)
            rows = torch.tensor([kept[s] for s in fills], device=dev)
            for layer in range(self.keys.shape[0]):  # one layer at a time: the temporary is one layer's KV
                k, v = self.pool.gather(layer, tables)  # (F, n_kv, width * block_size, hd) each
                self.keys[layer, rows, :, :, :span] = k[:, :, :span].transpose(2, 3)
                self.values[layer, rows, :, :span] = v[:, :, :span]
        return [kept.get(s) for s in seqs]

    def write_index(self, pos: Tensor) -> Tensor:
        """Flat indices (L, n * 2 * n_kv * hd) where rows 0..n-1 store their new KV at positions pos (n,)."""
        assert self._base is not None and self._step is not None
        n = pos.shape[0]
        return (self._base[:, :n] + (pos.view(n, 1) * self._step).view(1, n, 2, 1, 1)).view(self._base.shape[0], -1)

    def write(self, index: Tensor, kv: Tensor) -> None:
        """Store the stacked KV (n, 2, n_kv, hd) of rows 0..n-1 at one layer's `write_index` row."""
        assert self.buf is not None
        self.buf.put_(index, kv.reshape(-1))

    def view(self, start: int, end: int, span: int) -> tuple[Tensor, Tensor]:
        """Keys (L, n * n_kv, hd, span) and values (L, n * n_kv, span, hd) of rows start..end-1, every layer (views)."""
        assert self.keys is not None and self.values is not None
        L, n, kv, hd = self.keys.shape[0], end - start, self.pool.n_kv, self.pool.head_dim
        return (self.keys[:, start:end, :, :, :span].view(L, n * kv, hd, span),
                self.values[:, start:end, :, :span].view(L, n * kv, span, hd))

"""Shared pieces of the role workers: sample packing, log-probs, the prompt cache and micro-batching."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from fuseflow.data.batch import (
    Batch,
    length_sorted_chunks,
    pad_sequences,
    prompt_response,
    scatter_rows,
    trim_padding,
)
from fuseflow.rollout.base import Sample


def samples_to_batch(samples: list[Sample], pad_id: int, prompts: list[str], responses: list[str]) -> Batch:
    """Pack finished samples into the (prompt left-padded | response right-padded) layout of ``Batch``."""
    ids, mask, r_mask = prompt_response([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id)
    behavior = pad_sequences([s.logprobs for s in samples], 0, left=False, width=r_mask.shape[1],
                             dtype=torch.float32)
    return Batch(
        {
            "input_ids": ids,  # (B, Tp+Tr)
            "attention_mask": mask,  # (B, Tp+Tr)
            "response_mask": r_mask.float(),  # (B, Tr)
            "behavior_logprobs": behavior,  # (B, Tr)
        },
        {
            "uid": [s.uid for s in samples],
            "group_id": [s.group_id for s in samples],
            "prompt": prompts,
            "response": responses,
            "finish_reason": [s.finish_reason for s in samples],
            "policy_version": [s.policy_version for s in samples],
        },
    )


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return nullcontext()


def response_slice(batch: Batch) -> slice:
    """Columns of the logits that predict the response tokens."""
    tp = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    return slice(tp - 1, batch["input_ids"].shape[1] - 1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids from an attention mask: 0 at each row's first real token, counting real tokens; left padding
    gets 0, right padding repeats the last real position."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# Run prompts once and responses unpadded only where it saves at least this fraction of a forward's
# tokens: two forward calls, the cache gather and attention's scatter cost a little, which a small
# saving would not pay back.
SHARED_PREFIX_MIN_SAVING = 0.25


def _prompt_keys(batch: Batch) -> torch.Tensor:
    """(B, Tp) prompt columns with padding set to -1: rows with equal keys have the same prompt."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tp = ids.shape[1] - batch["response_mask"].shape[1]
    return torch.where(mask[:, :tp].bool(), ids[:, :tp], -1)


def shared_prompts(batch: Batch, cache: PromptCache | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, inverse)`` when running each distinct prompt once and the responses unpadded saves
    enough tokens, else None.

    ``first`` (U,) holds one row index per distinct prompt (its first row), ``inverse`` (B,) the
    position in ``first`` of each row's prompt. Rows share a prompt when their prompt columns
    (ids and mask, left-padded) are equal. The plan's forward costs ``U * Tp`` prompt tokens plus
    one per real response token but each row's last; None when that saves less than
    ``SHARED_PREFIX_MIN_SAVING`` of one padded forward's ``B * (Tp + Tr - 1)``. Prompts ``cache``
    holds (bound to the model) cost nothing, and then a single row may be planned too. A saving comes from
    shared prompts (GRPO's groups), from response padding (a long-tailed batch), or both.
    """
    plan = _shared_plan(batch, cache)
    return None if plan is None else plan[:2]


def _shared_plan(batch: Batch, cache: PromptCache | None):
    """``shared_prompts``' plan plus the U prompts' cache keys (``_prompt_cache_keys``; None without a
    cache or when a prompt's real tokens are not one run)."""
    ids = batch["input_ids"]
    b, tr = ids.shape[0], batch["response_mask"].shape[1]
    tp = ids.shape[1] - tr
    if (b < 2 and cache is None) or tp < 1:
        return None
    uniq, inverse = torch.unique(_prompt_keys(batch), dim=0, return_inverse=True)
    u = run = uniq.shape[0]
    keys = None if cache is None else _prompt_cache_keys(uniq, uniq >= 0)
    if keys:  # prompts to run
        run -= sum(cache.get(k, touch=False) is not None for k in keys)
    packed = int(batch["attention_mask"][:, tp + 1:].sum())  # response tokens that predict a next one
    if run * tp + packed > (1 - SHARED_PREFIX_MIN_SAVING) * b * (tp + tr - 1):
        return None
    rows = torch.arange(b, device=ids.device)
    first = torch.full((u,), b, dtype=torch.long, device=ids.device).scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse, keys


# A prompt cache holds at most this many bytes of keys and values (least recently used dropped first).
# SmolLM2-135M's 46-token chat prompts take 2.1 MB each in fp32 (30 layers x 2 x 3 heads x 64 x 46 x 4 B).
PROMPT_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _PromptEntry:
    keys: torch.Tensor  # (layers, H_kv, L, hd): the prompt's real tokens only
    values: torch.Tensor
    hidden: torch.Tensor  # (hidden,) the final-norm state at the prompt's last token (the head's input)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size() + self.hidden.numel() * self.hidden.element_size()


class PromptCache:
    """Keys, values and last-token state of the prompts a worker's model has run, reused by its
    later forwards without autograd (old and reference log-probs, values) under the same weights.

    Why: scoring splits a step's samples into many forwards (length-sorted chunks of each call and,
    in the streamed modes, several calls a step), and a GRPO/PPO group's samples land in several of
    them; each ran the group's prompt again. A forward with some prompts cached leaves them out of
    its input and is given their keys and values (``SharedPrefix``); the prompts it runs are added.
    Entries are views into the forward's block of prompt keys and values (a block is freed with its
    last entry). All are dropped when any parameter of the model is replaced or written in place
    (its identity or autograd version changes: an optimizer step, ``load_state_dict``, a weight
    sync), and the least recently used go once the entries hold more than ``max_bytes``.
    """

    def __init__(self, max_bytes: int = PROMPT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], _PromptEntry] = OrderedDict()
        self.nbytes = 0
        self._weights: tuple | None = None
        self.hits = self.misses = 0  # prompts found and run, since creation

    def bind(self, model: torch.nn.Module) -> None:
        """Drop every entry unless ``model``'s parameters are the ones the entries were made with."""
        weights = tuple((id(p), p._version) for p in model.parameters())
        if weights != self._weights:
            self.entries.clear()
            self.nbytes, self._weights = 0, weights

    def get(self, key: tuple[int, ...], touch: bool = True) -> _PromptEntry | None:
        """The entry of prompt ``key`` (its real tokens), marked as just used unless ``touch`` is off."""
        entry = self.entries.get(key)
        if entry is not None and touch:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple[int, ...], entry: _PromptEntry) -> None:
        """Keep ``entry`` for prompt ``key``, dropping the least recently used beyond ``max_bytes``."""
        if key in self.entries:
            self.nbytes -= self.entries.pop(key).nbytes
        self.entries[key] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes and len(self.entries) > 1:
            self.nbytes -= self.entries.popitem(last=False)[1].nbytes


def prompt_cache(worker) -> PromptCache | None:
    """``worker``'s prompt cache (made on first use) when its forwards share prompts (``shares_prefix``)
    and it keeps them (``cache_prompts``, from schedule.prompt_cache)."""
    if not (shares_prefix(worker) and getattr(worker, "cache_prompts", True)):
        return None
    cache = worker.__dict__.get("prompt_cache")
    if cache is None:
        cache = worker.prompt_cache = PromptCache()
    return cache


def _prompt_cache_keys(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]] | None:
    """Cache keys (each prompt's real tokens) of (U, Tp) left-padded prompts; None when some prompt's
    real tokens are not one run at the end (its positions would not be 0, 1, ...)."""
    if bool((mask[:, 1:] < mask[:, :-1]).any()):  # a real token followed by padding
        return None
    tp = ids.shape[1]
    return [tuple(row[tp - n:]) for row, n in zip(ids.tolist(), mask.sum(1).tolist(), strict=True)]


def _cached_prefix_outputs(model, ids: torch.Tensor, mask: torch.Tensor, tr: int, first: torch.Tensor,
                           inverse: torch.Tensor, keys: list[tuple[int, ...]], cache: PromptCache):
    """``_packed_inputs``' forward with the prompts ``cache`` holds left out (their keys and values given)
    and the others added to it: the head's outputs at the kept positions and those positions' ``where``.
    ``keys``: the cache keys of the U prompts of ``first``.
    """
    from fuseflow.models.llama import KVCache

    tp = ids.shape[1] - tr
    found = [cache.get(k) for k in keys]
    given = [u for u, e in enumerate(found) if e is not None]
    run = [u for u, e in enumerate(found) if e is None]
    cache.hits += len(given)
    cache.misses += len(run)
    inputs, wanted, where = _packed_inputs(ids, mask, tr, first, inverse, given, record=bool(run))
    if given:  # (layers, G, H_kv, Tp, hd), left-padded
        e0 = found[given[0]]
        shape = (e0.keys.shape[0], len(given), e0.keys.shape[1], tp, e0.keys.shape[3])
        k_given, v_given = e0.keys.new_zeros(shape), e0.values.new_zeros(shape)
        for g, u in enumerate(given):
            n = found[u].keys.shape[2]
            k_given[:, g, :, tp - n:] = found[u].keys
            v_given[:, g, :, tp - n:] = found[u].values
        inputs["past_key_values"] = KVCache(tuple(k_given.unbind(0)), tuple(v_given.unbind(0)))
    h, _ = model.model(**inputs)
    h = h[0, wanted]  # final-norm states at the kept positions
    if given:  # the rows' prompt states: run now (h's first entries) or cached
        last = h.new_empty((len(keys), h.shape[1]))
        last[run] = h[:len(run)]
        last[given] = torch.stack([found[u].hidden for u in given]).to(h.dtype)
        run_last, h = last[run], torch.cat([last.index_select(0, inverse), h[len(run):]])
    else:
        run_last = h[first]  # row first[u] holds prompt u
    if run:
        recorded = inputs["unpadded"].record
        k_run, v_run = torch.stack([k for k, _ in recorded]), torch.stack([v for _, v in recorded])
        run_last = run_last.clone()  # not a view of every kept position's state
        for j, u in enumerate(run):  # views into this forward's (layers, U_run, H_kv, Tp, hd) blocks
            n = len(keys[u])
            cache.put(keys[u], _PromptEntry(k_run[:, j, :, tp - n:], v_run[:, j, :, tp - n:], run_last[j]))
    return model.head(h), where


def _packed_inputs(ids: torch.Tensor, mask: torch.Tensor, tr: int, first: torch.Tensor, inverse: torch.Tensor,
                   given: list[int] | None = None, record: bool = False):
    """Keyword arguments of one packed forward over the real tokens, the positions whose outputs are
    kept, and the ``(row, column)`` in (B, Tr) of each kept position's output.

    The packed (1, N) tokens are the real tokens of the U distinct prompts, then the response tokens
    that predict a next real token (`SharedPrefix`, without padding). Only attention sees padded
    layouts: each prompt attends to itself, each response to its prompt's keys and values (autograd
    sums the rows' gradients back to the one prompt) and its own, at the positions the whole row
    would give them. The kept positions (``wanted``, M of them) are each row's prompt's last token
    (it predicts response token 0, and its state is the one before it: M's first B entries, one per
    batch row), then every packed response token. Outputs there equal one forward over the whole
    rows up to float rounding.

    ``given``: prompts (indices into U) left out of the input, whose keys and values the caller adds
    as ``past_key_values`` (in this order); ``wanted`` then starts with the last token of each prompt
    that runs (in order) instead of the rows'. ``record``: the layout keeps each layer's keys and
    values of the prompts it runs.
    """
    from fuseflow.models.attention import SharedPrefix

    tp, dev = ids.shape[1] - tr, ids.device
    pos = position_ids(mask)
    keep = mask[:, tp + 1:]  # (B, Tr - 1): input j is packed when token j + 1 is real
    run, given_mask = first, None
    if given:
        left_out = set(given)
        order = [u for u in range(first.numel()) if u not in left_out] + list(given)
        rank = torch.empty(len(order), dtype=torch.long, device=dev)
        rank[torch.tensor(order, device=dev)] = torch.arange(len(order), device=dev)
        inverse = rank[inverse]  # each row's prompt in the layout's order: those run, then those given
        run = first[torch.tensor(order[:len(order) - len(given)], dtype=torch.long, device=dev)]
        given_mask = mask[first[torch.tensor(given, device=dev)], :tp]
    layout = SharedPrefix.from_masks(mask[run, :tp], keep, inverse, [] if record else None, given_mask)
    p_at, r_at = layout.prompt.index, layout.response.index
    tokens = torch.cat([ids[run, :tp].reshape(-1)[p_at], ids[:, tp:-1].reshape(-1)[r_at]])
    positions = torch.cat([pos[run, :tp].reshape(-1)[p_at], pos[:, tp:-1].reshape(-1)[r_at]])
    # Left-padded prompts end in a real token: each prompt's last packed token predicts response token 0.
    last = mask[run, :tp].sum(1).cumsum(0) - 1  # (U_run,)
    n_p = p_at.numel()
    wanted = torch.cat([last if given else last[inverse], torch.arange(n_p, n_p + r_at.numel(), device=dev)])
    rows, width = torch.arange(ids.shape[0], device=dev), max(tr - 1, 1)
    where = (torch.cat([rows, r_at // width]), torch.cat([torch.zeros_like(rows), r_at % width + 1]))
    inputs = {"input_ids": tokens[None], "attention_mask": torch.cat([mask[:, :tp], keep], 1),
              "position_ids": positions[None], "unpadded": layout}
    return inputs, wanted, where


def response_values(model, batch: Batch, share_prefix: bool = False,
                    prompt_cache: PromptCache | None = None) -> torch.Tensor:
    """Values (B, Tr) of a ``ValueModel``: the state before each response token, fp32.

    ``share_prefix``: one packed forward over each distinct prompt once and the responses, without
    padding, as ``response_logprobs`` does (``shared_prompts`` decides whether it saves enough);
    positions past a row's response then hold 0, which the value loss and GAE mask out anyway.
    ``prompt_cache``: with ``share_prefix`` and autograd off, prompts it holds are not run again.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tr = batch["response_mask"].shape[1]
    cache = _usable(model, prompt_cache)
    plan = _shared_plan(batch, cache) if share_prefix else None
    if plan is None:
        return model(ids, attention_mask=mask, position_ids=position_ids(mask))[:, response_slice(batch)].float()
    values, where = _packed_outputs(model, ids, mask, tr, plan, cache,
                                    lambda inputs, wanted: model(**inputs, values_to_keep=wanted)[0])  # (M,)
    return values.new_zeros(ids.shape[0], tr).index_put(where, values)


def _usable(model, cache: PromptCache | None) -> PromptCache | None:
    """``cache``, bound to ``model``'s weights, where it may serve (autograd off, a plain decoder with a
    head), else None."""
    if cache is None or torch.is_grad_enabled() or not (hasattr(model, "head") and hasattr(model, "model")):
        return None
    cache.bind(model)
    return cache


def _packed_outputs(model, ids, mask, tr: int, plan, cache: PromptCache | None, forward):
    """The head's outputs (M, ...) at a shared-prefix ``plan``'s kept positions, and their ``where``:
    through ``cache`` when it serves and the plan has keys, else ``forward(inputs, wanted)`` over
    ``_packed_inputs``."""
    first, inverse, keys = plan
    if cache is not None and keys is not None:
        return _cached_prefix_outputs(model, ids, mask, tr, first, inverse, keys, cache)
    inputs, wanted, where = _packed_inputs(ids, mask, tr, first, inverse)
    return forward(inputs, wanted), where


def shares_prefix(worker) -> bool:
    """Whether ``worker``'s forwards share prompts: on by config (``share_prefix``, set from
    schedule.shared_prefix), and never for a sharded model, whose ranks must all run the same
    forwards while their batches differ."""
    return worker.share_prefix and not getattr(worker, "sharded", False)


def response_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False,
                      share_prefix: bool = False, prompt_cache: PromptCache | None = None):
    """Log-probs (B, Tr) of the response tokens under ``model`` at ``temperature``; optionally entropy (B, Tr).

    Only the last ``Tr + 1`` positions go through the LM head (``logits_to_keep``): the prompt's
    logits are never used, and with a 49k vocabulary they are a large share of a step's time and
    memory. Response token ``j`` sits at column ``Tp + j`` and is predicted by column ``Tp + j - 1``,
    whatever each row's padding (prompts are left-padded, responses right-padded), so the columns
    that predict the response are the last ``Tr + 1`` but one. A ``model`` that ignores
    ``logits_to_keep`` and returns every position gets the same columns. The entropy is a metric
    (no loss uses it): it is computed outside autograd, so its (B, Tr, V) intermediates are not
    kept for the backward pass.

    ``share_prefix``: one packed forward over each distinct prompt once and the responses, without
    padding (``shared_prompts`` decides whether it saves enough); positions past a row's response
    then hold 0. The model must be a plain decoder that takes ``unpadded`` (not a pipeline stage,
    not sharded: every rank would have to make the same choice). ``prompt_cache``: with
    ``share_prefix`` and autograd off, prompts it holds are not run again (``PromptCache``).
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    tr = batch["response_mask"].shape[1]
    targets = ids[:, -tr:]  # (B, Tr)
    cache = _usable(model, prompt_cache)
    plan = _shared_plan(batch, cache) if share_prefix else None
    where = None
    if plan is not None:  # (M, V) at the real response positions ``where``
        logits, where = _packed_outputs(model, ids, mask, tr, plan, cache,
                                        lambda inputs, wanted: model(**inputs, logits_to_keep=wanted).logits[0])
        logits = logits.float()
        targets = targets[where]
    else:
        logits = model(ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=tr + 1).logits
        logits = logits[:, -(tr + 1):-1].float()  # (B, Tr, V): the positions that predict the response
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            p = logp_all.exp()
            entropy = -p.mul_(logp_all).sum(-1)
    if where is not None:  # back to (B, Tr), zeros past each response
        full = targets.new_zeros(ids.shape[0], tr, dtype=logp.dtype)
        logp = full.index_put(where, logp)
        entropy = None if entropy is None else full.index_put(where, entropy)
    return logp if not with_entropy else (logp, entropy)


def mean_metrics(records: list[dict]) -> dict[str, float]:
    """Average each metric over the records that have it (micro-batches or ranks)."""
    keys = {k for r in records for k in r}
    out = {}
    for k in keys:
        vals = [float(r[k]) for r in records if k in r]
        out[k] = sum(vals) / len(vals)
    return out


def sorted_inference(batch: Batch, budget: int, fn, worker=None) -> torch.Tensor:
    """(B, Tr) per-token outputs of ``fn`` over length-sorted, trimmed micro-batches, in batch order.

    On a long-tailed batch most columns are padding; grouping rows of similar length and
    trimming each group cuts the forward cost about 3x on ``sort`` with the same values
    (masked columns carry no weight and positions come from the mask). A ``worker`` whose
    model is FSDP-sharded runs as many forwards as its peers (see ``match_peer_count``).
    """
    chunks = length_sorted_chunks(batch, budget)
    if getattr(worker, "sharded", False):
        chunks = match_peer_count(worker, chunks)
    parts = [(idx, fn(trim_padding(batch.select(idx)))) for idx in chunks]
    return scatter_rows(parts, len(batch), batch["response_mask"].shape[1])


def match_peer_count(worker, chunks: list[list[int]]) -> list[list[int]]:
    """``chunks`` with the biggest ones halved until there are as many as on the rank with the most.

    Each forward of an FSDP model all-gathers (and each backward reduce-scatters) with every
    rank, so a rank with fewer micro-batches would leave its peers waiting until the collective
    timeout. Ranks hold equal row counts (``dp_split`` pads them), so the largest count fits.
    """
    if worker is None or not (worker.dist.distributed and worker.world_size > 1):
        return chunks  # one process (or a pipeline stage, whose peers are not data-parallel)
    counts = torch.zeros(worker.world_size)
    counts[worker.rank] = len(chunks)
    need = int(worker.all_reduce_tensor(counts).max())
    chunks = list(chunks)
    while len(chunks) < need:
        big = max(range(len(chunks)), key=lambda i: len(chunks[i]))
        c = chunks.pop(big)
        chunks[big:big] = [c[: len(c) // 2], c[len(c) // 2 :]]
    return chunks


def _prompt_bins(batch: Batch, rows: list[int], max_rows: int) -> list[list[int]]:
    """``rows`` cut into groups of at most ``max_rows`` that each hold as few distinct prompts as they can.

    Rows with equal prompt columns form a prompt group; groups go largest first into the first
    bin with room (first-fit decreasing), a group larger than ``max_rows`` filling whole bins first.
    Each bin runs its distinct prompts once (a shared-prefix forward), so fewer prompts per bin is
    fewer prompt tokens. Rows keep their given order inside a group; bins come in creation order.
    """
    keys = [tuple(r) for r in _prompt_keys(batch)[rows].tolist()]
    groups: dict[tuple, list[int]] = {}
    for row, key in zip(rows, keys, strict=True):
        groups.setdefault(key, []).append(row)
    bins: list[list[int]] = []
    for group in sorted(groups.values(), key=len, reverse=True):  # stable: equal sizes keep first-seen order
        while len(group) >= max_rows:
            bins.append(group[:max_rows])
            group = group[max_rows:]
        if group:
            home = next((b for b in bins if len(b) + len(group) <= max_rows), None)
            if home is None:
                bins.append(list(group))
            else:
                home.extend(group)
    return bins


def train_microbatches(worker, mini: Batch, budget: int, max_rows: int, by_prompt: bool = False) -> list[Batch]:
    """Micro-batches of one mini-batch for gradient accumulation: length-sorted, trimmed, at most
    ``max_rows`` rows and ``budget`` padded tokens each.

    The loss is normalised by the mini-batch's global token and sequence counts, so how the
    rows are grouped changes the accumulated gradient only by float summation order. With FSDP
    every rank must run as many forwards/backwards as its peers (each one all-gathers and
    reduce-scatters), so ranks agree on the largest count and split their biggest groups to reach it.
    ``by_prompt``: within a length group, micro-batches are packed so that each holds as few
    distinct prompts as it can (``_prompt_bins``), so a shared-prefix forward runs fewer prompts.
    """
    chunks = length_sorted_chunks(mini, budget)
    if by_prompt:
        chunks = [b for c in chunks for b in _prompt_bins(mini, c, max_rows)]
    else:
        chunks = [c[i : i + max_rows] for c in chunks for i in range(0, len(c), max_rows)]
    return [trim_padding(mini.select(c)) for c in match_peer_count(worker, chunks)]

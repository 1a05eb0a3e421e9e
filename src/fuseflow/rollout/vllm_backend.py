"""The `vllm` rollout backend: vLLM's `LLMEngine` behind the same contract as fuseflow's engine.

Users with GPUs expect vLLM; here it runs on its CPU build (`make vllm`, docs/vllm.md). The engine
is vLLM's public `LLMEngine`, run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): starting
it then takes seconds instead of a spawned engine process's ~14 s, weights reach it as tensors
(a spawned process would get them serialised), and the trainer's process needs no `__main__`
guard. What it keeps from fuseflow's contract, and how:

- per-request seeds: each request's `seed` goes to vLLM's per-request generator, so a sample does
  not depend on its batch;
- behaviour log-probs: `logprobs=0` with `logprobs_mode="processed_logprobs"` returns the sampled
  token's log-prob after temperature, which is what the trainer recomputes (top-k/top-p would
  renormalise it, so they are refused; greedy rows report temperature-1 log-probs, so greedy
  needs temperature 1);
- completion order and streaming: `step()` returns each sample the step it finishes;
- abort and resume (migration): vLLM cannot export KV or its generator state, so `abort` returns
  the tokens so far and `resume` prefills prompt + those tokens as a new request whose seed is
  derived from the original seed and the tokens already drawn. A migrated sample is then
  statistically, not token for token, the same as an unmigrated one (fuseflow's engine keeps the
  exact path);
- weights: `update_weights` pushes the full state dict (tied `lm_head.weight` included: vLLM's
  in-place reload puts the old tensor back into any layer a call leaves out) in buckets of whole
  decoder layers through `collective_rpc("reload_weights")`, then resets the prefix cache.

All vLLM engines in a process share one lock: vLLM keeps its forward context in module globals,
so two engines must not step at once (rollout workers on threads take turns on the cores).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from fuseflow.controller.group import WorkerFailure, first_line
from fuseflow.models.llama import CausalLM

from .base import RolloutRequest, Sample, SamplingParams, StreamingBackend
from .engine.sequence import PartialState

INSTALL_HINT = ("rollout.backend=vllm needs vLLM, which is not installed: on a CUDA machine "
                "`pip install \"fuseflow[vllm]\"`, on a CPU machine `make vllm` (vLLM's CPU build; docs/vllm.md)")
DTYPES = ("auto", "float32", "bfloat16")
BLOCK = 128  # vLLM's KV block on CPU (tokens); the KV budget is rounded up to whole blocks
_LOCK = threading.RLock()  # one vLLM engine steps at a time in this process (see the module docstring)
# Every started engine of this process stays referenced until it is closed, and a closed one until no
# other is open: shutting an in-process vLLM engine down tears down the process-wide distributed state
# that every other engine in the process uses ("pipeline model parallel group is not initialized").
_OPEN: list = []
_CLOSED: list = []


def vllm_available() -> bool:
    """Whether the `vllm` package can be found (without importing it: importing costs seconds)."""
    return importlib.util.find_spec("vllm") is not None


def check_request(p: SamplingParams, uid: int) -> None:
    """Refuse sampling options whose behaviour log-probs vLLM would report differently from the trainer."""
    if p.top_k > 0 or p.top_p < 1.0:
        raise ValueError(f"request {uid}: top_k={p.top_k}, top_p={p.top_p}: the vllm backend reports log-probs "
                         "renormalised over the kept tokens, not the trainer's; set rollout.top_k=0 rollout.top_p=1, "
                         "or use rollout.backend=engine")
    if p.greedy and p.temperature != 1.0:
        raise ValueError(f"request {uid}: greedy with temperature={p.temperature}: vLLM reports greedy log-probs at "
                         "temperature 1; use temperature 1 for greedy requests, or rollout.backend=engine")
    if p.stop:
        raise ValueError(f"request {uid}: stop strings {p.stop!r}: the vllm backend runs on token ids without a "
                         "tokenizer; use stop_token_ids, or rollout.backend=engine")


def resume_seed(seed: int, n_done: int) -> int:
    """Seed of a resumed request: a fresh stream per (seed, tokens drawn), so a resumed sample never reuses the
    random numbers its first tokens were drawn with (vLLM restarts a request's generator from its seed)."""
    return (seed * 0x9E3779B1 + (n_done + 1) * 0x85EBCA77) % (2**31 - 1)


@dataclass
class _Live:
    """One request in flight: what it resumes from and what it has produced since (vLLM's deltas)."""

    request: RolloutRequest
    prior_ids: list[int]  # tokens from before a resume (part of vLLM's prompt)
    prior_logprobs: list[float]
    policy_version: int
    t_first_token: float | None
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)

    @property
    def response(self) -> list[int]:
        return self.prior_ids + self.new_ids

    def partial(self) -> PartialState:
        return PartialState(self.request, self.response, self.prior_logprobs + self.new_logprobs, None,
                            self.policy_version, self.t_first_token)


class VLLMBackend(StreamingBackend):
    """vLLM's `LLMEngine` over a copy of a `CausalLM`'s weights (or an HF checkpoint directory).

    >>> backend = VLLMBackend(model, dtype="bfloat16", kv_budget_tokens=16384)   # doctest: +SKIP
    >>> for sample in backend.generate(requests):                                # doctest: +SKIP
    ...     score(sample)
    >>> backend.update_weights(step)          # after a training step: pushes model's weights   # doctest: +SKIP

    The engine starts on first use, so a backend that is never asked to generate (the actor's own
    when rollout workers generate instead) costs nothing.
    """

    def __init__(self, model: CausalLM | None = None, *, path: str | None = None, dtype: str = "auto",
                 max_num_seqs: int = 64, kv_budget_tokens: int = 16384, weight_bucket_mb: float = 64.0,
                 enable_prefix_cache: bool = True, max_num_batched_tokens: int = 2048):
        if not vllm_available():
            raise ValueError(INSTALL_HINT)
        if (model is None) == (path is None):
            raise ValueError("VLLMBackend needs exactly one of model= (a CausalLM) or path= (an HF checkpoint dir)")
        if dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={dtype!r} must be one of {', '.join(DTYPES)}")
        if max_num_seqs < 1 or kv_budget_tokens < 1 or weight_bucket_mb <= 0:
            raise ValueError(f"VLLMBackend: max_num_seqs={max_num_seqs} and kv_budget_tokens={kv_budget_tokens} must "
                             f"be >= 1 and weight_bucket_mb={weight_bucket_mb} > 0")
        self.source, self.path, self.dtype = model, path, dtype
        self.max_num_seqs, self.kv_budget_tokens = max_num_seqs, kv_budget_tokens
        self.bucket_bytes = int(weight_bucket_mb * 2**20)
        self.enable_prefix_cache, self.max_num_batched_tokens = enable_prefix_cache, max_num_batched_tokens
        cfg = model.config if model is not None else None
        limit = cfg.max_position_embeddings if cfg is not None else None
        self.max_model_len = min(limit, kv_budget_tokens) if limit else kv_budget_tokens
        self.vocab_size = cfg.vocab_size if cfg is not None else None
        self.policy_version = 0
        self.engine = None
        self._threads = torch.get_num_threads()  # intra-op threads of every engine step (set at start)
        self._live: dict[str, _Live] = {}
        self._by_uid: dict[int, str] = {}
        self._next_id = 0
        self.sync_metrics: dict[str, float] = {}
        self.stats = {"generated_tokens": 0, "resumed": 0, "weight_syncs": 0}

    @property
    def model(self) -> CausalLM | None:
        """The policy whose weights this backend serves (None when built from a path): what a rollout
        replica's weight broadcast writes into before `update_weights` pushes it to vLLM."""
        return self.source

    # ------------------------------------------------------------------------------------ engine
    def start(self) -> None:
        """Build the engine from the source model's current weights (written as an HF checkpoint); `add` calls
        it on first use, a benchmark before its clock starts."""
        if self.engine is not None:
            return
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: see the module docstring
        from vllm import EngineArgs, LLMEngine

        with tempfile.TemporaryDirectory(prefix="fuseflow-vllm-") as tmp:
            path = self.path
            if self.source is not None:
                self.source.save_pretrained(tmp)
                path = tmp
            dtype = self.dtype
            if dtype == "auto" and self.source is not None:
                dtype = str(next(self.source.parameters()).dtype).removeprefix("torch.")
            # One block more than the budget: vLLM keeps one block aside (its null block).
            kv_bytes = (self.kv_capacity_tokens() + BLOCK) * self._kv_bytes_per_token(path, dtype)
            args = EngineArgs(model=path, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
                              kv_cache_memory_bytes=kv_bytes, max_num_seqs=self.max_num_seqs,
                              max_model_len=self.max_model_len, logprobs_mode="processed_logprobs",
                              enable_prefix_caching=self.enable_prefix_cache, seed=0, enable_chunked_prefill=False,
                              distributed_executor_backend="uni",  # in this process, also inside a Ray actor
                              max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_model_len))
            # vLLM reseeds the global RNGs and replaces torch.set_num_threads (for its thread binding, which
            # only its multiprocess executor does): both are this process's, so they are put back.
            states = (torch.random.get_rng_state(), random.getstate(), torch.set_num_threads)
            self._threads = torch.get_num_threads()
            try:
                with _LOCK:
                    self.engine = LLMEngine.from_engine_args(args)
                    _OPEN.append(self.engine)
            except Exception as e:  # noqa: BLE001 - one line naming the cause, for the CLI
                raise ValueError(f"vLLM could not start on {path}: {type(e).__name__}: {vllm_cause(e)}; vLLM must be "
                                 "able to load it as a Hugging Face checkpoint (docs/vllm.md), or use "
                                 "rollout.backend=engine") from e
            finally:
                torch.random.set_rng_state(states[0])
                random.setstate(states[1])
                torch.set_num_threads = states[2]

    def _kv_bytes_per_token(self, path: str, dtype: str) -> int:
        """KV bytes one token takes in vLLM's cache (keys and values of every layer), from config.json."""
        c = json.loads((Path(path) / "config.json").read_text())
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        itemsize = 4 if dtype == "float32" else 2
        if self.vocab_size is None:
            self.vocab_size = c["vocab_size"]
            self.max_model_len = min(self.max_model_len, c.get("max_position_embeddings", self.max_model_len))
        return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * itemsize

    # ------------------------------------------------------------------------------------ main loop
    def add(self, item: RolloutRequest | PartialState) -> None:
        """Queue a new request, or a `PartialState` (from `abort`) to continue."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        partial = item if isinstance(item, PartialState) else None
        req = partial.request if partial is not None else item
        self._validate(req, partial)
        self.start()
        p, done = req.params, list(partial.response_ids) if partial else []
        seed = p.seed if not done else resume_seed(p.seed, len(done))
        sp = VSP(temperature=0.0 if p.greedy else p.temperature, max_tokens=p.max_new_tokens - len(done), seed=seed,
                 logprobs=0, ignore_eos=True, stop_token_ids=list(p.stop_token_ids), detokenize=False,
                 output_kind=RequestOutputKind.DELTA)
        rid = f"{req.uid}-{self._next_id}"
        self._next_id += 1
        live = _Live(req, done, list(partial.logprobs) if partial else [],
                     partial.policy_version if partial and partial.policy_version is not None else self.policy_version,
                     partial.t_first_token if partial else None)
        with _LOCK:
            self.engine.add_request(rid, {"prompt_token_ids": list(req.prompt_ids) + done}, sp)
            self._live[rid], self._by_uid[req.uid] = live, rid
        if partial is not None:
            self.stats["resumed"] += 1

    def step(self) -> list[Sample]:
        """One vLLM engine step; returns the samples that finished in it."""
        finished = []
        with _LOCK:
            # vLLM's CPU attention sizes its work plan by this thread's OpenMP thread count, and a thread
            # Python started (a rollout worker) does not inherit the count torch.set_num_threads gave the
            # thread that built the engine: the kernel then aborts the process ("thread_num == thread_num").
            torch.set_num_threads(self._threads)
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one line for the user; the run cannot go on with this engine
                raise WorkerFailure("rollout", 0, "step", f"vLLM's engine step raised {type(e).__name__}: "
                                    f"{first_line(e)}", "vLLM engine in this process") from e
            now = time.perf_counter()
            for out in outs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                o = out.outputs[0]
                ids = list(o.token_ids)
                if ids and live.t_first_token is None:
                    live.t_first_token = now
                live.new_ids += ids
                live.new_logprobs += [d[t].logprob for d, t in zip(o.logprobs or [], ids, strict=True)]
                self.stats["generated_tokens"] += len(ids)
                if out.finished:
                    del self._live[out.request_id]
                    self._by_uid.pop(live.request.uid, None)
                    finished.append(Sample(live.request.uid, live.request.group_id, list(live.request.prompt_ids),
                                           live.response, live.prior_logprobs + live.new_logprobs,
                                           "stop" if o.finish_reason == "stop" else "length", live.policy_version,
                                           t_first_token=live.t_first_token, t_finish=now))
        return finished

    def has_unfinished(self) -> bool:
        """Whether any request is still queued or decoding."""
        return bool(self._live)

    def abort(self, uids: Iterable[int]) -> list[PartialState]:
        """Stop these samples and return what they produced so far; unknown uids are ignored."""
        out = []
        with _LOCK:
            rids = [self._by_uid.pop(u) for u in uids if u in self._by_uid]
            if rids:
                self.engine.abort_request(rids)
            for rid in rids:
                out.append(self._live.pop(rid).partial())
        return out

    # ------------------------------------------------------------------------------------ for the pool
    def running_rows(self) -> int:
        """Requests in flight (the pool logs it per step)."""
        return len(self._live)

    def pending_samples(self) -> list[tuple[int, int, int, int]]:
        """(uid, response tokens so far, tokens still allowed, tokens held) of each unfinished sample."""
        return [(lv.request.uid, len(lv.response), lv.request.params.max_new_tokens - len(lv.response),
                 len(lv.request.prompt_ids) + len(lv.response)) for lv in list(self._live.values())]

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV budget holds."""
        return math.ceil(self.kv_budget_tokens / BLOCK) * BLOCK

    # ------------------------------------------------------------------------------------ weights
    def update_weights(self, version: int | None = None, state_dict: Mapping[str, Tensor] | None = None) -> None:
        """Push new weights in place (`state_dict`, or else the source model's current ones), reset the prefix
        cache, record the version. Time and size go to `sync_metrics` (`rollout/weight_sync_*`)."""
        self.policy_version = self.policy_version + 1 if version is None else version
        if self.engine is None:
            if state_dict is not None and self.source is not None:
                self.source.load_state_dict(dict(state_dict), strict=False)
            return  # not started: it will start from the source's current weights
        if state_dict is None:
            if self.source is None:
                raise ValueError("update_weights: this backend was built from a path; pass state_dict=")
            state_dict = self.source.state_dict()
        t0 = time.perf_counter()
        buckets = weight_buckets(state_dict, self.bucket_bytes)
        with _LOCK, torch.no_grad():
            for bucket in buckets:
                self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket})
            self.engine.reset_prefix_cache()
        seconds = time.perf_counter() - t0
        mb = sum(t.numel() * t.element_size() for b in buckets for _, t in b) / 2**20
        self.stats["weight_syncs"] += 1
        self.sync_metrics = {"rollout/weight_sync_seconds": seconds, "rollout/weight_sync_mb": mb,
                             "rollout/weight_sync_s_per_mb": seconds / mb if mb else 0.0,
                             "rollout/weight_sync_buckets": float(len(buckets))}

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV (a benchmark repeat starts cold, as a fresh engine would)."""
        if self.engine is not None:
            with _LOCK:
                self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Drop the engine (its KV cache and weights; freed once no other engine of the process is open, see
        `_OPEN`); a later `add` starts a new one."""
        with _LOCK:
            if any(e is self.engine for e in _OPEN):
                _OPEN.remove(self.engine)
                _CLOSED.append(self.engine)
            if not _OPEN:
                _CLOSED.clear()
            self.engine = None
            self._live.clear()
            self._by_uid.clear()

    def _validate(self, req: RolloutRequest, partial: PartialState | None) -> None:
        p, n = req.params, len(req.prompt_ids)
        if n == 0:
            raise ValueError(f"request {req.uid}: prompt_ids is empty; give at least one token")
        check_request(p, req.uid)
        ids = req.prompt_ids + (partial.response_ids if partial else [])
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"request {req.uid}: token ids must lie in [0, {self.vocab_size}), got "
                             f"{min(ids)}..{max(ids)}")
        if n + p.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {req.uid}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) exceeds "
                             f"{self.max_model_len} tokens (rollout.kv_budget_tokens={self.kv_budget_tokens}, or the "
                             "model's max_position_embeddings); raise rollout.kv_budget_tokens or shorten them")
        if partial is not None and len(partial.response_ids) >= p.max_new_tokens:
            raise ValueError(f"request {req.uid}: partial state already has max_new_tokens={p.max_new_tokens} "
                             "tokens; nothing to resume")


def vllm_cause(e: BaseException, limit: int = 240) -> str:
    """vLLM's error in one short line: its config errors come as pydantic's ("1 validation error for
    ModelConfig" then the cause, a "[type=...]" trailer and a link), an unsupported architecture with
    the list of every supported one."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not re.match(r"\d+ validation errors? for ", ln)
             and not ln.startswith("For further information")]
    text = re.sub(r"\s*\[type=.*$", "", lines[0].removeprefix("Value error, ")) if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def weight_buckets(state_dict: Mapping[str, Tensor], bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """The state dict cut into buckets of whole decoder layers, about `bucket_bytes` each.

    Why whole layers: vLLM's in-place reload fuses q/k/v and gate/up into one tensor and rebuilds a
    layer from the tensors one call gives it, so a call holding only part of a layer would leave the
    rest of it unset. Everything outside the decoder layers (embeddings, final norm, the tied
    lm_head) goes in one group. A layer larger than `bucket_bytes` is a bucket of its own.
    """
    groups: dict[object, list[tuple[str, Tensor]]] = {}
    for name, t in state_dict.items():
        m = _LAYER.match(name)
        groups.setdefault(int(m.group(1)) if m else "rest", []).append((name, t.detach()))
    buckets: list[list[tuple[str, Tensor]]] = []
    size = 0
    for key in sorted(groups, key=lambda k: (k == "rest", k if isinstance(k, int) else 0)):
        g = groups[key]
        g_bytes = sum(t.numel() * t.element_size() for _, t in g)
        if not buckets or size + g_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(g)
        size += g_bytes
    return buckets

"""Rollout replicas on Ray: one actor process per bundle of the rollout pool, each with its own engine and weights.

``RolloutReplica`` is the object inside one replica process. ``stream`` is a Ray streaming
generator: the replica's engine decodes on a thread of its own and every sample goes to the
controller the moment it finishes (the controller blocks on the next item, it never polls).
While a stream runs, ``abort``/``add`` move unfinished samples out of and into the engine as
``PartialState`` (tokens, behaviour log-probs and the sampler's generator state), which is how
migration moves the long tail between processes; ``pending`` tells the migration policy what
each replica holds. A stream ends as soon as its engine has nothing left to decode.

Weights: after each update the trainer's rank 0 broadcasts the policy's parameters to every
replica over a process group of their own (``weight_sync.WeightGroup``: gloo on CPU, NCCL on
GPU), in flat buckets of a few hundred MB, with a version number. ``ReplicaSet`` is the
controller's side: it starts the replicas on the pool's placement-group bundles, joins them to
the trainer in that group, runs each sync with every wait bounded by ``ray.collective_timeout_s``
and names the replica that did not finish.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fuseflow.policy.migration import PendingSample
from fuseflow.rollout.base import RolloutRequest, Sample
from fuseflow.rollout.engine import Engine, EngineConfig
from fuseflow.rollout.engine.sequence import PartialState

from .group import WorkerFailure
from .priority import name_thread, set_background
from .weight_sync import WeightGroup, signature

_END = object()
ROLE = "rollout"  # how errors name a replica: "rollout worker rank i (pool NAME) failed in rollout.METHOD"


class RolloutReplica:
    """One rollout replica process: ``builder()`` makes its engine (its own model copy) where it runs.

    The engine is fuseflow's ``Engine`` or a ``VLLMBackend``; ``self.model`` is the policy copy the
    weight broadcast writes into (the engine's own model, or the one vLLM's weights are pushed from).
    """

    def __init__(self, builder: Callable[[], Any], index: int, threads: int = 1):
        torch.set_num_threads(max(1, threads))
        self.index = index
        # The engine, or (engine, scorer[, reference scorer]): workers with ``compute_logprobs`` on its
        # model and on a copy of the frozen reference.
        built = builder()
        self.engine, self.scorer, self.ref_scorer = (*built, None, None)[:3] if isinstance(built, tuple) else (
            built, None, None)
        self.model: torch.nn.Module = self.engine.model
        self.sync_metrics: dict[str, float] = {}  # the engine's own part of the last sync (vLLM's push)
        self.group: WeightGroup | None = None
        self._lock = threading.Lock()  # a decode loop ends and ``add`` hands it samples atomically
        self._running = False
        self._log: deque[tuple[int, float]] = deque(maxlen=4096)  # (live rows, seconds) per engine step
        self._background: set[int] = set()
        # Log-probs run on a thread of their own under SCHED_IDLE (see ``compute_logprobs``); it keeps that
        # priority for the process's life, so Ray's call threads (abort, pending, add) never inherit it.
        self._scoring = ThreadPoolExecutor(1, thread_name_prefix=f"score-{index}",
                                           initializer=lambda: _scoring_thread(index))

    def ready(self) -> int:
        """This replica's pid, answered once its constructor (the engine's build) has finished."""
        return os.getpid()

    def info(self) -> dict[str, Any]:
        """Engine capacity (for the migration plan), the weights' signature (checked against the trainer's),
        and where it runs: its Ray node and torch threads (the cores it lends while idle)."""
        import ray

        e = self.engine
        config = e.config if isinstance(e, Engine) else EngineConfig(e.max_num_seqs, e.kv_budget_tokens)
        return {"config": config, "kv_tokens": e.kv_capacity_tokens(), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(), "threads": torch.get_num_threads(),
                "scores": self.scorer is not None, "scores_reference": self.ref_scorer is not None,
                "backend": type(e).__name__, "signature": signature(self.model), "version": e.policy_version}

    # ------------------------------------------------------------------ generation
    def stream(self, requests: list[RolloutRequest], background: bool = False) -> Iterator[list[Sample]]:
        """Add ``requests`` and yield finished samples as they finish until the engine has nothing left:
        each item holds every sample finished since the last one was yielded (at least one).

        Why lists, not one sample per item: each streamed item costs both processes a message; for 256
        samples one per item took ~110 ms of CPU (controller and replica together) against ~30 ms for
        four per item (docs/ray_rollout.md). An engine step often finishes several samples, and
        none waits for another: whatever finished is sent the moment the stream can send.
        ``background`` decodes under ``SCHED_IDLE`` (an async prefetch beside training). One
        stream at a time: the controller starts another only after ``add`` said none runs.
        """
        out: queue.Queue = queue.Queue()
        with self._lock:
            if self._running:
                raise RuntimeError(f"rollout replica {self.index}: a stream already runs")
            for r in requests:
                self.engine.add(r)
            self._running = True
        threading.Thread(target=self._decode, args=(out, background), daemon=True,
                         name=f"decode-{self.index}").start()
        while True:
            items, finished = [out.get()], []
            while True:  # what else the decode thread finished meanwhile goes in the same item
                try:
                    items.append(out.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _END or isinstance(item, BaseException):
                    if finished:
                        yield finished
                    if isinstance(item, BaseException):
                        raise item
                    return
                finished.extend(item)
            yield finished

    def _decode(self, out: queue.Queue, background: bool) -> None:
        tid = threading.get_native_id()
        name_thread(f"decode-{self.index}")
        if background and set_background(tid, True):
            self._background.add(tid)
        try:
            while True:
                with self._lock:
                    if not self.engine.has_unfinished():
                        self._running = False
                        break
                rows, t0 = self.engine.running_rows(), time.perf_counter()
                done = self.engine.step()
                self._log.append((rows, time.perf_counter() - t0))
                if done:
                    out.put(list(done))
        except BaseException as e:  # noqa: BLE001 - raised in the stream, which the controller reads
            with self._lock:
                self._running = False
            out.put(e)
        finally:
            self._background.discard(tid)
            out.put(_END)

    def add(self, states: list[PartialState | RolloutRequest]) -> bool:
        """Queue migrated samples; True when a stream is running and will decode them, else the
        controller starts one."""
        with self._lock:
            for s in states:
                self.engine.add(s)
            return self._running

    def abort(self, uids: list[int]) -> list[PartialState]:
        """Stop these samples and export their state (uids already finished are skipped)."""
        return self.engine.abort(uids)

    def pending(self) -> list[PendingSample]:
        """Unfinished samples with their KV held now and tokens still allowed (as ``RolloutPool.pending``)."""
        return [PendingSample(*row) for row in self.engine.pending_samples()]

    def compute_logprobs(self, batch, reference: bool = False) -> Any:
        """(B, Tr) log-probs of a micro-batch (wire data in and out) under this replica's weights, or
        (``reference``) under its copy of the frozen reference.

        Once synced the weights are the actor's, so a replica with nothing to decode takes the old
        log-probs, and at any time the reference log-probs, off the roles' process (RLHFuse: freed
        rollout workers run inference).

        They compute under ``SCHED_IDLE``, as the roles' streamed inference does: while the other
        replica decodes, a free replica's log-probs and the critic's values (which only the roles'
        process can run, and which then form the step's tail) share the core the decode leaves,
        where at normal priority the log-probs took it all and the critic waited (measured: gen end
        to advantages 170-185 against 200-220 ms a fused step, docs/ray_rollout.md).
        """
        from .dispatch import from_wire, to_wire

        scorer = self.ref_scorer if reference else self.scorer
        if scorer is None:
            raise RuntimeError(f"rollout replica {self.index} was built without a "
                               f"{'reference ' if reference else ''}scorer")
        t0 = time.perf_counter()
        out = self._scoring.submit(scorer.compute_logprobs, from_wire(batch)).result()
        return to_wire(out), time.perf_counter() - t0

    def step_log(self) -> list[tuple[int, float]]:
        """Engine steps measured since the last call (the elastic rule fits its decode cost to them)."""
        out = list(self._log)
        self._log.clear()
        return out

    def restore_priority(self) -> None:
        """Training ended: a background decode thread goes back to normal scheduling (if the OS allows)."""
        for tid in list(self._background):
            if set_background(tid, False):
                self._background.discard(tid)

    # ------------------------------------------------------------------ weights
    def join_weights(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the weight group (rank 0 is the trainer's actor rank 0)."""
        device = next(self.model.parameters()).device.type
        self.group = WeightGroup(addr, port, rank, world_size, timeout_s, device)

    @torch.no_grad()
    def receive_weights(self, version: int) -> dict[str, float]:
        """Take rank 0's broadcast into this replica's model and stamp ``version``.

        fuseflow's engine decodes with that model; vLLM gets its full state dict pushed in place
        (``VLLMBackend.update_weights``). Either drops prefix KV computed with the old weights.
        Returns the seconds spent and the engine's own sync metrics (vLLM: ``rollout/weight_sync_*``).
        """
        t0 = time.perf_counter()
        self.group.broadcast(list(self.model.parameters()))
        self.engine.update_weights(version)
        self.sync_metrics = dict(getattr(self.engine, "sync_metrics", {}))
        return {"seconds": time.perf_counter() - t0, **self.sync_metrics}

    def weights(self) -> dict[str, Any]:
        """The model's parameters as numpy arrays (tests compare them bitwise with the trainer's)."""
        return {n: p.detach().cpu().numpy() for n, p in self.model.named_parameters()}


class ReplicaSet:
    """The controller's handles on the replicas of one run, and the weight sync to them.

    ``pool``: the placement pool's name (errors name it); ``timeout_s``: ``ray.collective_timeout_s``.
    """

    def __init__(self, handles: list[Any], pool: str, timeout_s: float, start_timeout_s: float):
        # Replicas start (and load their models) while the controller builds the other roles: their
        # details are read on first use.
        self.handles, self.pool, self.timeout_s, self.start_timeout_s = handles, pool, timeout_s, start_timeout_s
        self._info_refs = [h.info.remote() for h in handles]
        self._infos: list[dict] | None = None
        self.connected = False
        self.sync_log: list[tuple[int, float]] = []  # (bytes per replica, seconds) of every sync
        self.sync_metrics: dict[str, float] = {}  # the last sync's (``sync``), for the step's metrics
        self.synced: int | None = None  # version of the last sync (None: the weights they were built with)

    def _info(self) -> list[dict]:
        if self._infos is None:
            import ray
            from ray.exceptions import GetTimeoutError

            out = []
            for i, r in enumerate(self._info_refs):
                try:
                    out.append(ray.get(r, timeout=self.start_timeout_s))
                except GetTimeoutError:
                    raise WorkerFailure(ROLE, i, "start", f"not up within ray.start_timeout_s={self.start_timeout_s:g}s",
                                        f"pool {self.pool}") from None
                except Exception as e:  # noqa: BLE001 - named per replica
                    raise self.failure(i, "start", e) from None
            self._infos = out
        return self._infos

    @property
    def config(self):
        """The replicas' ``EngineConfig``."""
        return self._info()[0]["config"]

    @property
    def kv_tokens(self) -> list[int]:
        """KV-cache capacity in tokens of each replica's engine, in replica order. The first read of any
        replica detail waits for every replica to start, one after another (``WorkerFailure`` naming the first
        that failed, or that was not up within ``ray.start_timeout_s`` of its turn)."""
        return [i["kv_tokens"] for i in self._info()]

    @property
    def signature(self) -> list:
        """(name, shape, dtype) of replica 0's parameters in broadcast order; ``connect`` checks the actor's
        against it before the first weight sync."""
        return self._info()[0]["signature"]

    @property
    def scores(self) -> bool:
        """Whether the replicas can compute log-probs (``RolloutReplica.compute_logprobs``)."""
        return all(i["scores"] for i in self._info())

    @property
    def scores_reference(self) -> bool:
        """Whether the replicas hold a copy of the reference and compute its log-probs."""
        return all(i.get("scores_reference", False) for i in self._info())

    @property
    def pids(self) -> list[int]:
        """Process id of each replica, in replica order."""
        return [i["pid"] for i in self._info()]

    @property
    def cores_by_node(self) -> dict[str, int]:
        """The replicas' intra-op threads summed per Ray node (the cores they leave idle when they are)."""
        out: dict[str, int] = {}
        for i in self._info():
            out[i["node"]] = out.get(i["node"], 0) + i["threads"]
        return out

    @property
    def version(self) -> int:
        """Policy version the replicas hold."""
        return self._info()[0]["version"] if self.synced is None else self.synced

    def __len__(self) -> int:
        return len(self.handles)

    def connect(self, actor) -> None:
        """Form the weight group: the actor group's rank 0 (the source) and every replica."""
        import ray

        theirs = actor.weight_signature()
        if [tuple(x) for x in theirs] != [tuple(x) for x in self.signature]:
            raise RuntimeError("the rollout replicas' model does not match the actor's parameters "
                               f"({len(self.signature)} vs {len(theirs)} tensors); they must be built alike")
        addr, port = ray.get(actor.hosts[0].address.remote(), timeout=self.timeout_s)
        world = len(self.handles) + 1
        src = actor.join_weight_group.future(addr, port, world, self.timeout_s)
        refs = [h.join_weights.remote(addr, port, i + 1, world, self.timeout_s) for i, h in enumerate(self.handles)]
        self._wait(refs, src, "join_weights")
        self.connected = True

    def sync(self, version: int, actor) -> tuple[int, float]:
        """Broadcast the actor's current weights to every replica as ``version``; (bytes per replica, seconds)."""
        if not self.connected:
            self.connect(actor)
        t0 = time.perf_counter()
        refs = [h.receive_weights.remote(version) for h in self.handles]
        src = actor.broadcast_weights.future()
        sent = self._wait(refs, src, "receive_weights")
        seconds = time.perf_counter() - t0
        self.synced = version
        self.sync_log.append((sent, seconds))
        self.sync_metrics = sync_metrics(sent, seconds, self._get(refs, "receive_weights"))
        return self.sync_log[-1]

    def _wait(self, refs: list, src, method: str) -> Any:
        """Wait for every replica's side and the source's (``src``, a group future) within the timeout;
        a replica that failed or did not finish is named, before the source (whose error it causes)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        deadline = time.perf_counter() + self.timeout_s
        pending = list(refs) + list(src.refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
            if not ready:
                break
            if ready[0] in refs:
                self._check(refs.index(ready[0]), ready[0], method)
            else:
                try:
                    ray.get(ready[0])
                except (RayActorError, RayTaskError):
                    # The source fails when a receiver is gone: give the receivers a moment to say which.
                    done, _ = ray.wait(refs, num_returns=len(refs), timeout=min(5.0, self.timeout_s))
                    for r in done:
                        self._check(refs.index(r), r, method)
                    raise
        for i, r in enumerate(refs):
            if r in pending:
                raise WorkerFailure(ROLE, i, method, f"the weight sync did not complete within "
                                    f"ray.collective_timeout_s={self.timeout_s:g}s", f"pool {self.pool}")
        return src.result()

    def _check(self, i: int, ref, method: str) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            raise self.failure(i, method, e) from None

    def failure(self, i: int, method: str, e: BaseException) -> WorkerFailure:
        """The one-line error for replica ``i`` failing in ``method`` (a dead process or its exception)."""
        from ray.exceptions import RayActorError

        if isinstance(e, RayActorError):
            cause = f"its process died ({_summary(e)})"
        else:
            inner = getattr(e, "cause", None) or e
            # An engine's own one-line failure (VLLMBackend.step's) keeps its words, not a nested name.
            cause = inner.cause if isinstance(inner, WorkerFailure) else f"{type(inner).__name__}: {_summary(inner)}"
        return WorkerFailure(ROLE, i, method, cause, f"pool {self.pool}")

    def get(self, i: int, ref, method: str) -> Any:
        """Replica ``i``'s result of ``method`` within the timeout; a failure names the replica."""
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - named per replica
            raise self.failure(i, method, e) from None

    def _get(self, refs: list, method: str) -> list:
        return [self.get(i, r, method) for i, r in enumerate(refs)]

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every replica, their results in replica order (failures name the replica)."""
        return self._get([getattr(h, method).remote(*args) for h in self.handles], method)


def _scoring_thread(index: int) -> None:
    """A replica's scoring thread starts: ``SCHED_IDLE`` for its life, and the OS name ``score-INDEX``."""
    set_background(threading.get_native_id(), True)
    name_thread(f"score-{index}")


def sync_metrics(sent: int, seconds: float, replicas: list[dict[str, float]]) -> dict[str, float]:
    """One sync's metrics: its seconds (broadcast and every replica's engine update) and seconds per MB
    each replica received; with vLLM replicas also the in-place push into vLLM (the slowest replica's
    ``rollout/weight_sync_*``, renamed ``rollout/vllm_push_*``: the MB it pushes count a tied head twice)."""
    mb = sent / 2**20
    out = {"rollout/weight_sync_seconds": seconds, "rollout/weight_sync_s_per_mb": seconds / mb if mb else 0.0}
    pushes = [r for r in replicas if "rollout/weight_sync_seconds" in r]
    if pushes:
        slowest = max(pushes, key=lambda r: r["rollout/weight_sync_seconds"])
        out |= {k.replace("rollout/weight_sync_", "rollout/vllm_push_"): v for k, v in slowest.items()
                if k.startswith("rollout/weight_sync_")}
    return out


def _summary(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__

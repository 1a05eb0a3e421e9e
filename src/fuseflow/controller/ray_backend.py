"""The ``ray`` backend: each pool is a set of Ray actors (``WorkerHost``) in placement groups.

Start-up: join the cluster at ``ray.address`` (or start a local one), reserve each pool's
CPU/GPU bundles in placement groups, start one host per bundle, then give every pool of
more than one worker a torch.distributed process group. Every wait has a timeout whose
error names what did not come up.

While running, a call's future watches all its ranks at once: the first rank that
raises or dies ends the wait with a ``WorkerFailure`` naming the role and rank, without
waiting for the peers (which would sit in a collective until their own timeout).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from typing import Any

from .dispatch import from_wire, to_wire
from .group import Future, WorkerFailure, WorkerGroup, started_background, started_beside
from .host import WorkerHost
from .placement import Placement, PoolPlan

# Lanes per worker process for calls started ``beside()`` (group.beside): PPO's critic updates (two
# with safe_ppo's cost critic) beside the actor's, which keeps the process's serial lane. Calls started
# ``background()`` take one more lane, under SCHED_IDLE; one thread, so they keep their order.
BESIDE_LANES = 2
LANES = {"beside": BESIDE_LANES, "background": 1}
_TICKETS = itertools.count()  # numbers the controller's one-rank calls (``WorkerHost.withdraw``)


class ClusterError(RuntimeError):
    """The cluster could not be reached or could not hold the pools; a one-line message for the user."""


def connect(address: str | None, num_cpus: float, num_gpus: float, timeout_s: float) -> bool:
    """Attach this process to Ray; True when it started a local cluster (which it then owns).

    An already initialised Ray (e.g. a test fixture's cluster) is used as it is.
    """
    import ray

    if ray.is_initialized():
        return False
    if address:
        check_address(address, timeout_s)
        try:
            with _quiet_fd2():
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ClusterError(f"ray.address={address}: could not join the Ray cluster: {first}") from None
        return True
    # Ray's CPU slots are a scheduling count, not a thread limit: reserve as many as the pools ask for.
    start_local_ray(max(os.cpu_count() or 1, int(num_cpus + 0.999)), int(num_gpus + 0.999))
    return True


@contextmanager
def _quiet_fd2():
    """Hold back what Ray's C++ core writes straight to file descriptor 2 while joining a cluster.

    Its GCS client logs every retry there (``Failed to connect to GCS ...``), bypassing Python's
    logging; the user should see only fuseflow's own line when joining fails.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def start_local_ray(num_cpus: int, num_gpus: int = 0, env_vars: dict[str, str] | None = None) -> None:
    """Start a single-machine Ray for this process, lean and with workers at normal priority.

    Ray starts worker processes at niceness 15 by default; on a machine shared with other
    work they then lose the CPU to everything else and a step ran ~1.8x slower (measured),
    so a cluster started here runs them at 0. Clusters started with ``ray start`` keep
    their own setting (``RAY_worker_niceness=0 ray start --head`` gives the same).
    """
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet this starts
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus or None, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", runtime_env={"env_vars": env_vars} if env_vars else None)
    stop_idle_daemons()


def stop_idle_daemons() -> list[str]:
    """Stop the log monitor and the autoscaler's monitor of the local cluster this process started.

    This cluster has no use for them: the log monitor ships worker logs to drivers (fuseflow's run with
    ``log_to_driver=False``; the files stay in the session's log directory) and the autoscaler's monitor
    scales a cluster of one fixed node. In ``fuseflow bench fusion --backend ray`` on a 2-core machine they
    took about 0.6% of it (other processes' share fell by that much once they were stopped;
    docs/ray_rollout.md, session 38), CPU that a mode keeping both cores busy loses. ``ray.init`` has no
    switch for them (``ray start`` has ``--include-log-monitor=False`` and ``--no-monitor``), so they are
    stopped through the node object Ray keeps for the cluster it started. Best effort: where that object or
    its methods are missing (another Ray version), or this process joined a cluster instead of starting
    one, nothing is stopped. Returns the process types stopped.
    """
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        daemons = {ray_constants.PROCESS_TYPE_LOG_MONITOR: node.kill_log_monitor,
                   ray_constants.PROCESS_TYPE_MONITOR: node.kill_monitor}
        running = set(node.all_processes)
    except (ImportError, AttributeError):
        return []
    stopped = [name for name in daemons if name in running]
    for name in stopped:
        daemons[name](check_alive=False)
    return stopped


def check_address(address: str, timeout_s: float) -> None:
    """Fail in one line, within seconds, when nothing listens at ``HOST:PORT`` (ray.init would retry for long)."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"ray.address={address!r}: expected HOST:PORT (e.g. 10.0.0.5:6379) or 'auto'")
    wait = min(timeout_s, 10.0)
    try:
        conn = socket.create_connection((host, int(port)), timeout=wait)
    except OSError as e:
        raise ClusterError(f"ray.address={address}: no Ray cluster reachable there ({e.strerror or e}); "
                           "start one with `ray start --head` or drop ray.address to run a local one") from None
    # Something listens; Ray's GCS is a gRPC (HTTP/2) server, which answers a client preface with a
    # SETTINGS frame at once. Anything else (a database, a closed-off proxy) would leave ray.init
    # retrying for minutes while printing its own warnings, so it is refused here in seconds.
    with conn:
        try:
            conn.settimeout(wait)
            conn.sendall(_H2_PREFACE)
            head = _recv_exactly(conn, 9)
        except OSError:
            head = b""
    if len(head) < 9 or head[3] != 0x04:  # byte 3 of an HTTP/2 frame header is its type; 4 = SETTINGS
        raise ClusterError(f"ray.address={address}: something listens there but it is not a Ray cluster (no gRPC "
                           f"answer within {wait:g}s); check the head node's GCS port (default 6379)")


# The HTTP/2 connection preface plus an empty SETTINGS frame (RFC 9113, section 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class RayCluster:
    """The worker processes of one run: hosts per pool, built from a ``Placement``."""

    def __init__(self, placement: Placement, start_timeout_s: float, collective_timeout_s: float,
                 address: str | None = None, run_name: str | None = None):
        import ray

        self.placement, self.start_timeout_s = placement, start_timeout_s
        self.owns_ray = connect(address, placement.cpus_needed(), placement.gpus_needed(), start_timeout_s)
        self.run_name = run_name or uuid.uuid4().hex[:8]
        self.hosts: dict[str, list[Any]] = {}
        self.pgs: list[Any] = []
        self.collective_timeout_s = collective_timeout_s
        self.replicas: list[Any] = []  # rollout replica actors (``rollout_replicas``)
        # The rollout pool's bundles hold replica processes (``RolloutReplica``), not role hosts.
        rollout = placement.role_pool.get("rollout")
        self.rollout_pgs: list[Any] = []
        try:
            for pool in placement.pools.values():
                if pool.name == rollout:
                    self.rollout_pgs = self._reserve(pool)
                else:
                    self.hosts[pool.name] = self._start_pool(pool)
            waits = [(f"pool {n} rank {r}", h.ready.remote()) for n, hs in self.hosts.items() for r, h in enumerate(hs)]
            _wait_start(waits, start_timeout_s, "start")
            self.pids = {n: [ray.get(h.ready.remote()) for h in hs] for n, hs in self.hosts.items()}
            for name, hosts in self.hosts.items():
                if len(hosts) > 1:
                    addr, port = ray.get(hosts[0].address.remote(), timeout=start_timeout_s)
                    inits = [(f"pool {name} rank {r}", h.init_process_group.remote(addr, port, collective_timeout_s))
                             for r, h in enumerate(hosts)]
                    _wait_start(inits, start_timeout_s, "join its process group")
        except BaseException:
            self.shutdown()
            raise

    def _start_pool(self, pool: PoolPlan) -> list[Any]:
        import ray

        pgs = self._reserve(pool)
        # One serial lane for the roles' calls in order, plus lanes for calls started ``beside()`` and
        # ``background()``.
        remote = ray.remote(concurrency_groups=LANES)(WorkerHost)
        hosts = []
        for rank in range(pool.size):
            hosts.append(remote.options(
                num_cpus=pool.cpus_per_worker, num_gpus=pool.gpus_per_worker, scheduling_strategy=_bundle(pgs, pool, rank),
                name=f"fuseflow-{self.run_name}-{pool.name}-{rank}", max_restarts=0,
            ).remote(pool.name, rank, pool.size, max(1, int(pool.cpus_per_worker))))
        return hosts

    def _reserve(self, pool: PoolPlan) -> list[Any]:
        """Placement groups holding ``pool``'s bundles (one per node), ready within the start timeout."""
        import ray
        from ray.util.placement_group import placement_group

        bundle = {"CPU": pool.cpus_per_worker} | ({"GPU": pool.gpus_per_worker} if pool.gpus_per_worker else {})
        if self.owns_ray:  # a local cluster never grows: fail now rather than after the timeout
            total = ray.cluster_resources()
            for k, v in bundle.items():
                if v * pool.workers_per_node > total.get(k, 0.0):
                    raise ClusterError(f"pool {pool.name}: {pool.workers_per_node} workers x {v:g} {k} do not fit "
                                       f"this machine's {total.get(k, 0.0):g} {k}; lower pools.{pool.name}."
                                       f"{'cpus' if k == 'CPU' else 'gpus'}_per_worker")
        pgs = [placement_group([bundle] * pool.workers_per_node, strategy="STRICT_PACK" if pool.nodes > 1 else "PACK",
                               name=f"fuseflow-{self.run_name}-{pool.name}-{node}") for node in range(pool.nodes)]
        self.pgs += pgs
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.start_timeout_s)
        if len(ready) < len(pgs):
            have = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise ClusterError(f"pool {pool.name}: {pool.nodes} x {pool.workers_per_node} workers of {bundle} could "
                               f"not be placed within ray.start_timeout_s={self.start_timeout_s:g}s (free now: {have}); "
                               f"lower pools.{pool.name}.cpus_per_worker / gpus_per_worker or add nodes")
        return pgs

    def rollout_replicas(self, builder: Callable[[], Any]):
        """Start one ``RolloutReplica`` per bundle of the rollout pool (``placement.rollout``); None without one.

        ``builder()`` runs in each replica process and returns its engine (its own model copy).
        """
        import ray

        from .replica import ReplicaSet, RolloutReplica

        name = self.placement.role_pool.get("rollout")
        if name is None:
            return None
        pool, n = self.placement.pools[name], self.placement.dp["rollout"]
        # Threaded: a stream decodes while abort/add/pending calls come in (migration).
        remote = ray.remote(RolloutReplica)
        handles = [remote.options(num_cpus=pool.cpus_per_worker, num_gpus=pool.gpus_per_worker,
                                  scheduling_strategy=_bundle(self.rollout_pgs, pool, i), max_concurrency=8,
                                  name=f"fuseflow-{self.run_name}-{name}-{i}", max_restarts=0,
                                  ).remote(builder, i, max(1, int(pool.cpus_per_worker))) for i in range(n)]
        self.replicas += handles
        return ReplicaSet(handles, name, self.collective_timeout_s, self.start_timeout_s)

    def group(self, role: str, cls: type, builder: Callable, placed_as: str | None = None) -> RayGroup:
        """Build ``role`` on the first ``dp`` hosts of its pool and return its group.

        ``placed_as`` names the placement entry to follow instead of the role's own (safe_ppo's cost
        critic goes where the critic goes).
        """
        key = placed_as or role
        if key not in self.placement.role_pool:
            raise ValueError(f"role {key!r} has no pool in the placement ({', '.join(self.placement.role_pool)})")
        pool, dp = self.placement.role_pool[key], self.placement.dp[key]
        hosts = self.hosts[pool][:dp]
        _wait_start([(f"{role} rank {r}", h.add_role.remote(role, builder, dp)) for r, h in enumerate(hosts)],
                    self.start_timeout_s, f"build {role}")
        return RayGroup(role, cls, hosts, pool)

    def host(self, pool: str, rank: int) -> Any:
        """The Ray actor handle of one worker process (tests kill it to check fault handling)."""
        return self.hosts[pool][rank]

    def shutdown(self) -> None:
        """Stop the run's processes and free its placement groups; stop Ray if this run started it."""
        import ray

        if not ray.is_initialized():
            return
        for h in [h for hosts in self.hosts.values() for h in hosts] + self.replicas:
            ray.kill(h, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with a dead cluster; nothing left to free
                pass
        self.hosts, self.pgs, self.replicas = {}, [], []
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False


def _bundle(pgs: list[Any], pool: PoolPlan, rank: int) -> Any:
    """The scheduling strategy that puts worker ``rank`` of ``pool`` on its own bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    node, slot = divmod(rank, pool.workers_per_node)
    return PlacementGroupSchedulingStrategy(pgs[node], placement_group_bundle_index=slot)


class RayGroup(WorkerGroup):
    """A role's ranks as Ray actor handles; arguments go as numpy-backed wire data, sliced per rank."""

    def __init__(self, role: str, cls: type, hosts: list[Any], pool: str):
        super().__init__(role, cls, len(hosts))
        self.hosts, self.pool = hosts, pool

    def _submit(self, name, ranks, per_rank, collect) -> Future:
        import ray

        shared = None
        if len(per_rank) > 1 and all(p is per_rank[0] for p in per_rank):
            # one_to_all: store the input once; Ray hands each host the stored object.
            shared = tuple(ray.put(x) for x in to_wire(per_rank[0]))
        lane = {}
        if started_beside():
            if not self.runs_beside:
                raise RuntimeError(f"{self.role}.{name}: a call on {self.world_size} ranks cannot run beside another "
                                   f"role's (its ranks share pool {self.pool}'s process group); start it in order")
            lane = {"concurrency_group": "beside"}
        method = "call"
        if not lane and started_background() and self.runs_beside:  # several ranks: their one order instead
            lane, method = {"concurrency_group": "background"}, "call_background"
        # A one-rank call in a lane of one thread carries a ticket, so that it can be taken back
        # (``RayFuture.withdraw``) while it still waits there.
        in_beside = lane.get("concurrency_group") == "beside"
        ticket = next(_TICKETS) if len(ranks) == 1 and not in_beside else None
        named = {"lane": "beside"} if in_beside else {}  # the OS name its thread takes (``WorkerHost.call``)
        refs = []
        for r, call in zip(ranks, per_rank, strict=True):
            args, kwargs = shared or to_wire(call)
            refs.append(getattr(self.hosts[r], method).options(**lane).remote(self.role, name, args, kwargs, ticket,
                                                                              **named))
        future = RayFuture(self, name, ranks, refs, collect)
        if ticket is not None:
            future.withdraw = partial(_withdraw, self.hosts[ranks[0]], ticket,
                                      "background" if method == "call_background" else "serial")
        return future

    def lend_threads(self, cores: dict[str, int], at_once: int = 1) -> None:
        refs = [h.lend_threads.remote(cores, at_once) for h in self.hosts]
        _wait_ranks(self.role, "lend_threads", list(range(len(refs))), refs, self.pool)


class RayFuture(Future):
    def __init__(self, group: RayGroup, name: str, ranks: list[int], refs: list, collect: Callable[[list], Any]):
        self.group, self.name, self.ranks, self.refs, self.collect = group, name, ranks, refs, collect
        self._value: tuple | None = None

    def done(self) -> bool:
        """Whether every rank's call has finished (or failed), checked without waiting (``ray.wait``, timeout 0)."""
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> Any:
        """Wait for every rank and return the collected result, kept so later calls return it at once (the
        call's compute seconds are counted on the group once). The first rank to fail raises ``WorkerFailure``
        (its error, or its process died); a task's ``RewardError`` or ``DataError`` is raised as it is."""
        if self._value is None:
            outs = _wait_ranks(self.group.role, self.name, self.ranks, self.refs, self.group.pool)
            self.group._count([s for _, s, _ in outs], sum(c for _, _, c in outs))
            self._value = (self.collect([from_wire(r) for r, _, _ in outs]),)
        return self._value[0]


def _withdraw(host, ticket: int, lane: str, timeout_s: float = 30.0) -> bool:
    """``WorkerHost.withdraw`` on the host's ``beside`` lane: a steal happens while inference runs, never
    beside an update, so a thread of that lane is free and the answer comes at once."""
    import ray

    return ray.get(host.withdraw.options(concurrency_group="beside").remote(ticket, lane), timeout=timeout_s)


def _wait_ranks(role: str, method: str, ranks: list[int], refs: list, pool: str) -> list:
    """Every rank's result; the first failure (an exception or a dead process) raises at once."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    from fuseflow.tasks import DataError, RewardError

    index = {ref: i for i, ref in enumerate(refs)}
    out: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            i = index[ref]
            try:
                out[i] = ray.get(ref)
            except RayActorError as e:
                raise WorkerFailure(role, ranks[i], method, f"its process died ({_summary(e)})",
                                    f"pool {pool}") from None
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                if isinstance(cause, (RewardError, DataError)):  # the user's function or data: their one line
                    raise cause from None
                raise WorkerFailure(role, ranks[i], method, f"{type(cause).__name__}: {_summary(cause)}",
                                    f"pool {pool}") from None
    return out


def _wait_start(waits: list[tuple[str, Any]], timeout_s: float | None, what: str) -> None:
    """Wait for start-up calls; a timeout or a failure names the first worker that did not make it."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    refs = [r for _, r in waits]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for label, ref in waits:
        if ref in pending:
            raise ClusterError(f"{label} did not {what} within ray.start_timeout_s={timeout_s:g}s")
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            cause = getattr(e, "cause", None) or e
            raise ClusterError(f"{label} failed to {what}: {type(cause).__name__}: {_summary(cause)}") from None


def _summary(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__

"""Execution strategies: how one controller program's steps run on the worker groups.

The algorithm program (generate, score, infer, advantages, train, sync) never changes; a
mode (``schedule.mode``) only changes when and where each piece runs.

- ``stages``: what every mode computes (seeded requests, reward, inference calls, DAPO's
  dynamic sampling, ReMax's greedy baseline, batch assembly), holding the worker groups.
- ``base``: the interface (``Strategy``) and ``Sequential``; ``modes``: the pooled strategies
  (``Pooled`` and its ``Fused``, ``Async``, ``FusedAsync``, ``Elastic``, ``FusedElastic``); see its docstring.
- ``pool``: the mechanism the pooled strategies drive on the local backend: rollout workers on
  threads, each with its own engine, that decode, take inference tasks when idle, migrate samples
  and (elastic) are released when they run out of work.
- ``ray_pool``: the same interface over rollout replica processes on Ray
  (``fuseflow.controller.replica``): streamed samples, migration of ``PartialState`` between
  processes, weight broadcast from the actor's rank 0.
- ``staleness``: the bounded-staleness admission and checks of asynchronous PPO.
- ``pending``: an async prefetch's samples in a checkpoint, so a resume is exact.

The decisions themselves (micro-batching, migration, length prediction and assignment, the
elastic replica count) are pure functions in ``fuseflow.policy``, which the simulator calls
too. Visibility: each worker writes spans on its own trace track and a ``sample_done``
instant per finished sample; ``fuseflow.telemetry.gantt`` turns them into busy fractions,
long-tail time and a Gantt PNG.

Also here: ``schedule.pipeline``, fused actor/critic training pipeline schedules
(intra-stage fusion).
"""

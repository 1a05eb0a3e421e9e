"""Execution strategies: how one controller program's steps run on the worker groups.

The algorithm program (generate, score, infer, advantages, train, sync) never changes; a
mode (``schedule.mode``) only changes when and where each piece runs. The pieces here are
policy, as pure functions and small state machines; the controller (``fuseflow.controller``
worker groups) and the rollout engine (streaming ``generate``, abort/resume) are the
mechanism that carries them out.

sequential
    verl's order: the rollout group generates the whole batch; then the reference, critic,
    reward and actor (old log-probs) groups run inference on it; then training; then the
    weights go to the rollout. Nothing overlaps; it is the baseline every mode must match.

fused (RLHFuse inter-stage fusion)
    The rollout workers stream samples as they finish. ``microbatch.TokenBudgetBatcher``
    groups them into inference micro-batches by a padded-token budget, and each closed
    micro-batch is dispatched to the inference groups at once (a non-blocking
    ``group.method.future``), while generation continues. Each step the controller polls the
    rollout workers' unfinished samples; when ``migration.should_migrate`` fires (unfinished
    at or below ``threshold * batch``, the threshold fixed or ``migration.auto_threshold``
    from the last steps' lengths), ``migration.plan_migration`` picks the fewest target
    workers within slot and KV budgets, keeping the ones with the most work in place. The
    controller aborts the moved samples on their source engines, resumes them on the
    targets, and gives the freed workers inference micro-batches. Training still waits for
    the whole batch (PPO shuffles mini-batches over it), so nothing migrates across that
    boundary. Per-request seeds keep every sample's tokens identical to ``sequential``.

async (Pipe-RLHF bounded staleness)
    Generation for step t+1 runs while step t trains. ``staleness.StalenessGate`` admits a
    generation only when the rollout's weights are recent enough (version >= t - 1 -
    ``max_staleness`` for trainer step t), stamps each sample with the version it used, and
    blocks or defers otherwise; the training side calls ``publish`` after each weight sync.
    ``staleness.check_staleness`` guards every trained batch, ``staleness_metrics`` logs the
    histogram, and the loss uses the decoupled objective (proximal policy for the ratio,
    truncated importance weight against the behaviour log-probs). ``max_staleness=0``
    degenerates to ``sequential``.

fused+async
    Both: the streamed, migrated generation of step t+1 overlaps training of step t, under
    the same gate. Freed rollout workers take inference micro-batches of either step.

Visibility: each worker group writes spans on its own trace track (``Tracer.span(track=)``,
``Tracer.name_track``) and a ``sample_done`` instant per finished sample;
``fuseflow.telemetry.gantt`` turns them into busy fractions, long-tail time and a Gantt PNG.

Also here: ``schedule.pipeline``, fused actor/critic training pipeline schedules
(intra-stage fusion).
"""

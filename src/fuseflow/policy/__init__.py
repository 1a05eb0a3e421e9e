"""Scheduling decisions as pure functions, shared by the runtime (``fuseflow.schedule``) and the
simulator (``fuseflow.sim``), so a simulated plan runs fuseflow's own rules.

- ``microbatch``: token-budget micro-batches (streamed and length-sorted).
- ``migration``: when the long tail starts and onto which rollout replicas it moves (RLHFuse).
- ``lengths``: response-length prediction and length-aware assignment of prompts to replicas (RLHFless).
- ``elastic``: the cost-aware choice of how many rollout replicas a step uses (RLHFless).
- ``pipeline``: lower bounds on fused actor/critic pipeline schedules (RLHFuse).

This is the bottom layer (DESIGN.md): plain Python and numbers, no torch, no I/O.
"""

"""Cluster simulator and plan search: RL post-training runs predicted at 8 to 1024 GPUs.

Cost model (`costmodel`), decode replicas (`generation`), a SimPy discrete-event
simulation of RL iterations under the execution policies (`engine`, `policies`), plan
search (`search`), the published scenarios (`scenarios`) and calibration against a real
run (`calibrate`). See docs/simulation.md.

Example:
    >>> from fuseflow.sim.hardware import get_hardware
    >>> from fuseflow.sim.modelspec import get_model
    >>> from fuseflow.sim.placement import Problem
    >>> from fuseflow.sim.search import search
    >>> from fuseflow.sim.workload import Workload
    >>> plans, stats = search(Problem.build(get_model("llama-7b"), get_hardware("A100"), 16, Workload()))  # doctest: +SKIP
"""

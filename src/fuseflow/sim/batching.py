"""The length-grouping rule of token-budget micro-batches, shared by the workers and the simulator.

The workers (``fuseflow.data.batch.length_sorted_chunks``) group a batch's rows with it, and the
calibration (``fuseflow.sim.calibrate.trimmed_widths``) prices each row at the width of its group
with it, so a prediction can never drift from what the workers run. Plain Python on lengths: it
sits in the lowest layer (DESIGN.md), where both may import it.
"""

from __future__ import annotations

from collections.abc import Sequence


def group_by_length(prompt_len: Sequence[int], resp_len: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices in groups of similar length whose padded size stays within ``budget`` tokens.

    Rows go shortest first (ties by index); a group closes when one more row would make rows x
    (longest prompt + longest response) exceed ``budget``, since prompts and responses are padded
    separately. A row longer than the budget forms a group of its own.

    >>> group_by_length([1, 1, 1, 1], [5, 2, 2, 1], budget=12)
    [[3, 1, 2], [0]]
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(prompt_len)), key=lambda i: (prompt_len[i] + resp_len[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    lp = lr = 0
    for i in order:
        p, r = max(lp, prompt_len[i]), max(lr, resp_len[i])
        if cur and (len(cur) + 1) * (p + r) > budget:
            groups.append(cur)
            cur, p, r = [], prompt_len[i], resp_len[i]
        cur.append(i)
        lp, lr = p, r
    if cur:
        groups.append(cur)
    return groups

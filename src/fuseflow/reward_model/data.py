"""Preference pairs: rows of ``{prompt, chosen, rejected}`` from JSONL, Parquet or the synthetic task."""

from __future__ import annotations

import zlib
from pathlib import Path

from fuseflow.tasks import DataError, read_rows

FIELDS = ("prompt", "chosen", "rejected")


def load_pairs(path: str | Path, field: str = "rm.data") -> list[dict]:
    """Validated pairs from a ``.jsonl`` or ``.parquet`` file; any problem is a ``DataError`` naming the row.

    Every row needs non-empty strings ``prompt``, ``chosen`` and ``rejected``, with
    ``chosen != rejected`` (an identical pair carries no preference).
    """
    rows = read_rows(path, field, f"columns {', '.join(FIELDS)}", "preference dataset")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is not an object with fields {', '.join(FIELDS)}")
        for name in FIELDS:
            if not isinstance(row.get(name), str) or not row[name]:
                raise DataError(f"{path}: row {i} has no non-empty string {name!r}; each row needs "
                                f"{', '.join(FIELDS)}")
        if row["chosen"] == row["rejected"]:
            raise DataError(f"{path}: row {i} has chosen == rejected, which states no preference")
    return [{k: row[k] for k in FIELDS} for row in rows]


def split_pairs(pairs: list[dict], eval_frac: float) -> tuple[list[dict], list[dict]]:
    """(train, held-out) by a stable hash of the prompt, so no held-out prompt is trained on."""
    cut = int(round(eval_frac * 1000))
    held = [zlib.crc32(p["prompt"].encode()) % 1000 < cut for p in pairs]
    train = [p for p, h in zip(pairs, held, strict=True) if not h]
    heldout = [p for p, h in zip(pairs, held, strict=True) if h]
    if not train or not heldout:
        raise DataError(f"rm.eval_frac={eval_frac} leaves {len(train)} training and {len(heldout)} held-out pairs; "
                        "both need some (use more prompts, or pass rm.eval_data=FILE)")
    return train, heldout

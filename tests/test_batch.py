"""Batch: select/split/concat/token-budget chunks keep fields aligned."""

import pytest
import torch

from fuseflow.data.batch import Batch, pad_rows, pad_sequences, scatter_rows, unpad


def _batch():
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 1, 0], [3, 3, 3, 3]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    return Batch({"input_ids": ids, "attention_mask": mask}, {"uid": [10, 11, 12]})


def test_select_split_concat_round_trip():
    b = _batch()
    s = b.select([2, 0])
    assert s.meta["uid"] == [12, 10] and s["input_ids"][0].tolist() == [3, 3, 3, 3]
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 1]
    back = Batch.concat(parts)
    assert torch.equal(back["input_ids"], b["input_ids"]) and back.meta["uid"] == b.meta["uid"]


def test_mismatched_sizes_rejected():
    with pytest.raises(ValueError, match="disagree"):
        Batch({"a": torch.zeros(2)}, {"uid": [1, 2, 3]})
    b = _batch()
    with pytest.raises(ValueError, match="batch size"):
        b["x"] = torch.zeros(5)


def test_pad_and_unpad():
    left = pad_sequences([[1, 2], [3]], 0, left=True)
    assert left.tolist() == [[1, 2], [0, 3]]
    right = pad_sequences([[1, 2], [3]], 9, left=False, width=3)
    assert right.tolist() == [[1, 2, 9], [3, 9, 9]]
    assert unpad(left[1], left[1] != 0) == [3]
    with pytest.raises(ValueError, match="more than the width"):
        pad_sequences([[1, 2, 3]], 0, left=True, width=2)


def test_pad_rows_equals_scatter_rows_in_order_and_rejects_a_row_too_long():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(int(n), generator=g) for n in (3, 0, 7, 1)]
    want = scatter_rows([([i], r.unsqueeze(0)) for i, r in enumerate(rows)], len(rows), 9, fill=-1.0)
    assert torch.equal(pad_rows(rows, 9, fill=-1.0), want)
    with pytest.raises(ValueError, match="more than the target width 5"):
        pad_rows(rows, 5)

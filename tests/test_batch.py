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


def _naive_pad(seqs, pad, left, width, dtype):
    out = torch.full((len(seqs), width), pad, dtype=dtype)
    for i, x in enumerate(seqs):
        if x:
            if left:
                out[i, width - len(x):] = torch.tensor(x, dtype=dtype)
            else:
                out[i, :len(x)] = torch.tensor(x, dtype=dtype)
    return out


def test_pad_sequences_equals_a_row_by_row_write_and_masks_match_it():
    from fuseflow.data.batch import length_mask

    rng = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(1, 12, (1,), generator=rng))
        lens = torch.randint(0, 9, (n,), generator=rng).tolist()
        ids = [torch.randint(1, 50, (k,), generator=rng).tolist() for k in lens]
        floats = [torch.randn(k, generator=rng).tolist() for k in lens]
        width = max(lens) + trial % 3
        for left in (True, False):
            assert torch.equal(pad_sequences(ids, 7, left, width), _naive_pad(ids, 7, left, width, torch.long))
            got = pad_sequences(floats, 0, left, width, dtype=torch.float32)
            assert torch.equal(got, _naive_pad(floats, 0, left, width, torch.float32))  # bitwise
            mask = length_mask(torch.tensor(lens), width, left)
            assert torch.equal(mask, _naive_pad([[1] * k for k in lens], 0, left, width, torch.long).bool())
    assert pad_sequences([[], []], 3, left=True).shape == (2, 0)
    assert pad_sequences([[], [1]], 3, left=True, width=2).tolist() == [[3, 3], [3, 1]]
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens"):
        pad_sequences([[1], [1, 2, 3]], 0, left=False, width=2)


def test_pad_rows_equals_scatter_rows_in_order_and_rejects_a_row_too_long():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(int(n), generator=g) for n in (3, 0, 7, 1)]
    want = scatter_rows([([i], r.unsqueeze(0)) for i, r in enumerate(rows)], len(rows), 9, fill=-1.0)
    assert torch.equal(pad_rows(rows, 9, fill=-1.0), want)
    with pytest.raises(ValueError, match="more than the target width 5"):
        pad_rows(rows, 5)


def test_prompt_stream_takes_each_epochs_seeded_order_across_epochs_and_a_moved_cursor():
    from fuseflow.trainer import PromptStream

    def naive(seed, n, cursor, k):
        return [int(torch.randperm(n, generator=torch.Generator().manual_seed(seed + c // n))[c % n])
                for c in range(cursor, cursor + k)]

    s = PromptStream(7, seed=3)
    assert s.take(5) + s.take(5) + s.take(9) == naive(3, 7, 0, 19)  # three epochs
    s.cursor = 2  # a resumed run sets the cursor
    assert s.take(6) == naive(3, 7, 2, 6) and s.cursor == 8


def test_prompt_response_lays_out_left_padded_prompts_then_right_padded_responses_with_their_masks():
    from fuseflow.data.batch import prompt_response

    prompts, responses = [[5, 6, 7], [8], []], [[1], [2, 3, 4, 9], [4, 4]]
    ids, mask, r_mask = prompt_response(prompts, responses, 0)
    want_p = _naive_pad(prompts, 0, True, 3, torch.long)
    want_r = _naive_pad(responses, 0, False, 4, torch.long)
    assert torch.equal(ids, torch.cat([want_p, want_r], 1))
    ones = lambda seqs, left, w: _naive_pad([[1] * len(x) for x in seqs], 0, left, w, torch.long)  # noqa: E731
    assert torch.equal(r_mask, ones(responses, False, 4))
    assert torch.equal(mask, torch.cat([ones(prompts, True, 3), r_mask], 1)) and mask.dtype == torch.long

"""Bounded staleness: admission gate, checker and histogram."""

from __future__ import annotations

import pytest

from fuseflow.schedule.staleness import (
    StalenessError,
    check_staleness,
    min_version_for,
    staleness_histogram,
    staleness_metrics,
    staleness_of,
)


def test_version_arithmetic():
    # Step s trains version s-1; with k=1 its samples may come from version s-2.
    assert min_version_for(1, 0) == 0 and min_version_for(5, 0) == 4 and min_version_for(5, 1) == 3
    assert staleness_of([4, 3, 4], step=5) == [0, 1, 0]
    with pytest.raises(StalenessError, match="newer than version 4"):
        staleness_of([5], step=5)
    with pytest.raises(ValueError, match="1-based"):
        min_version_for(0, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        min_version_for(3, -1)


def test_checker_names_offending_samples():
    check_staleness([3, 4, 4], step=5, max_staleness=1)
    with pytest.raises(StalenessError, match=r"1 samples exceed schedule.max_staleness=1.*samples \[12\]"):
        check_staleness([3, 2, 4], step=5, max_staleness=1, uids=[11, 12, 13])
    with pytest.raises(StalenessError, match="max_staleness=0"):
        check_staleness([3], step=5, max_staleness=0)


def test_histogram_and_metrics():
    assert staleness_histogram([4, 3, 4, 4], step=5, max_staleness=2) == {0: 3, 1: 1, 2: 0}
    assert staleness_histogram([1], step=5, max_staleness=1) == {0: 0, 1: 0, 3: 1}  # violations stay visible
    m = staleness_metrics([4, 3, 4, 4], step=5, max_staleness=1)
    assert m == {"async/staleness_frac_0": 0.75, "async/staleness_frac_1": 0.25,
                 "async/staleness_mean": 0.25, "async/staleness_max": 1.0}
    assert staleness_metrics([], step=5, max_staleness=1) == {}

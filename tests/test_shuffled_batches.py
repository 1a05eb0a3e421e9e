"""The shared SFT / reward-model batch draw: full batches, every item once per pass, seeded."""

from fuseflow.sft import shuffled_batches


def test_each_pass_is_a_permutation_with_the_short_tail_skipped():
    draws = shuffled_batches(10, 3, seed=5)
    batches = [next(draws) for _ in range(6)]  # two passes of 3 full batches (9 of 10 items each)
    assert all(len(b) == 3 for b in batches)
    for p in (batches[:3], batches[3:]):
        items = [i for b in p for i in b]
        assert len(set(items)) == 9 and set(items) <= set(range(10))
    assert batches[:3] != batches[3:]  # a fresh shuffle per pass


def test_same_seed_same_draws_other_seed_other_draws():
    take = lambda seed: [next(d) for d in [shuffled_batches(50, 8, seed)] for _ in range(12)]  # noqa: E731
    assert take(1) == take(1) and take(1) != take(2)

"""A spy on a trainer's steps, shared by the tests that compare execution modes batch by batch."""

from __future__ import annotations


def record_batches(trainer) -> list:
    """Wrap ``trainer.make_experience`` so that every step's batch is appended to the list returned."""
    batches, inner = [], trainer.make_experience

    def spy(step):
        batch, metrics = inner(step)
        batches.append(batch)
        return batch, metrics

    trainer.make_experience = spy
    return batches

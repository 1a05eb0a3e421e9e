import os

import pytest
import torch

# Tests build their own tiny models; one thread avoids oversubscription on 2-core CI machines.
torch.set_num_threads(int(os.environ.get("FUSEFLOW_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def sft_cache(tmp_path_factory):
    """One SFT cache for the whole session, so end-to-end tests share warm-start models.

    With parallel workers (`make test` runs pytest-xdist) the workers share it: each warm-start
    model is trained once, by the first worker that needs it (the others wait on its lock,
    ``fuseflow.sft.ensure_sft_model``).
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process
        return tmp_path_factory.mktemp("sft-cache")
    shared = tmp_path_factory.getbasetemp().parent / "sft-cache"
    shared.mkdir(exist_ok=True)
    return shared

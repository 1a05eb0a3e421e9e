import os

import pytest
import torch

# Tests build their own tiny models; one thread avoids oversubscription on 2-core CI machines.
torch.set_num_threads(int(os.environ.get("FUSEFLOW_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def sft_cache(tmp_path_factory):
    """One SFT cache for the whole session, so end-to-end tests share warm-start models."""
    return tmp_path_factory.mktemp("sft-cache")

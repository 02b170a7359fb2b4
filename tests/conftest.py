import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# scripts/test.sh runs two suites side by side on 2 cores and gives each one thread (TRIKV_TEST_THREADS=1): two
# processes with two OpenMP threads each would spin-wait for each other's cores
torch.set_num_threads(int(os.environ.get("TRIKV_TEST_THREADS", min(2, torch.get_num_threads()))))


@pytest.fixture
def one_thread():
    """One torch thread for the test, restored after it: tiny models gain nothing from threads, and on a busy
    2-core machine every OpenMP parallel region waits for a core. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def real_model():
    """The bundled SmolLM2-135M-Instruct (converted from its GGUF on first use)."""
    import trikv

    return trikv.load_model("smollm2-135m")

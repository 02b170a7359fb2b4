import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# scripts/test.sh runs five lanes side by side on 2 cores and gives each one thread (TRIKV_TEST_THREADS=1): busy
# processes with two OpenMP threads each would spin-wait for each other's cores
torch.set_num_threads(int(os.environ.get("TRIKV_TEST_THREADS", min(2, torch.get_num_threads()))))
if "TRIKV_TEST_THREADS" in os.environ:
    # and the processes the tests start (vLLM engines, CLI commands) too: torch.set_num_threads does not reach them, and
    # vLLM's CPU kernels size their OpenMP pool from OMP_NUM_THREADS (a 200-token vLLM run beside the other suite took
    # 73 s with the default pool of 2, 12 s with 1)
    os.environ.setdefault("OMP_NUM_THREADS", os.environ["TRIKV_TEST_THREADS"])
    # vLLM's n-gram proposer runs a numba parallel loop every step; numba's threads spin-wait between steps, and beside
    # the other lanes a speculating 160-token run took 157 s with numba's default pool, 6 s with 1
    os.environ.setdefault("NUMBA_NUM_THREADS", os.environ["TRIKV_TEST_THREADS"])


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

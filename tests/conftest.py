import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def real_model():
    """The bundled SmolLM2-135M-Instruct (converted from its GGUF on first use)."""
    import trikv

    return trikv.load_model("smollm2-135m")

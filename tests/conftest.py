import os

# The test process's one choice of Triton mode, made before any kernel module is imported (Triton reads
# it when a kernel is defined): interpreted (CPU) unless the caller sets TRITON_INTERPRET=0 (GPU runs).
# Test modules leave the process environment alone at import (tests/test_repository.py checks).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tests never reach the network (lm-eval, datasets)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def v3():
    """The tiny deepseek_v3 model (random weights) most engine tests serve, built once per test module."""
    from quantmla.model.tiny import tiny_model

    return tiny_model("deepseek_v3")

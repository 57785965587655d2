import os

import torch

# The test process's one choice of Triton mode, made before any kernel module is imported (Triton reads
# it when a kernel is defined): compiled where a CUDA device is present, interpreted (CPU) otherwise, unless the
# caller sets TRITON_INTERPRET (a GPU run of pytest that interpreted the kernels failed on the CUDA tensors).
# Test modules leave the process environment alone at import (tests/test_repository.py checks).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tests never reach the network (lm-eval, datasets)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def v3():
    """The tiny deepseek_v3 model (random weights) most engine tests serve, built once per test module."""
    from quantmla.model.tiny import tiny_model

    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint with its own tokenizer and a held-out set beside it (tiny/, heldout/), as `quantmla eval`
    reads them."""
    import sysconfig
    from pathlib import Path

    from quantmla.corpus.datasets import write_jsonl
    from quantmla.model.tiny import tiny_model
    from quantmla_lab.training.tasks import make_eval_samples
    from quantmla_lab.training.tokenizer import train_tokenizer, wrap

    root = tmp_path_factory.mktemp("ckpt")
    std = Path(sysconfig.get_paths()["stdlib"])
    docs = [(std / n).read_text() for n in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py")]
    tok = wrap(train_tokenizer(docs, 300))
    model = tiny_model("deepseek_v3_rotate_half", vocab_size=300, max_position_embeddings=2048)
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    write_jsonl(root / "heldout" / "code.jsonl", [{"text": d} for d in docs[2:]])
    write_jsonl(root / "heldout" / "retrieval_1024.jsonl.xz", make_eval_samples(tok, docs, 1024, 2))
    return root

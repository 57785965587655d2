"""The options of a reference model's data preparation and training (train.py), and of its card (card.py)."""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.corpus.datasets import RETRIEVAL_LENGTHS


@dataclass
class PrepareOptions:
    vocab_size: int = 3072
    max_train_bytes: int = 400_000_000
    tokenizer_bytes: int = 24_000_000
    heldout_fraction: float = 0.06
    heldout_code_bytes: int = 320_000
    heldout_prose_bytes: int = 200_000
    retrieval_pool_bytes: int = 1_000_000
    n_retrieval: int = 100
    retrieval_lengths: tuple[int, ...] = RETRIEVAL_LENGTHS
    seed: int = 0
    workers: int = 16
    tokenizer_from: str | None = None  # a directory holding tokenizer.json: used as is, none is fitted
    heldout_from: str | None = None  # a held-out set directory with its manifest: copied, its packages held out


@dataclass
class TrainOptions:
    size: str = "ref"
    device: str = "cuda"
    time_budget_s: float = 400.0
    max_steps: int = 100_000
    batch_tokens: int = 32768
    short_len: int = 1024
    long_len: int = 4096
    short_frac: float = 0.3
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 250
    weight_decay: float = 0.1
    p_retrieval: float = 0.5
    answer_weight: float = 3.0
    seed: int = 0
    log_every: int = 50
    # evaluation
    eval_seq_len: int = 2048
    eval_retrieval_n: int = 100
    slice_seq_len: int = 512
    slice_chunks: int = 2
    slice_retrieval: int = 2

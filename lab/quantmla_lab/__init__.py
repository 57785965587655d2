"""The QuantMLA lab: the project's own experiments beside the library (``quantmla``).

- ``training``: the shipped reference models (corpus split, tokenizer, retrieval tasks, training);
  ``quantmla train-reference``.
- ``bench``: the benchmarks, one module per question, by topic: ``bench.kernels`` (decode kernel
  speed, tilings, split floors; ``quantmla bench-kernel``), ``bench.serving`` (whole-job throughput
  under a KV budget, agreement with transformers, where a step's time goes; ``quantmla serve-bench``),
  ``bench.calibration`` (calibration variants, RoPE offsets, calibration time at scale).
- ``random_checkpoint``: synthetic sharded checkpoints with random weights.

The lab uses the library's public API and may depend on it; the library never imports the lab.
Results live in ``lab/results/`` (its README says which command wrote each file).
"""

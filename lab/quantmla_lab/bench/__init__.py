"""The benchmarks, one module per question (run as ``python -m quantmla_lab.bench.<topic>.<name>``), and
what they share (``common``)."""

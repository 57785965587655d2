"""Benchmarks of the decode kernels: speed per format against BF16 and a peer (``decode_speed``,
``quantmla bench-kernel``), tilings and split counts (``decode_schedule``), split floors (``decode_splits``),
the CUDA kernel's build-time knobs (``decode_cuda_variants``)."""

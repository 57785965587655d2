"""Benchmarks of calibration: which options fit best (``variants``), the RoPE key offset
(``rope_centring_ablation``, ``rope_offsets_cost``, ``rope_key_stats``) and calibration time at scale (``scaling``)."""

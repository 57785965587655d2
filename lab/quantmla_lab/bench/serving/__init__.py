"""Benchmarks of the serving engine: whole-job throughput under a KV byte budget (``throughput``,
``quantmla serve-bench``), agreement with transformers' ``generate()`` (``agreement``), and where a
step's time goes (``step_profile``, ``step_grid``, ``step_anatomy``, ``step_overhead``, ``capture_cost``,
``warm_vs_cold``); ``breakdown`` and ``projection`` read a throughput result."""

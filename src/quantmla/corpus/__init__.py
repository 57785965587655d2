"""The texts and shipped reference models the project calibrates and evaluates on: Python package sources
found on the machine (sources), the held-out sets and reference models of ``models/`` (datasets), and the
default calibration text, which never overlaps the held-out sets (calibration_text)."""

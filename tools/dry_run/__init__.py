"""Fake-CUDA dry run: one rank of a large world, on CPU, checked against GPU and NCCL rules.

``tools/gpu_dry_run.py`` is the entry point. ``cuda_shim`` must load before torch is
imported (it registers a CUDA device guard in a CPU-only torch), so this package's
``__init__`` imports nothing; the modules that need torch are imported by the runner.
"""

"""Shared pytest setup: keep torch to one thread per process on the 2-core machines."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

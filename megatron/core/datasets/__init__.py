"""Datasets: the indexed token format and the datasets built on it (this package import stays torch-free)."""

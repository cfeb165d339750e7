"""Adapters to optional libraries (Megatron-core's ``extensions`` package); each imports its library lazily."""

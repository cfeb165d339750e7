"""Heterogeneous transformers: layers whose attention and MLP differ in shape or are replaced (Llama-Nemotron)."""

"""Fused forms of the elementwise and normalisation work between the GEMMs (Megatron's fusion flags).

Each op has its unfused reference where the model keeps it (``transformer/norms.py``, ``mlp.py``,
``transformer_layer.py``); the config's switches choose. (The fused RoPE lives beside its reference in
``transformer/rope_utils.py``.) The fused regions are
``jit.jit_fuser`` functions: compiled by ``torch.compile`` (Inductor, CPU or GPU) once per input
signature, or run eagerly under ``--disable-jit-fuser`` (``jit.set_jit_fuser_enabled(False)``).
"""

"""Enumerations shared by transformer modules (Megatron's names)."""

import enum


class AttnMaskType(enum.Enum):
    """How attention is masked: ``causal`` builds the mask itself, ``padding``/``arbitrary`` take one."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Attention kernel choice. flash/fused/auto use PyTorch SDPA; unfused/local use explicit softmax."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class ModelType(enum.Enum):
    """Model families, as the pipeline schedules need to know them."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2


class LayerType(enum.Enum):
    """What a layer of a model is (Megatron-core's names and values)."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnType(enum.Enum):
    """Self- or cross-attention (Megatron-core's names and values)."""

    self_attn = 1
    cross_attn = 2

"""The old import path of the pipeline layer layout: the code lives in ``transformer/layer_layout.py``
(the transformer block and layer use it to number their layers, so it sits in their layer, not above it)."""

from megatron.core.transformer.layer_layout import (  # noqa: F401 - re-exported
    config_layer_assignment,
    pipeline_layer_assignment,
    stage_layer_counts,
)

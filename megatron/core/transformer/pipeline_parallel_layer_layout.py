"""Megatron-core's ``PipelineParallelLayerLayout``: which layers each pipeline stage and virtual chunk holds.

A layout lists the model's stages in running order (chunk 0 of every pipeline rank, then chunk 1, ...),
each stage a list of layer types. As a string, ``|`` separates stages and each character is a layer:
``E`` the embedding, ``t`` a transformer (decoder) layer, ``m`` a multi-token-prediction layer, ``L``
the loss; ``x*n`` repeats a character and ``(...)*n`` a group, commas are ignored. Example, 2 pipeline
ranks x 2 chunks: ``"Et|tt|tt|tL"``. ``TransformerConfig(pipeline_model_parallel_layout=...)`` builds one.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import List, Optional, Union

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType

_CHARS = {"E": LayerType.embedding, "L": LayerType.loss, "t": LayerType.decoder, "m": LayerType.mtp}


def _unroll(text: str) -> str:
    """``(ab)*2`` -> ``abab`` and ``a*3`` -> ``aaa``; commas dropped."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)


def _as_layer_type(value: Union[str, LayerType]) -> LayerType:
    if isinstance(value, LayerType):
        return value
    if isinstance(value, str) and value in LayerType.__members__:
        return LayerType[value]
    raise ValueError(
        f"pipeline_model_parallel_layout: {value!r} is not a LayerType (one of {list(LayerType.__members__)})"
    )


class PipelineParallelLayerLayout:
    """A custom split of the model's layers over pipeline ranks and virtual chunks (see the module doc).

    ``layout[pp_rank][vp_rank]`` is the list of ``LayerType`` that stage holds; ``flatten_layout`` the
    whole model in running order.
    """

    decoder_type = LayerType.decoder  # what ``pipeline_parallel.layer_layout`` counts as transformer layers

    def __init__(self, layout: Union[str, list], pipeline_model_parallel_size: int) -> None:
        self.input_data = layout
        stages = self.parse_str_to_list(layout) if isinstance(layout, str) else copy.deepcopy(layout)
        if not all(isinstance(stage, list) for stage in stages):
            raise ValueError(f"pipeline_model_parallel_layout must be a list of lists, got {layout!r}")
        pp = pipeline_model_parallel_size
        if pp < 1 or len(stages) % pp:
            raise ValueError(
                f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of "
                f"pipeline_model_parallel_size={pp}"
            )
        vp = len(stages) // pp
        self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size = pp, vp
        # Stage s of the running order is chunk s // pp of pipeline rank s % pp.
        self.layout: List[List[List[LayerType]]] = [
            [[_as_layer_type(x) for x in stages[chunk * pp + rank]] for chunk in range(vp)] for rank in range(pp)
        ]
        self.flatten_layout: List[LayerType] = [
            x for chunk in range(vp) for rank in range(pp) for x in self.layout[rank][chunk]
        ]

    def __repr__(self) -> str:
        return self.input_data if isinstance(self.input_data, str) else str(self.input_data)

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: Optional[int]) -> bool:
        """Raise ValueError unless the layout holds the model; returns whether MTP stands apart (never here).

        The embedding must open and the loss close the model, each once; exactly ``num_layers``
        decoder layers; the ``mtp_num_layers`` MTP layers after every decoder layer, together in the
        last chunk of the last pipeline rank (MTP on a stage of its own is not supported yet).
        """
        flat, count = self.flatten_layout, self.flatten_layout.count
        problems = []
        if not flat or flat[0] != LayerType.embedding or count(LayerType.embedding) != 1:
            problems.append("the embedding (E) must come first, exactly once")
        if not flat or flat[-1] != LayerType.loss or count(LayerType.loss) != 1:
            problems.append("the loss (L) must come last, exactly once")
        if count(LayerType.decoder) != num_layers:
            problems.append(f"it holds {count(LayerType.decoder)} decoder layers (t), num_layers={num_layers}")
        if count(LayerType.encoder):
            problems.append("encoder layers are not supported in a pipeline layout")
        mtp = mtp_num_layers or 0
        last_stage = self.layout[-1][-1]
        if count(LayerType.mtp) != mtp or last_stage.count(LayerType.mtp) != mtp:
            problems.append(f"all mtp_num_layers={mtp_num_layers} MTP layers (m) must be in the last stage")
        elif mtp and any(x == LayerType.decoder for x in flat[flat.index(LayerType.mtp) :]):
            problems.append("decoder layers must come before the MTP layers")
        if problems:
            raise ValueError(f"pipeline_model_parallel_layout={self!r}: " + "; ".join(problems))
        return False

    def _stage(self, vp_stage: Optional[int], pp_rank: Optional[int]) -> tuple:
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None and self.virtual_pipeline_model_parallel_size > 1:
            raise ValueError("vp_stage must be given: the layout has virtual pipeline chunks")
        return pp_rank, vp_stage or 0

    def get_num_layers_to_build(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> int:
        """How many ``layer_type`` layers stage ``(pp_rank, vp_stage)`` holds (pp_rank default: this rank's)."""
        pp_rank, chunk = self._stage(vp_stage, pp_rank)
        return self.layout[pp_rank][chunk].count(layer_type)

    def get_layer_offset(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> int:
        """How many ``layer_type`` layers the model runs before stage ``(pp_rank, vp_stage)``."""
        pp_rank, chunk = self._stage(vp_stage, pp_rank)
        before = chunk * self.pipeline_model_parallel_size + pp_rank
        pp = self.pipeline_model_parallel_size
        return sum(self.layout[s % pp][s // pp].count(layer_type) for s in range(before))

    def get_layer_id_list(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
    ) -> List[int]:
        """0-based global indices of the ``layer_type`` layers of stage ``(pp_rank, vp_stage)``."""
        offset = self.get_layer_offset(layer_type, vp_stage, pp_rank)
        return list(range(offset, offset + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    def pretty_repr(self) -> str:
        """One line per pipeline rank, one column per chunk: ``embedding,decoder*2``."""

        def stage_text(stage: List[LayerType]) -> str:
            runs: List[List] = []
            for x in stage:
                if runs and runs[-1][0] == x:
                    runs[-1][1] += 1
                else:
                    runs.append([x, 1])
            return ",".join(f"{t.name}*{n}" if n > 1 else t.name for t, n in runs) or "(empty stage)"

        rows = [
            [f"PP rank {r}"] + [stage_text(s) for s in self.layout[r]] for r in range(self.pipeline_model_parallel_size)
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    @staticmethod
    @functools.lru_cache
    def from_str(layout: str, pipeline_model_parallel_size: int) -> PipelineParallelLayerLayout:
        """The layout a string describes (cached per string and size)."""
        return PipelineParallelLayerLayout(layout, pipeline_model_parallel_size)

    @staticmethod
    def get_num_stages_from_str(layout: str) -> int:
        """How many stages (pipeline ranks x virtual chunks) a layout string lists."""
        return len(PipelineParallelLayerLayout.parse_str_to_list(layout))

    @staticmethod
    def parse_str_to_list(layout_str: str) -> List[List[LayerType]]:
        """``"Ett|(tt|)*2L"`` -> one list of ``LayerType`` per stage; an unknown character raises ValueError."""
        stages = []
        for stage in _unroll(layout_str).split("|"):
            unknown = sorted(set(stage) - set(_CHARS))
            if unknown:
                raise ValueError(f"pipeline_model_parallel_layout {layout_str!r}: unknown layer characters {unknown}")
            stages.append([_CHARS[c] for c in stage])
        return stages

"""``HeterogeneousTransformerConfig``: one block config per layer, read from Llama-Nemotron's JSON format.

The JSON (Hugging Face's ``config.json`` of the Llama-Nemotron / DeciLM models, or any file with the same
``block_configs`` key) lists per layer an ``attention`` and an ``ffn`` (or ``mlp``) entry::

    {"block_configs": [
        {"attention": {"n_heads_in_group": 8, "no_op": false, "replace_with_linear": false},
         "ffn": {"ffn_mult": 2.625, "no_op": false, "replace_with_linear": false}},
        {"attention": {"n_heads_in_group": null, "no_op": true, "replace_with_linear": false},
         "ffn": {"ffn_hidden_size": 1024}}
    ]}

Per layer the attention is built as configured (``num_query_groups``, or ``num_attention_heads //
n_heads_in_group``), replaced by one hidden-to-hidden linear (``replace_with_linear``) or left out
(``no_op``: the layer passes its input on); the same for the MLP, whose size is ``ffn_hidden_size`` or
``ffn_mult`` (Llama's rounding: ``2/3 * ffn_mult * hidden_size`` up to a multiple of 256). Keys this
format has for other purposes are ignored. The text is parsed with ``json`` only: nothing read can run
code. Every error names the config field the JSON came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional

from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["AttentionConfig", "MLPConfig", "TransformerBlockConfig", "HeterogeneousTransformerConfig"]


def _flag(part: Dict[str, Any], key: str, where: str) -> bool:
    value = part.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}={value!r}: must be true or false")
    return value


def _size(value: Any, where: str) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{where}={value!r}: must be a positive integer or null")
    return value


def _part(block: Any, keys: tuple, where: str) -> Dict[str, Any]:
    """The first of ``keys`` present in ``block``, which must be a JSON object."""
    if not isinstance(block, dict):
        raise ValueError(f"{where}: must be an object, got {type(block).__name__}")
    for key in keys:
        if isinstance(block.get(key), dict):
            return block[key]
    raise ValueError(f"{where}: needs an object under {' or '.join(repr(k) for k in keys)}")


def _exclusive(no_op: bool, replace_with_linear: bool, size: Optional[int], size_name: str, where: str) -> None:
    if no_op and replace_with_linear:
        raise ValueError(f"{where}: no_op and replace_with_linear are exclusive")
    if size is not None and (no_op or replace_with_linear):
        raise ValueError(f"{where}: {size_name}={size} with no_op or replace_with_linear (no such module is built)")


@dataclass
class AttentionConfig:
    """The self-attention of one layer: built with ``num_query_groups`` (None: the model's), a linear, or none."""

    no_op: bool = False
    replace_with_linear: bool = False
    num_query_groups: Optional[int] = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, num_attention_heads: int) -> AttentionConfig:
        """From one ``block_configs`` entry: ``num_query_groups``, or ``n_heads_in_group`` heads per group."""
        where = "attention"
        part = _part(block_config_dict, ("attention",), where)
        groups = _size(part.get("num_query_groups"), f"{where}.num_query_groups")
        if "num_query_groups" not in part:
            per_group = _size(part.get("n_heads_in_group"), f"{where}.n_heads_in_group")
            if per_group is not None:
                if num_attention_heads % per_group:
                    raise ValueError(
                        f"{where}.n_heads_in_group={per_group}: must divide num_attention_heads={num_attention_heads}"
                    )
                groups = num_attention_heads // per_group
        config = cls(_flag(part, "no_op", where), _flag(part, "replace_with_linear", where), groups)
        _exclusive(config.no_op, config.replace_with_linear, groups, "num_query_groups", where)
        return config


@dataclass
class MLPConfig:
    """The MLP of one layer: built with ``ffn_hidden_size`` (None: the model's), a linear, or none."""

    no_op: bool = False
    replace_with_linear: bool = False
    ffn_hidden_size: Optional[int] = None

    @classmethod
    def build_config_from_dict(cls, block_config_dict: dict, hidden_size: int) -> MLPConfig:
        """From one ``block_configs`` entry's ``ffn`` (or ``mlp``): ``ffn_hidden_size``, or ``ffn_mult``."""
        where = "ffn"
        part = _part(block_config_dict, ("ffn", "mlp"), where)
        size = _size(part.get("ffn_hidden_size"), f"{where}.ffn_hidden_size")
        if "ffn_hidden_size" not in part and part.get("ffn_mult") is not None:
            mult = part["ffn_mult"]
            if not isinstance(mult, (int, float)) or isinstance(mult, bool) or mult <= 0:
                raise ValueError(f"{where}.ffn_mult={mult!r}: must be a positive number")
            size = cls.ffn_mult_to_intermediate_size(mult, hidden_size)
        config = cls(_flag(part, "no_op", where), _flag(part, "replace_with_linear", where), size)
        _exclusive(config.no_op, config.replace_with_linear, size, "ffn_hidden_size", where)
        return config

    @staticmethod
    def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
        """Llama's SwiGLU size: ``int(2 * ffn_mult * hidden_size / 3)`` rounded up to a multiple of 256."""
        return MLPConfig.find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)

    @staticmethod
    def find_multiple(n: int, k: int) -> int:
        """The smallest multiple of ``k`` that is >= ``n``."""
        return n if n % k == 0 else n + k - n % k


@dataclass
class TransformerBlockConfig:
    """One layer's attention and MLP."""

    attention: AttentionConfig
    mlp: MLPConfig


@dataclass
class HeterogeneousTransformerConfig(TransformerConfig):
    """A ``TransformerConfig`` whose layers each follow one entry of ``block_configs`` (module docstring).

    ``heterogeneous_layers_config_encoded_json`` (the JSON text) wins; when empty it is read from
    ``heterogeneous_layers_config_path`` (and then kept, so that checkpoints can carry it). There must be
    one entry per layer (``num_layers``). ``get_config_for_layer(n)`` is the plain ``TransformerConfig`` of
    layer ``n`` (1-based), which ``TransformerBlock`` builds it with; every layer's is checked here.
    """

    heterogeneous_layers_config_path: str = ""
    heterogeneous_layers_config_encoded_json: str = ""
    per_block_parameters: List[TransformerBlockConfig] = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.heterogeneous_block_specs = True
        source = "HeterogeneousTransformerConfig.heterogeneous_layers_config_encoded_json"
        if self.heterogeneous_layers_config_encoded_json in ("", None):
            path = self.heterogeneous_layers_config_path
            source = f"HeterogeneousTransformerConfig.heterogeneous_layers_config_path ({path})"
            self.heterogeneous_layers_config_encoded_json = self._read_path()
        try:
            blocks = _block_list(json.loads(self.heterogeneous_layers_config_encoded_json))
            if len(blocks) != self.num_layers:
                raise ValueError(f"{len(blocks)} block_configs for num_layers={self.num_layers}: give one per layer")
            self.per_block_parameters = [self._block(i, block) for i, block in enumerate(blocks)]
            for number in range(1, self.num_layers + 1):
                self.get_config_for_layer(number)  # each layer's own rules (heads per group, TP divisibility)
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{source}: {err}") from err

    def _read_path(self) -> str:
        path = self.heterogeneous_layers_config_path
        if not path:
            raise ValueError(
                "HeterogeneousTransformerConfig needs heterogeneous_layers_config_path or "
                "heterogeneous_layers_config_encoded_json"
            )
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"heterogeneous_layers_config_path={path!r}: cannot be read ({err})") from err

    def _block(self, index: int, block: Any) -> TransformerBlockConfig:
        try:
            return TransformerBlockConfig(
                attention=AttentionConfig.build_config_from_dict(block, self.num_attention_heads),
                mlp=MLPConfig.build_config_from_dict(block, self.hidden_size),
            )
        except ValueError as err:
            raise ValueError(f"block_configs[{index}].{err}") from err

    def get_config_for_layer(self, layer_number: int) -> TransformerConfig:
        """The ``TransformerConfig`` of layer ``layer_number`` (1-based): this one with the layer's
        ``num_query_groups`` / ``ffn_hidden_size`` where its block config sets them."""
        if not 1 <= layer_number <= len(self.per_block_parameters):
            raise ValueError(f"layer_number={layer_number}: must be in [1, {len(self.per_block_parameters)}]")
        block = self.per_block_parameters[layer_number - 1]
        kwargs = {f.name: getattr(self, f.name) for f in fields(TransformerConfig) if f.init}
        kwargs["heterogeneous_block_specs"] = False
        if block.attention.num_query_groups is not None:
            kwargs["num_query_groups"] = block.attention.num_query_groups
        if block.mlp.ffn_hidden_size is not None:
            kwargs["ffn_hidden_size"] = block.mlp.ffn_hidden_size
        try:
            return TransformerConfig(**kwargs)
        except ValueError as err:
            raise ValueError(f"block_configs[{layer_number - 1}]: {err}") from err


def _block_list(parsed: Any) -> list:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("block_configs"), list):
        raise ValueError('must be a JSON object with a "block_configs" list')
    return parsed["block_configs"]

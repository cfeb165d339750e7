"""Multi-token prediction (DeepSeek-V3): extra modules that predict the tokens 2, 3, ... ahead.

Module ``k`` (1-based, of ``mtp_num_layers``) takes the previous module's hidden state (the
decoder's output for k = 1) and the embedding of the input shifted left by k, normalizes both,
projects their concatenation ``[emb; hidden]`` ``2h -> h`` (``eh_proj``, column parallel, the output
gathered over TP), runs one transformer layer (global number ``num_layers + k``) and a final norm.
``GPTModel`` turns each module's output into logits with the shared output layer and a loss
against the labels shifted left by k (the loss mask shifted too, its last k positions dropped).
The losses do not change the model's output: ``MoEAuxLossAutoScaler`` injects their gradient,
scaled by ``mtp_loss_scaling_factor / mtp_num_layers`` and by the main loss's scale, and the
coefficient-free values are tracked as ``mtp_{k} loss`` with the MoE aux losses (``moe_utils``).

The block runs on the last pipeline stage (``GPTModel.mtp_process``), which embeds the shifted tokens
with its own copy of the embedding, kept equal to the first stage's (``tied_embeddings``). Its layer
keeps the global number ``num_layers + k`` on any stage. Under context parallelism the shifts run over
the whole sequence (``roll_left_over_cp``) and each loss is normalised by the token count of all CP
ranks (``mtp_loss_terms``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple, Union

import torch

from megatron.core.context_parallel import roll_left_over_cp
from megatron.core.parallel_state import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    initialization_rng,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.fp8_utils import attach_mtp_quantizers
from megatron.core.transformer.hyper_connection import HyperHead
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_aux_loss_tracker
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def roll_left(t: torch.Tensor, cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
    """``[..., s(/cp)]`` -> each position holds the next one's value; the sequence's last position gets 0.

    Under context parallelism the shift crosses this rank's chunk boundaries (``roll_left_over_cp``).
    """
    return roll_left_over_cp(t, cp_group)


def mtp_loss_name(depth: int) -> str:
    """The logged name of module ``depth``'s loss (Megatron's)."""
    return f"mtp_{depth} loss"


class MultiTokenPredictionLayer(MegatronModule):
    """One prediction module: ``enorm``, ``hnorm``, ``eh_proj``, ``transformer_layer``, ``final_layernorm``."""

    def __init__(
        self, config: TransformerConfig, layer_spec: Union[ModuleSpec, type], depth: int, *, pg_collection
    ) -> None:
        super().__init__(config)
        h, self.tp_group = config.hidden_size, pg_collection.tp
        self.enorm, self.hnorm = build_norm(config, h), build_norm(config, h)
        self.eh_proj = ColumnParallelLinear(
            2 * h, h, config=config, init_method=config.init_method, bias=False, tp_group=pg_collection.tp
        )
        number = config.num_layers + depth
        self.transformer_layer = build_module(  # the global number whatever the pipeline stage
            layer_spec, config, layer_number=number, add_layer_offset=False, pg_collection=pg_collection
        )
        self.hyper_head = None  # hyper-connections: the layer runs on n streams, collapsed before the norm
        if config.hyper_connection_streams > 1:
            self.hyper_head = HyperHead(config, config.hyper_connection_streams, config.hyper_connection_eps)
        self.final_layernorm = build_norm(config, h)
        attach_mtp_quantizers(self, config, pg_collection)  # FP8 GEMMs (eh_proj and the layer), as Megatron

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rotary_pos_emb: Optional[torch.Tensor],
        token_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``hidden``, ``embedded`` ``[s(/tp), b, h]`` -> this module's hidden state, same shape.

        ``token_ids`` ``[b, s]``: the shifted input ids, for a layer whose MoE routes by them."""
        c = self.config
        sp = c.sequence_parallel
        dropout = self.training and (c.hidden_dropout > 0 or c.attention_dropout > 0)
        # Under SP each TP rank holds other tokens: dropout draws from the model-parallel stream, as in the decoder.
        fork = get_cuda_rng_tracker().fork() if sp and dropout else contextlib.nullcontext()
        with fork:
            x = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)  # [s(/tp), b, 2h]
            x, _ = self.eh_proj(x)  # [s, b, h/tp]
            x = gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
            if sp:
                x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
            if self.hyper_head is not None:
                x = x.repeat(1, 1, c.hyper_connection_streams)  # [s(/tp), b, n * h]: n equal streams
            by_id = {} if token_ids is None else {"token_ids": token_ids}
            x, _ = self.transformer_layer(x, attention_mask, rotary_pos_emb=rotary_pos_emb, **by_id)
            if self.hyper_head is not None:
                x = self.hyper_head(x)  # [s(/tp), b, h]
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(MegatronModule):
    """``mtp_num_layers`` prediction modules in sequence (``layers.{k-1}``); holds the aux-loss tracker
    the losses go to (the training loop binds it to its run's, like the routers')."""

    def __init__(
        self, config: TransformerConfig, layer_spec: Union[ModuleSpec, type], *, pg_collection: ProcessGroupCollection
    ) -> None:
        super().__init__(config)
        layers = []
        for depth in range(1, config.mtp_num_layers + 1):
            with initialization_rng(config.initialization_seed, f"mtp.layers.{depth - 1}"):
                layers.append(MultiTokenPredictionLayer(config, layer_spec, depth, pg_collection=pg_collection))
        self.layers = torch.nn.ModuleList(layers)
        self.aux_loss_tracker = get_aux_loss_tracker()
        self.cp_group = pg_collection.cp if pg_collection.size_of("cp") > 1 else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        hidden: torch.Tensor,
        embedding: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
    ) -> List[torch.Tensor]:
        """Each module's hidden state ``[s(/tp), b, h]``; ``input_ids`` ``[b, s(/cp)]`` are shifted once per
        module (over the whole sequence under CP), ``position_ids`` too when given (``embedding`` fills in
        the positions when they are None)."""
        outputs = []
        for layer in self.layers:
            input_ids = roll_left(input_ids, self.cp_group)
            position_ids = None if position_ids is None else roll_left(position_ids, self.cp_group)
            by_id = {"token_ids": input_ids} if self.config.moe_num_hash_layers else {}
            hidden = layer(hidden, embedding(input_ids, position_ids), attention_mask, rotary_pos_emb, **by_id)
            outputs.append(hidden)
        return outputs


def mtp_loss_terms(
    token_loss: torch.Tensor, mask: torch.Tensor, per_token: bool, cp_group: Optional[torch.distributed.ProcessGroup]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, detached value to log) of one module from its per-token loss and
    shifted mask ``[b, s(/cp)]``.

    The value is the masked mean over the whole sequence. The back-propagated loss is the masked sum
    with ``per_token`` (``calculate_per_token_loss``), else the mean; under CP this rank's sum is
    divided by the count over all CP ranks and multiplied by the CP size, like the main loss (the
    gradient all-reduce averages over CP), so any CP size gives the one-rank gradient.
    """
    total = (token_loss * mask).sum()
    if cp_group is None:
        count = mask.sum().clamp(min=1)
        return (total if per_token else total / count), total.detach() / count
    sums = torch.stack([total.detach().float(), mask.sum().float()])  # [2]: this rank's loss sum and token count
    torch.distributed.all_reduce(sums, group=cp_group)
    count = sums[1].clamp(min=1)
    scaled = total if per_token else total / count * torch.distributed.get_world_size(cp_group)
    return scaled, sums[0] / count

"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): ``n`` residual streams instead of one.

The residual stream of a layer becomes ``n = num_streams`` streams (transformers' ``hc_mult``), kept packed as
``[s, b, n * h]``. Around each sub-block (attention or MLP) a ``HyperConnectionModule`` computes,
per token, from the RMS-normalised (unweighted) flattened streams ``x`` ``[n * h]`` and one
projection ``W`` ``[(2 + n) n, n h]`` with a bias ``c`` and three scales ``a``:

* ``pre = sigmoid(a0 (x W_pre) + c_pre) + eps`` ``[n]``: the sub-block's input is ``sum_i pre_i stream_i``;
* ``post = 2 sigmoid(a1 (x W_post) + c_post)`` ``[n]``: the sub-block's output goes to stream ``i`` times ``post_i``;
* ``comb = softmax(a2 (x W_comb) + c_comb) + eps`` ``[n, n]`` (rows), then Sinkhorn-normalised (columns,
  then ``sinkhorn_iterations - 1`` rounds of rows and columns) to a nearly doubly stochastic matrix;
  the new streams are ``comb^T streams + post * output``.

``HyperHead`` collapses the streams once at the end (``sum_i pre_i stream_i`` with its own projection).
The computation is in fp32, as ``transformers``' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``.
Parameters are replicated on every TP rank (they act per token on whole hidden vectors); under
sequence parallelism each rank sees its own tokens, so they carry ``sequence_parallel`` and their
gradients are summed over TP like a norm's.

``HyperConnectionTransformerLayer`` is the layer with ``config.hyper_connection_streams`` > 1: its
input and output are the packed streams. ``TransformerBlock`` widens the embedding into ``n`` equal
streams (on the first pipeline stage) and collapses them with a ``HyperHead`` before the final norm (on the last);
pipeline stages in between exchange the packed streams (``p2p_communication.stage_hidden_size``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension (no gain)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(matrix: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` positive -> columns normalised, then ``iterations - 1`` rounds of rows and columns."""
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    return matrix


def _initialize(module: MegatronModule, config: TransformerConfig) -> None:
    """Draw the projection; mark every parameter for the TP sum under sequence parallelism."""
    if config.perform_initialization:
        config.init_method(module.mapping_proj)
    for param in module.parameters():
        param.sequence_parallel = config.sequence_parallel


class HyperConnectionModule(MegatronModule):
    """The mixing weights around one sub-block (see the module docstring).

    Parameters: ``mapping_proj`` ``[(2 + n) n, n h]`` (rows: pre, post, comb), ``mapping_bias``
    ``[(2 + n) n]``, ``mapping_scale`` ``[3]`` (pre, post, comb). ``eps`` is transformers' ``hc_eps``; the
    RMS norm uses ``config.layernorm_epsilon``.
    """

    def __init__(
        self, config: TransformerConfig, num_streams: int, sinkhorn_iterations: int = 20, eps: float = 1e-6
    ) -> None:
        super().__init__(config)
        n, h = num_streams, config.hidden_size
        self.n, self.hidden_size, self.sinkhorn_iterations, self.eps = n, h, sinkhorn_iterations, eps
        self.mapping_proj = torch.nn.Parameter(torch.empty((2 + n) * n, n * h))
        self.mapping_bias = torch.nn.Parameter(torch.zeros((2 + n) * n))
        self.mapping_scale = torch.nn.Parameter(torch.ones(3))
        _initialize(self, config)

    def forward(self, streams: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed streams ``[s, b, n * h]`` -> (the sub-block's input ``[s, b, h]``, ``post`` ``[s, b, n]``,
        ``comb`` ``[s, b, n, n]``), the last two fp32."""
        n, eps = self.n, self.eps
        mixes = F.linear(unweighted_rms_norm(streams.float(), self.config.layernorm_epsilon), self.mapping_proj.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)  # [s, b, n], [s, b, n], [s, b, n*n]
        pre_b, post_b, comb_b = self.mapping_bias.float().split([n, n, n * n])
        a_pre, a_post, a_comb = self.mapping_scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * a_pre + pre_b) + eps  # [s, b, n]
        post = 2 * torch.sigmoid(post_w * a_post + post_b)  # [s, b, n]
        comb = torch.softmax((comb_w * a_comb + comb_b).unflatten(-1, (n, n)), dim=-1) + eps
        comb = sinkhorn(comb, self.sinkhorn_iterations, eps)  # [s, b, n, n]
        unpacked = streams.unflatten(-1, (n, self.hidden_size))  # [s, b, n, h]
        collapsed = (pre.unsqueeze(-1) * unpacked).sum(dim=-2).to(streams.dtype)  # [s, b, h]
        return collapsed, post, comb

    def merge(
        self, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New packed streams ``comb^T streams + post * output``: ``[s, b, n * h]`` and ``output`` ``[s, b, h]``."""
        unpacked = streams.unflatten(-1, (self.n, self.hidden_size))  # [s, b, n, h]
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), unpacked)  # [s, b, n, h]
        return (post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed).flatten(-2)  # [s, b, n*h]


class HyperHead(MegatronModule):
    """The final collapse of the packed streams ``[s, b, n * h]`` to ``[s, b, h]`` (before the final norm).

    Parameters: ``mapping_proj`` ``[n, n h]``, ``mapping_bias`` ``[n]``, ``mapping_scale`` ``[1]``.
    """

    def __init__(self, config: TransformerConfig, num_streams: int, eps: float = 1e-6) -> None:
        super().__init__(config)
        n, h = num_streams, config.hidden_size
        self.n, self.hidden_size, self.eps = n, h, eps
        self.mapping_proj = torch.nn.Parameter(torch.empty(n, n * h))
        self.mapping_bias = torch.nn.Parameter(torch.zeros(n))
        self.mapping_scale = torch.nn.Parameter(torch.ones(1))
        _initialize(self, config)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``[s, b, n * h]`` -> ``[s, b, h]``."""
        flat = unweighted_rms_norm(streams.float(), self.config.layernorm_epsilon)
        mixes = F.linear(flat, self.mapping_proj.float())  # [s, b, n]
        pre = torch.sigmoid(mixes * self.mapping_scale.float() + self.mapping_bias.float()) + self.eps
        unpacked = streams.unflatten(-1, (self.n, self.hidden_size))  # [s, b, n, h]
        return (pre.unsqueeze(-1) * unpacked).sum(dim=-2).to(streams.dtype)


class HyperConnectionTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` over ``n = config.hyper_connection_streams`` packed residual streams
    ``[s(/tp), b, n * h]``: around attention and MLP a ``HyperConnectionModule`` collapses the streams into
    the sub-block's input and merges its output back (instead of ``x + f(norm(x))``).

    Parameters beyond the layer's: ``attention_hyper_connection`` and ``mlp_hyper_connection``.
    Cross-attention and the post-norm variants are refused.
    """

    def __init__(self, config: TransformerConfig, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        if self.cross_attention is not None or self.post_self_attn_layernorm or self.post_mlp_layernorm:
            raise NotImplementedError("HyperConnectionTransformerLayer: cross-attention or post-norms")
        if self.self_attention is None or self.mlp is None:
            raise NotImplementedError("HyperConnectionTransformerLayer: needs both attention and an MLP")
        n, iters = config.hyper_connection_streams, config.hyper_connection_sinkhorn_iterations
        eps = config.hyper_connection_eps
        self.attention_hyper_connection = HyperConnectionModule(config, n, iters, eps)
        self.mlp_hyper_connection = HyperConnectionModule(config, n, iters, eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        token_ids: Optional[torch.Tensor] = None,
        **unsupported: Any,
    ) -> Tuple[torch.Tensor, None]:
        """Streams ``[s(/tp), b, n * h]`` -> (same shape, None); ``token_ids`` ``[b, s]`` go to the MLP
        (a hash-routed MoE layer)."""
        unsupported = {k: v for k, v in unsupported.items() if v is not None}
        if unsupported:
            raise NotImplementedError(f"HyperConnectionTransformerLayer: {sorted(unsupported)} are not supported")
        streams = hidden_states
        collapsed, post, comb = self.attention_hyper_connection(streams)  # [s, b, h]
        out, bias = self.self_attention(self.input_layernorm(collapsed), attention_mask, rotary_pos_emb=rotary_pos_emb)
        streams = self.attention_hyper_connection.merge(streams, self._dropout(out, bias), post, comb)
        collapsed, post, comb = self.mlp_hyper_connection(streams)
        out, bias = self.mlp(self.pre_mlp_layernorm(collapsed), **self._token_ids_for_mlp(token_ids))
        return self.mlp_hyper_connection.merge(streams, self._dropout(out, bias), post, comb), None

    def _dropout(self, out: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = out if bias is None else out + bias
        return F.dropout(out, p=self.hidden_dropout, training=self.training)

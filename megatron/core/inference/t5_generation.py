"""Encoder-decoder generation (T5): the encoder runs once, the decoder one token per step over two caches.

The decoder's self-attention keys and values go into a ``StaticInferenceContext`` as for GPT; each
cross-attention layer projects the encoder output to keys and values on the first step and keeps them in the
same context (``cross_key_value_memory_dict``), so later steps project only the new token's query. Encoder
inputs of different lengths are right-padded and masked (encoder and encoder-decoder padding masks).
"""

from __future__ import annotations

from typing import List

import torch

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.engine import GenerationResult
from megatron.core.inference.sampling import sample_tokens
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.models.T5 import t5_padding_attention_masks


def generate_t5(
    model: torch.nn.Module,
    encoder_inputs: List[List[int]],
    params: SamplingParams,
    decoder_start_token_id: int = 0,
) -> List[GenerationResult]:
    """Continue from ``decoder_start_token_id`` for each encoder input (token ids) with a ``T5Model`` in eval mode
    on one TP rank. ``generated_tokens`` exclude the start token; a stop token ends its sequence."""
    if model.training or model.tp_group.size() > 1:
        raise NotImplementedError("generate_t5: needs an eval-mode T5Model on one tensor-parallel rank")
    if params.return_log_probs:
        raise NotImplementedError("generate_t5: return_log_probs is not supported")
    b, device = len(encoder_inputs), next(model.parameters()).device
    width = max(len(x) for x in encoder_inputs)
    enc = torch.zeros(b, width, dtype=torch.long, device=device)  # [b, s_enc], right-padded
    enc_pad = torch.zeros(b, width, dtype=torch.long, device=device)
    for j, x in enumerate(encoder_inputs):
        enc[j, : len(x)], enc_pad[j, : len(x)] = torch.tensor(x), 1
    enc_mask, _, cross_mask = t5_padding_attention_masks(enc_pad, torch.ones(b, 1, dtype=torch.long))
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
    context = StaticInferenceContext(b, params.num_tokens_to_generate + 1)
    tokens = torch.full((b, 1), decoder_start_token_id, dtype=torch.long, device=device)  # [b, 1]
    generated: List[List[int]] = [[] for _ in range(b)]
    finish = [None] * b
    with torch.no_grad():
        hidden = model(enc, None, enc_mask, None, None, output_encoder_hidden_only=True)  # [s_enc, b, h]
        for _ in range(params.num_tokens_to_generate):
            logits = model(
                enc, tokens, enc_mask, None, cross_mask, encoder_hidden_states=hidden, inference_context=context
            )
            context.increment_sequence_len_offset(1)
            tokens = sample_tokens(logits[:, -1].float(), params, generator)[:, None]  # [b, 1]
            for j, token in enumerate(tokens[:, 0].tolist()):
                if finish[j] is None:
                    generated[j].append(token)
                    finish[j] = "stop" if token in params.stop_token_ids else None
            if all(f is not None for f in finish):
                break
    return [
        GenerationResult(list(x), g, None, None, f or "length") for x, g, f in zip(encoder_inputs, generated, finish)
    ]

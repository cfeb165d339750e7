"""Tiny random Hugging Face GPT-2 / Llama models and our GPTModel holding their weights (any TP/PP layout)."""

from __future__ import annotations

from typing import List

import torch
import transformers  # a test dependency (requirements-test.txt): missing it must fail, not skip

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.hf_state_dict import from_hf_gpt2, from_hf_llama, resize_vocab
from megatron.core.parallel_state import ProcessGroupCollection
from tests.model_utils import build_gpt, single_rank_groups
from tests.unit_tests.pipeline_parallel.pipeline_parity import load_reference
from tools.checkpoint.hf_config import gpt_model_kwargs, megatron_args_from_hf

HF_VOCAB = 128  # no padding: a padded id's zero logit could win the argmax where HF has no such id
MAX_POSITIONS = 32


def hf_model(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random ``GPT2LMHeadModel`` (``kind`` "gpt2") or ``LlamaForCausalLM`` (GQA, RoPE), eval mode, no EOS."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=HF_VOCAB,
            n_positions=MAX_POSITIONS,
            n_embd=32,
            n_layer=2,
            n_head=4,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=0.3,  # spread-out logits (no near-ties for the argmax), varied greedy output
            architectures=["GPT2LMHeadModel"],
            bos_token_id=None,
            eos_token_id=None,
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.2,
        architectures=["LlamaForCausalLM"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def our_model(hf: transformers.PreTrainedModel, groups: ProcessGroupCollection) -> GPTModel:
    """This rank's stage of our GPTModel (``groups``' TP/PP layout) with ``hf``'s weights, eval mode."""
    kind, args = megatron_args_from_hf(hf.config.to_dict(), "test model", tp=1, divisible_by=HF_VOCAB)
    kwargs = gpt_model_kwargs(args)
    reference = build_gpt(kwargs, single_rank_groups())  # TP=1, PP=1 on this rank
    convert = from_hf_gpt2 if kind == "gpt2" else from_hf_llama
    sd = resize_vocab(convert(hf.state_dict(), reference.config), args["padded_vocab_size"])
    reference.load_state_dict(sd, strict=True)
    if groups.size_of("tp") == 1 and groups.size_of("pp") == 1:
        return reference.eval()
    pp, stage = groups.size_of("pp"), groups.rank_in("pp")
    model = build_gpt(kwargs, groups, pre_process=stage == 0, post_process=stage == pp - 1)
    load_reference([model], reference, groups)
    return model.eval()


def hf_greedy(hf: transformers.PreTrainedModel, prompts: List[List[int]], new_tokens: int) -> List[List[int]]:
    """``generate(do_sample=False)`` on each prompt alone: the generated tokens only."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(full[0, len(prompt) :].tolist())
    return out


def random_prompts(lengths: List[int], seed: int = 0, vocab: int = HF_VOCAB) -> List[List[int]]:
    """Random token ids below ``vocab``, one prompt per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]

"""Tiny random ``transformers`` Mamba2 and Nemotron-H models matching ``mamba_utils``' configs, and the
largest logit difference against ours after importing HF's weights and after exporting ours."""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.hf_state_dict import (
    from_hf_mamba2,
    from_hf_nemotron_h,
    to_hf_mamba2,
    to_hf_nemotron_h,
)
from tests.unit_tests.ssm.mamba_utils import HIDDEN, SEQ, VOCAB, mamba_config, spec_with_chunk

HF_MAMBA = dict(chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False)  # HF scans 16-token chunks


def hf_mamba2(num_layers):
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=num_layers, state_size=8, head_dim=8, n_groups=2,
        num_heads=8, **HF_MAMBA,
    )  # fmt: skip
    return transformers.Mamba2ForCausalLM(config).eval()


# Nemotron-H MoE layers (a sigmoid router over 2 groups of experts with the expert-bias buffer, a shared
# expert): HF's fields, and the same router and experts in our config's fields.
HF_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=16,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
)  # fmt: skip
OUR_MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16,
    moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0,
)  # fmt: skip


def hf_nemotron_h(pattern):
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        intermediate_size=48, time_step_min=1e-9,  # HF clamps dt below at time_step_min; Megatron does not
        **HF_MAMBA, **(HF_MOE if "E" in pattern else {}),
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.NemotronHForCausalLM(config).eval()


def perturb(model):
    """Random values everywhere (HF initializes D and the norms to ones, which would hide a mix-up)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0, 2) if "A_log" in name else param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # the MoE routers' expert bias (zeros)
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.add_(0.1 * torch.randn_like(buffer))


def max_logit_difference(ours, hf, ids):
    with torch.no_grad():
        return float((ours(ids, None, None) - hf(ids, use_cache=False).logits).abs().max())


def mamba2_parity(groups, ids, num_layers=3):
    """(imported, exported) logit differences against ``Mamba2ForCausalLM``."""
    hf = hf_mamba2(num_layers)
    perturb(hf)
    ours = MambaModel(mamba_config(num_layers), spec_with_chunk(), VOCAB, SEQ, pg_collection=groups).eval()
    ours.load_state_dict(from_hf_mamba2(hf.state_dict(), num_layers))
    imported = max_logit_difference(ours, hf, ids)
    perturb(ours)
    hf.load_state_dict(to_hf_mamba2(ours.state_dict(), num_layers))
    return imported, max_logit_difference(ours, hf, ids)


def nemotron_h_parity(groups, ids, pattern="M*M-M"):
    """(imported, exported) logit differences against ``NemotronHForCausalLM`` (MoE layers: ``E``)."""
    config = mamba_config(len(pattern), **(OUR_MOE if "E" in pattern else {}))
    hf = hf_nemotron_h(pattern)
    perturb(hf)
    ours = MambaModel(
        config, spec_with_chunk(), VOCAB, SEQ, hybrid_override_pattern=pattern, pg_collection=groups
    ).eval()
    types = ours.decoder.layer_type_list
    ours.load_state_dict(from_hf_nemotron_h(hf.state_dict(), config, types))
    imported = max_logit_difference(ours, hf, ids)
    perturb(ours)
    hf.load_state_dict(to_hf_nemotron_h(ours.state_dict(), config, types))
    return imported, max_logit_difference(ours, hf, ids)


def greedy_tokens(hf_model, groups, prompts, new_tokens):
    """Greedy continuations of ``prompts`` by our ``InferenceEngine`` over ``hf_model``'s weights (imported
    into a model split over ``groups``)."""
    from megatron.core.inference.engine import InferenceEngine
    from megatron.core.inference.sampling_params import SamplingParams
    from tests.unit_tests.ssm.mamba_utils import PATTERN, build_mamba, shard_state_dict

    ours = build_mamba(groups, PATTERN).eval()
    types = ours.decoder.layer_type_list
    full = from_hf_nemotron_h(hf_model.state_dict(), mamba_config(len(PATTERN)), types)
    ours.load_state_dict(shard_state_dict(ours, full, groups.tp))
    engine = InferenceEngine(ours, groups)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, num_tokens_to_generate=new_tokens))
    return [r.generated_tokens for r in results]


def hf_greedy_full_forward(hf_model, prompts, new_tokens):
    """Greedy continuations by ``transformers``' full forward (no cache), one prompt at a time: the reference
    for generation. (HF's cached ``generate`` of Nemotron-H departs from its own full forward on some prompts.)"""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        out.append(ids[len(prompt) :])
    return out

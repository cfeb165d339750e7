"""Mamba-2 layers and hybrid stacks: the chunked scan against a sequential recurrence, the layer
allocation rules, and logits against ``transformers``' Mamba2 and Nemotron-H (tiny random models)."""

import pytest
import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core.activations import squared_relu
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.hf_state_dict import (
    from_hf_mamba2,
    from_hf_nemotron_h,
    to_hf_mamba2,
    to_hf_nemotron_h,
)
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.ssm.ssd import ssd_chunked_scan
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.dist_harness import run_distributed
from tests.model_utils import single_rank_groups

MAX_ABS = 1e-4
VOCAB, HIDDEN, SEQ, CHUNK = 64, 32, 40, 8  # SEQ spans five scan chunks of CHUNK (and three of HF's 16)


def _recurrence(x, dt, A, B, C, state):
    """The selective scan one position at a time: S = exp(dt A) S + dt x B^T, y = S C."""
    heads_per_group = x.shape[2] // B.shape[2]
    ys = []
    for t in range(x.shape[1]):
        Bt, Ct = (m[:, t].repeat_interleave(heads_per_group, dim=1) for m in (B, C))  # [b, h, n]
        decay = torch.exp(dt[:, t] * A)[..., None, None]  # [b, h, 1, 1]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ct))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("chunk", [5, 7, 64])
def test_chunked_scan_matches_sequential_recurrence(chunk):
    torch.manual_seed(0)
    b, length, h, p, g, n = 2, 23, 4, 3, 2, 5
    f64 = dict(dtype=torch.float64, requires_grad=True)
    inputs = dict(
        x=torch.randn(b, length, h, p, **f64),
        dt=torch.rand(b, length, h, **f64),
        A=(-3 * torch.rand(h, dtype=torch.float64)).requires_grad_(),
        B=torch.randn(b, length, g, n, **f64),
        C=torch.randn(b, length, g, n, **f64),
    )
    initial = torch.randn(b, h, p, n, **f64)
    y, final = ssd_chunked_scan(**inputs, chunk_size=chunk, initial_state=initial)
    y_ref, final_ref = _recurrence(*inputs.values(), initial)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-10)
    leaves = [*inputs.values(), initial]
    weights = torch.randn_like(y), torch.randn_like(final)
    grads = torch.autograd.grad((y * weights[0]).sum() + (final * weights[1]).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), leaves)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_hybrid_allocation_follows_ratios_and_pattern():
    for layers, attention, mlp in ((8, 0.25, 0.25), (12, 1 / 6, 0.5), (5, 0.2, 0.0), (10, 0.0, 0.3)):
        types = allocate_layers(layers, attention, mlp)
        assert types.count(Symbols.ATTENTION) == round(layers * attention)
        assert types.count(Symbols.MLP) == round(layers * mlp)
        if attention:  # attention is spread out between Mamba runs, never first or last
            assert Symbols.ATTENTION not in (types[0], types[-1])
            positions = [i for i, t in enumerate(types) if t == Symbols.ATTENTION]
            assert all(b - a > 1 for a, b in zip(positions, positions[1:]))
    assert allocate_layers(4, 0.25, 0.25, "M*M-") == list("M*M-")
    for bad, message in (("M*M", "has 3 layers"), ("M*MX", "not among"), ("M**-", "as many layers")):
        with pytest.raises(ValueError, match=message):
            allocate_layers(4, 0.25, 0.25, bad)


def _config(num_layers, **extra):
    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, transformer_impl="local",
        use_cpu_initialization=True, **extra,
    )  # fmt: skip


def _spec_with_chunk(chunk):
    """``mamba_stack_spec`` with the mixers' scan chunk set to ``chunk``."""
    import copy

    spec = copy.deepcopy(mamba_stack_spec)
    spec.submodules.mamba_layer.submodules.mixer = ModuleSpec(
        module=spec.submodules.mamba_layer.submodules.mixer.module,
        params={"chunk_size": chunk},
        submodules=spec.submodules.mamba_layer.submodules.mixer.submodules,
    )
    return spec


def _perturb(model):
    """Random values everywhere (HF initializes D and the norms to ones, which would hide a mix-up)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.1 * torch.randn_like(param)) if "A_log" not in name else param.uniform_(0, 2)


def _compare(ours, hf, ids):
    with torch.no_grad():
        return float((ours(ids, None, None) - hf(ids, use_cache=False).logits).abs().max())


def _mamba2(groups, ids):
    config = _config(3)
    hf = transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, state_size=8, head_dim=8, n_groups=2,
            num_heads=8, chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        )
    ).eval()  # fmt: skip
    _perturb(hf)
    ours = MambaModel(config, _spec_with_chunk(CHUNK), VOCAB, SEQ, pg_collection=groups).eval()
    ours.load_state_dict(from_hf_mamba2(hf.state_dict(), 3))
    imported = _compare(ours, hf, ids)
    _perturb(ours)
    hf.load_state_dict(to_hf_mamba2(ours.state_dict(), 3))
    return imported, _compare(ours, hf, ids)


def _nemotron_h(groups, ids, pattern="M*M-M"):
    config = _config(len(pattern), kv_channels=8, activation_func=squared_relu)
    hf_config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, hybrid_override_pattern=pattern, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        intermediate_size=48, chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        time_step_min=1e-9,  # HF clamps dt below at time_step_min; Megatron's scan does not clamp
    )  # fmt: skip
    hf_config._attn_implementation = "eager"
    hf = transformers.NemotronHForCausalLM(hf_config).eval()
    _perturb(hf)
    ours = MambaModel(
        config, _spec_with_chunk(CHUNK), VOCAB, SEQ, hybrid_override_pattern=pattern, pg_collection=groups
    ).eval()
    types = ours.decoder.layer_type_list
    ours.load_state_dict(from_hf_nemotron_h(hf.state_dict(), config, types))
    imported = _compare(ours, hf, ids)
    _perturb(ours)
    hf.load_state_dict(to_hf_nemotron_h(ours.state_dict(), config, types))
    return imported, _compare(ours, hf, ids)


def _parity_body(rank, world_size):
    torch.manual_seed(0)
    groups = single_rank_groups()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return {"mamba2": _mamba2(groups, ids), "nemotron_h": _nemotron_h(groups, ids)}


def test_logits_match_transformers_mamba2_and_nemotron_h():
    for family, (imported, exported) in run_distributed(_parity_body, 1)[0].items():
        assert imported < MAX_ABS, (family, "HF weights imported", imported)
        assert exported < MAX_ABS, (family, "our weights exported", exported)

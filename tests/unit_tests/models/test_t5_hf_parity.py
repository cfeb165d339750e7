"""T5Model (v1.1 layout) against Hugging Face's T5ForConditionalGeneration (random weights, no download).

A tiny ``T5Config`` (d_model 32, 2+2 layers, 4 heads of 8, 8 relative buckets, gated-gelu) and our
v1.1 model get the same weights (ours -> HF through ``to_hf_t5``). With encoder and decoder padding
the logits agree within 1e-4 max abs (fp32, eval) and so do the per-token and mean losses. Each
feature is shown to matter: without the relative bias, without the masks, with the exact (erf)
GeLU instead of the tanh approximation, without the gate, or with bidirectional decoder buckets,
our logits move by more than the tolerance. The state-dict round trips are exact.

transformers 5 always ties T5's ``lm_head`` to ``shared`` (``tie_word_embeddings=False`` only turns
off the decoder-output rescaling); v1.1 checkpoints have their own LM head, so the test unties it.
"""

import torch
import torch.nn.functional as F
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.relative_pos_embedding import relative_position_bucket
from megatron.core.models.T5 import t5_padding_attention_masks
from megatron.core.models.T5.hf_state_dict import from_hf_t5, to_hf_t5
from megatron.core.transformer.attention import DotProductAttention
from tests.dist_harness import run_distributed
from tests.model_utils import T5_VOCAB, build_t5, t5_batch, t5_config

MAX_ABS = 1e-4
CHANGED = 1e-2  # how far outputs must move when a feature is dropped
STD = 0.3  # larger than the default init: sharp attention, so masks and biases matter


def _hf_model(config, model) -> transformers.T5ForConditionalGeneration:
    hf_config = transformers.T5Config(
        vocab_size=T5_VOCAB,
        d_model=config.hidden_size,
        d_kv=config.kv_channels,
        d_ff=config.ffn_hidden_size,
        num_layers=config.num_layers,
        num_decoder_layers=config.num_layers,
        num_heads=config.num_attention_heads,
        relative_attention_num_buckets=model.encoder_relative_pos_emb.relative_attention_num_buckets,
        relative_attention_max_distance=model.encoder_relative_pos_emb.relative_attention_max_distance,
        dropout_rate=0.0,
        layer_norm_epsilon=config.layernorm_epsilon,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())  # v1.1: an untied head
    hf.load_state_dict(to_hf_t5(model.state_dict(), config, config), strict=True)
    return hf


def _models():
    groups = ps.initialize_model_parallel(1, 1)
    config = t5_config(groups, init_method_std=STD)
    ours = build_t5(groups, config=config).eval()
    # RMSNorm gains start at 1: randomize them too, so a misplaced norm weight shows.
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return config, ours, _hf_model(config, ours)


def _ours(model, data, **kwargs):
    masks = t5_padding_attention_masks(data["enc_pad"], data["dec_pad"])
    return model(data["enc"], data["dec"], *masks, **kwargs)


def _hf(hf, data, **kwargs):
    return hf(
        input_ids=data["enc"],
        attention_mask=data["enc_pad"],
        decoder_input_ids=data["dec"],
        decoder_attention_mask=data["dec_pad"],
        **kwargs,
    )


def _real(t: torch.Tensor, data) -> torch.Tensor:
    """The decoder positions that are not padding (padded positions are never compared)."""
    return t[data["dec_pad"].bool()]


def _diff(a, b, data) -> float:
    return (_real(a, data) - _real(b, data)).abs().max().item()


def _parity_body(rank, world_size):
    config, ours, hf = _models()
    data = t5_batch()
    with torch.no_grad():
        logits = _ours(ours, data)  # [b, s_dec, vocab]
        ref = _hf(hf, data).logits
        assert (logits - ref).abs().max().item() < MAX_ABS  # every position, padded ones included
        # Megatron's dataset masks for the local layers ([b, 1, sq, sk], padded query rows blocked too).
        enc_keep, dec_keep = data["enc_pad"].bool(), data["dec_pad"].bool()
        enc_mask = ~(enc_keep[:, None, :, None] & enc_keep[:, None, None, :])  # [b, 1, s_enc, s_enc]
        dec_mask = ~(dec_keep[:, None, :, None] & dec_keep[:, None, None, :])  # [b, 1, s_dec, s_dec]
        cross = ~(dec_keep[:, None, :, None] & enc_keep[:, None, None, :])  # [b, 1, s_dec, s_enc]
        local = ours(data["enc"], data["dec"], enc_mask, dec_mask, cross)
        assert _diff(local, ref, data) < MAX_ABS
        # The unfused softmax (--attention-backend unfused) adds the bias and the masks the same way.
        cores = [m for m in ours.modules() if isinstance(m, DotProductAttention)]
        for core in cores:
            core.use_sdpa = False
        assert (_ours(ours, data) - ref).abs().max().item() < MAX_ABS
        for core in cores:
            core.use_sdpa = True
        loss = _ours(ours, data, lm_labels=data["labels"])  # [b, s_dec]
        ref_loss = F.cross_entropy(ref.transpose(1, 2), data["labels"], reduction="none")
        assert _diff(loss, ref_loss, data) < MAX_ABS
        labels = data["labels"].masked_fill(data["dec_pad"] == 0, -100)  # HF ignores -100
        mean = (loss * data["loss_mask"]).sum() / data["loss_mask"].sum()
        assert abs(mean.item() - _hf(hf, data, labels=labels).loss.item()) < MAX_ABS
    return (logits - ref).abs().max().item(), _diff(loss, ref_loss, data)


def _features_body(rank, world_size):
    """Dropping a feature moves our logits away from Hugging Face's: the parity test sees each one."""
    config, ours, hf = _models()
    data = t5_batch()
    with torch.no_grad():
        ref = _hf(hf, data).logits
        assert _diff(ours(data["enc"], data["dec"], None, None, None), ref, data) > CHANGED  # masks
        for table in (ours.encoder_relative_pos_emb, ours.decoder_relative_pos_emb):
            saved = table.relative_attention_bias.weight.clone()
            table.relative_attention_bias.weight.zero_()
            assert _diff(_ours(ours, data), ref, data) > CHANGED  # relative bias
            table.relative_attention_bias.weight.copy_(saved)
            table.bidirectional = not table.bidirectional
            assert _diff(_ours(ours, data), ref, data) > CHANGED  # bucket direction
            table.bidirectional = not table.bidirectional
        assert _diff(_ours(ours, data), ref, data) < MAX_ABS  # all restored
        for act, gated, moved in ((F.gelu, True, MAX_ABS), (F.gelu, False, CHANGED)):
            for cfg in (ours.config, ours.encoder_config):
                cfg.activation_func, cfg.gated_linear_unit = act, gated
            if not gated:  # the gate's half of fc1 alone: a plain MLP of the same width
                for layer in [*ours.encoder.layers, *ours.decoder.layers]:
                    fc1 = layer.mlp.linear_fc1.weight
                    layer.mlp.linear_fc1.weight = torch.nn.Parameter(fc1[: fc1.shape[0] // 2].clone())
            assert _diff(_ours(ours, data), ref, data) > moved


def _round_trip_body(rank, world_size):
    config, ours, hf = _models()
    ours_sd, hf_sd = ours.state_dict(), hf.state_dict()
    back = from_hf_t5(to_hf_t5(ours_sd, config, config), config, config)
    assert set(back) == set(ours_sd)
    for name, tensor in ours_sd.items():
        assert torch.equal(back[name], tensor), name
    again = to_hf_t5(from_hf_t5(hf_sd, config, config), config, config)
    assert set(again) == set(hf_sd)
    for name, tensor in hf_sd.items():
        assert torch.equal(again[name], tensor), name


def test_t5_logits_and_loss_equal_hugging_face():
    logits_diff, loss_diff = run_distributed(_parity_body, 1)[0]
    print(f"max abs diff vs HF: logits {logits_diff:.2e}, per-token loss {loss_diff:.2e}")


def test_t5_each_feature_moves_the_logits():
    run_distributed(_features_body, 1)


def test_t5_state_dict_round_trips_exactly():
    run_distributed(_round_trip_body, 1)


def test_relative_position_buckets_equal_hugging_face():
    """Every distance from -300 to 300 falls into Hugging Face's bucket, in both directions."""
    distance = torch.arange(-300, 301)[None, :]  # [1, 601]
    for bidirectional in (True, False):
        for buckets, max_distance in ((32, 128), (8, 16), (6, 20)):
            ours = relative_position_bucket(distance, bidirectional, buckets, max_distance)
            ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
                distance, bidirectional, buckets, max_distance
            )
            assert torch.equal(ours, ref), (bidirectional, buckets, max_distance)

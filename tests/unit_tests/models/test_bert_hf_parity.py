"""Post-LN BertModel against Hugging Face's BertForPreTraining / BertForMaskedLM (random weights, no download).

The same weights go into both models (ours -> HF and HF -> ours); with a padding mask that pads
some positions and token types 0/1, the MLM logits and NSP logits must agree within 1e-4 max abs
(fp32, eval). Each check also shows the feature matters: without token types or without the
padding mask our outputs move by far more than the tolerance.
"""

import torch
import transformers  # a test dependency: missing it must fail, not skip

from megatron.core import parallel_state as ps
from megatron.core.models.bert.hf_state_dict import from_hf_bert, to_hf_bert
from tests.dist_harness import run_distributed
from tests.model_utils import SEQ, VOCAB, bert_batch, bert_config, build_bert

MAX_ABS = 1e-4
CHANGED = 1e-2  # how far outputs must move when a feature is dropped
STD = 0.3  # weight init std, larger than BERT's 0.02: sharper attention, so padding matters


def _hf_config(config) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=SEQ,
        type_vocab_size=2,
        layer_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=True,
        initializer_range=STD,
    )


def _load_hf(hf: torch.nn.Module, sd) -> None:
    result = hf.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(k.endswith("position_ids") for k in result.missing_keys), result.missing_keys


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _pretraining_diffs(ours, hf, data):
    logits, binary = ours(data["tokens"], data["padding"], data["types"])
    out = hf(input_ids=data["tokens"], attention_mask=data["padding"], token_type_ids=data["types"])
    return _max_diff(logits, out.prediction_logits), _max_diff(binary, out.seq_relationship_logits)


def _pretraining_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    data = bert_batch()
    config = bert_config(groups, init_method_std=STD)
    ours = build_bert(groups, config=config, share_embeddings_and_output_weights=True).eval()
    hf = transformers.BertForPreTraining(_hf_config(ours.config)).eval()
    _load_hf(hf, to_hf_bert(ours.state_dict(), ours.config))
    results = {}
    results["mlm"], results["nsp"] = _pretraining_diffs(ours, hf, data)

    fresh = transformers.BertForPreTraining(_hf_config(ours.config)).eval()
    hf_sd = fresh.state_dict()
    ours.load_state_dict(from_hf_bert(hf_sd, ours.config), strict=True)
    results["mlm_from_hf"], results["nsp_from_hf"] = _pretraining_diffs(ours, fresh, data)

    # Round trips: HF -> ours -> HF and ours -> HF -> ours give back every tensor exactly.
    back = to_hf_bert(ours.state_dict(), ours.config)
    assert set(back) == {k for k in hf_sd if not k.endswith("position_ids")}
    assert all(torch.equal(back[k], hf_sd[k]) for k in back)
    again = from_hf_bert(back, ours.config)
    assert set(again) == set(ours.state_dict())
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())

    # The features are exercised: dropping token types or the padding mask changes the outputs.
    logits, _ = ours(data["tokens"], data["padding"], data["types"])
    no_types, _ = ours(data["tokens"], data["padding"], torch.zeros_like(data["types"]))
    no_mask, _ = ours(data["tokens"], None, data["types"])
    assert _max_diff(no_types, logits) > CHANGED
    assert _max_diff(no_mask, logits) > CHANGED
    return results


def _masked_lm_body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    data = bert_batch(seed=1)
    config = bert_config(groups, init_method_std=STD)
    ours = build_bert(groups, config=config, add_binary_head=False, share_embeddings_and_output_weights=True, seed=7)
    ours.eval()
    hf = transformers.BertForMaskedLM(_hf_config(ours.config)).eval()
    _load_hf(hf, to_hf_bert(ours.state_dict(), ours.config, binary_head=False))
    logits, binary = ours(data["tokens"], data["padding"], data["types"])
    assert binary is None
    out = hf(input_ids=data["tokens"], attention_mask=data["padding"], token_type_ids=data["types"]).logits
    results = {"masked_lm": _max_diff(logits, out)}

    fresh = transformers.BertForMaskedLM(_hf_config(ours.config)).eval()
    ours.load_state_dict(from_hf_bert(fresh.state_dict(), ours.config, binary_head=False), strict=True)
    logits, _ = ours(data["tokens"], data["padding"], data["types"])
    out = fresh(input_ids=data["tokens"], attention_mask=data["padding"], token_type_ids=data["types"]).logits
    results["masked_lm_from_hf"] = _max_diff(logits, out)

    # Untied output weight: Hugging Face's decoder weight becomes our output_layer.weight.
    untied = build_bert(groups, config=config, add_binary_head=False, seed=7).eval()
    untied.load_state_dict(from_hf_bert(fresh.state_dict(), ours.config, binary_head=False, tied=False), strict=True)
    logits, _ = untied(data["tokens"], data["padding"], data["types"])
    results["masked_lm_untied"] = _max_diff(logits, out)
    return results


def test_bert_for_pretraining_matches_hugging_face():
    results = run_distributed(_pretraining_body, 1)[0]
    print(results)
    for name, diff in results.items():
        assert diff <= MAX_ABS, f"{name}: max |diff| = {diff:.3g} > {MAX_ABS}"


def test_bert_for_masked_lm_matches_hugging_face():
    results = run_distributed(_masked_lm_body, 1)[0]
    print(results)
    for name, diff in results.items():
        assert diff <= MAX_ABS, f"{name}: max |diff| = {diff:.3g} > {MAX_ABS}"

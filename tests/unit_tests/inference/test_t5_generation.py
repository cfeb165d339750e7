"""T5 generation with the self- and cross-attention caches equals Hugging Face's greedy ``generate``.

The tiny v1.1 T5 of the HF parity test (our weights exported with ``to_hf_t5``); three encoder inputs of
different lengths in one padded batch, each HF reference generated alone. The cross-attention cache is
structural: each layer projects the encoder output to keys and values once, not once per step.
"""

import torch

from megatron.core.inference import SamplingParams
from megatron.core.inference.t5_generation import generate_t5
from tests.dist_harness import run_distributed
from tests.model_utils import T5_VOCAB
from tests.unit_tests.inference.hf_models import random_prompts
from tests.unit_tests.models.test_t5_hf_parity import _models

NEW = 8


def _body(rank, world_size):
    config, ours, hf = _models()
    inputs = random_prompts([5, 9, 3], seed=2, vocab=T5_VOCAB)
    calls = []
    for layer in ours.decoder.layers:
        layer.cross_attention.linear_kv.register_forward_hook(lambda *_: calls.append(1))
    results = generate_t5(ours, inputs, SamplingParams(temperature=0.0, num_tokens_to_generate=NEW))
    expected = []
    for x in inputs:
        ids = torch.tensor([x])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                decoder_start_token_id=0,
                eos_token_id=None,
            )
        expected.append(out[0, 1:].tolist())
    return [r.generated_tokens for r in results], expected, len(calls), len(ours.decoder.layers)


def test_t5_greedy_equals_hugging_face_with_cached_cross_attention():
    ours, expected, kv_calls, layers = run_distributed(_body, 1)[0]
    assert ours == expected
    assert kv_calls == layers, f"the encoder's keys/values were projected {kv_calls} times over {layers} layers"

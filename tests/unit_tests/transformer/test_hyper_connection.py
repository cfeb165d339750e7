"""Hyper-connection modules (DeepSeek-V4's mHC) against transformers' DeepseekV4HyperConnection / HyperHead.

Same random weights, random packed streams: the collapsed sub-block input, ``post``, the Sinkhorn-
normalised ``comb``, the merged streams and the hyper head's output equal transformers' at 1e-6
(fp32). With one Sinkhorn round instead of 20 (V3's plain residual has no mixing at all) ``comb``
moves far more than that, so the normalisation is what is checked. No process group: the modules
have no parallel parts.
"""

import torch
import transformers

from megatron.core.transformer.hyper_connection import HyperConnectionModule, HyperHead
from megatron.core.transformer.transformer_config import TransformerConfig

N, H, S, B = 3, 8, 5, 2


CONFIG = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, layernorm_epsilon=1e-6)


def test_hyper_connection_and_head_match_deepseek_v4():
    torch.manual_seed(0)
    hf_config = transformers.DeepseekV4Config(hidden_size=H, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6)
    v4 = transformers.models.deepseek_v4.modeling_deepseek_v4
    hf, hf_head = v4.DeepseekV4HyperConnection(hf_config), v4.DeepseekV4HyperHead(hf_config)
    ours, head = HyperConnectionModule(CONFIG, N), HyperHead(CONFIG, N)
    with torch.no_grad():
        for p in list(hf.parameters()) + list(hf_head.parameters()):
            p.normal_(0, 0.5)
        pairs = ((ours, (hf.fn, hf.base, hf.scale)), (head, (hf_head.hc_fn, hf_head.hc_base, hf_head.hc_scale)))
        for dst, src in pairs:
            for name, value in zip(("mapping_proj", "mapping_bias", "mapping_scale"), src):
                getattr(dst, name).copy_(value)
        streams = torch.randn(S, B, N * H)  # ours: [s, b, n*h]; transformers: [b, s, n, h]
        hf_streams = streams.view(S, B, N, H).transpose(0, 1)
        post, comb, collapsed = hf(hf_streams)
        got_collapsed, got_post, got_comb = ours(streams)
        torch.testing.assert_close(got_collapsed, collapsed.transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(got_post, post.transpose(0, 1), rtol=0, atol=1e-6)
        torch.testing.assert_close(got_comb, comb.transpose(0, 1), rtol=0, atol=1e-6)
        output = torch.randn(S, B, H)
        expected = post.unsqueeze(-1) * output.transpose(0, 1).unsqueeze(-2) + comb.transpose(-1, -2) @ hf_streams
        merged = ours.merge(streams, output, got_post, got_comb)
        torch.testing.assert_close(merged, expected.transpose(0, 1).flatten(-2), rtol=0, atol=1e-6)
        torch.testing.assert_close(head(streams), hf_head(hf_streams).transpose(0, 1), rtol=0, atol=1e-6)
        one_round = HyperConnectionModule(CONFIG, N, sinkhorn_iterations=1)
        one_round.load_state_dict(ours.state_dict())
        assert (one_round(streams)[2] - got_comb).abs().max() > 1e-3

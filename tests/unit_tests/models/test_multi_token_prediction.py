"""Multi-token prediction against an independent reference, and the losses it tracks.

On a DeepSeek-V3-style tiny model with ``mtp_num_layers=2``: the reference recomputes each
module's loss by hand (inputs, labels and loss mask shifted with explicit slicing, ``F.linear``
for the projection and the output layer, ``F.cross_entropy``) from the model's own submodules.
Checked: the tracked ``mtp_k loss`` values equal the reference's masked means; the model's
gradients (main loss mean, aux-loss scale 1) equal those of ``main + factor/2 * (loss_1 + loss_2)``
of the reference; the returned per-token loss does not change with MTP.
"""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_utils import get_aux_loss_tracker
from tests.dist_harness import run_distributed
from tests.model_utils import batch, build_gpt, deepseek_style

FACTOR, DEPTHS = 0.3, 2


def _shift(t, k):
    """``[b, s]`` -> positions i hold i+k; the last k positions 0."""
    return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)


def _reference_losses(model, tokens, labels, mask):
    """Main per-token loss ``[b, s]`` and each module's masked mean loss, recomputed by hand."""
    s = tokens.shape[1]
    rotary = model.rotary_pos_emb(s)
    hidden = model.decoder(model.embedding(tokens, None), None, rotary_pos_emb=rotary)  # [s, b, h]
    out_w = model.output_layer.weight

    def token_loss(h, lab):  # h [s, b, h] -> [b, s]
        logits = F.linear(h, out_w).transpose(0, 1)  # [b, s, v]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none").view_as(lab)

    main, losses = token_loss(hidden, labels), []
    for k, layer in enumerate(model.mtp.layers, 1):
        emb = model.embedding(_shift(tokens, k), None)
        x = F.linear(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1), layer.eh_proj.weight)
        hidden = layer.final_layernorm(layer.transformer_layer(x, None, rotary_pos_emb=rotary)[0])
        m = _shift(mask, k)
        losses.append((token_loss(hidden, _shift(labels, k)) * m).sum() / m.sum())
    return main, losses


def _body(rank, world_size):
    groups = ps.initialize_model_parallel(1, 1)
    tokens, labels = batch(b=2)
    mask = (torch.rand(tokens.shape, generator=torch.Generator().manual_seed(1)) > 0.2).float()
    kw = deepseek_style(mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=FACTOR)
    model, reference = build_gpt(kw, groups), build_gpt(kw, groups)
    tracker = get_aux_loss_tracker()
    tracker.clear()
    tracker.set_loss_scale(1.0)
    loss = model(tokens, None, None, labels=labels, loss_mask=mask)  # [b, s]
    loss.mean().backward()
    tracked = [tracker.values[f"mtp_{k} loss"].sum() for k in range(1, DEPTHS + 1)]
    main, ref_losses = _reference_losses(reference, tokens, labels, mask)
    (main.mean() + FACTOR / DEPTHS * sum(ref_losses)).backward()
    torch.testing.assert_close(loss.detach(), main.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(tracked), torch.stack(ref_losses).detach(), rtol=1e-5, atol=1e-6)
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        g = ref_grads[name].grad
        assert p.grad is not None and g is not None, name
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    mtp_grad = model.mtp.layers[1].eh_proj.weight.grad.abs().max().item()
    return [t.item() for t in tracked], mtp_grad


def test_mtp_matches_an_independent_reference():
    losses, mtp_grad = run_distributed(_body, 1)[0]
    assert all(loss > 1.0 for loss in losses) and mtp_grad > 0, (losses, mtp_grad)

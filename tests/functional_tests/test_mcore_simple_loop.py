"""A Megatron-core user's training loop runs unchanged on our ``megatron.core`` (CPU, 2 ranks, TP=2).

``test_upstream_example`` runs Megatron-LM's own ``examples/run_simple_mcore_train_loop.py`` when
``MCORE_UPSTREAM_EXAMPLE`` names a copy of it (the file is not part of this project), with only its
device choice and backend made CPU-safe: no ``torch.cuda.set_device``, ``gloo`` for ``nccl``,
``torch.device("cpu")`` for ``"cuda"``. ``test_loop_in_megatron_core_style`` is our own loop making the
same calls the way that script does, and checks what the script only prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List

import pytest
import torch

from tests.dist_harness import run_distributed
from tests.functional_tests.gpt_runs import REPO

# The three CPU edits: (upstream text, replacement). Each must occur exactly once.
CPU_EDITS = (
    ("torch.cuda.set_device(local_rank)", "pass  # CPU: no device"),
    ('backend="nccl"', 'backend="gloo"'),
    ('torch.device("cuda")', 'torch.device("cpu")'),
)
SEQ = 64


def cpu_safe_copy(source: str, target: str) -> None:
    """Write ``source`` to ``target`` with exactly the three CPU edits applied."""
    with open(source) as f:
        text = f.read()
    for old, new in CPU_EDITS:
        count = text.count(old)
        assert count == 1, f"{source}: expected {old!r} once, found it {count} times (the example changed?)"
        text = text.replace(old, new)
    with open(target, "w") as f:
        f.write(text)


def test_upstream_example(tmp_path):
    source = os.environ.get("MCORE_UPSTREAM_EXAMPLE")
    if not source:
        pytest.skip("set MCORE_UPSTREAM_EXAMPLE to Megatron-LM's examples/run_simple_mcore_train_loop.py to run it")
    script = tmp_path / "cpu_loop.py"
    cpu_safe_copy(source, str(script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for iteration in range(5):
        assert len(re.findall(rf"Iteration {iteration}: Losses reduced", proc.stdout)) == 2, out[-4000:]
    assert proc.stdout.count("Successfully loaded the model") == 2
    assert (tmp_path / "ckpt" / "metadata.json").exists()


def _data_iterator():
    """One batch of mock data, built as the upstream script builds its data, repeated (the loss must fall)."""
    from torch.utils.data import DataLoader

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import compile_helpers
    from megatron.core.tokenizers import MegatronTokenizer

    compile_helpers()  # a documented no-op: our index helpers are NumPy
    config = GPTDatasetConfig(
        random_seed=0,
        sequence_length=SEQ,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=SEQ),
        mid_level_dataset_surplus=0.005,
    )
    assert config.mock and config.split == "1,1,1"  # no blend given: mock data, even split
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, config).build()
    assert len(train) >= 1000 and valid is not None and test is not None  # None: one epoch of the split
    batch = next(iter(DataLoader(train, batch_size=8, shuffle=False)))
    while True:
        yield batch


def _forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], data["attention_mask"], labels=data["labels"])
    mask = data["loss_mask"].view(-1).float()

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum()
        return loss, {"lm loss": loss}

    return output, loss_func


def _build():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True, pipeline_dtype=torch.float32
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=100, max_sequence_length=SEQ
    )
    # The sizes were left at their defaults: the model took them from parallel_state.
    assert config.tensor_model_parallel_size == 2 and model.config is config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def _train(model, iterations: int = 5) -> List[float]:
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward_backward_func = get_forward_backward_func()
    data, losses = _data_iterator(), []
    for _ in range(iterations):
        optim.zero_grad()
        reduced = forward_backward_func(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=8,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        finalize_model_grads([model])  # groups from the model, none passed
        # DDP reduces into main_grad and leaves .grad None, as Megatron-core's does, so a plain torch
        # optimizer (the upstream example's Adam) would never step; hand it the reduced gradients.
        for param in model.parameters():
            param.grad = param.main_grad
        optim.step()
        losses.append(float(reduced[0]["lm loss"].detach()))
    return losses


def _save_perturb_load(model, checkpoint_dir: str) -> Dict[str, bool]:
    from megatron.core import dist_checkpointing

    gpt = model.module
    saved = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    sharded = gpt.sharded_state_dict(prefix="")
    dist_checkpointing.save(sharded_state_dict=sharded, checkpoint_dir=checkpoint_dir)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(1.0)  # a load that did nothing leaves these
    sharded = gpt.sharded_state_dict(prefix="")
    checkpoint = dist_checkpointing.load(sharded_state_dict=sharded, checkpoint_dir=checkpoint_dir)
    assert set(checkpoint) == set(gpt.state_dict()), "load returns the module's own state_dict names"
    gpt.load_state_dict(checkpoint)
    equal = all(torch.equal(p, saved[name]) for name, p in gpt.named_parameters())
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    plain = dist_checkpointing.load_plain_tensors(checkpoint_dir)
    return {
        "equal_after_load": equal,
        "tp_sharded_key": sharded[qkv].key == qkv and sharded[qkv].global_shape[0] == 2 * saved[qkv].shape[0],
        "plain_whole": tuple(plain[qkv].shape) == sharded[qkv].global_shape,
        "common_empty": dist_checkpointing.load_common_state_dict(checkpoint_dir) == {},
    }


def _loop_body(rank: int, world_size: int, checkpoint_dir: str):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(123)
    model = _build()
    losses = _train(model)
    return losses, _save_perturb_load(model, checkpoint_dir)


def test_loop_in_megatron_core_style(tmp_path):
    results = run_distributed(_loop_body, 2, str(tmp_path / "ckpt"))
    (losses0, checks0), (losses1, checks1) = results
    assert losses0 == losses1, "TP ranks report the same loss"
    assert losses0[-1] < losses0[0] - 0.1, f"the loss falls over 5 iterations on one repeated batch: {losses0}"
    for checks in (checks0, checks1):
        assert checks == dict.fromkeys(checks, True), checks
    assert (tmp_path / "ckpt" / "metadata.json").exists()
    assert not (tmp_path / "ckpt" / "common_state.json").exists(), "a model-only checkpoint keeps our layout"

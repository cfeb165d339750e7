"""Train a tiny GPT with Megatron Core alone: groups, model, DDP, optimizer, schedule; no flags.

    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py

Tensor parallelism over the 2 ranks, mock data, a few iterations; prints the loss per step and
saves a sharded checkpoint that any other layout can load.
"""

from __future__ import annotations

import os
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.data_samplers import build_pretraining_data_loader  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.dist_checkpointing import save as save_sharded  # noqa: E402
from megatron.core.dist_checkpointing.state_dict import sharded_state_dict  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.models import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.tokenizers import build_tokenizer  # noqa: E402

SEQ, MICRO, ITERS = 64, 4, 5


def build(groups):
    model = GPTModel(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=1024,
        max_sequence_length=SEQ,
        tensor_model_parallel_size=groups.size_of("tp"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pg_collection=groups,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0), [ddp], pg_collection=groups)
    model.config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=groups)
    return ddp, optimizer


def data(groups):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=SEQ, split="1,0,0", tokenizer=tokenizer, mock=True, create_attention_mask=False
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [ITERS * MICRO, None, None], lambda: True, config
    ).build()
    return iter(build_pretraining_data_loader(train, 0, MICRO, groups.rank_in("dp"), groups.size_of("dp")))


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {key: value.cuda(non_blocking=True) for key, value in batch.items()}
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
    mask = batch["loss_mask"].float()

    def loss_func(output):
        total = (output * mask).sum()
        return total, mask.sum().int(), {"lm loss": torch.stack([total.detach(), mask.sum()])}

    return losses, loss_func


def main() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    groups = parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(123)
    model, optimizer = build(groups)
    iterator = data(groups)
    schedule = get_forward_backward_func()
    for step in range(1, ITERS + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reported = schedule(
            forward_step_func=forward_step,
            data_iterator=iterator,
            model=model,
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=MICRO,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        loss = reported[0]["lm loss"]
        if dist.get_rank() == 0:
            print(f"step {step}: lm loss {float(loss[0] / loss[1]):.4f}, grad norm {grad_norm:.3f}", flush=True)
    checkpoint_dir = os.environ.get("CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="mcore-ckpt-")
    save_sharded(sharded_state_dict(model.module, pg_collection=groups), checkpoint_dir)
    if dist.get_rank() == 0:
        print(f"saved a sharded checkpoint to {checkpoint_dir}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Sharded checkpoints: geometry, resharding across TP/PP/DP layouts, and clear errors for bad checkpoints."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dcp_mc
from megatron.core.dist_checkpointing import CheckpointingError, ShardedTensor, plain_data
from megatron.core.tensor_parallel.layers import _shard_of_master
from tests.dist_harness import run_distributed
from tests.unit_tests.dist_checkpointing.ckpt_utils import (
    assert_same_weights,
    build_stage,
    full_weights_by_key,
    groups_for,
)


# ------------------------------------------------------------------ no processes
@pytest.mark.parametrize("stride,tp", [(1, 2), (2, 2), (2, 4), (3, 2)])
def test_stride_geometry_places_every_shard_exactly(stride, tp):
    rows = 3 * tp * stride
    full = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4)
    rebuilt = None
    for rank in range(tp):
        shard = _shard_of_master(full, rows // tp, 0, stride, rank, tp)
        spec = dcp_mc.sharded_tensor_for("w", _mark(shard, stride), rank, tp, 0)
        if rebuilt is None:
            rebuilt = torch.full(spec.global_shape, float("nan"))
        index = tuple(slice(o, o + s) for o, s in zip(spec.global_offset, spec.local_shape))
        rebuilt[index] = spec.data
    assert torch.equal(rebuilt.reshape(full.shape), full)


def _mark(t: torch.Tensor, stride: int) -> torch.Tensor:
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, 0, stride
    return t


def test_replicated_tensors_written_once():
    t = torch.zeros(3)
    writers = [
        (tp, dp) for tp in range(2) for dp in range(3) if dcp_mc.sharded_tensor_for("b", t, tp, 2, dp).replica_id == 0
    ]
    assert writers == [(0, 0)]


def test_sharded_tensor_rejects_bad_geometry():
    with pytest.raises(ValueError, match="outside the global size"):
        ShardedTensor.from_global("k", torch.zeros(4, 2), (6, 2), (4, 0))
    with pytest.raises(ValueError, match="same number of dimensions"):
        ShardedTensor.from_global("k", torch.zeros(4, 2), (4,), (0,))


def test_plain_data_round_trip_and_refusal():
    value = {"step": 3, "betas": (0.9, 0.95), 0: [1.5, None], "t": torch.arange(6).view(2, 3).to(torch.bfloat16)}
    back = plain_data.decode(json.loads(json.dumps(plain_data.encode(value))))
    assert back["step"] == 3 and back["betas"] == (0.9, 0.95) and back[0] == [1.5, None]
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], value["t"])
    with pytest.raises(TypeError, match=r"\$.f: a function"):
        plain_data.encode({"f": test_plain_data_round_trip_and_refusal})


# ------------------------------------------------------------------ 4 ranks
def _save(style, tp, pp, path, seed=1):
    groups = groups_for(tp, pp)
    model = build_stage(style, groups, seed)
    dcp_mc.save(dcp_mc.sharded_state_dict(model, pg_collection=groups), path)
    return full_weights_by_key(model, groups)


def _load(style, tp, pp, path, seed=2):
    groups = groups_for(tp, pp)
    model = build_stage(style, groups, seed)
    dcp_mc.load(dcp_mc.sharded_state_dict(model, pg_collection=groups), path)
    return full_weights_by_key(model, groups)


def _resharding_body(rank, world, tmp):
    # SwiGLU (stride-2 fc1), GQA, untied: TP=2 x DP=2 -> TP=4, TP=1 x DP=4, PP=2 x TP=2.
    saved = _save("llama", 2, 1, os.path.join(tmp, "llama_tp2"))
    for tp, pp in ((4, 1), (1, 1), (2, 2)):
        assert_same_weights(saved, _load("llama", tp, pp, os.path.join(tmp, "llama_tp2")))
    # Mixture of experts: router replicated, each expert split over TP like a dense MLP.
    saved = _save("moe", 2, 1, os.path.join(tmp, "moe_tp2"))
    assert any(".mlp.experts.local_experts.3.linear_fc1." in key for key in saved), sorted(saved)
    for tp, pp in ((1, 1), (2, 2)):
        assert_same_weights(saved, _load("moe", tp, pp, os.path.join(tmp, "moe_tp2")))
    # Tied embeddings: PP=2 x TP=2 (the last stage's copy is not saved) -> PP=1 x TP=1.
    saved = _save("gpt2", 2, 2, os.path.join(tmp, "gpt2_pp2"))
    saved.pop("tied_copy")
    assert_same_weights(dict(saved), _load("gpt2", 1, 1, os.path.join(tmp, "gpt2_pp2")))
    # PP=1 -> PP=2: the last stage's tied copy is filled from the embedding key.
    saved = _save("gpt2", 1, 1, os.path.join(tmp, "gpt2_pp1"))
    assert_same_weights(saved, _load("gpt2", 2, 2, os.path.join(tmp, "gpt2_pp1")))
    _virtual_pipeline_checks(tmp)
    if rank == 0:
        files = sorted(os.listdir(os.path.join(tmp, "gpt2_pp2")))
        assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)] + ["metadata.json"], files
        with open(os.path.join(tmp, "gpt2_pp2", "metadata.json")) as f:
            meta = json.load(f)
        recorded = meta.pop("checksums")
        assert meta == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        assert recorded["algorithm"] == "sha256" and sorted(recorded["files"]) == files[:-1]
        for name, entry in recorded["files"].items():
            with open(os.path.join(tmp, "gpt2_pp2", name), "rb") as f:
                data = f.read()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    return True


def _vp_chunks(groups, seed, layers=4):
    """Chunks of a gated model with 4 layers; PP=2 x VP=2 puts layers 1,3 on stage 0 and 2,4 on stage 1."""
    from tests.model_utils import build_gpt
    from tests.unit_tests.dist_checkpointing.ckpt_utils import tiny_kwargs

    pp_rank, pp = groups.rank_in("pp"), groups.size_of("pp")
    vp = 2 if pp > 1 else 1
    kw = dict(tiny_kwargs("llama"), num_layers=layers, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    return [
        build_gpt(
            kw,
            groups,
            seed=seed + v,
            vp_stage=v if vp > 1 else None,
            pre_process=pp_rank == 0 and v == 0,
            post_process=pp_rank == pp - 1 and v == vp - 1,
        )
        for v in range(vp)
    ]


def _merged(chunks, groups):
    out = {}
    for chunk in chunks:
        out.update(full_weights_by_key(chunk, groups))
    return out


def _virtual_pipeline_checks(tmp):
    path = os.path.join(tmp, "vp")
    groups = groups_for(2, 2)
    chunks = _vp_chunks(groups, 1)
    assert [layer.layer_number for c in chunks for layer in c.decoder.layers] in ([1, 3], [2, 4])
    dcp_mc.save(dcp_mc.model_sharded_state_dict(chunks, pg_collection=groups), path)
    saved = _merged(chunks, groups)
    groups = groups_for(1, 1)
    chunks = _vp_chunks(groups, 2)
    dcp_mc.load(dcp_mc.model_sharded_state_dict(chunks, pg_collection=groups), path)
    assert_same_weights(saved, _merged(chunks, groups))


def test_resharding_across_tp_pp_dp(tmp_path):
    run_distributed(_resharding_body, 4, str(tmp_path))


# ------------------------------------------------------------------ 2 ranks: errors
def _expect_error(match, fn, *args):
    with pytest.raises(CheckpointingError, match=match):
        fn(*args)


def _errors_body(rank, world, tmp):
    import shutil

    path = os.path.join(tmp, "ok")
    _save("gpt2", 2, 1, path)
    groups = groups_for(2, 1)
    from tests.model_utils import build_gpt, gpt2_style

    wider = build_gpt(gpt2_style(hidden_size=64), groups)
    _expect_error(
        r"shape mismatch for key 'embedding.word_embeddings.weight'.*\(128, 32\).*\(128, 64\)",
        dcp_mc.load,
        dcp_mc.sharded_state_dict(wider, pg_collection=groups),
        path,
    )
    # A key only rank 1 asks for: both ranks raise (no hang), rank 1 names the key.
    model = build_stage("gpt2", groups, 3)
    sd = dcp_mc.sharded_state_dict(model, pg_collection=groups)
    if rank == 1:
        sd["extra.weight"] = ShardedTensor.from_global("extra.weight", torch.zeros(2), (2,), (0,))
    _expect_error("extra.weight" if rank == 1 else "rank 1", dcp_mc.load, sd, path)
    _expect_error("checkpoint directory not found", dcp_mc.load, sd, os.path.join(tmp, "nope"))
    dist.barrier()
    if rank == 0:
        for name in ("no_json", "truncated", "bad_meta"):
            shutil.copytree(path, os.path.join(tmp, name))
        os.remove(os.path.join(tmp, "no_json", "metadata.json"))
        data = os.path.join(tmp, "truncated", "__1_0.distcp")
        os.truncate(data, os.path.getsize(data) // 2)
        with open(os.path.join(tmp, "bad_meta", ".metadata"), "wb") as f:
            f.write(b"not a pickle")
    dist.barrier()
    sd = dcp_mc.sharded_state_dict(model, pg_collection=groups)
    _expect_error(r"incomplete.*no_json/metadata.json", dcp_mc.load, sd, os.path.join(tmp, "no_json"))
    _expect_error(r"truncated: .*truncated/__1_0.distcp", dcp_mc.load, sd, os.path.join(tmp, "truncated"))
    _expect_error(
        r"unsafe or corrupt checkpoint metadata .*bad_meta/.metadata", dcp_mc.load, sd, os.path.join(tmp, "bad_meta")
    )
    return True


def test_bad_checkpoints_raise_clear_errors_on_every_rank(tmp_path):
    run_distributed(_errors_body, 2, str(tmp_path))


AGREEMENT_TIMEOUT_S = 3


def _one_rank_raises_before_save(rank, world, tmp):
    """Rank 2 fails before the collective save; ranks 0 and 1 must give up after the group's timeout."""
    import time
    from datetime import timedelta

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=AGREEMENT_TIMEOUT_S))
    dist.barrier(group=group)  # every rank is past group creation; from here on rank 2 only fails
    if rank == 2:
        raise RuntimeError("rank 2 fails before the save")
    state = {"w": ShardedTensor.from_global("w", torch.full((2,), float(rank)), (2 * world,), (2 * rank,))}
    start = time.monotonic()
    with pytest.raises(CheckpointingError, match=r"rank\(s\) \[2\] did not reach it") as raised:
        dcp_mc.save(state, os.path.join(tmp, "ckpt"), process_group=group)
    elapsed = time.monotonic() - start
    # At least the wait for rank 2's key; at most the gather's own timeout (while rank 2's process still lives)
    # plus that wait, with room for a loaded machine (measured: 4.0 s here).
    assert AGREEMENT_TIMEOUT_S <= elapsed < 2 * AGREEMENT_TIMEOUT_S + 10, elapsed
    raise RuntimeError(f"rank {rank} stopped after {elapsed:.1f}s: {raised.value}")


def test_save_agreement_names_a_rank_that_failed_before_it(tmp_path):
    """No rank waits forever: the peers of a failed rank stop within the agreement timeout and name it."""
    with pytest.raises(AssertionError) as failure:  # the harness reports every rank's end
        run_distributed(_one_rank_raises_before_save, 3, str(tmp_path), peer_grace=60)
    report = str(failure.value)
    assert "hung (killed" not in report and "rank 2 fails before the save" in report
    for rank in (0, 1):
        assert f"rank {rank} stopped after" in report and "rank(s) [2] did not reach" in report, report

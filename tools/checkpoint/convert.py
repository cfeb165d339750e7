"""Convert Hugging Face GPT-2 / Llama-family / BERT / T5 directories to and from our torch_dist checkpoints.

    python tools/checkpoint/convert.py --direction hf-to-megatron --hf-dir HF --save CKPT \
        [--target-tensor-parallel-size N] [--target-pipeline-model-parallel-size P] \
        [--make-vocab-size-divisible-by 128]
    python tools/checkpoint/convert.py --direction megatron-to-hf --load CKPT --hf-dir-out HF \
        --model-type gpt2|llama|qwen2|qwen3|qwen3_moe|qwen3_next|mistral|mixtral|deepseek_v3|deepseek_v32|deepseek_v4 \
        |bert|t5|mamba2|nemotron_h [--vocab-size V]

Llama family (``tools/checkpoint/llama_family.py``): LlamaForCausalLM (``llama``), Qwen2ForCausalLM
(``qwen2``: ``--add-qkv-bias``), Qwen3ForCausalLM (``qwen3``: ``--qk-layernorm``), Qwen3MoeForCausalLM
(``qwen3_moe``: ``--qk-layernorm`` and MoE MLPs, ``--num-experts ... --moe-router-topk ...
--moe-ffn-hidden-size ...``, ``--moe-router-pre-softmax`` when ``norm_topk_prob`` is false,
``--moe-layer-freq`` for ``mlp_only_layers``), MistralForCausalLM (``mistral``: a ``sliding_window`` W
shorter than the positions is ``--window-size W-1,0``), MixtralForCausalLM (``mixtral``: that and MoE
MLPs in every layer, experts of ``intermediate_size``), DeepseekV3ForCausalLM (``deepseek_v3``) and
DeepseekV32ForCausalLM (``deepseek_v32``: that and ``--experimental-attention-variant dsa``) and
Qwen3NextForCausalLM (``qwen3_next``: Qwen3-MoE with Gated DeltaNet layers, ``tools/checkpoint/qwen3_next.py``).
DeepseekV4ForCausalLM (``deepseek_v4``: compressed sparse / heavily compressed attention, hyper-connections,
hash-routed and learned MoE; its config fields and refusals in ``tools/checkpoint/deepseek_v4.py``, the weight
names in ``megatron/core/models/gpt/hf_deepseek_v4.py``).

hf-to-megatron writes ``CKPT/release`` (model weights only) and a tracker saying
``release``, and prints the ``pretrain_gpt.py`` flags that build the same model; load it
with ``--load CKPT`` (a release checkpoint starts at iteration 0) or ``--finetune``.

BERT (``architectures`` BertForPreTraining or BertForMaskedLM): the model is
``pretrain_bert.py --bert-post-layernorm``'s (Hugging Face's post-LN layout), with the pooler
and binary head only for BertForPreTraining (BertForMaskedLM: ``--bert-no-binary-head``, token
type 0 folded into the position embeddings, see ``tools/checkpoint/bert.py``); the printed flags
are ``pretrain_bert.py``'s. ``--model-type bert`` exports BertForPreTraining, or BertForMaskedLM
when the checkpoint has no binary head; pre-LN BERT checkpoints are refused.

T5 (``architectures`` T5ForConditionalGeneration, v1.1 only: ``feed_forward_proj`` gated-gelu and
an untied LM head; v1.0 is refused): the model is ``pretrain_t5.py --t5-v11``'s, the printed flags
are ``pretrain_t5.py``'s (give the sequence lengths and ``--vocab-extra-ids`` of the run). ``--model-type
t5`` exports T5ForConditionalGeneration with ``tie_word_embeddings=False`` and its own
``lm_head.weight`` (see ``tools/checkpoint/t5.py``); T5 has no pipeline parallelism.

Hybrid Mamba (``architectures`` Mamba2ForCausalLM or NemotronHForCausalLM, ``--model-type mamba2|nemotron_h``):
the model is ``pretrain_mamba.py``'s and the printed flags are its (see ``tools/checkpoint/mamba.py``).

Vocabulary: our model pads the vocabulary to a multiple of
``--make-vocab-size-divisible-by x TP``. Converting in pads the embedding (and untied
output) rows with zeros for the target TP; the checkpoint then loads under any layout
whose flags give the same padded size. Converting out strips the padded rows to
``--vocab-size`` (default: the HF vocabulary recorded by hf-to-megatron, else for a
checkpoint trained with a BertWordPiece tokenizer the lines of its ``--vocab-file`` (with
``--vocab-extra-ids``: the tokenizer's vocabulary, sentinels included), else
none stripped). The sharded format loads under any TP/PP, so the target sizes only set the
padding and the printed flags; the checkpoint is always written from this one process.

Nothing is unpickled: HF weights are read from safetensors (``pytorch_model.bin`` only
with ``torch.load(weights_only=True)``), our checkpoints are plain JSON plus DCP tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.dist_checkpointing.serialization import read_json, saved_tensor, write_json_atomic
from megatron.core.models.bert import BertModel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.hf_deepseek_v4 import from_hf_deepseek_v4, to_hf_deepseek_v4
from megatron.core.models.gpt.hf_qwen3_next import from_hf_qwen3_next, to_hf_qwen3_next
from megatron.core.models.gpt.hf_state_dict import (
    StateDict,
    from_hf_gpt2,
    from_hf_llama,
    resize_vocab,
    to_hf_gpt2,
    to_hf_llama,
)
from megatron.core.models.T5 import T5Model
from megatron.core.parallel_state import ParallelLayout, ProcessGroupCollection, build_process_groups
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpointing import (
    CHECKPOINT_VERSION,
    COMMON_FILE,
    TORCH_DIST,
    TRACKER_FILE,
    checkpoint_dir,
    detect_format,
    read_tracker,
)
from tools.checkpoint.bert import (
    BINARY_HEAD_KEY,
    LM_HEAD_KEY,
    bert_from_hf,
    bert_to_hf,
    build_bert,
    tokenizer_flags,
    wordpiece_vocab_size,
)
from tools.checkpoint.checks import (
    ReadTracker,
    check_all_read,
    check_hf_tensors,
    check_model_args,
    check_shapes,
    meta_copy,
    shard_paths,
)
from tools.checkpoint.deepseek_v4 import KIND as DEEPSEEK_V4
from tools.checkpoint.deepseek_v4 import read_weights as read_v4_weights
from tools.checkpoint.hf_config import (
    Args,
    ConversionError,
    gpt_model_kwargs,
    hf_config_from_args,
    megatron_args_from_hf,
    megatron_flags,
)
from tools.checkpoint.llama_family import DECODER_FAMILIES
from tools.checkpoint.mamba import (
    FINAL_NORM_KEY,
    MAMBA_KINDS,
    build_mamba,
    in_memory_names,
    mamba_flags,
    mamba_from_hf,
    mamba_hf_config,
    mamba_to_hf,
)
from tools.checkpoint.t5 import (
    CROSS_ATTENTION_KEY,
    build_t5,
    check_t5_args,
    mark_untied,
    t5_flags,
    t5_from_hf,
    t5_hf_config,
    t5_to_hf,
    untie_lm_head,
)

HF_VOCAB_KEY = "hf_vocab_size"  # in common.json: the unpadded vocabulary of a converted model
EMBEDDING_KEY = "embedding.word_embeddings.weight"


@contextlib.contextmanager
def single_process_group() -> Iterator[ProcessGroupCollection]:
    """Groups of a one-rank world: reuse an initialised world of size 1, else make a gloo one (file store)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConversionError(f"the converter runs on one process; this world has {dist.get_world_size()}")
        yield build_process_groups(ParallelLayout(world_size=1))
        return
    with tempfile.TemporaryDirectory(prefix="convert_store_") as tmp:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(tmp, 'store')}",
            rank=0,
            world_size=1,
            timeout=timedelta(minutes=30),
        )
        try:
            yield build_process_groups(ParallelLayout(world_size=1))
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- Hugging Face side
def read_hf_config(hf_dir: str) -> Dict[str, Any]:
    """``hf_dir/config.json`` as a dict (plain JSON, no remote code)."""
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"Hugging Face directory not found: {hf_dir}")
    path = os.path.join(hf_dir, "config.json")
    try:
        return read_json(path, "Hugging Face config")
    except CheckpointingError as e:
        raise ConversionError(str(e)) from None


def read_hf_weights(hf_dir: str) -> StateDict:
    """All tensors of a ``save_pretrained`` directory (single or sharded safetensors, else weights-only .bin)."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        listing = read_json(index, "safetensors index")
        files = shard_paths(hf_dir, listing.get("weight_map") if isinstance(listing, dict) else None, index)
        return {k: v for path in files for k, v in _load_weights_file(load_file, path).items()}
    if os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        return _load_weights_file(load_file, os.path.join(hf_dir, "model.safetensors"))
    if os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
        bin_file = functools.partial(torch.load, map_location="cpu", weights_only=True)
        return _load_weights_file(bin_file, os.path.join(hf_dir, "pytorch_model.bin"))
    raise ConversionError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _load_weights_file(load_file: Any, path: str) -> StateDict:
    """One weights file read by ``load_file``; a missing or corrupt one is a ``ConversionError`` naming it."""
    try:
        sd = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors and torch raise their own error types for a bad file
        raise ConversionError(
            f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    if not isinstance(sd, dict):
        raise ConversionError(f"{path} holds a {type(sd).__name__}, not a dict of tensors")
    return sd


def hf_config_of(args: Args, kind: str, vocab_size: int, where: str) -> Any:
    """The ``transformers`` config of ``kind`` for ``args``; refuses what the class cannot express."""
    if kind in MAMBA_KINDS:
        return mamba_hf_config(args, kind, vocab_size)
    return t5_hf_config(args, vocab_size) if kind == "t5" else hf_config_from_args(args, kind, vocab_size, where)


def write_hf(sd: StateDict, config: Any, kind: str, out_dir: str) -> None:
    """Build the HF model of ``config``, load ``sd`` strictly (buffers aside) and ``save_pretrained``."""
    import transformers

    cls = getattr(transformers, config.architectures[0])
    model = cls(config)
    if kind == "t5":
        untie_lm_head(model)  # else loading lm_head.weight would overwrite shared.weight
    result = model.load_state_dict(sd, strict=False)
    # GPT-2's causal mask, BERT's position / token type ids are (non-learned) buffers; anything else missing is a bug.
    missing = [k for k in result.missing_keys if not k.endswith(_BUFFERS)]
    if missing or result.unexpected_keys:
        raise ConversionError(
            f"state dict does not fit {cls.__name__}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    model.save_pretrained(out_dir)
    if kind == "t5":
        mark_untied(out_dir)


_BUFFERS = (".attn.bias", ".attn.masked_bias", "embeddings.position_ids", "embeddings.token_type_ids")


# ---------------------------------------------------------------- Megatron side
def build_model(args: Args, groups: ProcessGroupCollection, kind: str = "gpt2") -> Union[GPTModel, BertModel, T5Model]:
    """Our TP=1 GPTModel (``kind`` bert: BertModel, t5: T5Model) for ``args`` (weights are overwritten right after)."""
    if kind == "bert":
        return build_bert(args, groups)
    if kind == "t5":
        return build_t5(args, groups)
    if kind in MAMBA_KINDS:
        return build_mamba(args, groups)
    return GPTModel(
        pg_collection=groups, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, **gpt_model_kwargs(args)
    )


def _write_tracker_release(root: str) -> None:
    path = os.path.join(root, TRACKER_FILE)
    with open(path + ".tmp", "w") as f:
        f.write("release")
    os.replace(path + ".tmp", path)


def save_release(
    model: torch.nn.Module, args: Args, groups: ProcessGroupCollection, root: str, hf_vocab_size: int
) -> str:
    """``root/release``: common.json (the model flags), the model's tensors, then the tracker."""
    iter_dir = checkpoint_dir(root, 0, release=True)
    os.makedirs(iter_dir, exist_ok=True)
    common = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "train_state": {},
        "opt_param_scheduler": None,
        "optimizer": None,
        "args": args,
        HF_VOCAB_KEY: hf_vocab_size,
        "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "cp": 1},
        "ckpt_format": TORCH_DIST,
    }
    write_json_atomic(os.path.join(iter_dir, COMMON_FILE), common)
    dc.save(dc.model_sharded_state_dict([model], pg_collection=groups), iter_dir)  # metadata.json last
    _write_tracker_release(root)
    return iter_dir


def find_checkpoint(root: str) -> Tuple[str, Dict[str, Any]]:
    """(iteration directory, common.json) of the latest torch_dist checkpoint under ``root``."""
    if not os.path.isdir(root):
        raise ConversionError(f"checkpoint directory not found: {root}")
    found = read_tracker(root)
    if found is None:
        raise ConversionError(f"{root} is not a Megatron checkpoint directory: no {TRACKER_FILE}")
    iter_dir = checkpoint_dir(root, found[0], release=found[1])
    if detect_format(iter_dir) != TORCH_DIST:
        raise ConversionError(
            f"{iter_dir} is a legacy --ckpt-format torch checkpoint; the converter reads torch_dist checkpoints only"
        )
    common = read_json(os.path.join(iter_dir, COMMON_FILE), "checkpoint common state")
    if not isinstance(common.get("args"), dict):
        raise ConversionError(f"{os.path.join(iter_dir, COMMON_FILE)} has no 'args': not written by this code")
    return iter_dir, common


def load_megatron(
    root: str, groups: ProcessGroupCollection, verify: bool = True, kind: str = "gpt2"
) -> Tuple[StateDict, Args, Dict[str, Any]]:
    """Full (TP=1) state dict, model flags and common.json of the checkpoint under ``root``.

    ``verify``: check every file against the checksums ``metadata.json`` records first. ``kind``
    bert: a BertModel, with the binary head exactly when the checkpoint holds one.
    """
    iter_dir, common = find_checkpoint(root)
    args = dict(common["args"])
    if verify:
        dc.verify_checksums(iter_dir)  # a flipped bit is named before any tensor is read
    metadata = dc.read_metadata(iter_dir)
    saved = metadata.state_dict_metadata
    if EMBEDDING_KEY not in saved:
        raise ConversionError(f"{iter_dir} has no {EMBEDDING_KEY!r}: not a GPT, BERT or T5 checkpoint")
    # The resume path's check (a crafted bytes entry is refused, not read as a tensor); every other key
    # gets it from dc.load below.
    embedding = saved_tensor(metadata, EMBEDDING_KEY, iter_dir)
    args["padded_vocab_size"] = int(embedding.size[0])  # whatever TP it was saved under
    check_model_args(args, os.path.join(iter_dir, COMMON_FILE))
    _check_family(saved, kind, iter_dir)
    if kind == "bert":
        args["bert_binary_head"] = BINARY_HEAD_KEY in saved
    if kind == "t5":
        check_t5_args(args, os.path.join(iter_dir, COMMON_FILE))
    model = build_model(args, groups, kind)
    dc.load(dc.model_sharded_state_dict([model], pg_collection=groups), iter_dir)
    return {k: v.detach() for k, v in _model_tensors(model).items()}, args, common


_FAMILY_KEYS = {"bert": ("a BERT", LM_HEAD_KEY), "t5": ("a T5", CROSS_ATTENTION_KEY)}
_FAMILY_KEYS.update({kind: ("a hybrid Mamba", FINAL_NORM_KEY) for kind in MAMBA_KINDS})


def _check_family(saved: Any, kind: str, iter_dir: str) -> None:
    """Refuse ``--model-type kind`` for a checkpoint of another family (BERT, T5 or GPT), naming both."""
    for family, (name, key) in _FAMILY_KEYS.items():
        if family in MAMBA_KINDS and kind in MAMBA_KINDS:
            family = kind  # either Mamba family reads a MambaModel checkpoint
        if (key in saved) != (kind == family):
            found = name if key in saved else "not " + name
            raise ConversionError(f"{iter_dir} is {found} checkpoint ({key!r}); --model-type is {kind}")


# ---------------------------------------------------------------- the two directions
_FROM_HF = {
    "gpt2": lambda hf_sd, model: from_hf_gpt2(hf_sd, model.config),
    "bert": bert_from_hf,
    "t5": t5_from_hf,
    **{kind: mamba_from_hf for kind in MAMBA_KINDS},
    **{kind: lambda hf_sd, model: from_hf_llama(hf_sd, model.config) for kind in DECODER_FAMILIES},
    "qwen3_next": lambda hf_sd, model: from_hf_qwen3_next(hf_sd, model.config),
    DEEPSEEK_V4: lambda hf_sd, model: from_hf_deepseek_v4(hf_sd, model.config),
}


def hf_to_megatron(
    hf_dir: str, save: str, tp: int = 1, pp: int = 1, divisible_by: int = 128, allow_nonfinite: bool = False
) -> List[str]:
    """Convert ``hf_dir`` into ``save/release``; returns the matching ``pretrain_gpt.py`` (BERT:
    ``pretrain_bert.py``, T5: ``pretrain_t5.py``) flags. Config, dtypes, values, names and shapes are
    checked first (``tools/checkpoint/checks.py``); ``allow_nonfinite`` converts NaN/inf values as they are."""
    where = os.path.join(hf_dir, "config.json")
    hf_config = read_hf_config(hf_dir)
    kind, args = megatron_args_from_hf(hf_config, where, tp, divisible_by)
    if kind == "t5" and pp > 1:
        raise ConversionError(f"--target-pipeline-model-parallel-size {pp}: T5 has no pipeline parallelism")
    if kind == "qwen3_next" and tp > 1:  # the checkpoint is written in the one-rank layout of these rows
        raise ConversionError(
            f"--target-tensor-parallel-size {tp}: Qwen3-Next's Gated DeltaNet rows are stored per TP rank; "
            "convert with 1 (such a checkpoint trains at TP=1 only, not resharded yet)"
        )
    if args["num_layers"] % pp:
        raise ConversionError(
            f"--target-pipeline-model-parallel-size {pp} does not divide the {args['num_layers']} layers of {where}"
        )
    hf_sd = read_v4_weights(hf_dir) if kind == DEEPSEEK_V4 else in_memory_names(read_hf_weights(hf_dir), kind)
    check_hf_tensors(hf_sd, hf_dir, allow_nonfinite)
    with single_process_group() as groups:
        model = build_model(args, groups, kind)
        model.load_state_dict(_mapped_from_hf(hf_sd, model, args, kind, hf_dir), strict=True)
        save_release(model, args, groups, save, hf_config["vocab_size"])
    if kind == "t5":
        return t5_flags(args)
    if kind in MAMBA_KINDS:
        return mamba_flags(args) + (["--pipeline-model-parallel-size", str(pp)] if pp > 1 else [])
    flags = megatron_flags(args) + (["--pipeline-model-parallel-size", str(pp)] if pp > 1 else [])
    return flags + (tokenizer_flags(hf_dir) if kind == "bert" else [])


def _mapped_from_hf(hf_sd: StateDict, model: torch.nn.Module, args: Args, kind: str, hf_dir: str) -> StateDict:
    """Our state dict from the HF tensors, with every tensor's shape checked and every tensor used.

    Expected HF shapes come from the export mapping run on shape-only copies of ``model``'s tensors,
    so the HF names in a message are the file's; what that mapping cannot name (another layout of the
    same weights) is checked by our names after the import mapping.
    """
    ours = _model_tensors(model)
    expected = _to_hf_names(resize_vocab(meta_copy(ours), args["vocab_size"]), args, kind)
    check_shapes(hf_sd, expected, hf_dir, sorted(hf_sd))
    tracker = ReadTracker(hf_sd)
    try:
        sd = resize_vocab(_FROM_HF[kind](tracker, model), args["padded_vocab_size"])
    except KeyError as e:  # name it as the file would (the mapping may have stripped a prefix)
        absent = [n for n in expected if n not in hf_sd and n.endswith(str(e.args[0]))] or [e.args[0]]
        raise ConversionError(f"{hf_dir}: weight {absent[0]!r} is missing") from None
    except ConversionError:
        raise
    except (RuntimeError, ValueError) as e:  # a reshape or a layer layout the config does not allow
        raise ConversionError(f"{hf_dir}: the weights do not fit config.json: {e}") from None
    check_all_read(tracker, hf_dir, _BUFFERS)
    if not args["untie_embeddings_and_output_weights"]:
        sd.pop("output_layer.weight", None)  # tied: our output layer reads the embedding
    check_shapes(sd, ours, f"{hf_dir} (converted)", sorted(sd))
    return sd


def _model_tensors(model: torch.nn.Module) -> StateDict:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def megatron_to_hf(load: str, out_dir: str, kind: str, vocab_size: Optional[int] = None, verify: bool = True) -> int:
    """Write ``out_dir`` (config.json + model.safetensors) from the checkpoint under ``load``; returns the vocab."""
    with single_process_group() as groups:
        sd, args, common = load_megatron(load, groups, verify, kind)
    vocab = vocab_size or common.get(HF_VOCAB_KEY) or wordpiece_vocab_size(args) or args["padded_vocab_size"]
    if vocab > args["padded_vocab_size"]:
        raise ConversionError(f"--vocab-size {vocab} exceeds the checkpoint's {args['padded_vocab_size']} rows")
    sd = resize_vocab(sd, vocab)
    config = hf_config_of(args, kind, vocab, os.path.join(load, COMMON_FILE))  # refusals before any name
    write_hf(_to_hf_names(sd, args, kind), config, kind, out_dir)
    return vocab


def _to_hf_names(sd: StateDict, args: Args, kind: str) -> StateDict:
    """Hugging Face names of our full state dict (vocabulary already stripped)."""
    if kind == "t5":
        return t5_to_hf(sd, args)
    if kind in MAMBA_KINDS:
        return mamba_to_hf(sd, args, kind)
    config = gpt_model_kwargs(args)
    if kind == "qwen3_next":  # the layer pattern and norm convention: the whole config
        own = ("position_embedding_type", "rotary_base", "rotary_percent", "share_embeddings_and_output_weights")
        fields = {k: v for k, v in config.items() if k not in own + ("vocab_size", "max_sequence_length")}
        return to_hf_qwen3_next(sd, TransformerConfig(**fields))
    model_config = _ConfigView(
        num_layers=config["num_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config["num_query_groups"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["ffn_hidden_size"],
        kv_channels=config["kv_channels"] or config["hidden_size"] // config["num_attention_heads"],
        num_moe_experts=config.get("num_moe_experts"),
        multi_latent_attention=bool(config.get("multi_latent_attention")),
    )
    if kind == DEEPSEEK_V4:
        return to_hf_deepseek_v4(sd, model_config)
    if kind == "bert":
        return bert_to_hf(sd, model_config, args["bert_binary_head"])
    return (to_hf_gpt2 if kind == "gpt2" else to_hf_llama)(sd, model_config)


class _ConfigView:
    """The few TransformerConfig fields the name mappings read (no full config needed to export)."""

    def __init__(self, **fields: int) -> None:
        self.__dict__.update(fields)


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--direction", required=True, choices=["hf-to-megatron", "megatron-to-hf"])
    p.add_argument(
        "--hf-dir",
        help="hf-to-megatron: a save_pretrained directory (GPT-2, Llama/Mistral, Qwen2/Qwen3/Qwen3-MoE, "
        "DeepSeek-V3/V4, BERT, T5 v1.1, Mamba2, Nemotron-H)",
    )
    p.add_argument("--save", help="hf-to-megatron: checkpoint root to write (release/ and the tracker)")
    p.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        default=1,
        help="TP the vocabulary is padded for (the checkpoint loads under any layout of that padding)",
    )
    p.add_argument(
        "--target-pipeline-model-parallel-size",
        type=int,
        default=1,
        help="checked against the layer count and printed with the flags",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="hf-to-megatron: convert NaN or infinite weights as they are (refused by default)",
    )
    p.add_argument("--load", help="megatron-to-hf: checkpoint root (its tracker picks the iteration)")
    p.add_argument("--hf-dir-out", help="megatron-to-hf: directory to save_pretrained into")
    families = ["gpt2", *DECODER_FAMILIES, DEEPSEEK_V4, "bert", "t5", *MAMBA_KINDS]
    p.add_argument("--model-type", choices=families, help="megatron-to-hf: the HF family to write")
    p.add_argument("--vocab-size", type=int, help="megatron-to-hf: rows to keep (strips the vocabulary padding)")
    p.add_argument(
        "--no-verify-checkpoint",
        action="store_true",
        help="megatron-to-hf: skip checking the files against metadata.json's checksums",
    )
    return p


def _script_of(flags: Sequence[str]) -> str:
    """The training script the printed flags are for."""
    if "--t5-v11" in flags:
        return "pretrain_t5.py"
    if "--hybrid-override-pattern" in flags:
        return "pretrain_mamba.py"
    return "pretrain_bert.py" if "--bert-post-layernorm" in flags else "pretrain_gpt.py"


def _required(args: argparse.Namespace, names: Sequence[str]) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        raise ConversionError(f"--direction {args.direction} needs {', '.join(missing)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-megatron":
            _required(args, ["hf_dir", "save"])
            flags = hf_to_megatron(
                args.hf_dir,
                args.save,
                args.target_tensor_parallel_size,
                args.target_pipeline_model_parallel_size,
                args.make_vocab_size_divisible_by,
                args.allow_nonfinite,
            )
            script = _script_of(flags)
            print(f"wrote {checkpoint_dir(args.save, 0, release=True)}; train or evaluate with {script}:")
            print("  --load " + args.save + " --finetune " + " ".join(flags))
        else:
            _required(args, ["load", "hf_dir_out", "model_type"])
            vocab = megatron_to_hf(
                args.load, args.hf_dir_out, args.model_type, args.vocab_size, verify=not args.no_verify_checkpoint
            )
            written = read_hf_config(args.hf_dir_out)["architectures"][0]
            print(f"wrote {args.hf_dir_out} ({written}, vocabulary {vocab})")
    except (ConversionError, CheckpointingError) as e:
        # The core names its setting; this tool's flag for it is --no-verify-checkpoint.
        print(f"error: {str(e).replace('verify_checkpoint=False', '--no-verify-checkpoint')}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dump megatron-core's masked WordPiece dataset samples (BERT or T5) to .npz files (the oracle).

Shared by ``mcore_bert_samples.py`` and ``mcore_t5_samples.py``, which run it as a script from
this folder with ``PYTHONPATH`` pointing at a ``pip install --no-deps --target DIR
megatron-core==0.16.1`` (never in a process that imports our ``megatron`` package: both are
named ``megatron``).

``cases.json`` is a list of cases (one process builds them all); each holds ``out`` (the .npz to
write), ``prefix`` (the .bin/.idx path prefix), ``tokenizer`` (``inv_vocab``: the token strings in
id order, the ``cls``/``sep``/``mask``/``pad``/``eos`` ids, and for T5 ``bos`` and ``sentinels``),
``config`` (the dataset config fields other than blend and tokenizer), ``sizes`` (train, valid,
test samples) and ``global_seed`` (NumPy's global seed, set before each split is read, since
masking_do_permutation draws from the global RandomState). For each built split the .npz holds
``{split}_sample_index`` and ``{split}_{field}`` stacked over all samples.
"""

import json
import os
import sys
import tempfile

import numpy
import torch
from bare_import import import_bare


class SpecTokenizer:
    """Only what the masked datasets read from a tokenizer, from the spec."""

    def __init__(self, spec):
        self.inv_vocab = dict(enumerate(spec["inv_vocab"]))
        self.vocab = {t: i for i, t in self.inv_vocab.items()}
        self.vocab_size = len(self.inv_vocab)
        self.cls, self.sep, self.mask = spec["cls"], spec["sep"], spec["mask"]
        self.pad, self.eos = spec["pad"], spec["eos"]
        if "bos" in spec:
            self.bos = spec["bos"]
        self.additional_special_tokens_ids = list(spec.get("sentinels", []))
        # megatron-core puts the tokenizer's identifiers into the cache description.
        self.unique_identifiers = {"class": "SpecTokenizer", "vocab_size": self.vocab_size}


def init_single_process_group():
    """megatron-core asks torch.distributed for the rank while building indices."""
    if not torch.distributed.is_initialized():
        store = tempfile.mktemp(prefix="mcore_oracle_store_")
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def dump_case(spec, dataset_class, config_class, fields):
    """Build one case's datasets and write all their samples' ``fields`` to ``spec["out"]``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    config = config_class(blend=([spec["prefix"]], None), tokenizer=SpecTokenizer(spec["tokenizer"]), **spec["config"])
    datasets = BlendedMegatronDatasetBuilder(dataset_class, spec["sizes"], lambda: True, config).build()
    arrays = {}
    for name, dataset in zip(("train", "valid", "test"), datasets):
        if dataset is None:
            continue
        numpy.random.seed(spec["global_seed"])
        samples = [dataset[i] for i in range(len(dataset))]
        arrays[f"{name}_sample_index"] = numpy.asarray(dataset.sample_index)
        for field in fields:
            arrays[f"{name}_{field}"] = numpy.array([s[field] for s in samples])
    numpy.savez(spec["out"], **arrays)


def check_is_megatron_core():
    """Refuse to run on megatron-open's package (also named ``megatron``) by mistake."""
    from megatron.core.datasets import masked_dataset

    folder = os.path.dirname(masked_dataset.__file__)
    if not os.path.isfile(os.path.join(folder, "helpers.cpp")):
        sys.exit(f"{folder} is not megatron-core's datasets package: point PYTHONPATH at a megatron-core install")


def run(argv, load_classes, fields):
    """The scripts' main: ``load_classes()`` gives (dataset class, config class) once checked."""
    if len(argv) != 2:
        sys.exit(f"usage: {os.path.basename(argv[0])} CASES.json")
    import_bare("megatron.core.datasets")  # the datasets without megatron-core's package __init__
    check_is_megatron_core()
    dataset_class, config_class = load_classes()
    with open(argv[1]) as f:
        cases = json.load(f)
    init_single_process_group()
    for spec in cases:
        dump_case(spec, dataset_class, config_class, fields)
    torch.distributed.destroy_process_group()

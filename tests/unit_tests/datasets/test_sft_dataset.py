"""SFT data: loss masks against Hugging Face's own assistant mask, packing, splitting, bad lines.

Reference for the loss mask: ``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)``
on the same ChatML template written with ``{% generation %}`` markers around the assistant turns, a
mechanism independent of ours (we render message prefixes and map characters to tokens). The
built-in ``chatml`` format (piecewise tokenization) must give the same ids and mask.
"""

import json

import numpy as np
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.sft_dataset import SFTDataset, SFTDatasetConfig, pack_rows, packed_batch
from megatron.core.datasets.sft_format import conversation_messages, format_conversation
from megatron.core.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.core.tokenizers.training import train_tokenizer
from tests.tokenizer_files import corpus_texts

SEQ = 128
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue, the sky's."},
            {"role": "user", "content": "And another?"},
            {"role": "assistant", "content": "Green: the grass."},
        ]
    },
    {"system": "Answer in French.", "prompt": "Hello there", "response": "Bonjour."},
    {"prompt": "Count to five, please, slowly and with care.", "response": "One, two, three, four, five."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat_tok")
    train_tokenizer("huggingface-chat", corpus_texts(40_000), 400, str(out))
    return HuggingFaceTokenizer(str(out))


@pytest.mark.parametrize("prompt_format", ["chat_template", "chatml"])
def test_loss_mask_equals_transformers_assistant_mask(tokenizer, prompt_format):
    hf = tokenizer._tokenizer
    for record in CONVERSATIONS:
        messages = conversation_messages(record)
        ids, trained = format_conversation(tokenizer, messages, prompt_format)
        ref = hf.apply_chat_template(
            messages,
            chat_template=GENERATION_TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert ids == list(ref["input_ids"])
        assert trained == [bool(x) for x in ref["assistant_masks"]]
        assert any(trained) and not all(trained)


def _write(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def _config(tokenizer, path, **kw):
    kw = {"random_seed": 1, "sequence_length": SEQ, "split": "75,25,0", **kw}
    return SFTDatasetConfig(tokenizer=tokenizer, blend=([path], None), **kw)


def test_malformed_lines_are_counted_and_named(tokenizer, tmp_path):
    good = [json.dumps(c) for c in CONVERSATIONS]
    bad = ["{not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]}), json.dumps({"text": "x"})]
    path = _write(tmp_path / "chat.jsonl", good[:2] + bad + good[2:])
    with pytest.warns(
        UserWarning, match=r"3 malformed lines skipped \(line 3: .*line 4: no assistant.*line 5: neither"
    ):
        low = SFTDataset.build_low_level_dataset(path, _config(tokenizer, path))
    assert len(low) == 4 and [n for n, _ in low.malformed] == [3, 4, 5]


def _expected_rows(tokenizer, records, seq_length=SEQ):
    """Each record's ids and mask, cut to ``seq_length + 1`` tokens (the stated truncation)."""
    out = [format_conversation(tokenizer, conversation_messages(r), "chat_template") for r in records]
    return [(ids[: seq_length + 1], trained[: seq_length + 1]) for ids, trained in out]


@pytest.mark.parametrize("pack,multiple", [(True, 1), (True, 4), (False, 1)])
def test_rows_hold_each_conversation_with_its_mask(tokenizer, tmp_path, pack, multiple):
    records = CONVERSATIONS * 3
    path = _write(tmp_path / "chat.jsonl", [json.dumps(r) for r in records])
    config = _config(tokenizer, path, sft_pack_sequences=pack, sft_pad_to_multiple_of=multiple, split="1,0,0")
    (train, _, _) = BlendedMegatronDatasetBuilder(SFTDataset, [None, None, None], lambda: True, config).build()
    expected = _expected_rows(tokenizer, records)
    seen = []
    for row in range(len(train)):
        sample = train[row]
        cu = torch.unique_consecutive(sample["cu_seqlens"]).tolist()
        assert cu[0] == 0 and cu[-1] == SEQ and all(b % multiple == 0 for b in cu)
        for conv, start in zip(train.rows[row], cu):
            ids, trained = expected[conv]
            n = len(ids) - 1
            assert sample["tokens"][start : start + n].tolist() == ids[:-1]
            assert sample["labels"][start : start + n].tolist() == ids[1:]
            assert sample["loss_mask"][start : start + n].tolist() == [float(t) for t in trained[1:]]
            assert sample["position_ids"][start : start + n].tolist() == list(range(n))
            seen.append(conv)
        assert sample["loss_mask"].sum() == sum(sum(expected[c][1][1:]) for c in train.rows[row])
    assert sorted(seen) == list(range(len(records)))  # one epoch: every conversation once
    assert (len(train) < len(records)) == pack


def test_truncation_and_split(tokenizer, tmp_path):
    long = {"prompt": "Say it.", "response": " ".join(["word"] * 200)}
    path = _write(tmp_path / "chat.jsonl", [json.dumps(long)] + [json.dumps(c) for c in CONVERSATIONS * 2])
    config = _config(tokenizer, path, split="75,25,0")
    train, valid, _ = BlendedMegatronDatasetBuilder(SFTDataset, [None, None, None], lambda: True, config).build()
    assert train.truncated == 1 and valid.truncated == 0
    assert set(train.indices.tolist()).isdisjoint(valid.indices.tolist())  # held out conversations
    first = train.rows.index(next(r for r in train.rows if 0 in r))
    assert train[first]["cu_seqlens"].tolist()[:2] == [0, SEQ]  # the long one fills its row


def test_packed_batch_and_pack_rows():
    assert pack_rows([5, 3, 7, 8], 10, True, 1) == [[0, 1], [2], [3]]
    assert pack_rows([5, 3, 7], 12, True, 4) == [[0, 1], [2]]  # 8 + 4, then 8
    assert pack_rows([5, 3], 10, False, 1) == [[0], [1]]
    cu = torch.tensor([[0, 3, 8, 8, 8, 8, 8, 8, 8], [0, 8, 8, 8, 8, 8, 8, 8, 8]], dtype=torch.int32)
    batch = {"tokens": torch.arange(16).view(2, 8), "cu_seqlens": cu}
    flat, params = packed_batch(batch)
    assert flat["tokens"].shape == (1, 16) and params.cu_seqlens_q.tolist() == [0, 3, 8, 16]
    assert params.max_seqlen_q == 8 and np.array_equal(flat["tokens"][0].numpy(), np.arange(16))


def test_rows_are_cached_and_keyed_by_the_file_content(tokenizer, tmp_path):
    lines = [json.dumps(c) for c in CONVERSATIONS * 2]
    path = _write(tmp_path / "chat.jsonl", lines)

    def build():
        config = _config(tokenizer, path, split="1,0,0")
        return BlendedMegatronDatasetBuilder(SFTDataset, [None, None, None], lambda: True, config).build()[0]

    def cached():
        return sorted((tmp_path / "cache" / "SFTDataset_indices").glob("*-row_offsets.npy"))

    first = build()
    assert len(cached()) == 1
    assert build().rows == first.rows and len(cached()) == 1  # read back, not rebuilt under another key
    _write(tmp_path / "chat.jsonl", lines[::-1])  # same conversations, another order: another file
    build()
    assert len(cached()) == 2

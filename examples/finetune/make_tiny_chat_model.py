"""Make a tiny Llama-style chat model and a generated chat data set locally (nothing is downloaded).

    python examples/finetune/make_tiny_chat_model.py --out DIR [--conversations 600]

Writes ``DIR/hf`` (a random ``LlamaForCausalLM`` with grouped-query attention and a byte-level BPE
tokenizer trained on the standard library's docstrings, with ChatML's special tokens and chat
template) and ``DIR/chat.jsonl``: arithmetic conversations (``messages``, some with a system turn and
several exchanges, so their lengths are skewed), the data set fine-tuning learns.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.tokenizers.training import train_tokenizer  # noqa: E402
from tools.make_sample_corpus import corpus_texts  # noqa: E402

NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def conversation(rng: random.Random) -> dict:
    """One to four questions about small sums, answered in words and digits."""
    messages = [{"role": "system", "content": "You add numbers."}] if rng.random() < 0.3 else []
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        a, b = rng.randint(0, 5), rng.randint(0, 5)
        messages.append({"role": "user", "content": f"What is {a} plus {b}?"})
        messages.append({"role": "assistant", "content": f"{a} plus {b} is {NUMBER_WORDS[a + b]} ({a + b})."})
    return {"messages": messages}


def write_chat_set(path: str, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(conversation(rng)) + "\n")


def write_model(out: str, vocab_size: int) -> None:
    import torch
    import transformers

    trained = train_tokenizer("huggingface-chat", corpus_texts(30_000), vocab_size, out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(trained.kwargs["tokenizer_model"], local_files_only=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for hf/ and chat.jsonl")
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_model(os.path.join(args.out, "hf"), args.vocab_size)
    write_chat_set(os.path.join(args.out, "chat.jsonl"), args.conversations)
    print(f"wrote {args.out}/hf (tiny Llama + chat tokenizer) and {args.out}/chat.jsonl")


if __name__ == "__main__":
    main()

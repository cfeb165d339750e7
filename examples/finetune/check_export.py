"""Check a Hugging Face export against the checkpoint it came from, and give it the tokenizer.

    python examples/finetune/check_export.py --load CKPT --hf-dir HF_OUT --tokenizer HF_IN --data chat.jsonl

Our model (loaded from ``--load``, TP=1) and ``transformers``' model loaded from ``--hf-dir`` run the
first conversations of ``--data``, formatted with the tokenizer's chat template; the largest
|logit difference| over the real vocabulary must be at most ``--max-abs`` (1e-4). The tokenizer of
``--tokenizer`` is saved into ``--hf-dir`` so the export is a complete chat model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron.core.datasets.sft_format import conversation_messages, format_conversation  # noqa: E402
from tools.checkpoint import convert  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-abs", type=float, default=1e-4)
    args = parser.parse_args()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    tokenizer.save_pretrained(args.hf_dir)
    with open(args.data, encoding="utf-8") as f:
        records = [json.loads(line) for line, _ in zip(f, range(args.conversations))]
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf_dir, local_files_only=True).eval()
    diffs = []
    with convert.single_process_group() as groups:
        sd, model_args, _ = convert.load_megatron(args.load, groups)
        ours = convert.build_model(model_args, groups, "llama").eval()
        ours.load_state_dict(sd, strict=False)
        for record in records:
            ids, _ = format_conversation(tokenizer, conversation_messages(record), "chat_template")
            tokens = torch.tensor([ids])
            with torch.no_grad():
                mine = ours(tokens, runtime_gather_output=True)[..., : hf.config.vocab_size]  # [1, s, vocab]
                theirs = hf(tokens).logits
            diffs.append((mine - theirs).abs().max().item())
    worst = max(diffs)
    ok = all(d <= args.max_abs for d in diffs)  # a NaN fails
    verdict = "OK" if ok else "FAILED"
    print(
        f"export check {verdict}: max |logits ours - HF| = {worst:.3g} over {len(records)} conversations "
        f"(limit {args.max_abs})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

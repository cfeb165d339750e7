"""What the server's answers must equal, computed in-process from the same checkpoint (one rank).

``python -m torch.distributed.run --nproc-per-node 1 text_generation_reference.py <server flags>``
with ``REFERENCE_IN`` (JSON: ``greedy`` [{prompt, tokens, seed}], ``loss_texts`` [str], ``mc_jsonl`` path) and
``REFERENCE_OUT`` (where the JSON answer goes) in the environment. It writes:

- ``greedy``: the engine's greedy continuation (text after the prompt) of each prompt;
- ``sampled``: its continuation sampled at temperature 1 with each prompt's ``seed``;
- ``losses``: the model's own mean per-token loss (``GPTModel(..., labels=...)``) on each text, not the engine's;
- ``mc_scores``: per item of the multiple-choice JSONL, the sum of the engine's log probs of each
  `` <choice>`` after the question, tokenized as lm-eval does (whole text encoded, context length split).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from megatron.core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron.core.tensor_parallel.random import use_rng_tracker  # noqa: E402
from megatron.training.initialize import shutdown_distributed  # noqa: E402
from pretrain_gpt import model_provider  # noqa: E402
from tools.text_generation.model_loading import ServedModel, build_engine, load_served_model  # noqa: E402


def model_loss(served: ServedModel, text: str) -> float:
    ids = served.tokenizer.tokenize(text)
    tokens = torch.tensor([ids[:-1]])
    labels = torch.tensor([ids[1:]])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    losses = served.chunks[0](tokens, positions, None, labels=labels)  # [1, s] per-token losses
    return float(losses.float().mean())


def continuation(engine: Any, served: ServedModel, prompt: str, tokens: int, **sampling: Any) -> str:
    """The engine's continuation of ``prompt`` (text after it) with the server's stop token."""
    params = SamplingParams(num_tokens_to_generate=tokens, stop_token_ids=[served.tokenizer.eod], **sampling)
    (result,) = engine.generate([served.tokenizer.tokenize(prompt)], params)
    generated = [t for t in result.generated_tokens if t != served.tokenizer.eod]
    return served.tokenizer.detokenize(list(result.prompt_tokens) + generated)[len(prompt) :]


def choice_scores(engine: Any, served: ServedModel, question: str, choices: List[str]) -> List[float]:
    tok = served.tokenizer
    scores = []
    for choice in choices:
        whole = tok.tokenize(question + " " + choice)
        ctxlen = len(tok.tokenize(question))
        (result,) = engine.generate(
            [whole], SamplingParams(temperature=0.0, num_tokens_to_generate=1, return_log_probs=True)
        )
        scores.append(sum(result.prompt_log_probs[ctxlen - 1 :]))
    return scores


def main() -> None:
    with open(os.environ["REFERENCE_IN"]) as f:
        wanted: Dict[str, Any] = json.load(f)
    served = load_served_model(model_provider, sys.argv[1:])
    engine = build_engine(served)
    with use_rng_tracker(served.run.rng_tracker), torch.no_grad():
        out = {
            "greedy": [
                continuation(engine, served, g["prompt"], g["tokens"], temperature=0.0) for g in wanted["greedy"]
            ],
            "sampled": [
                continuation(engine, served, g["prompt"], g["tokens"], temperature=1.0, seed=g["seed"])
                for g in wanted["greedy"]
            ],
            "losses": [model_loss(served, text) for text in wanted["loss_texts"]],
        }
        with open(wanted["mc_jsonl"]) as f:
            docs = [json.loads(line) for line in f if line.strip()]
        out["mc_scores"] = [choice_scores(engine, served, d["question"], d["choices"]) for d in docs]
        out["mc_answers"] = [d["answer"] for d in docs]
    with open(os.environ["REFERENCE_OUT"], "w") as f:
        json.dump(out, f)
    shutdown_distributed()


if __name__ == "__main__":
    main()

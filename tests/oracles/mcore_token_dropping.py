"""Megatron-core's ``apply_router_token_dropping`` on the cases of a saved file (run with
``PYTHONPATH=$MCORE_ORACLE``): ``python mcore_token_dropping.py cases.pt out.pt``; each case holds
``probs``, ``routing_map``, ``topk``, ``factor``, ``policy``, ``pad``; out: a list of (probs, map)."""

import sys

import torch
from bare_import import import_bare

apply_router_token_dropping = import_bare("megatron.core.transformer.moe.moe_utils").apply_router_token_dropping


def main(cases_path: str, out_path: str) -> None:
    results = []
    for case in torch.load(cases_path):
        results.append(
            apply_router_token_dropping(
                case["probs"],
                case["routing_map"],
                router_topk=case["topk"],
                capacity_factor=case["factor"],
                drop_policy=case["policy"],
                pad_to_capacity=case["pad"],
            )
        )
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

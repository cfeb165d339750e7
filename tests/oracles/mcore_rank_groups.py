"""Print megatron-core 0.16.1's rank groups of the dense and expert grids (the rank-grid oracle).

Usage: ``python tests/oracles/mcore_rank_groups.py CASES.json`` with ``PYTHONPATH`` pointing at a
``pip install --no-deps --target DIR megatron-core==0.16.1`` (never together with our ``megatron``).
Each case holds ``world``, ``tp``, ``cp``, ``pp``, ``ep``, ``etp`` and ``order``. The generators are
built as upstream's ``initialize_model_parallel`` builds them: the dense one with ``ep=1`` and
``dp = world / (tp*cp*pp)``, the expert one with ``tp=etp``, ``cp=1`` and
``dp = world / (etp*ep*pp)``. Prints one JSON list: per case, token -> rank lists.
"""

import json
import sys

from bare_import import import_bare

RankGenerator = import_bare("megatron.core.parallel_state").RankGenerator

DENSE_TOKENS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "tp-dp-cp")
EXPERT_TOKENS = ("ep", "tp", "tp-ep", "tp-ep-pp", "dp", "pp")


def groups_of(case):
    world, tp, cp, pp, ep, etp = (case[k] for k in ("world", "tp", "cp", "pp", "ep", "etp"))
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order=case["order"])
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=case["order"])
    out = {f"dense:{t}": dense.get_ranks(t) for t in DENSE_TOKENS}
    out.update({f"expert:{t}": expert.get_ranks(t) for t in EXPERT_TOKENS})
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print(json.dumps([groups_of(c) for c in cases]))

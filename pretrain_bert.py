"""Pretrain a BERT model: not implemented yet.

The flags parse (so a Megatron launch script fails here with this message, not with
"unrecognized arguments"), then the run stops with a non-zero exit.
"""

import sys

from megatron.training.arguments import parse_args

if __name__ == "__main__":
    parse_args(entry_point="bert")
    sys.exit("pretrain_bert.py: BERT pretraining is not implemented yet (only pretrain_gpt.py trains)")

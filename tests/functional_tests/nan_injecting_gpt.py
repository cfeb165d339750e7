"""pretrain_gpt.py with a forward step that poisons the loss at one iteration (for the NaN test).

Usage: python nan_injecting_gpt.py <poisoned iteration> <Megatron flags...>
A user's own entry point can wrap the forward step the same way; nothing in the library
knows about the injection.
"""

import sys

import pretrain_gpt
from megatron.core.transformer.enums import ModelType
from megatron.training.training import pretrain


def main() -> None:
    poisoned, calls = int(sys.argv.pop(1)), {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        calls["n"] += 1
        if calls["n"] == poisoned:  # one micro batch per iteration in the test
            output = output * float("nan")
        return output, loss_func

    pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )


if __name__ == "__main__":
    main()

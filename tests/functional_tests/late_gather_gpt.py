"""pretrain_gpt.py whose parameter all-gathers land only when waited for (``tests/late_gather.py``).

Usage: torchrun ... late_gather_gpt.py <Megatron flags...>. With --overlap-param-gather, a forward
that reads a parameter before waiting for its bucket trains on the previous step's weights.
"""

import pretrain_gpt
from megatron.core.transformer.enums import ModelType
from megatron.training.training import pretrain
from tests.late_gather import late_parameter_gathers

if __name__ == "__main__":
    with late_parameter_gathers():
        pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
        )

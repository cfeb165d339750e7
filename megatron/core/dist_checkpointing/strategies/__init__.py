"""Megatron-core's checkpoint-strategy package path; one format (torch.distributed.checkpoint) is written here."""

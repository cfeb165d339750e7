"""Scripts run in a separate process against an installed megatron-core, to compare with ours."""

"""Why a no-op flag changes nothing here: the text its ``--help`` shows after "no effect here"."""

KERNEL = "picks a GPU kernel, fusion or RNG implementation; the computed values are the same"
OVERLAP = "a GPU communication-overlap or scheduling choice; the computed values are the same"
COMMUNICATORS = "configures NCCL communicators, buffers or backends; the computed values are the same"
CUDA_GRAPHS = "CUDA graph capture; the computed values are the same"
MEMORY = "where activations or caches live on a GPU; the computed values are the same"
INFERENCE = "an inference-time option; training is unchanged"
DEPRECATED = "Megatron ignores it too (Megatron-Core models are the only ones)"
UNDER_REFUSED = "only takes effect together with a flag that is not supported yet here (see that flag's help)"
CHECKPOINT_IO = (
    "how checkpoint or index files are written or read (parallelism, async, caching); the values are the same"
)
DIAGNOSTICS = "a profiling, diagnostic or logging extra this project does not produce; training is unchanged"
HOUSEKEEPING = "process housekeeping (garbage collection, timeouts, spare process groups); the values are the same"

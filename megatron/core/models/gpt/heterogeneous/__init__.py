"""Layer specs of heterogeneous GPT models (``get_gpt_heterogeneous_layer_spec``)."""

"""Megatron's text-generation server, in parts.

- ``validation``: JSON bodies of ``PUT /api`` and ``POST /v1/completions`` checked and turned into
  a :class:`~tools.text_generation.validation.GenerationRequest` (token ids + sampling settings).
- ``responses``: generation results turned back into text, stop-string cuts, log probs and offsets.
- ``service``: one request end to end (parse, generate, answer), with the generate step injected.
- ``app``: the Flask app on rank 0 and its threaded HTTP server (many connections, one generation at a time).
- ``errors``: a failure on any rank turned into one HTTP status (400 / 503 / 500).
- ``ranks``: the command broadcast between rank 0 and the follower ranks, and clean shutdown.
- ``model_loading``: model, checkpoint, tokenizer and engine from Megatron's flags.
"""

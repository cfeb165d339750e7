"""ChatML, the built-in chat format: its special tokens and the same format as a Jinja chat template.

It lives with the tokenizers (a trained chat tokenizer ships the template) so that the SFT dataset's
formatting (``megatron.core.datasets.sft_format``) and tokenizer training read one copy.
"""

CHATML_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

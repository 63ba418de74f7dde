"""The served model's own prompt tokens (issue 22): its tokenizer.json and chat template, so the
router counts a prompt exactly as the engine will instead of estimating it from characters.

    template   the chat template rendered as Hugging Face and vLLM render it (jinja2)
    tokenizer  one model's tokenizer: a request body's prompt token ids, per endpoint
    loaded     the per-model tokenizers of the settings, read once per directory
    counting   the request parse that uses them (large prompts tokenized off the event loop)
"""

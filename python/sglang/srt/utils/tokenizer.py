"""Tokenizer loading (Hugging Face tokenizers through transformers)."""

from __future__ import annotations

import os
from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@lru_cache(maxsize=4)
def get_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory.

    chat_template: a Jinja file path or an inline template overriding the tokenizer's own.
    Raises ValueError when the directory has no tokenizer.
    """
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    if chat_template:
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                chat_template = f.read()
        tok.chat_template = chat_template
    return tok

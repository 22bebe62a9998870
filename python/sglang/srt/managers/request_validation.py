"""Checks a request must pass before it reaches the scheduler; each raises ValueError with a
message that names the offending parameter (the HTTP layer turns it into a 400)."""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.sampling.sampling_params import SamplingParams


def build_sampling_params(raw: dict | None, tokenizer, model_config: ModelConfig) -> SamplingParams:
    """Parse, verify and normalize user sampling params (upstream defaults)."""
    if raw is not None and not isinstance(raw, dict):
        raise ValueError("'sampling_params' must be a JSON object")
    raw = {k: v for k, v in (raw or {}).items() if not (k == "max_new_tokens" and v is None)}
    sp = SamplingParams.from_dict(raw)
    sp.verify(model_config.vocab_size)
    sp.normalize(tokenizer)
    return sp


class ContextLengthError(ValueError):
    """A request that cannot fit the context (or the KV cache). param: the request field to
    blame ("prompt" for the input, "max_new_tokens" for the output budget); OpenAI's error
    code for it is context_length_exceeded."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_length(
    prompt_len: int, sp: SamplingParams, context_len: int, max_total_tokens: int | None
) -> None:
    """Refuse prompts that cannot fit: upstream's 'longer than the model's context length'.
    Raises ContextLengthError."""
    if prompt_len >= context_len:
        raise ContextLengthError(
            f"The input ({prompt_len} tokens) does not fit the model's context length "
            f"({context_len} tokens): at least one token must remain for the output.",
            "prompt",
        )
    if prompt_len + sp.max_new_tokens > context_len:
        raise ContextLengthError(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens: {prompt_len} prompt tokens + max_new_tokens {sp.max_new_tokens}.",
            "max_new_tokens",
        )
    if max_total_tokens is not None and prompt_len >= max_total_tokens:
        raise ContextLengthError(
            f"The input ({prompt_len} tokens) does not fit in the KV cache of this server "
            f"({max_total_tokens} tokens).",
            "prompt",
        )

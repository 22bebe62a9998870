"""Checks a request must pass before it reaches the scheduler; each raises ValueError with a
message that names the offending parameter (the HTTP layer turns it into a 400)."""

from __future__ import annotations

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.sampling.sampling_params import SamplingParams, json_text

# Most top logprobs a request may ask for per token: OpenAI's cap on top_logprobs (chat) and
# logprobs (completions); /generate's top_logprobs_num has the same one.
MAX_TOP_LOGPROBS = 20
# Most completions (choices) one request may ask for: n on every route.
MAX_N = 128
# Deepest nesting of lists / objects a request body may have (a chat body needs 5). Deeper ones
# (a few hundred levels) made the recursive checks and repr() of error messages raise
# RecursionError, an HTTP 500; json_too_deep refuses them first.
MAX_JSON_DEPTH = 100


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


def _is_int(v: object) -> bool:
    """A JSON integer: not a float (2.0) and not a bool (true), as OpenAI's API requires."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_logprob_params(
    return_logprob: bool, logprob_start_len: object, top_logprobs_num: object, prompt_len: int
) -> int:
    """Check /generate's logprob_start_len and top_logprobs_num; return the start position
    (upstream: -1 scores from the last prompt token). Raises ValueError naming the field."""
    if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"'top_logprobs_num' must be an integer in [0, {MAX_TOP_LOGPROBS}], "
            f"got {json_text(top_logprobs_num)}"
        )
    if not _is_int(logprob_start_len):
        raise ValueError(
            f"'logprob_start_len' must be an integer, got {json_text(logprob_start_len)}"
        )
    start = logprob_start_len
    if return_logprob and not -1 <= start < prompt_len:
        raise ValueError(
            f"'logprob_start_len' must be -1 (the last prompt token) or in [0, {prompt_len}) "
            f"for this prompt of {prompt_len} tokens, got {start}"
        )
    if start == -1 and return_logprob:
        start = prompt_len - 1
    return start


def max_prompt_len(context_len: int, max_total_tokens: int | None) -> int:
    """The longest prompt (tokens) a request may have; the one rule of the HTTP-side check
    (check_prompt_length) and Scheduler.add_request, so they cannot drift apart.

    A prompt must leave one token of the context for the output, and the KV cache of
    max_total_tokens slots (None: not known yet, no limit) must hold it with two slots to spare
    for the output (the scheduler's rule since the engine skeleton: prompt_len <
    min(context_len, max_total_tokens - 1))."""
    longest = context_len - 1
    if max_total_tokens is not None:
        longest = min(longest, max_total_tokens - 2)
    return longest


def prompt_too_long_message(
    prompt_len: int, context_len: int, max_total_tokens: int | None = None
) -> str:
    """The one wording of "prompt too long" (/generate, both OpenAI routes, scheduler aborts):
    it names the context length, or the KV cache when that is the tighter limit."""
    if prompt_len >= context_len or max_total_tokens is None:
        return (
            f"The prompt is too long: {prompt_len} tokens, but the model's context length is "
            f"{context_len} tokens and at least one token must remain for the output."
        )
    return (
        f"The prompt is too long: {prompt_len} tokens, but the KV cache of this server holds "
        f"{max_total_tokens} tokens and a prompt may use at most "
        f"{max_prompt_len(context_len, max_total_tokens)} of them."
    )


def check_prompt_fits(prompt_len: int, context_len: int, max_total_tokens: int | None) -> None:
    """Raise ContextLengthError (param "prompt") when prompt_len > max_prompt_len(...)."""
    if prompt_len > max_prompt_len(context_len, max_total_tokens):
        raise ContextLengthError(
            prompt_too_long_message(prompt_len, context_len, max_total_tokens), "prompt"
        )


def max_tokens_too_large_message(
    field: str, max_new_tokens: int, prompt_len: int | None, context_len: int
) -> str:
    """The one wording of "output budget beyond the context" on every route; `field` is the
    route's name for it (max_new_tokens on /generate, max_tokens or max_completion_tokens on the
    OpenAI routes); prompt_len None: the prompt is not tokenised yet."""
    prompt = f" (+ {prompt_len} prompt tokens)" if prompt_len is not None else ""
    return (
        f"{field} is too large: {max_new_tokens}{prompt} exceeds the model's context length of "
        f"{context_len} tokens."
    )


class MaxTokensError(ContextLengthError):
    """max_new_tokens (+ the prompt) exceeds the context length; `for_field` renames the field
    for the route that received the request (param and message)."""

    def __init__(
        self, max_new_tokens: int, prompt_len: int | None, context_len: int, field: str
    ) -> None:
        msg = max_tokens_too_large_message(field, max_new_tokens, prompt_len, context_len)
        super().__init__(msg, field)
        self.max_new_tokens = max_new_tokens
        self.prompt_len = prompt_len
        self.context_len = context_len

    def for_field(self, field: str) -> MaxTokensError:
        return MaxTokensError(self.max_new_tokens, self.prompt_len, self.context_len, field)


def check_max_new_tokens(
    max_new_tokens: int | None, prompt_len: int | None, context_len: int, field: str
) -> None:
    """Raise MaxTokensError naming `field` when max_new_tokens (+ prompt_len when known) exceeds
    context_len; None (unset) passes."""
    if max_new_tokens is not None and max_new_tokens + (prompt_len or 0) > context_len:
        raise MaxTokensError(max_new_tokens, prompt_len, context_len, field)


def check_prompt_length(
    prompt_len: int, sp: SamplingParams, context_len: int, max_total_tokens: int | None
) -> None:
    """Refuse prompts that cannot fit (check_prompt_fits) and output budgets beyond the context
    (check_max_new_tokens). Raises ContextLengthError."""
    check_prompt_fits(prompt_len, context_len, max_total_tokens)
    check_max_new_tokens(sp.max_new_tokens, prompt_len, context_len, "max_new_tokens")


# Slack of the character bound below: a tokenizer's normalizer may drop characters before
# the tokens are formed, so the bound is only used this many times over.
TEXT_SIZE_SLACK = 4


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: the longest entry of its
    vocabulary (added tokens included). Byte-level BPE spells each byte with one symbol and
    SentencePiece each character, so a text of c characters takes at least
    c / max_token_chars tokens (before normalization)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1)


def check_text_size(num_chars: int, context_len: int, chars_per_token: int, param: str) -> None:
    """Refuse a prompt text that cannot fit the context before tokenizing it: tokenizing
    megabytes takes seconds, and the HTTP process serves no one meanwhile (a 12 MB prompt held
    /health for 7 s). The bound, context_len * chars_per_token * TEXT_SIZE_SLACK characters,
    never refuses a prompt that fits. Raises ContextLengthError naming `param`."""
    limit = context_len * chars_per_token * TEXT_SIZE_SLACK
    if num_chars > limit:
        raise ContextLengthError(
            f"the prompt has {num_chars} characters, more than a context of {context_len} "
            f"tokens can hold (at most {limit} characters with this tokenizer); shorten it",
            param,
        )


def check_n(n: object) -> int:
    """/generate's sampling_params.n and the OpenAI routes' n: an integer in [1, MAX_N] (the
    OpenAI routes' cap, which also bounds how many copies one request fans out to). Returns n;
    raises ValueError naming n."""
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {json_text(n)}")
    return n


def json_too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a decoded JSON value nests lists / objects more than `limit` levels deep (the
    body itself is level 1). Iterative, so any depth is safe to check."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def raw_json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the raw JSON text `body` opens lists / objects more than `limit` levels deep
    (brackets inside strings, escapes included, do not count). For a body a JSON parser
    refused: a deep enough one exhausts its recursion, and the client should hear why."""
    depth, in_str, escaped = 0, False, False
    for c in body:
        if in_str:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif c in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False


def json_too_deep_message(limit: int = MAX_JSON_DEPTH) -> str:
    """The one wording of the nesting-depth error (every route)."""
    return f"invalid JSON body: lists / objects nested more than {limit} levels deep"


def lone_surrogate_path(value: object, path: str = "") -> str | None:
    """The path (e.g. "messages[0].content", "stop[1]") of the first string in a decoded JSON
    value that holds a lone UTF-16 surrogate (JSON allows "\\udc80"; such a string cannot be
    encoded as UTF-8, so no tokenizer takes it), or None. Walks dicts and lists."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate_path(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = lone_surrogate_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def lone_surrogate_message(path: str) -> str:
    """The one wording of the lone-surrogate error (every route)."""
    return f"{path} is not valid Unicode text: it contains a lone UTF-16 surrogate"

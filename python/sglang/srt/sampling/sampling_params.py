"""Per-request sampling parameters, with upstream SGLang's field names, defaults and checks.

`SamplingParams.from_dict` type-checks a JSON-like dict (unknown keys and wrong types raise
ValueError naming the parameter); `verify(vocab_size)` checks value ranges; `normalize(tokenizer)`
canonicalises (stop as list, greedy as top_k = 1, `stop_str_max_len`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

# Temperatures below this are greedy (upstream's _SAMPLING_EPS).
SAMPLING_EPS = 1e-6
# top_k value meaning "no top-k" after normalize (upstream uses 1 << 30 too).
TOP_K_ALL = 1 << 30
# logit_bias values must lie in [-100, 100], as in OpenAI's API.
LOGIT_BIAS_MAX = 100
# Valid range of each numeric parameter (upstream's), quoted by both the type error of from_dict
# and the range error of verify, so that e.g. max_new_tokens=1e20 says what is allowed.
RANGES = {
    "max_new_tokens": ">= 0",
    "temperature": ">= 0",
    "top_p": "in (0, 1]",
    "top_k": ">= 1, or -1 (all)",
    "min_p": "in [0, 1]",
    "frequency_penalty": "in [-2, 2]",
    "presence_penalty": "in [-2, 2]",
    "repetition_penalty": "in (0, 2]",
    "min_new_tokens": ">= 0",
    "n": ">= 1",
    "max_draft_tokens": ">= 0",
}


@dataclass
class SamplingParams:
    """Sampling parameters of one request (upstream field names and defaults).

    Fields set by `normalize` (not user inputs): `stop_strs` (list of stop strings) and
    `stop_str_max_len` (max token length of a stop string, used as the tail decode window).
    """

    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str | int, float] | None = None
    sampling_seed: int | None = None
    max_draft_tokens: int | None = None  # per-request cap on speculative draft length, >= 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Set by normalize(), not by users.
    stop_strs: list[str] = field(default_factory=list, repr=False)
    stop_str_max_len: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name) is not None:
                raise ValueError(f"constrained decoding ({name}) is not supported yet")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Build from a JSON-like dict; None or {} gives the defaults.

        Raises ValueError naming the key for unknown keys ("unknown sampling parameter 'foo'")
        and naming the parameter and its range for wrong types (e.g. temperature="hot" or
        Infinity, max_new_tokens=1.5 or 2.0 -- integers must be JSON integers, as in OpenAI's
        API -- or a bool where a number is expected). Ints are accepted where floats are.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            checker = _CHECKERS.get(key)
            if checker is None:
                raise ValueError(f"unknown sampling parameter {key!r}")
            kwargs[key] = checker(key, value)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The user-facing fields as a plain dict (round-trips through from_dict)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _CHECKERS}

    # ------------------------------------------------------------------ checks
    def verify(self, vocab_size: int) -> None:
        """Check value ranges (upstream's ranges). Raises ValueError naming parameter and value."""
        _require(self.temperature >= 0.0, "temperature", self.temperature)
        _require(0.0 < self.top_p <= 1.0, "top_p", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k)
        _require(0.0 <= self.min_p <= 1.0, "min_p", self.min_p)
        _require(self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens)
        _require(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            self.min_new_tokens,
            f"must be in [0, max_new_tokens={self.max_new_tokens}]",
        )
        _require(self.n >= 1, "n", self.n)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, value)
        _require(
            0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", self.repetition_penalty
        )
        for tid in self.stop_token_ids or []:
            ok = 0 <= tid < vocab_size
            _require(ok, "stop_token_ids", tid, f"outside vocab [0, {vocab_size})")
        for key, bias in (self.logit_bias or {}).items():
            tid = _token_id_key(key)
            if not 0 <= tid < vocab_size:  # the key as the client wrote it (JSON), like values
                raise ValueError(
                    f"logit_bias key {json_text(str(key))} is outside vocab [0, {vocab_size})"
                )
            _bias_value(key, bias)
        if self.max_draft_tokens is not None:
            _require(self.max_draft_tokens >= 0, "max_draft_tokens", self.max_draft_tokens)

    def normalize(self, tokenizer: Any | None) -> None:
        """Canonicalise in place (upstream semantics).

        - `stop_strs` = `stop` as a list ([] when None).
        - temperature < 1e-6 is greedy: temperature = 1.0 and top_k = 1 (upstream does the same).
        - top_k == -1 becomes TOP_K_ALL.
        - `stop_str_max_len`: max number of tokens of a stop string (its char length when
          tokenizer is None); the detokenizer re-decodes that many tail tokens to find stops.
        - logit_bias keys become ints.
        """
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        else:
            self.stop_strs = list(self.stop)
        if self.temperature < SAMPLING_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.logit_bias:
            self.logit_bias = {_token_id_key(k): float(v) for k, v in self.logit_bias.items()}
        max_len = 0
        for s in self.stop_strs:
            if tokenizer is None:
                n = len(s)
            else:
                n = len(tokenizer.encode(s, add_special_tokens=False))
            max_len = max(max_len, n)
        self.stop_str_max_len = max_len

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (after or before normalize)."""
        return self.top_k == 1 or self.temperature < SAMPLING_EPS


# ---------------------------------------------------------------------- helpers
def _require(ok: bool, name: str, value: Any, why: str | None = None) -> None:
    if not ok:
        why = why or f"must be {RANGES[name]}"
        raise ValueError(f"invalid sampling parameter {name}={value!r}: {why}")


def _token_id_key(key: str | int) -> int:
    """A logit_bias key as a token id: an int, or a string of decimal digits (JSON object keys
    are strings; int() would also take " 5", "5_0" or non-ASCII digits). Raises ValueError."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
        return int(key)
    raise ValueError(f"logit_bias key {json_text(key)} is not a token id")


def _bias_value(key: str | int, v: Any) -> float:
    """One logit_bias value: a number in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range).
    Raises ValueError naming logit_bias and the key."""
    if not isinstance(v, bool) and isinstance(v, (int, float)):
        if -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:  # False for NaN
            return float(v)
    raise ValueError(
        f"sampling parameter logit_bias[{json_text(str(key))}] must be a number in "
        f"[-{LOGIT_BIAS_MAX}, {LOGIT_BIAS_MAX}], got {json_text(v)}"
    )


def json_text(v: Any) -> str:
    """v as the JSON the user wrote (2.0, 1e+20, true, "x"; repr for non-JSON values), cut to
    80 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_error(name: str, value: Any, expected: str) -> ValueError:
    rng = RANGES.get(name)
    expected = f"{expected} {rng}" if rng else expected
    return ValueError(f"sampling parameter {name} must be {expected}, got {json_text(value)}")


def _int(name: str, v: Any) -> int:
    """A JSON integer: 2.0 and true are refused, as by OpenAI's API and pydantic strict ints."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, v, "an integer")
    return v


def _opt_int(name: str, v: Any) -> int | None:
    return None if v is None else _int(name, v)


def _float(name: str, v: Any) -> float:
    if not isinstance(v, bool) and isinstance(v, (int, float)):
        try:
            f = float(v)
        except OverflowError:  # an int beyond float range
            f = math.inf
        if math.isfinite(f):
            return f
    raise _type_error(name, v, "a finite number")


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _type_error(name, v, "a bool")
    return v


def _stop(name: str, v: Any) -> str | list[str] | None:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    raise _type_error(name, v, "a string or a list of strings")


def _int_list(name: str, v: Any) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        return list(v)
    raise _type_error(name, v, "a list of integers")


def _bias(name: str, v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _type_error(name, v, "a dict of token id -> float")
    out: dict[str | int, float] = {}
    for k, b in v.items():
        _token_id_key(k)
        out[k] = _bias_value(k, b)
    return out


def _opt_str(name: str, v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise _type_error(name, v, "a string")
    return v


_CHECKERS = {
    "max_new_tokens": _int,
    "stop": _stop,
    "stop_token_ids": _int_list,
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "logit_bias": _bias,
    "sampling_seed": _opt_int,
    "max_draft_tokens": _opt_int,
    "json_schema": _opt_str,
    "regex": _opt_str,
    "ebnf": _opt_str,
}

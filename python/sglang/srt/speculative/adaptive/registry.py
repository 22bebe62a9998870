"""--speculative-adaptive-config: parsing, validation, and the policy registry.

The config is a JSON object (inline, or the path of a file holding one); every key is optional:

    {"policy": "goodput" | "fixed" | "tiers",   # which draft-length policy runs
     "fixed_k": 3,                               # fixed: draft length (default K)
     "tiers": {"1": 3, "8": 2, "32": 1, "64": 0},# tiers: batch-size threshold -> draft length
     "hysteresis": 0.02,                         # goodput: relative gain needed to switch
     "recheck_every": 4,                         # goodput: an all-zero choice is reused for
                                                 # the next 3 steps unless the batch shrinks
     "recheck_max": 128,                         # ... and the reuse doubles up to 128 steps
                                                 # while the policy keeps choosing all zeros
     "recheck_shrink": 0.125,                    # "shrinks": by more than this fraction of
                                                 # the batch the policy last ran on (floor;
                                                 # below 8 requests any shrink)
     "recheck_margin": 0.8,                      # > 0: while the last all-zero run's bound
                                                 # put drafting at most this fraction of the
                                                 # plain rate, a shrink keeps the choice if
                                                 # at least half the batch is left and
                                                 # ratio x old batch <= new (0: off)
     "initial_accept": 0.7,                      # server-wide acceptance before any data
     "server_prior_count": 8, "prior_strength": 4,
     "server_accept_decay": 0.999, "request_accept_decay": 0.95,
     "idle_accept_decay": 0.97,                  # per non-drafting step: back to the prior
     "time_model": {"const": 0.004, ...},        # prior step-time coefficients (seconds/unit)
     "online_correction": true, "time_decay": 0.98, "time_prior_weight": 0.05,
     "time_idle_decay": 0.999,                   # step-time statistics of a regime (drafting
                                                 # or not, batch-size bucket) fade by
                                                 # time_decay per step of that regime, by
                                                 # this per step of any other
     "profile": true,                            # warm-up sweep at startup (CUDA only)
     "profile_batch_sizes": [1, 4, 16, 64, 256],  # those that fit the pools
     "probe_every": 32,                          # after this many drafting steps in a row,
     "probe_len": 4,                             # this many plain steps measure what not
                                                 # drafting costs (the first, after a
                                                 # drafting step, runs unpipelined and is no
                                                 # sample)
     "count_overhead": true,                     # T is wall time between decode commits
     "defer_draft_extend": true,                 # goodput, while it keeps choosing all
                                                 # zeros: prefills skip the draft extend and
                                                 # cached prefixes without draft KV are used
     "guard": true,                              # goodput: block drafting at batch sizes
     "guard_margin": 0.03,                       # where drafting steps delivered fewer tokens
     "guard_min_steps": 16,                      # per second than plain ones (goodput_guard)
     "guard_backoff": 256, "guard_backoff_max": 8192,
     "catchup_horizon": 16}                      # goodput: a catch-up beyond K + 1 positions
                                                 # is charged 1/h per step, h = min(this,
                                                 # the request's drafting steps left); 1 =
                                                 # all to the drafting step
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.speculative.adaptive.baselines import FixedKPolicy, TierPolicy
from sglang.srt.speculative.adaptive.policy import GoodputPolicy
from sglang.srt.speculative.adaptive.step_time_model import FEATURES

FLAG = "--speculative-adaptive-config"
POLICIES = ("goodput", "fixed", "tiers")  # keys of _FACTORIES
# batch-size threshold -> draft length of the tiers baseline (upstream-like; capped at K)
DEFAULT_TIERS = {1: 3, 8: 2, 32: 1, 64: 0}


@dataclass(frozen=True)
class AdaptiveConfig:
    policy: str = "goodput"
    fixed_k: int | None = None
    tiers: dict[int, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    hysteresis: float = 0.02
    recheck_every: int = 4
    recheck_max: int = 128
    recheck_shrink: float = 0.125
    recheck_margin: float = 0.8
    initial_accept: float = 0.7
    server_prior_count: float = 8.0
    prior_strength: float = 4.0
    server_accept_decay: float = 0.999
    request_accept_decay: float = 0.95
    idle_accept_decay: float = 0.97
    time_model: dict[str, float] | None = None
    online_correction: bool = True
    time_decay: float = 0.98
    time_prior_weight: float = 0.05
    time_idle_decay: float = 0.999
    profile: bool = True
    profile_batch_sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
    probe_every: int = 32
    probe_len: int = 4
    count_overhead: bool = True
    defer_draft_extend: bool = True
    guard: bool = True
    guard_margin: float = 0.03
    guard_min_steps: int = 16
    guard_backoff: int = 256
    guard_backoff_max: int = 8192
    catchup_horizon: int = 16


def _js(v: Any) -> str:
    """v (parsed from the config's JSON) as JSON: what the user wrote, true and not True."""
    return json.dumps(v)


MAX_COEF_S = 10.0  # upper bound of a configured time_model coefficient (seconds per unit)
MIN_CONST_S = 1e-6  # lower bound of a configured time_model const (seconds per step)


def _err(msg: str) -> ValueError:
    return ValueError(f"{FLAG}: {msg}")


def _number(key: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    """v as a float in [lo, hi] ((lo, hi] with lo_open). Raises ValueError naming key for a
    non-number, a non-finite number (JSON's NaN / Infinity, or an integer too large for a
    float: NaN fails every comparison and inf passes hi = inf) or one out of range."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _err(f"{key!r} must be a number, got {_js(v)}")
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int beyond float range
        finite = False
    if not finite:
        raise _err(f"{key!r} must be a finite number, got {_js(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _err(f"{key!r} must be in {'(' if lo_open else '['}{lo}, {hi}], got {_js(v)}")
    return float(v)


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _err(f"{key!r} must be an integer >= {lo}, got {_js(v)}")
    return v


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _err(f"{key!r} must be true or false, got {_js(v)}")
    return v


def _tiers(v: Any) -> dict[int, int]:
    if not isinstance(v, dict) or not v:
        raise _err(
            f"'tiers' must be a non-empty object of batch size -> draft length, got {_js(v)}"
        )
    out = {}
    for k, d in v.items():
        # canonical decimal keys only: "08" or " 8" would silently merge with "8"; at most 9
        # digits, so int() never meets Python's digit limit
        digits = isinstance(k, str) and 0 < len(k) <= 9 and k.isascii() and k.isdigit()
        if not digits or k != str(int(k)):
            raise _err(f"'tiers' key {k!r} is not an integer batch size (like \"8\")")
        out[_int("tiers key", int(k), 1)] = _int(f"tiers[{k!r}]", d, 0)
    return out


def _time_model(v: Any) -> dict[str, float]:
    if not isinstance(v, dict):
        raise _err(f"'time_model' must be an object of coefficients, got {_js(v)}")
    unknown = sorted(set(v) - set(FEATURES))
    if unknown:
        raise _err(f"unknown 'time_model' keys {unknown}; known: {list(FEATURES)}")
    # Seconds per unit. A step of more than MAX_COEF_S per unit is no model of any server (and
    # huge values overflow the fit's scaled arithmetic into NaN); `const` >= MIN_CONST_S keeps
    # every predicted step time positive and finite rates (the policy divides tokens by it).
    out = {k: _number(f"time_model.{k}", c, 0.0, MAX_COEF_S) for k, c in v.items()}
    if "const" in out and out["const"] < MIN_CONST_S:
        raise _err(
            f"'time_model.const' must be in [{MIN_CONST_S}, {MAX_COEF_S}], got {_js(v['const'])}"
        )
    return out


def _batch_sizes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not v:
        raise _err(f"'profile_batch_sizes' must be a non-empty list, got {_js(v)}")
    return tuple(_int("profile_batch_sizes", b, 1) for b in v)


_CHECKS = {
    "policy": lambda v: (
        v if v in POLICIES else _raise(f"'policy' must be one of {POLICIES}, got {_js(v)}")
    ),
    "fixed_k": lambda v: _int("fixed_k", v, 0),
    "tiers": _tiers,
    "hysteresis": lambda v: _number("hysteresis", v, 0.0, 1.0),
    "recheck_every": lambda v: _int("recheck_every", v, 1),
    "recheck_max": lambda v: _int("recheck_max", v, 1),
    "recheck_shrink": lambda v: _number("recheck_shrink", v, 0.0, 0.99),
    "recheck_margin": lambda v: _number("recheck_margin", v, 0.0, 0.99),
    "catchup_horizon": lambda v: _int("catchup_horizon", v, 1),
    "initial_accept": lambda v: _number("initial_accept", v, 0.0, 1.0),
    "server_prior_count": lambda v: _number("server_prior_count", v, 0.0, 1e9, lo_open=True),
    "prior_strength": lambda v: _number("prior_strength", v, 0.0, 1e9, lo_open=True),
    "server_accept_decay": lambda v: _number("server_accept_decay", v, 0.0, 1.0, lo_open=True),
    "request_accept_decay": lambda v: _number("request_accept_decay", v, 0.0, 1.0, lo_open=True),
    "idle_accept_decay": lambda v: _number("idle_accept_decay", v, 0.0, 1.0, lo_open=True),
    "time_model": _time_model,
    "online_correction": lambda v: _bool("online_correction", v),
    "time_decay": lambda v: _number("time_decay", v, 0.0, 1.0, lo_open=True),
    "time_prior_weight": lambda v: _number("time_prior_weight", v, 0.0, 1e9, lo_open=True),
    "time_idle_decay": lambda v: _number("time_idle_decay", v, 0.0, 1.0, lo_open=True),
    "profile": lambda v: _bool("profile", v),
    "profile_batch_sizes": _batch_sizes,
    "probe_every": lambda v: _int("probe_every", v, 0),
    "probe_len": lambda v: _int("probe_len", v, 2),
    "count_overhead": lambda v: _bool("count_overhead", v),
    "defer_draft_extend": lambda v: _bool("defer_draft_extend", v),
    "guard": lambda v: _bool("guard", v),
    "guard_margin": lambda v: _number("guard_margin", v, 0.0, 0.99),
    "guard_min_steps": lambda v: _int("guard_min_steps", v, 1),
    "guard_backoff": lambda v: _int("guard_backoff", v, 1),
    "guard_backoff_max": lambda v: _int("guard_backoff_max", v, 1),
}
assert set(_CHECKS) == {f.name for f in dataclasses.fields(AdaptiveConfig)}


def _raise(msg: str) -> Any:
    raise _err(msg)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json.loads object_pairs_hook: a key given twice is refused (json keeps the last one)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {k!r} appears more than once in one object")
        out[k] = v
    return out


def parse_adaptive_config(value: str | None) -> AdaptiveConfig:
    """Parse --speculative-adaptive-config (inline JSON, or a path to a JSON file; None gives
    the defaults; so does "{}"). Raises ValueError naming the flag on an empty or blank value
    (e.g. an unset shell variable: the defaults were probably not what was meant), unreadable
    files (or not UTF-8), bad JSON (too deeply nested included), a key given twice in one
    object, unknown keys or out-of-range values."""
    if value is None:
        return AdaptiveConfig()
    if not value.strip():
        raise _err(
            f"got an empty value {value!r}; omit the flag (or pass '{{}}') for the defaults, "
            "or give a JSON object or the path of a file holding one"
        )
    text = value
    if not value.lstrip().startswith(("{", "[")):
        if not os.path.isfile(value):
            raise _err(f"not a JSON object and not an existing file: {value!r}")
        try:
            with open(value, encoding="utf-8-sig") as f:  # a byte-order mark is fine
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise _err(f"cannot read {value!r} as UTF-8 text ({e})") from None
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise _err(str(e)) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, int digit limit, deep nesting
        raise _err(f"invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _err(f"must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_CHECKS))
    if unknown:
        raise _err(f"unknown keys {unknown}; known: {sorted(_CHECKS)}")
    cfg = AdaptiveConfig(**{k: _CHECKS[k](v) for k, v in raw.items()})
    if cfg.guard_backoff_max < cfg.guard_backoff:
        raise _err(
            f"'guard_backoff_max' {cfg.guard_backoff_max} is below 'guard_backoff' "
            f"{cfg.guard_backoff} (the first back-off)"
        )
    return cfg


_FACTORIES = {
    "goodput": lambda cfg, k: GoodputPolicy(cfg.hysteresis),
    "fixed": lambda cfg, k: FixedKPolicy(k if cfg.fixed_k is None else cfg.fixed_k),
    "tiers": lambda cfg, k: TierPolicy(cfg.tiers),
}


def build_policy(cfg: AdaptiveConfig, k: int) -> GoodputPolicy | FixedKPolicy | TierPolicy:
    """The draft-length policy named by cfg.policy, for server draft length K = k. Raises
    ValueError when fixed_k, or a draft length of a configured tiers table, exceeds K, whatever
    the policy (a value that could never apply is a mistake in the config; the default table's
    lengths are capped at K like every draft length: it drafts 3 at batch 1 also when K < 3)."""
    if cfg.fixed_k is not None and cfg.fixed_k > k:
        raise _err(f"'fixed_k' {cfg.fixed_k} exceeds --speculative-num-steps {k}")
    if cfg.tiers != DEFAULT_TIERS and max(cfg.tiers.values()) > k:
        bad = {bs: d for bs, d in cfg.tiers.items() if d > k}
        raise _err(f"'tiers' draft lengths {bad} exceed --speculative-num-steps {k}")
    return _FACTORIES[cfg.policy](cfg, k)

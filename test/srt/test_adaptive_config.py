"""Adaptive speculation (issue 7): the --speculative-adaptive-config parser (registry.py) and its
validation, and the checks of --speculative-adaptive at server-args resolution."""

from __future__ import annotations

import json

import pytest

from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_resolve import resolve_speculative_args
from sglang.srt.speculative.adaptive.registry import parse_adaptive_config


def test_config_parsing_and_validation(tmp_path):
    cfg = parse_adaptive_config('{"policy": "tiers", "tiers": {"1": 2, "16": 0}}')
    assert cfg.policy == "tiers" and cfg.tiers == {1: 2, 16: 0}
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"policy": "fixed", "fixed_k": 2}))
    assert parse_adaptive_config(str(path)).fixed_k == 2
    assert parse_adaptive_config(None).policy == "goodput"
    assert parse_adaptive_config("{}") == parse_adaptive_config(None)
    # an empty value (e.g. --speculative-adaptive-config "$UNSET") is refused, not the defaults
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="--speculative-adaptive-config: got an empty value"):
            parse_adaptive_config(empty)
    for bad in ('{"policy": "fixed"', '{"polcy": "fixed"}', '{"policy": "x"}', "[1]", "nope"):
        with pytest.raises(ValueError, match="--speculative-adaptive-config"):
            parse_adaptive_config(bad)
    with pytest.raises(ValueError, match="hysteresis"):
        parse_adaptive_config('{"hysteresis": -1}')
    # errors quote the value as the user wrote it (JSON true, not Python True)
    with pytest.raises(ValueError, match=r"'probe_every' must be an integer >= 0, got true$"):
        parse_adaptive_config('{"probe_every": true}')
    with pytest.raises(ValueError, match=r"'probe_every' must be an integer >= 0, got -1$"):
        parse_adaptive_config('{"probe_every": -1}')
    assert parse_adaptive_config('{"probe_every": 0}').probe_every == 0
    assert parse_adaptive_config(None).recheck_shrink == 0.125
    assert parse_adaptive_config('{"recheck_shrink": 0}').recheck_shrink == 0.0
    with pytest.raises(ValueError, match=r"'recheck_shrink' must be .*, got 1$"):
        parse_adaptive_config('{"recheck_shrink": 1}')
    assert parse_adaptive_config('{"time_model": {"draft_reqs": 0.001}}').time_model == {
        "draft_reqs": 0.001
    }
    assert parse_adaptive_config(None).time_idle_decay == 0.999
    assert parse_adaptive_config('{"time_idle_decay": 1}').time_idle_decay == 1.0
    for bad in ("0", "1.5", '"x"', "true"):
        with pytest.raises(ValueError, match=rf"'time_idle_decay' must .*, got {bad}$"):
            parse_adaptive_config(json.dumps({"time_idle_decay": json.loads(bad)}))


@pytest.mark.parametrize(
    "text, key, shown",
    [
        ('{"hysteresis": NaN}', "hysteresis", "NaN"),  # NaN fails every < > comparison
        ('{"initial_accept": NaN}', "initial_accept", "NaN"),
        ('{"prior_strength": Infinity}', "prior_strength", "Infinity"),
        ('{"server_prior_count": -Infinity}', "server_prior_count", "-Infinity"),
        ('{"time_model": {"const": Infinity}}', "time_model.const", "Infinity"),
        ('{"time_model": {"const": 1e999}}', "time_model.const", "Infinity"),  # overflows
        pytest.param(
            '{"time_model": {"const": 1' + "0" * 400 + "}}",
            "time_model.const",
            "1" + "0" * 400,
            id="int-beyond-float",
        ),
    ],
)
def test_config_rejects_non_finite_numbers(text, key, shown):
    """Python's json accepts NaN / Infinity; the config must not (found by review)."""
    msg = f"--speculative-adaptive-config: '{key}' must be a finite number, got {shown}$"
    with pytest.raises(ValueError, match=msg):
        parse_adaptive_config(text)
    a = ServerArgs(  # and start-up (server-args resolution) fails the same way
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_adaptive=True,
        speculative_adaptive_config=text,
    )
    with pytest.raises(ValueError, match=msg):
        resolve_speculative_args(a, bundled=False)


@pytest.mark.parametrize(
    "text, error",
    [
        # found by a new user's review: each of these used to start, or fail without the flag
        ("[" * 100_000, r"invalid JSON \(maximum recursion depth"),  # was a traceback
        ('{"probe_every": 1' + "0" * 5000 + "}", r"invalid JSON \(Exceeds the limit"),
        ('{"fixed_k": 5, "fixed_k": 1}', r"key 'fixed_k' appears more than once"),
        ('{"tiers": {"8": 3, "08": 0}}', r"'tiers' key '08' is not an integer batch size"),
        ('{"tiers": {" 8 ": 3}}', r"'tiers' key ' 8 ' is not an integer batch size"),
        ('{"tiers": {"+1": 3}}', r"'tiers' key '\+1' is not an integer batch size"),
        ('{"policy": "fixd"}', r"'policy' must be one of .*, got \"fixd\"$"),
        (
            '{"time_model": {"draft_steps": 1e308}}',
            r"'time_model.draft_steps' must be in \[0.0, 10.0\]",
        ),
        ('{"time_model": {"const": 0}}', r"'time_model.const' must be in \[1e-06, 10.0\], got 0$"),
        (
            '{"time_model": {"const": 1e-320}}',
            r"'time_model.const' must be in \[1e-06, 10.0\], got 1e-320$",
        ),
        ('{"tiers": {"1' + "0" * 5000 + '": 1}}', r"'tiers' key '1000.*' is not an integer"),
    ],
)
def test_config_refuses_what_review_found(text, error):
    with pytest.raises(ValueError, match="--speculative-adaptive-config: " + error):
        parse_adaptive_config(text)


def test_config_file_encodings(tmp_path):
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"policy": "fixed", "fixed_k": 1}')
    assert parse_adaptive_config(str(bom)).fixed_k == 1  # a byte-order mark is fine
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'\xff\xfe{"policy": 1}')
    msg = r"--speculative-adaptive-config: cannot read .*binary.json' as UTF-8 text"
    with pytest.raises(ValueError, match=msg):
        parse_adaptive_config(str(binary))
    assert parse_adaptive_config('{"time_model": {"const": 10, "bs": 0}}').time_model == {
        "const": 10.0,
        "bs": 0.0,
    }


def test_server_args_validation():
    a = ServerArgs(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_adaptive=True,
        speculative_adaptive_config='{"bogus": 1}',
    )
    with pytest.raises(ValueError, match="--speculative-adaptive-config"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(speculative_adaptive=True)
    with pytest.raises(ValueError, match="--speculative-adaptive needs"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(speculative_adaptive_config='{"recheck_every": 2}')  # the config alone
    with pytest.raises(ValueError, match="--speculative-adaptive-config needs"):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(  # fixed_k beyond K fails at start-up, naming both
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_num_steps=3,
        speculative_adaptive=True,
        speculative_adaptive_config='{"policy": "fixed", "fixed_k": 4}',
    )
    with pytest.raises(ValueError, match="'fixed_k' 4 exceeds --speculative-num-steps 3"):
        resolve_speculative_args(a, bundled=False)
    a.speculative_adaptive_config = '{"fixed_k": 4}'  # unused by goodput: still a mistake
    with pytest.raises(ValueError, match="'fixed_k' 4 exceeds --speculative-num-steps 3"):
        resolve_speculative_args(a, bundled=False)
    a.speculative_adaptive_config = '{"policy": "fixed", "fixed_k": 3}'
    resolve_speculative_args(a, bundled=False)
    assert a.speculative_num_steps == 3
    # a configured tiers table beyond K too (a new-user helper found it accepted while fixed_k
    # was refused); the default table, which drafts 3 at batch 1, is capped at K instead
    a.speculative_adaptive_config = '{"policy": "tiers", "tiers": {"1": 9, "8": 2}}'
    msg = r"'tiers' draft lengths \{1: 9\} exceed --speculative-num-steps 3"
    with pytest.raises(ValueError, match=msg):
        resolve_speculative_args(a, bundled=False)
    a = ServerArgs(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/x",
        speculative_num_steps=2,
        speculative_adaptive=True,
        speculative_adaptive_config='{"policy": "tiers"}',
    )
    resolve_speculative_args(a, bundled=False)
    # a back-off ceiling below the first back-off
    with pytest.raises(ValueError, match="'guard_backoff_max' 10 is below 'guard_backoff' 1000"):
        parse_adaptive_config('{"guard_backoff": 1000, "guard_backoff_max": 10}')
    assert (
        parse_adaptive_config('{"guard_backoff": 64, "guard_backoff_max": 64}').guard_backoff == 64
    )


def test_speculative_flags_without_an_algorithm_are_named_as_ignored(caplog):
    """Upstream ignores --speculative-num-steps and its kin without --speculative-algorithm;
    here the server says so once at start (a new-user helper found them silently ignored,
    thirty-fourth session) and serves without speculation."""
    a = ServerArgs(speculative_num_steps=3, speculative_draft_model_path="/x")
    with caplog.at_level("WARNING", logger="sglang.srt.server_args_resolve"):
        resolve_speculative_args(a, bundled=False)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "--speculative-draft-model-path, --speculative-num-steps given without "
        "--speculative-algorithm: ignored, speculation is off"
    ]
    assert a.speculative_algorithm is None
    caplog.clear()
    with caplog.at_level("WARNING", logger="sglang.srt.server_args_resolve"):
        resolve_speculative_args(ServerArgs(), bundled=False)
    assert caplog.records == []

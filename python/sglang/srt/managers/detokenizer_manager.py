"""Incremental detokenization with stop-string search.

`IncrementalDetokenizer` turns a growing list of output ids into text. It uses the classic
surrounding-offset / read-offset scheme (upstream SGLang's DetokenizerManager, also vLLM and
TGI): the newest tokens are decoded together with a few preceding ones (the "surrounding"
window, so tokenizers that drop a leading space at the start of a decode stay correct) and the
new text is the difference of the two decodes. When the new text ends in U+FFFD the last token
is an incomplete UTF-8 sequence (e.g. half of "é" or of an emoji, split over byte tokens), so it
is held back until a later token completes it.

`DetokenizerManager` keeps one IncrementalDetokenizer per request id. Unlike upstream, it is a
plain object called from the scheduler process, not a separate process.
"""

from __future__ import annotations

from typing import Any

# Upstream's INIT_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens used as initial context.
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


# Text that transformers' clean-up of tokenization spaces changes (" ." -> ".", " n't" ->
# "n't", ...): decoding its ids shows whether a tokenizer's decode cleans up.
_CLEANUP_PROBE = "a . b , c ! d ? e n't f 'm g 's h 've i 're j"


def backend_decode(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer.decode` behind a transformers fast tokenizer, when calling it
    gives exactly what `tokenizer.decode` gives (no clean-up of tokenization spaces: then
    transformers' fast `_decode` returns the backend's text unchanged, and
    spaces_between_special_tokens only applies to slow tokenizers); else None.

    Whether a tokenizer cleans up is decided by decoding _CLEANUP_PROBE both ways, not by its
    `clean_up_tokenization_spaces` flag alone: transformers 5.17 sets the flag on the bundled
    SmolLM2 tokenizer but ignores it for BPE tokenizers, while a WordPiece tokenizer with the
    flag set does clean up.

    Why: per call, transformers' decode spends ~6 us in Python (argument conversion and
    checks) around a ~1 us Rust decode, and the scheduler decodes twice per streamed request
    per step (flush: 0.64 ms per step at 64 streamed requests on the CPU machine, 80% of it in
    decode)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    decode = getattr(backend, "decode", None)
    if not callable(decode):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        try:
            ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
            if decode(ids, skip_special_tokens=True) != tokenizer.decode(ids):
                return None
        except Exception:  # noqa: BLE001 - not a transformers fast tokenizer after all
            return None
    return decode


class IncrementalDetokenizer:
    """Decodes output ids incrementally; `text` only ever grows by complete characters.

    Args:
        tokenizer: a HF tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
        prompt_ids_tail: the last prompt ids, used only as decode context (their text is not
            part of `text`); up to INIT_INCREMENTAL_DETOKENIZATION_OFFSET of them are used.
        skip_special_tokens, spaces_between_special_tokens: passed to tokenizer.decode.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids_tail: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._fast = backend_decode(tokenizer)  # None: through tokenizer.decode
        tail = list(prompt_ids_tail or [])[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:]
        self.all_ids: list[int] = tail  # context tail + output ids
        self.num_context_ids = len(tail)
        self.surr_offset = 0  # start of the surrounding window (index into all_ids)
        self.read_offset = len(tail)  # ids before this are already in `text`
        self._text = ""
        self._unread: list[int] = []  # appended ids not decoded yet (see append)

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def append(self, ids: list[int]) -> None:
        """Add new output ids. Decoding is lazy: the ids are decoded (as one chunk) when `text`,
        `find_stop`, `flush` or `num_pending_ids` is next used, so a request whose text is
        only read when it finishes costs two decodes in all, not two per token."""
        self._unread.extend(ids)

    def _catch_up(self) -> None:
        if self._unread:
            ids, self._unread = self._unread, []
            self._decode_chunk(ids)

    def _decode_chunk(self, ids: list[int]) -> None:
        """`text` grows by every newly completed character of all_ids + ids."""
        self.all_ids.extend(ids)
        surr_text = self._decode(self.all_ids[self.surr_offset : self.read_offset])
        # Usually the whole chunk completes; if it ends mid-character, emit the longest prefix
        # of the chunk that ends on a complete character (rare, so the extra decodes are cheap).
        for end in range(len(self.all_ids), self.read_offset, -1):
            new_text = self._decode(self.all_ids[self.surr_offset : end])
            if len(new_text) > len(surr_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                self._text += new_text[len(surr_text) :]
                self.surr_offset = self.read_offset
                self.read_offset = end
                return
            if len(ids) == 1:
                return

    @property
    def text(self) -> str:
        """All output text so far (complete characters only)."""
        self._catch_up()
        return self._text

    @property
    def output_ids(self) -> list[int]:
        """All output ids appended so far."""
        return self.all_ids[self.num_context_ids :] + self._unread

    @property
    def num_pending_ids(self) -> int:
        """Output ids whose text is held back (incomplete UTF-8 at the end)."""
        self._catch_up()
        return len(self.all_ids) - self.read_offset

    def flush(self) -> str:
        """Emit held-back text even if incomplete (call when the request finishes).

        Returns the full text, which may now end in U+FFFD if generation stopped mid-character.
        """
        self._catch_up()
        if self.num_pending_ids:
            surr_text = self._decode(self.all_ids[self.surr_offset : self.read_offset])
            new_text = self._decode(self.all_ids[self.surr_offset :])
            self._text += new_text[len(surr_text) :]
            self.surr_offset = self.read_offset
            self.read_offset = len(self.all_ids)
        return self._text

    # ------------------------------------------------------------------ stop strings
    def find_stop(self, stop_strs: list[str], search_from_char: int) -> tuple[int, str] | None:
        """Earliest stop string that ends after `search_from_char`.

        Pass search_from_char = len(text) as it was at the previous check (0 the first time).
        A stop string s is searched from max(0, search_from_char - len(s) + 1), so matches
        straddling the old/new boundary (or a token boundary) are found, and each match is
        reported by exactly one call (matches lying wholly in old text were seen before).

        Returns (char index in `text` where the match starts, the stop string), the earliest
        start (ties: the first in stop_strs), or None.
        """
        self._catch_up()
        best: tuple[int, str] | None = None
        for s in stop_strs:
            if not s:
                continue
            start = max(0, search_from_char - len(s) + 1)
            idx = self._text.find(s, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best


class DetokenizerManager:
    """rid -> IncrementalDetokenizer (upstream's name; here a plain in-process holder)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDetokenizer] = {}

    def add(
        self,
        rid: str,
        prompt_ids_tail: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        """Register a request (replaces an existing one with the same rid)."""
        dec = IncrementalDetokenizer(
            self.tokenizer, prompt_ids_tail, skip_special_tokens, spaces_between_special_tokens
        )
        self.decoders[rid] = dec
        return dec

    def get(self, rid: str) -> IncrementalDetokenizer:
        """Raises KeyError for an unknown rid."""
        return self.decoders[rid]

    def handle(self, rid: str, new_ids: list[int]) -> str:
        """Append new output ids of `rid` (registering it with defaults if new); full text."""
        dec = self.decoders.get(rid)
        if dec is None:
            dec = self.add(rid)
        dec.append(new_ids)
        return dec.text

    def release(self, rid: str) -> None:
        """Forget a finished or aborted request (no error if unknown)."""
        self.decoders.pop(rid, None)

    def __len__(self) -> int:
        return len(self.decoders)

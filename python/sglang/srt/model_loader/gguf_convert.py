"""Convert a GGUF checkpoint once into a Hugging Face directory (float32 safetensors).

The engine only reads HF directories; a .gguf file is dequantized by transformers and cached at
<root>/<file stem>-<hash of abs path, size, mtime>, where root is `cache_root`, else
$SGLANG_CACHE_DIR/gguf, else ~/.cache/sglang/gguf. The conversion is written into a private temp
directory and published with one os.rename, so concurrent converters never see a partial directory;
a loser of the race discards its copy and uses the winner's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch

from sglang.srt.model_loader.weight_utils import save_safetensors_checkpoint

logger = logging.getLogger(__name__)


def gguf_cache_dir(gguf_path: str, cache_root: str | None = None) -> str:
    """Directory the converted checkpoint of `gguf_path` lives in (it may not exist yet).

    Raises:
        FileNotFoundError: `gguf_path` is not a file.
    """
    path = os.path.abspath(gguf_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file '{gguf_path}' does not exist")
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    if cache_root is None:
        env_root = os.environ.get("SGLANG_CACHE_DIR")
        base = env_root if env_root else os.path.join("~", ".cache", "sglang")
        cache_root = os.path.join(os.path.expanduser(base), "gguf")
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(os.path.abspath(cache_root), f"{stem}-{key}")


def convert_gguf_to_hf(gguf_path: str, cache_root: str | None = None) -> str:
    """Return an HF model directory holding `gguf_path` dequantized to float32.

    The directory has config.json, generation_config.json, model.safetensors and the tokenizer
    files (tokenizer_config.json keeps the chat template). The first call converts (about 20 s
    for the bundled 135M model); later calls return the cached directory at once.

    Raises:
        FileNotFoundError: `gguf_path` is not a file.
        ValueError: transformers cannot read the GGUF architecture.
    """
    target = gguf_cache_dir(gguf_path, cache_root)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(
        prefix=".tmp-" + os.path.basename(target) + "-", dir=os.path.dirname(target)
    )
    try:
        logger.info("Converting GGUF %s to a Hugging Face checkpoint in %s", gguf_path, target)
        start = time.perf_counter()
        _write_hf_checkpoint(os.path.abspath(gguf_path), tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
            logger.info("Another process finished converting %s first; using its copy", gguf_path)
        else:
            logger.info("GGUF conversion done in %.1f s", time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_checkpoint(gguf_path: str, out_dir: str) -> None:
    """Dequantize `gguf_path` with transformers and write an HF checkpoint into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dirname, basename = os.path.split(gguf_path)
    with _gguf_without_accelerate():
        model = AutoModelForCausalLM.from_pretrained(
            dirname,
            gguf_file=basename,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    tokenizer = AutoTokenizer.from_pretrained(dirname, gguf_file=basename)

    config = model.config
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # transformers leaves it unset for GGUF
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    save_safetensors_checkpoint(
        model.state_dict(), os.path.join(out_dir, "model.safetensors"), config.tie_word_embeddings
    )
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir, tokenizer.chat_template)


def _embed_chat_template(out_dir: str, chat_template: str | None) -> None:
    """Also store the chat template inside tokenizer_config.json (transformers 5 writes it to
    chat_template.jinja only), so readers of tokenizer_config.json alone still find it."""
    if not chat_template:
        return
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config["chat_template"] = chat_template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2, ensure_ascii=False)


@contextlib.contextmanager
def _gguf_without_accelerate() -> Iterator[None]:
    """transformers 5.24 refuses `gguf_file=` unless `accelerate` is installed, although the
    dequantizing CPU path never uses it. When accelerate is missing, lift that one check for the
    duration of the load (tested: the load itself works without accelerate)."""
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, "is_accelerate_available", None)
    if original is None or original():
        yield
        return
    modeling_utils.is_accelerate_available = lambda: True
    try:
        yield
    finally:
        modeling_utils.is_accelerate_available = original

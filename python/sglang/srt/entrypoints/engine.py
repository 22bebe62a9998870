"""Engine: the offline API, and the process launcher shared with the HTTP server.

Process layout (upstream's): the caller's process runs the TokenizerManager; the scheduler
(model, KV cache, detokenization) runs in a spawned subprocess; they talk over ZMQ IPC.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import GENERATE_FIELD_TYPES, GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_resolve import resolve_server_args
from sglang.srt.speculative.draft_config import read_draft_config
from sglang.srt.utils.process import (
    child_env,
    kill_process_tree,
    scheduler_heap_env,
    scheduler_thread_env,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PortArgs:
    tokenizer_ipc: str  # scheduler -> tokenizer manager (outputs, replies)
    scheduler_input_ipc: str  # tokenizer manager -> scheduler (requests, control)

    @staticmethod
    def new() -> PortArgs:
        d = tempfile.mkdtemp(prefix="sglang-ipc-")
        return PortArgs(f"ipc://{d}/tokenizer", f"ipc://{d}/scheduler")


def launch_subprocesses(server_args: ServerArgs) -> tuple[TokenizerManager, list[mp.Process]]:
    """Resolve the arguments, start the scheduler process, wait for its model to load.

    Raises ValueError for bad arguments (unknown model path, unsupported architecture, a
    speculative draft path without a config.json, a bad SGLANG_SCHEDULER_HUGEPAGE_HEAP, ...)
    and RuntimeError when the scheduler fails to start (its error message included).
    """
    server_args = resolve_server_args(server_args)
    heap = scheduler_heap_env()  # before anything starts: a bad setting raises ValueError
    model_config = ModelConfig(
        server_args.model_path,
        context_length=server_args.context_length,
        dtype=server_args.dtype,
        device=server_args.device,
    )
    if server_args.speculative_algorithm and server_args.speculative_draft_model_path:
        # a missing draft is a bad flag: refuse it before the target model loads
        read_draft_config(server_args.speculative_draft_model_path)
    port_args = PortArgs.new()
    from sglang.srt.managers.scheduler import run_scheduler_process

    ctx = mp.get_context("spawn")
    # the resource tracker (a helper process the first spawn starts) must not inherit the
    # scheduler's environment below: start it first
    resource_tracker.ensure_running()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=run_scheduler_process,
        args=(server_args, model_config, port_args, writer),
        name="sglang-scheduler",
        daemon=True,
    )
    # read by the child at start: its CPU thread pools and its heap
    with child_env({**scheduler_thread_env(server_args.device), **heap}):
        proc.start()
    writer.close()
    try:
        info = reader.recv()
    except EOFError:
        info = {"status": "error", "error": f"scheduler exited with code {proc.exitcode}"}
    if info.get("status") != "ready":
        kill_process_tree(proc.pid)
        raise RuntimeError(f"failed to start the scheduler: {info.get('error')}")
    tm = TokenizerManager(server_args, model_config, port_args)
    tm.max_total_num_tokens = info["max_total_num_tokens"]
    return tm, [proc]


class Engine:
    """Offline engine: `Engine(model_path=None, **server_args).generate(prompt, sampling_params)`.

    Returns upstream-style dicts {"text", "output_ids", "meta_info"} (a list for a list of
    prompts). Calls from several threads take turns on the engine's event loop. Use as a
    context manager or call shutdown(); a call after shutdown(), or after the scheduler
    process died, raises RuntimeError. `speculative_adaptive_config` takes a dict or its JSON
    text.
    """

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        if isinstance(kwargs.get("speculative_adaptive_config"), dict):
            kwargs["speculative_adaptive_config"] = json.dumps(
                kwargs["speculative_adaptive_config"]
            )
        self._shut_down = False
        # one event loop serves every call: threads calling at once take turns on it (a
        # second run_until_complete raised "This event loop is already running")
        self._loop_lock = threading.RLock()
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager, self.procs = launch_subprocesses(self.server_args)
        self.server_args = self.tokenizer_manager.server_args
        atexit.register(self.shutdown)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        rid: str | list[str] | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (a dict) or a list (a list of dicts); with stream=True an
        iterator of partial outputs. Raises ValueError for a bad request (naming the field),
        RuntimeError once the engine is shut down."""
        self._check_running()
        check_engine_inputs(prompt, sampling_params, input_ids)
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            stream=stream,
        )
        gen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return self._iterate(gen)
        return self._run(gen.__anext__())

    def _iterate(self, agen) -> Iterator[dict]:
        while True:
            try:
                yield self._run(agen.__anext__())
            except StopAsyncIteration:
                return

    def _run(self, aw: Any) -> Any:
        """Run awaitable `aw` on the engine's loop, one caller at a time."""
        with self._loop_lock:
            return self.loop.run_until_complete(aw)

    def _check_running(self) -> None:
        """RuntimeError after shutdown() or once the scheduler process has exited (a request
        would wait for it forever)."""
        if self._shut_down:
            raise RuntimeError("the engine is shut down; create a new Engine")
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"the scheduler process exited (code {dead[0].exitcode}); create a new Engine"
            )

    def get_server_info(self) -> dict:
        """The resolved server arguments and the scheduler's state, both at the top level and
        (as GET /get_server_info returns it) under "internal_states"."""
        self._check_running()
        state = self._run(self.tokenizer_manager.get_internal_state())
        info = {k: v for k, v in dataclasses.asdict(self.server_args).items() if k != "api_key"}
        return {**info, **state, "internal_states": [state]}

    def flush_cache(self) -> bool:
        self._check_running()
        return self._run(self.tokenizer_manager.flush_cache())

    def shutdown(self) -> None:
        self._shut_down = True
        task = getattr(getattr(self, "tokenizer_manager", None), "_handle_task", None)
        if task is not None and not task.done() and not self.loop.is_closed():
            task.cancel()
            self._run(asyncio.gather(task, return_exceptions=True))
        for p in getattr(self, "procs", []):
            if p.is_alive():
                kill_process_tree(p.pid)
        self.procs = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# Engine.generate's argument -> (GenerateReqInput field, the types it takes)
_ENGINE_INPUTS = {
    "prompt": ("text", "a str or a list of str"),
    "sampling_params": ("sampling_params", "a dict or a list of dicts"),
    "input_ids": ("input_ids", "a list of ints or a list of lists of ints"),
}


def check_engine_inputs(prompt: Any, sampling_params: Any, input_ids: Any) -> None:
    """ValueError naming the argument when Engine.generate's prompt, sampling_params or
    input_ids has a type /generate refuses too (io_struct.GENERATE_FIELD_TYPES); values are
    checked later, as for HTTP requests."""
    given = {"prompt": prompt, "sampling_params": sampling_params, "input_ids": input_ids}
    for arg, value in given.items():
        field, expected = _ENGINE_INPUTS[arg]
        if value is not None and not GENERATE_FIELD_TYPES[field](value):
            raise ValueError(f"{arg} must be {expected}, got {type(value).__name__}")


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

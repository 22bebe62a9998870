"""The hidden state pool: every target forward of a speculative server writes the hidden states
of its tokens into the rows of their KV slots, so the rows of a request's slots are the target
hidden states of its positions whichever step computed them (prefill, plain decode, verify),
eager or through the CUDA-graph runner's static batches, and the catch-up reads them there."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.mem_cache.hidden_state_pool import HiddenStatePool, spec_hidden_width
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.test.scheduler_utils import make_scheduler, run_until_idle, submit

K = 3
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [17, 4051, 998, 12, 3070, 451, 23, 9, 1402, 77, 310]


def test_write_read_and_shape_errors():
    pool = HiddenStatePool(8, 4, torch.float32, "cpu")
    assert pool.buffer.shape == (9, 4)
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    pool.write(torch.tensor([5, 1, 7]), rows)
    assert torch.equal(pool.read(torch.tensor([7, 5])), rows[[2, 0]])
    assert torch.equal(pool.buffer[0], torch.zeros(4))  # untouched rows stay
    with pytest.raises(ValueError, match="width 4"):
        pool.write(torch.tensor([1]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="2 slots"):
        pool.write(torch.tensor([1, 2]), torch.zeros(3, 4))
    assert HiddenStatePool.bytes_per_token(12, torch.bfloat16) == 24


def test_width_by_algorithm():
    assert spec_hidden_width("EAGLE3", 64) == 192  # three aux layers concatenated
    assert spec_hidden_width("eagle", 64) == 64  # the final hidden state
    assert spec_hidden_width(None, 64) == 0  # no speculation: no pool


def _scheduler(tiny_model_dir, draft_dir, graphs: bool, **kw):
    sched = make_scheduler(
        tiny_model_dir,
        dtype="float32",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=K,
        **kw,
    )
    if graphs:  # the CUDA-graph runners a CUDA server has, run eagerly over padded batches
        worker = sched.tp_worker
        runner, sizes = worker.model_runner, [1, 2, 4]
        mode = CaptureHiddenMode.LAST
        runner.cuda_graph_runner = CudaGraphRunner(runner, mode, K + 1, sizes, use_graphs=False)
        worker.draft.init_cuda_graphs(sizes, K + 1, use_graphs=False)
        # whole greedy drafting steps (they gather the catch-up rows from the pool)
        assert worker.draft.init_chain_graphs(worker.hidden_pool, sizes, K, use_graphs=False)
    return sched


def _rows(sched, tokens: list[int]) -> torch.Tensor:
    """The pool rows of the cached KV slots of `tokens` (all of them must be cached)."""
    m = sched.tree_cache.match_prefix(tokens)
    assert len(m.device_indices) == len(tokens)
    pool = sched.tp_worker.hidden_pool
    return pool.read(m.device_indices.to(pool.buffer.device, torch.int64)).clone()


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("drafting", [False, True])
def test_rows_of_decoded_positions_equal_a_prefill_of_the_same_tokens(
    tiny_model_dir, draft_dir, graphs, drafting
):
    """A request decoded with drafts (verify steps) or without (plain steps, every d_i = 0)
    leaves in the rows of its KV slots the hidden states a single prefill of its tokens
    computes: a wrong slot, a missing write or a rejected draft's row in a kept slot fails."""
    sched = _scheduler(tiny_model_dir, draft_dir, graphs, disable_overlap_schedule=True)
    if not drafting:  # every step plain (d_i = 0), as under load
        sched.spec.choose_draft_lens = lambda reqs: [0] * len(reqs)
    outs: dict = {}
    submit(sched, "r", PROMPT, GREEDY)
    run_until_idle(sched, outs)
    verified = sched.spec.stats["spec_drafting_steps"]
    assert (verified > 0) == drafting
    check_rows_equal_a_prefill(sched, outs["r"]["output_ids"], tiny_model_dir, draft_dir, 1e-3)


def check_rows_equal_a_prefill(sched, out, tiny_model_dir, draft_dir, tol: float, **kw) -> None:
    """The pool rows of PROMPT + out[:-1] in sched equal those of one prefill of the same tokens
    by a fresh scheduler (kw: its settings)."""
    tokens = PROMPT + out[:-1]  # the positions with KV (the last token was never computed)
    decoded = _rows(sched, tokens)
    ref = _scheduler(tiny_model_dir, draft_dir, graphs=False, **kw)
    submit(ref, "p", tokens, {**GREEDY, "max_new_tokens": 1})
    run_until_idle(ref, {})
    prefilled = _rows(ref, tokens)
    assert decoded.shape == (len(tokens), 3 * ref.model_config.hidden_size)
    assert prefilled.abs().sum(-1).min() > 0  # every row written
    # float32; decode and prefill reduce in different orders (a misplaced row differs by O(0.1))
    torch.testing.assert_close(decoded.cpu(), prefilled.cpu(), atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("drafting", [False, True])
def test_rows_written_inside_cuda_graphs(tiny_model_dir, draft_dir, drafting):
    """The same through a CUDA server's own captured graphs (decode and verify replays write
    the pool inside the graph) with overlap scheduling."""
    kw = {"device": "cuda", "attention_backend": "triton", "max_total_tokens": 4096}
    sched = _scheduler(tiny_model_dir, draft_dir, False, **kw)
    assert sched.tp_worker.model_runner.cuda_graph_runner is not None
    if not drafting:
        sched.spec.choose_draft_lens = lambda reqs: [0] * len(reqs)
    outs: dict = {}
    submit(sched, "r", PROMPT, GREEDY)
    run_until_idle(sched, outs)
    assert (sched.spec.stats["spec_drafting_steps"] > 0) == drafting
    kw["disable_cuda_graph"] = True  # the reference prefill runs eagerly
    check_rows_equal_a_prefill(
        sched, outs["r"]["output_ids"], tiny_model_dir, draft_dir, 5e-3, **kw
    )

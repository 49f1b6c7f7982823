"""CUDAGraphWrapper: pass-through rules on any device; capture, replay and nesting on a GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from compiled_llm.compilation import (
    BatchDescriptor,
    CUDAGraphMode,
    CUDAGraphWrapper,
    capture_phase,
    set_forward_context,
)
from compiled_llm.compilation.counters import counters
from compiled_llm.compilation.cuda_graph import DEBUG_ENV, cudagraph_state, weak_ref_tensors

M = CUDAGraphMode


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.reset()
    yield
    counters.reset()


class Recorder:
    """A runnable that counts its calls, to tell pass-through from capture."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 2


HIDDEN = 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Piece(nn.Module):
    """A compiled piece: it also allocates the buffer the eager op between pieces writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.linear(x))
        return h, torch.empty_like(h)


class TwoPieces(nn.Module):
    """Two pieces with an eager 'attention' between them, as the split graph runs them."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.pieces = nn.ModuleList([Piece(), Piece()])
        self.runnables = [CUDAGraphWrapper(p, M.PIECEWISE) if wrap else p for p in self.pieces]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = self.runnables[0](x)
        torch.mul(h, h.sum(-1, keepdim=True), out=out)
        return self.runnables[1](out)[0]


def nested_and_eager(device: str) -> tuple[TwoPieces, CUDAGraphWrapper, TwoPieces]:
    """A FULL wrapper over a model whose pieces have PIECEWISE wrappers, and an unwrapped twin."""
    torch.manual_seed(0)
    model, eager = TwoPieces(wrap=True).to(device), TwoPieces(wrap=False).to(device)
    eager.load_state_dict(model.state_dict())
    return model, CUDAGraphWrapper(model, M.FULL), eager


def fill(buffer: torch.Tensor, seed: int) -> None:
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)))


def run(model, x: torch.Tensor, mode: CUDAGraphMode, n: int) -> torch.Tensor:
    with set_forward_context(None, mode, BatchDescriptor(n)):
        return model(x[:n]).clone()


@pytest.mark.parametrize("wrapper_mode", [M.FULL, M.PIECEWISE])
def test_passes_through_without_a_forward_context(wrapper_mode):
    inner = Recorder()
    wrapper = CUDAGraphWrapper(inner, wrapper_mode)
    x = torch.arange(4.0)
    assert torch.equal(wrapper(x), x * 2)
    assert inner.calls == 1 and wrapper.entries == {}


@pytest.mark.parametrize(
    "wrapper_mode, context_mode",
    [(M.FULL, M.NONE), (M.FULL, M.PIECEWISE), (M.PIECEWISE, M.NONE), (M.PIECEWISE, M.FULL)],
)
def test_passes_through_when_the_context_mode_is_not_its_own(wrapper_mode, context_mode):
    inner = Recorder()
    wrapper = CUDAGraphWrapper(inner, wrapper_mode)
    x = torch.arange(4.0)
    # Outside the capture phase, so anything but a pass-through would raise.
    with set_forward_context(None, context_mode, BatchDescriptor(4)):
        assert torch.equal(wrapper(x), x * 2)
    assert inner.calls == 1 and wrapper.entries == {}
    assert counters.num_cudagraph_captured == counters.num_cudagraph_replayed == 0


def test_passes_through_without_a_batch_descriptor():
    inner = Recorder()
    wrapper = CUDAGraphWrapper(inner, M.FULL)
    with set_forward_context(None, M.FULL, None):
        wrapper(torch.ones(2))
    assert inner.calls == 1


def test_new_descriptor_after_the_capture_phase_is_a_clear_error():
    inner = Recorder()
    wrapper = CUDAGraphWrapper(inner, M.PIECEWISE, name="piece_0")
    with set_forward_context(None, M.PIECEWISE, BatchDescriptor(8)):
        with pytest.raises(RuntimeError, match=r"piece_0.*BatchDescriptor\(num_tokens=8.*capture phase"):
            wrapper(torch.ones(8))
    assert inner.calls == 0


@pytest.mark.parametrize("mode", [M.NONE, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_wrapper_mode_is_full_or_piecewise(mode):
    with pytest.raises(ValueError, match="FULL or PIECEWISE"):
        CUDAGraphWrapper(Recorder(), mode)


def test_attributes_of_the_runnable_are_reachable():
    linear = nn.Linear(4, 2)
    wrapper = CUDAGraphWrapper(linear, M.FULL)
    assert wrapper.out_features == 2 and wrapper.weight is linear.weight
    assert "Linear" in repr(wrapper) and "FULL" in repr(wrapper)
    with pytest.raises(AttributeError):
        _ = wrapper.no_such_attribute


def test_debug_check_follows_the_environment(monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert CUDAGraphWrapper(Recorder(), M.FULL).debug
    assert not CUDAGraphWrapper(Recorder(), M.FULL, debug=False).debug
    monkeypatch.setenv(DEBUG_ENV, "0")
    assert not CUDAGraphWrapper(Recorder(), M.FULL).debug


def test_capture_phase_is_scoped():
    assert not cudagraph_state.capturing
    with capture_phase():
        assert cudagraph_state.capturing
        with capture_phase():
            assert cudagraph_state.capturing
        assert cudagraph_state.capturing
    assert not cudagraph_state.capturing


def test_weak_refs_alias_outputs_without_keeping_them_alive():
    owner = torch.arange(12.0).reshape(3, 4)
    view = owner[1:]
    refs = weak_ref_tensors((view, [owner], None, 3))
    alias = refs[0]
    assert alias.data_ptr() == view.data_ptr()
    assert alias.shape == view.shape and alias.stride() == view.stride()
    assert refs[2:] == (None, 3) and refs[1][0].data_ptr() == owner.data_ptr()
    owner[2, 0] = -1.0
    assert alias[1, 0].item() == -1.0
    storage = StorageWeakRef(owner.untyped_storage())
    del owner, view
    assert storage.expired()  # only the aliases remain, and they do not own the memory


def test_nested_wrappers_pass_through_in_eager_mode():
    _, outer, eager = nested_and_eager("cpu")
    x = torch.randn(3, HIDDEN)
    with torch.no_grad(), set_forward_context(None, M.NONE, BatchDescriptor(3)):
        torch.testing.assert_close(outer(x), eager(x))


def test_outer_full_wrapper_hands_a_piecewise_step_to_the_pieces():
    _, outer, _ = nested_and_eager("cpu")
    # Outside the capture phase the first wrapper that acts raises: for a PIECEWISE step that is
    # the first piece, proving the FULL wrapper passed the call through.
    with set_forward_context(None, M.PIECEWISE, BatchDescriptor(3)):
        with pytest.raises(RuntimeError, match=r"CUDAGraphWrapper\(Piece, PIECEWISE\)"):
            outer(torch.randn(3, HIDDEN))
    with set_forward_context(None, M.FULL, BatchDescriptor(3)):
        with pytest.raises(RuntimeError, match=r"CUDAGraphWrapper\(TwoPieces, FULL\)"):
            outer(torch.randn(3, HIDDEN))


# GPU: the real capture and replay.

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL])
def test_capture_then_replay_returns_the_eager_result(mode):
    torch.manual_seed(0)
    mlp = MLP().cuda()
    wrapper = CUDAGraphWrapper(mlp, mode)
    x = torch.empty(16, HIDDEN, device="cuda")  # the persistent input buffer
    sizes = [16, 8, 4]  # largest first, as at start-up
    with torch.no_grad():
        fill(x, 0)
        with capture_phase():
            for n in sizes:
                torch.testing.assert_close(run(wrapper, x, mode, n), mlp(x[:n]))
        assert counters.num_cudagraph_captured == len(sizes)
        assert counters.num_cudagraph_replayed == 0
        for seed, n in enumerate(sizes * 2, start=1):
            fill(x, seed)  # new values, same addresses
            torch.testing.assert_close(run(wrapper, x, mode, n), mlp(x[:n]))
    assert counters.num_cudagraph_captured == len(sizes)  # replays capture nothing new
    assert counters.num_cudagraph_replayed == 2 * len(sizes)
    assert set(wrapper.entries) == {BatchDescriptor(n) for n in sizes}


@cuda
@pytest.mark.parametrize("context_mode", [M.FULL, M.PIECEWISE])
def test_full_over_piecewise_captures_only_the_wrapper_of_the_context_mode(context_mode):
    model, outer, eager = nested_and_eager("cuda")
    x = torch.empty(8, HIDDEN, device="cuda")
    with torch.no_grad():
        fill(x, 0)
        with capture_phase():
            torch.testing.assert_close(run(outer, x, context_mode, 8), eager(x))
        fill(x, 1)
        torch.testing.assert_close(run(outer, x, context_mode, 8), eager(x))
    inner = model.runnables
    if context_mode is M.FULL:
        assert counters.num_cudagraph_captured == 1
        assert len(outer.entries) == 1 and all(not w.entries for w in inner)
        assert counters.num_cudagraph_replayed == 1
    else:
        assert counters.num_cudagraph_captured == 2
        assert not outer.entries and all(len(w.entries) == 1 for w in inner)
        assert counters.num_cudagraph_replayed == 2


@cuda
def test_capture_after_the_capture_phase_raises():
    wrapper = CUDAGraphWrapper(MLP().cuda(), M.FULL)
    x = torch.zeros(8, HIDDEN, device="cuda")
    with torch.no_grad():
        with capture_phase():
            run(wrapper, x, M.FULL, 8)
        run(wrapper, x, M.FULL, 8)
        with pytest.raises(RuntimeError, match=r"BatchDescriptor\(num_tokens=4"):
            run(wrapper, x, M.FULL, 4)
    assert counters.num_cudagraph_captured == 1


@cuda
def test_debug_check_rejects_inputs_at_new_addresses():
    wrapper = CUDAGraphWrapper(MLP().cuda(), M.PIECEWISE, debug=True)
    x = torch.zeros(8, HIDDEN, device="cuda")
    with torch.no_grad():
        with capture_phase():
            run(wrapper, x, M.PIECEWISE, 8)
        run(wrapper, x, M.PIECEWISE, 8)
        with pytest.raises(RuntimeError, match="captured at"):
            run(wrapper, x.clone(), M.PIECEWISE, 8)


@cuda
def test_entries_hold_outputs_weakly():
    torch.manual_seed(0)
    mlp = MLP().cuda()
    wrapper = CUDAGraphWrapper(mlp, M.FULL)
    x = torch.empty(8, HIDDEN, device="cuda")
    with torch.no_grad(), set_forward_context(None, M.FULL, BatchDescriptor(8)):
        fill(x, 0)
        with capture_phase():
            output = wrapper(x)
        storage = StorageWeakRef(output.untyped_storage())
        del output
        assert storage.expired()  # the block is back in the pool for later captures
        fill(x, 1)
        torch.testing.assert_close(wrapper(x), mlp(x))


@cuda
def test_only_the_first_capture_of_a_phase_collects_garbage(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append(1) or 0)
    wrapper = CUDAGraphWrapper(MLP().cuda(), M.PIECEWISE)
    x = torch.zeros(8, HIDDEN, device="cuda")
    with torch.no_grad(), capture_phase():
        run(wrapper, x, M.PIECEWISE, 8)
        after_first = len(calls)
        run(wrapper, x, M.PIECEWISE, 4)
        run(wrapper, x, M.PIECEWISE, 2)
    assert after_first >= 1 and len(calls) == after_first

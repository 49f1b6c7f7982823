"""Chat templates rendered in worker processes, so that no template can stall or sink the server.

A chat template is a Jinja program: one sent with a request (`chat_template`, when the operator
allows it) can loop for hours or build a string of many gigabytes. A thread cannot be stopped,
so rendering runs in a small pool of spawned processes. Each render has a deadline; a worker
that misses it is killed and replaced, and its request gets a 400. A worker's memory is capped
(`RLIMIT_AS`), so a template that builds a huge string fails there instead of in the server.
Other requests keep flowing meanwhile, on the other workers, and nothing a worker does can keep
the server from exiting. A render whose client leaves is not a fault of its worker: the worker
rejoins the pool once its unwanted answer arrives (a fresh worker takes seconds to start, and 100
clients giving up at once would otherwise replace every worker and stall the next request).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import resource
from multiprocessing.connection import Connection
from typing import Any

from compiled_llm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_NUM_WORKERS = 2
# Address space a worker may grow to beyond what it holds once its tokenizer is loaded.
_MEMORY_HEADROOM_BYTES = 2 << 30


class ChatTemplateError(ValueError):
    """The template could not render this conversation (the message says why): a 400."""


def _address_space_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _worker_main(model: str, conn: Connection) -> None:
    """A render worker: load the chat template, then render what it is sent until its pipe closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    from compiled_llm.engine.tokenizer_snapshot import load_chat_templates

    templates = load_chat_templates(model)  # from the tokenizer's snapshot: no vocabulary to read
    if templates is None:
        from compiled_llm.engine.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(model)
        render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
    else:
        render = templates.render
    used = _address_space_bytes()
    if used is not None:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (used + _MEMORY_HEADROOM_BYTES, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            pass
    try:
        conn.send(("ready", None))
    except OSError:  # the server went away while this loaded
        return
    while True:
        try:
            messages, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = render(messages, **kwargs)
            reply = ("ok", text if isinstance(text, str) else str(text))
        except MemoryError:
            reply = ("error", "the chat template used more memory than a render may")
        except Exception as e:  # the template's own error (roles, raise_exception, ...)
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


class _Worker:
    def __init__(self, model: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(model, child), name="ChatTemplateWorker", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    async def receive(self, timeout: float | None) -> Any:
        """The worker's next message, waiting at most `timeout` seconds, without blocking the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: future.done() or future.set_result(None))
        try:
            await asyncio.wait_for(future, timeout)
        finally:
            loop.remove_reader(fd)
            # uvloop leaves a watched fd non-blocking: a large message would then be cut short
            # (BlockingIOError) on this pipe's next send or receive, which expect a blocking fd.
            os.set_blocking(fd, True)
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ChatTemplateRenderer:
    """A pool of render workers for one model's tokenizer (its chat template and special tokens)."""

    def __init__(
        self, model: str, num_workers: int = DEFAULT_NUM_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self._workers = [_Worker(model) for _ in range(num_workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self._closed = False
        self._reclaiming: set[asyncio.Task] = set()  # workers finishing a render nobody waits for

    def _pool(self) -> asyncio.Queue[_Worker]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for worker in self._workers:
                self._idle.put_nowait(worker)
        return self._idle

    async def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The conversation as text; raises `ChatTemplateError` for a template that fails, runs
        past the deadline or runs out of memory."""
        if self._closed:
            raise RuntimeError("the chat template renderer is shut down")
        idle = self._pool()
        worker = await idle.get()
        outcome = "idle"  # what becomes of the worker: back to the pool, replaced, or reclaimed
        try:
            if not worker.ready:  # its first message says the tokenizer is loaded
                await worker.receive(None)
                worker.ready = True
            worker.conn.send((messages, kwargs))
            kind, value = await worker.receive(self.timeout_s)
        except asyncio.TimeoutError:
            outcome = "replace"
            raise ChatTemplateError(f"rendering the chat template took longer than {self.timeout_s:g} s") from None
        except (EOFError, OSError, BrokenPipeError):
            outcome = "replace"
            raise ChatTemplateError("the chat template's render worker died (out of memory?)") from None
        except asyncio.CancelledError:  # its client left: the worker is sound, its answer unwanted
            outcome = "reclaim"
            raise
        except BaseException:
            outcome = "replace"
            raise
        finally:
            if outcome == "replace":
                self._replace(worker)
            elif outcome == "reclaim":
                task = asyncio.get_running_loop().create_task(self._reclaim(worker))
                self._reclaiming.add(task)
                task.add_done_callback(self._reclaiming.discard)
            else:
                idle.put_nowait(worker)
        if kind != "ok":
            raise ChatTemplateError(value)
        return value

    async def _reclaim(self, worker: _Worker) -> None:
        """Wait for the message the cancelled render was waiting for (its tokenizer being ready, or
        its answer, within the deadline), then give the worker back; replace it past the deadline."""
        try:
            await worker.receive(None if not worker.ready else self.timeout_s)
        except asyncio.CancelledError:  # the server is stopping
            return
        except (asyncio.TimeoutError, EOFError, OSError):
            self._replace(worker)
            return
        worker.ready = True
        if not self._closed:
            self._pool().put_nowait(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        if self._closed:
            return
        fresh = _Worker(self.model)
        self._workers.append(fresh)
        self._pool().put_nowait(fresh)

    def shutdown(self) -> None:
        self._closed = True
        for task in self._reclaiming:
            task.cancel()
        for worker in self._workers:
            worker.kill()
        self._workers.clear()

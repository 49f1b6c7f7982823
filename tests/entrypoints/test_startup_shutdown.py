"""Issue 25: a warm start and a prompt shutdown.

`compiled-llm serve` forks its engine core (on a CPU) before it imports the server stack, so the two
load side by side and the engine skips the imports the server made for the config. These tests
check what that must keep: a warm start of the bundled model still makes no Inductor compilation,
SIGTERM ends an idle server and its engine within a few seconds (a generous bound: it takes about
one on an idle 2-core machine; the timing itself is benchmarks/startup.py's), and a forked engine
still exits when its client goes (it must not hold the client's end of the start-up pipe itself).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import httpx
import psutil
from remote_server import RemoteServer

STOP_BOUND_S = 10


def test_warm_bundled_server_starts_without_compiling_and_stops_promptly(real_model_path, warm_compile_cache):
    server = RemoteServer([real_model_path, "-O1", "--require-cache-hit", "--max-model-len", "1024"])
    try:
        log = server.read_log()
        assert "0 Inductor compilations" in log, log
        assert "Engine core 0 (pid" in log, log
        engine = server.engine_process()
        assert engine.ppid() == server.proc.pid
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        children = server.children_alive()
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        elapsed = time.monotonic() - started
        assert alive == []
        assert elapsed < STOP_BOUND_S, f"the server and its processes took {elapsed:.1f} s to end"
        assert "Engine core exited." in server.read_log()
    finally:
        server.stop()


FORKED_ENGINE = textwrap.dedent("""
    import sys, time
    from compiled_llm.engine.arg_utils import EngineArgs
    from compiled_llm.engine.engine_process import EngineProcess

    config = EngineArgs(model=sys.argv[1], optimization_level=0, max_model_len=256,
                        kv_cache_memory_bytes=16 << 20).create_engine_config()
    engine = EngineProcess(config, fork=True)
    engine.start(engine.output_bind_address)  # before its client binds: the socket queues meanwhile
    assert type(engine.proc._popen).__module__ == "multiprocessing.popen_fork", type(engine.proc._popen)
    handshake = engine.wait_ready()
    assert handshake.ok and handshake.num_blocks > 0, handshake
    engine.start(engine.output_bind_address)  # the client's own start: nothing more happens
    try:
        engine.start("ipc:///elsewhere")
        raise AssertionError("a second start to another address was accepted")
    except ValueError:
        pass
    engine._conn.close()  # the client goes without a word: the engine sees its pipe end
    engine.join(20)
    print("exit code", engine.proc.exitcode)
""")


def test_forked_engine_starts_and_exits_when_its_client_goes(tiny_llama):
    """In a fresh process: a fork is safe only where no torch computation ran before it (this
    test process has run many)."""
    out = subprocess.run([sys.executable, "-c", FORKED_ENGINE, tiny_llama], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    assert "exit code 0" in out.stdout, out.stdout + out.stderr[-5000:]

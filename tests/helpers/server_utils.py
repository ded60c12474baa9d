"""A ``vllm serve`` subprocess for the server tests (``test_engine_serve``, ``test_engine_beams_serve``): started,
waited for until ``/health`` answers, stopped at the end. Sets no environment of its own (the caller passes the
server's, e.g. ``vllm_dsbd/testing/server.server_env``)."""
import contextlib
import subprocess
import time
import urllib.error
import urllib.request

import pytest


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, env: dict, log_path, timeout_s: float = 240.0):
    """Starts ``cmd`` (a ``vllm serve`` command line listening on 127.0.0.1:``port``) with its output in
    ``log_path``, waits for ``/health``, yields ``(base_url, process, tail)`` (``tail()``: the log's last 4000
    characters, for failure messages) and stops the server at the end."""
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

        def tail() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-4000:]

        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{tail()}")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"server not healthy in {timeout_s:.0f} s:\n{tail()}")
                time.sleep(1)
            yield base, proc, tail
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

"""Every snippet of the README runs as written, on the tiny random Llama pair where the README names SmolLM2's folders.

Read from ``README.md`` itself (a snippet that changes is tested as it now reads):

* the offline ```` ```python ```` block, run as a script (``TARGET`` / ``DRAFT`` defined before it, the engine core in
  a spawned child process as vLLM runs it by default, which is what its ``__main__`` guard is for): it exits 0 and
  prints the best beam's text and a cumulative log-probability;
* the serve command (the indented ``.venv/bin/vllm serve ...`` block, with this environment's ``vllm`` program, the
  tiny folders for SmolLM2's and ``--host``/``--port`` added; every flag as written): one server for all requests;
* the ``curl`` request as written (host and port replaced): a completion of the served model with 8 tokens;
* the request fragments the README names (``"vllm_xargs": {"dsbd_width": 1}``, ``"use_beam_search": true, "n": 4``),
  each merged into the curl request's body and sent with the same curl command: 200, and 4 choices for the beams.

The environment is the serve tests' (``server_env``: the KV cache capped at 1 GiB with ``VLLM_CPU_KVCACHE_SPACE``,
one thread per process); ``scripts/demo.sh`` and ``scripts/test.sh`` are not run here (the demo has its own smoke
test, the tests are this suite).
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import vllm  # noqa: F401  (a broken vLLM must fail the suite, never skip it)

from engine_utils import tiny_pair
from server_utils import running_server

from vllm_dsbd.testing.server import free_port, server_env

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text()
STARTUP_TIMEOUT_S = 360
LOG_LINE = re.compile(r"^(\([^)]*pid=\d+\) )*(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d ")  # "(Worker pid=..) (EngineCore pid=..) INFO"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", TEXT, re.S)


def _serve_command() -> list[str]:
    """The indented serve block, its continuation lines joined."""
    m = re.search(r"^    (\.venv/bin/vllm serve .*?)\n\n", TEXT, re.S | re.M)
    assert m, "README has no indented `.venv/bin/vllm serve` block"
    return shlex.split(m.group(1).replace("\\\n", " "))


def _curl_command() -> list[str]:
    m = re.search(r"`(curl localhost:8000/v1/completions .*?)`", TEXT, re.S)
    assert m, "README has no curl request"
    return shlex.split(m.group(1).replace("\n", " "))


def _fragments() -> list[dict]:
    """The inline request fragments (``"key": value, ...`` in backticks) the README adds to a request."""
    found = re.findall(r'`("(?:vllm_xargs|use_beam_search)"[^`]*)`', TEXT)
    return [json.loads("{" + f + "}") for f in found]


def test_the_readme_has_what_this_test_runs():
    assert len(_python_blocks()) == 1
    assert _serve_command()[:3] == [".venv/bin/vllm", "serve", "~/.cache/vllm-dsbd/smollm2-135m-instruct"]
    assert _curl_command()[0] == "curl"
    assert _fragments() == [{"vllm_xargs": {"dsbd_width": 1}}, {"use_beam_search": True, "n": 4}]


def test_offline_snippet_runs(tmp_path):
    target, draft = tiny_pair()
    script = tmp_path / "snippet.py"
    script.write_text(f"TARGET = {str(target)!r}\nDRAFT = {str(draft)!r}\n" + _python_blocks()[0])
    proc = subprocess.run([sys.executable, str(script)], env=server_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # vLLM logs to stdout too: what the snippet printed is what is not a log record (the beam's text may hold
    # newlines); its last line ends with the best beam's cumulative log-probability
    printed = [ln for ln in proc.stdout.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    print("snippet printed:", printed)
    assert printed and float(printed[-1].rsplit(None, 1)[-1]) < 0, proc.stdout[-4000:]


def _curl(cmd: list[str], port: int, body: dict | None = None) -> dict:
    cmd = [a.replace("localhost:8000", f"127.0.0.1:{port}") for a in cmd]
    if body is not None:
        cmd[cmd.index("-d") + 1] = json.dumps(body)
    proc = subprocess.run(cmd + ["-sS", "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    payload, code = proc.stdout.rsplit("\n", 1)
    return {"code": int(code), "json": json.loads(payload)}


def test_serve_command_and_requests(tmp_path):
    target, draft = tiny_pair()
    cmd = _serve_command()
    folders = {"~/.cache/vllm-dsbd/smollm2-135m-instruct": str(target),
               "~/.cache/vllm-dsbd/draft-smollm2-135m-2l": str(draft)}
    assert set(folders) <= set(cmd), cmd
    cmd = [folders.get(a, a) for a in cmd]
    cmd[0] = str(Path(sys.executable).parent / "vllm")
    port = free_port()
    with running_server(cmd + ["--host", "127.0.0.1", "--port", str(port)], port, server_env(),
                        tmp_path / "server.log", STARTUP_TIMEOUT_S) as (_, _, tail):
        curl = _curl_command()
        plain = _curl(curl, port)
        print("curl as written:", plain)
        assert plain["code"] == 200, (plain, tail())
        assert plain["json"]["model"] == "smollm2-dsbd" and plain["json"]["usage"]["completion_tokens"] == 8
        body = json.loads(curl[curl.index("-d") + 1])
        for frag in _fragments():
            got = _curl(curl, port, {**body, **frag})
            print(frag, got["code"], [c["text"] for c in got["json"].get("choices", [])])
            assert got["code"] == 200, (frag, got, tail())
            assert len(got["json"]["choices"]) == frag.get("n", 1)

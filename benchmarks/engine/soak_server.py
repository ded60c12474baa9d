"""The soak's server side: the ``vllm serve`` command line, an HTTP client over loopback, health and KV-cache
readings from ``/metrics``, and stopping the server with every process it started (``soak.py``)."""

from __future__ import annotations

import http.client
import json
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any


MODEL_NAME = "tiny-dsbd"
ENGINE_WIDTH = 4
DEPTH = 2
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 256
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# ----------------------------------------------------------------------------------------------------------------
# server
# ----------------------------------------------------------------------------------------------------------------
def serve_cmd(target, draft, port: int, chat_template) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-method", "dsbd", "--spec-model", str(draft), "--spec-tokens", str(DEPTH),
            # pinned shapes (cost model off): the soak stresses forests under load, and the cost model would switch
            # the tiny pair's draft off on a CPU (no forests at all, seen 2026-11-26)
            "--speculative-config", json.dumps({"width": ENGINE_WIDTH, "cost_model": None}),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--chat-template", str(chat_template),
            "--enable-log-requests"]  # logs "Aborted request(s) ..." when a client goes away


class Client:
    """HTTP/1.1 over loopback with http.client, one connection per request."""

    def __init__(self, port: int, timeout: float):
        self.port, self.timeout = port, timeout

    def _conn(self, timeout=None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout or self.timeout)

    def get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        conn = self._conn(timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, path: str, payload: dict) -> tuple[int, bytes]:
        conn = self._conn()
        try:
            conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post_stream(self, path: str, payload: dict, stop_after: int | None = None):
        """Streams server-sent events. Returns (status, events, done, body): ``events`` the decoded ``data:``
        objects, ``done`` whether ``[DONE]`` came. ``stop_after=k``: close the connection after k events."""
        conn = self._conn()
        try:
            conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                return r.status, [], False, r.read()
            events, done = [], False
            while True:
                raw = r.readline()
                if not raw:
                    break
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
                if stop_after is not None and len(events) >= stop_after:
                    break  # the client goes away mid-stream
            return r.status, events, done, b""
        finally:
            if stop_after is not None:
                try:  # a hard close (RST-free but immediate): shut the socket down before closing it
                    if conn.sock is not None:
                        conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()


def wait_healthy(client: Client, proc: subprocess.Popen, timeout: float, log_path: pathlib.Path) -> float:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{tail(log_path)}")
        try:
            if client.get("/health", timeout=5)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"server not healthy in {timeout:.0f} s:\n{tail(log_path)}")
        time.sleep(1)


def tail(path: pathlib.Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def kv_reading(client: Client) -> dict[str, Any]:
    """KV-cache usage from /metrics: the gauge (fraction of blocks in use) and the engine's block count."""
    status, body = client.get("/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    usage, blocks, finished = None, None, {}
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name == "vllm:kv_cache_usage_perc":
            usage = float(value)
        elif name == "vllm:request_success_total" and labels:
            reason = re.search(r'finished_reason="([^"]*)"', labels)
            if reason:
                finished[reason.group(1)] = finished.get(reason.group(1), 0) + int(float(value))
        elif name == "vllm:cache_config_info" and labels:
            b = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if b:
                blocks = int(b.group(1))
    if usage is None:
        raise RuntimeError("/metrics has no vllm:kv_cache_usage_perc")
    # BlockPool.get_usage: 1 - free / (num_gpu_blocks - 1) (the null block is never free)
    used = round(usage * (blocks - 1)) if blocks else None
    return {"usage": usage, "num_blocks": blocks, "used_blocks": used, "finished_requests": finished}


# DSBD's counters that show the server drafted and verified forests (plain requests, then beam requests)
DSBD_COUNTERS = {"forests": "vllm:dsbd_iterations_total", "nodes": "vllm:dsbd_draft_nodes_total",
                 "layers_passed": "vllm:dsbd_layers_passed_sum", "beam_passes": "vllm:dsbd_beam_target_passes_total",
                 "beam_steps": "vllm:dsbd_beam_steps_total", "beam_nodes": "vllm:dsbd_beam_draft_nodes_total",
                 "beam_layers_passed": "vllm:dsbd_beam_layers_passed_total"}


def dsbd_reading(client: Client) -> dict[str, float]:
    """DSBD's counters from /metrics (``DSBD_COUNTERS``; 0 for one the server does not show)."""
    status, body = client.get("/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = {k: 0.0 for k in DSBD_COUNTERS}
    names = {v: k for k, v in DSBD_COUNTERS.items()}
    for line in body.decode(errors="replace").splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in names:
            out[names[m.group(1)]] += float(m.group(3))
    return out


def probe(client: Client) -> None:
    """A one-token request: makes the engine take a step, which refreshes the KV-usage gauge."""
    status, body = client.post("/v1/completions", {"model": MODEL_NAME, "prompt": "probe", "max_tokens": 1,
                                                   "temperature": 0})
    if status != 200:
        raise RuntimeError(f"probe request answered {status}: {body[:300]!r}")


def _children(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_server(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """SIGTERM, then waits for the server and every process it started. Kills what is left (and says so)."""
    import psutil

    children = _children(proc.pid)
    info: dict[str, Any] = {"children_before": [{"pid": c.pid, "name": _name(c)} for c in children]}
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        info["returncode"] = proc.wait(timeout=timeout)
        info["exited_by_itself"] = True
    except subprocess.TimeoutExpired:
        info["exited_by_itself"] = False
        proc.kill()
        info["returncode"] = proc.wait()
    info["exit_s"] = round(time.monotonic() - t0, 2)
    _, alive = psutil.wait_procs(children, timeout=max(5.0, timeout - (time.monotonic() - t0)))
    info["children_left"] = [{"pid": c.pid, "name": _name(c)} for c in alive]
    for c in alive:  # ours: the server's children, still running after the server exited
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    return info


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001
        return "?"

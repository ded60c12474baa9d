"""Soak of a DSBD OpenAI server, CI size: ``benchmarks/engine/soak.py`` with 60 requests, 8 at a time.

The script starts its own DSBD server on 127.0.0.1 (tiny random Llama pair, engine width 4, depth 2, pinned shapes: cost
model off, so that every step drafts; the engine core
in a child process), fires a seeded mix of plain and beam requests, streaming and not, widths 1/2/4, T = 0 and 1,
clients that leave mid-stream and bad requests, then checks completeness, the 400s, health, T = 0 replays alone,
the KV cache's free blocks, that DSBD's counters grew (forests drafted; layers passed on plain requests) and a clean
shutdown; it exits non-zero on any failure. Here it runs as a subprocess (as
a user runs it) and its JSON record is checked as well, so that a soak that silently did less (no beam request, no
disconnect, nothing replayed, no forest drafted or layer passed) also fails. About 1 minute on 2 CPU cores; the full 200-request run is in
``results/soak/``.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import vllm  # noqa: F401  (a broken vLLM must fail the suite, never skip it)

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQUESTS, CONCURRENCY, SEED = 60, 8, 3  # seed 3: this mix has every kind of request (asserted below)


def test_soak_ci(tmp_path):
    out, log = tmp_path / "soak.json", tmp_path / "server.log"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "soak.py"),
                           "--requests", str(REQUESTS),
                           "--concurrency", str(CONCURRENCY), "--seed", str(SEED), "--out", str(out),
                           "--log", str(log), "--no-progress"],
                          capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), report
    rec = json.loads(out.read_text())
    assert rec["failures"] == [], rec["failures"]
    assert proc.returncode == 0 and rec["ok"], report

    c = rec["counts"]
    assert c["sent"] == REQUESTS == len(rec["requests"])
    # the mix covered what the soak is about
    assert c["plain"] > 0 and c["beam"] > 0 and c["bad"] > 0 and c["disconnect"] > 0
    assert c["t0"] > 0 and c["t1"] > 0 and c["streaming"] > 0 and c["chat"] > 0
    assert all(c["width"][w] > 0 for w in ("1", "2", "4"))
    assert {r["stream"] for r in rec["requests"] if r["kind"] == "bad"} == {False, True}
    # every good request complete, every bad one a 400 naming its parameter, every disconnect aborted
    assert c["good_ok"] == c["good"] == c["plain"] + c["beam"]
    assert c["bad_400"] == c["bad"]
    assert c["disconnect_ok"] == c["disconnect"] == c["engine_aborts"]
    for r in rec["requests"]:
        if r["kind"] in ("plain", "beam"):
            assert r["status"] == 200 and r["finish_reasons"] and None not in r["finish_reasons"], r
    # the server drafted (its /metrics, recorded by the soak): forests verified and layers passed on plain requests,
    # forests verified on beam requests (measured: 322 forests, 1390 nodes, 278 layers passed; beam requests 36 nodes
    # and 1 layer passed in 31 passes, too few passes to assert on under a load-dependent schedule)
    m = rec["dsbd_metrics"]
    print("DSBD counters over the soak:", m)
    assert m["forests"] > 0 and m["nodes"] > 0 and m["layers_passed"] > 0, m
    assert m["beam_passes"] > 0 and m["beam_nodes"] > 0, m
    # T = 0 under load equals T = 0 alone, for every T = 0 request
    assert c["t0_replayed"] == c["t0"] and c["t0_equal"] == c["t0"]
    # the server stayed healthy, answered no 5xx, and gave back every KV block
    assert rec["health_after"] == 200 and rec["health_end"] == 200
    assert rec["server_log"]["http_5xx"] == 0
    kb, ka, ke = rec["kv_before"], rec["kv_after"], rec["kv_end"]
    assert kb["num_blocks"] > 0 and kb["used_blocks"] is not None
    assert ka["used_blocks"] == kb["used_blocks"] and ke["used_blocks"] == kb["used_blocks"]
    assert ka["usage"] == kb["usage"]
    # SIGTERM: the server exits by itself and leaves none of its processes (API server, engine core, worker)
    sd = rec["shutdown"]
    assert sd["exited_by_itself"] and sd["returncode"] == 0
    assert len(sd["children_before"]) >= 2 and sd["children_left"] == []

"""Soak test of a DSBD OpenAI server: bounded, loopback only, stops by itself.

Starts ``python -m vllm.entrypoints.cli.main serve`` on 127.0.0.1 with ``--speculative-method dsbd`` (engine width 4,
depth 2, ``--max-num-seqs 16``, the engine core in a child process as ``vllm serve`` runs by default) on the tiny
random Llama pair of ``vllm_dsbd.testing.models.tiny_llama_pair``, then fires a seeded random mix of requests from a pool of
``--concurrency`` client threads (HTTP with the standard library only):

* plain completions and chat completions, streaming and not, per-request widths 1/2/4 (``vllm_xargs.dsbd_width``),
  temperature 0 and 1 (temperature 1 with a per-request seed), some with ``logprobs``, most with ``ignore_eos``;
* vLLM's front-end beam search (``use_beam_search: true``, ``n = 2``, temperature 0);
* clients that read a couple of stream chunks and then close the connection (the server must abort the request);
* bad requests (~10%): a width above the engine's, and a setting DSBD refuses (``prompt_logprobs``).

Checks (any failure makes the exit status non-zero):

1. every good request got 200 and a complete answer (``finish_reason`` present, streams end with ``[DONE]``, the
   completion token count equals ``max_tokens`` when ``ignore_eos``; ``n`` choices for beam requests);
2. every bad request got 400 with a message naming the parameter (a streaming one may get it as the stream's only
   event, ``{"error": {"code": 400, ...}}``: vLLM checks sampling parameters once the response has started, for its
   own checks as for DSBD's);
3. every client that left mid-stream had its request aborted by the server (``--enable-log-requests`` logs it);
   no HTTP 5xx in the server log; ``/health`` is 200 afterwards;
4. every temperature-0 request, replayed alone (one at a time), gives the same text as under load (seeded
   temperature-1 requests are replayed too, their equality only recorded);
5. the server drafted: DSBD's counters on ``/metrics`` grew over the concurrent phase by forests verified, forest
   nodes and layers passed for plain requests, and by forest nodes for beam requests (their T = 0 forests pass
   rarely on the tiny pair; the counts are in the record);
6. no KV-cache leak: the KV-cache usage (``vllm:kv_cache_usage_perc`` on ``/metrics``, times the block count of
   ``vllm:cache_config_info``) returns to its starting value. The gauge is refreshed only by an engine step, and an
   aborted request (client gone) is freed outside a step, so each reading is taken right after a one-token probe
   request (its own blocks are freed before the step's statistics are made); polled for up to ``--kv-wait`` s;
7. the server exits by itself on SIGTERM within ``--shutdown-timeout`` s and leaves no child process alive.

A short table of counts is printed last; ``--out FILE`` writes the whole record (every request) as JSON.

    .venv/bin/python benchmarks/engine/soak.py --requests 200 --concurrency 16 --seed 0 --out results/soak/soak.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from soak_requests import Result, Spec, execute, make_specs  # beside this file (a script's folder is on sys.path)
from soak_server import (CHAT_TEMPLATE, DEPTH, ENGINE_WIDTH, MAX_NUM_SEQS, Client, dsbd_reading, kv_reading, probe,
                         serve_cmd, stop_server, tail, wait_healthy)
from vllm_dsbd.testing.server import free_port, server_env


# ----------------------------------------------------------------------------------------------------------------
# the soak
# ----------------------------------------------------------------------------------------------------------------
def _progress(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disable, dynamic_ncols=True, file=sys.stderr)


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_dsbd.testing.models import tiny_llama_pair

    t_start = time.monotonic()
    record: dict[str, Any] = {
        "config": {"requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
                   "engine_width": ENGINE_WIDTH, "depth": DEPTH, "max_num_seqs": MAX_NUM_SEQS,
                   "model": "tiny_llama_pair(vocab_size=400, seed=0, draft_init='truncate', init_std=0.1, "
                            "target_layers=3, draft_layers=2)"},
        "failures": [],
    }
    failures: list[str] = record["failures"]
    target, draft = tiny_llama_pair(vocab_size=400, seed=0, draft_init="truncate", init_std=0.1, target_layers=3,
                                    draft_layers=2)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="dsbd-soak-"))
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    log_path = pathlib.Path(args.log) if args.log else workdir / "server.log"
    port = args.port or free_port()
    client = Client(port, timeout=args.request_timeout)
    specs = make_specs(args.requests, args.seed)
    results: list[Result] = []
    proc = None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_cmd(target, draft, port, template), env=server_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            record["startup_s"] = round(wait_healthy(client, proc, args.startup_timeout, log_path), 1)
            probe(client)
            kv_before = kv_reading(client)
            record["kv_before"] = kv_before
            dsbd_before = dsbd_reading(client)

            # --- concurrent phase
            t0 = time.monotonic()
            deadline = t0 + args.time_limit
            pool = cf.ThreadPoolExecutor(max_workers=args.concurrency)
            try:
                with _progress(len(specs), "soak", args.no_progress) as bar:
                    futures = [pool.submit(execute, client, s) for s in specs]
                    for fut in cf.as_completed(futures, timeout=args.time_limit):
                        results.append(fut.result())
                        bar.update(1)
            except cf.TimeoutError:
                failures.append(f"the requests did not all finish within --time-limit {args.time_limit:.0f} s "
                                f"({len(results)} of {len(specs)} done): the server hangs")
                raise _Abort
            finally:  # on a hang, the server is stopped below, which ends the requests still waiting
                pool.shutdown(wait=False, cancel_futures=True)
            record["concurrent_s"] = round(time.monotonic() - t0, 1)
            results.sort(key=lambda r: r.index)
            for r in results:
                if not r.ok:
                    failures.append(f"request {r.index} ({r.kind}, {r.endpoint}, stream={r.stream}): {r.error}")

            # --- health
            try:
                health = client.get("/health", timeout=30)[0]
            except OSError as e:
                health = f"{type(e).__name__}: {e}"
            record["health_after"] = health
            if health != 200:
                failures.append(f"/health after the soak: {health}")
            if proc.poll() is not None:
                failures.append(f"server exited with {proc.returncode} during the soak")
                raise _Abort

            # --- the server drafted: forests verified and layers passed, for plain and for beam requests
            dsbd_after = dsbd_reading(client)
            record["dsbd_metrics"] = grown = {k: dsbd_after[k] - dsbd_before[k] for k in dsbd_after}
            for kind, keys in (("plain", ("forests", "nodes", "layers_passed")), ("beam", ("beam_nodes",))):
                if any(r.kind == kind for r in results) and not all(grown[k] > 0 for k in keys):
                    failures.append(f"{kind} requests: DSBD's counters did not grow ({', '.join(keys)}): {grown}")

            # --- the raw gauge (stale after aborts), then the no-leak check with probes
            record["kv_after_raw"] = kv_reading(client)
            record["kv_after"] = kv_after = _wait_kv(client, kv_before, args.kv_wait)
            if kv_after["used_blocks"] != kv_before["used_blocks"] or kv_after["usage"] != kv_before["usage"]:
                failures.append(f"KV cache did not return to its starting usage within {args.kv_wait:.0f} s: "
                                f"{kv_before['used_blocks']} -> {kv_after['used_blocks']} blocks in use "
                                f"(usage {kv_before['usage']} -> {kv_after['usage']})")

            # --- one at a time: temperature 0 (must be equal) and seeded temperature 1 (recorded only)
            replay = [r for r in results if r.ok and r.kind in ("plain", "beam")]
            t0 = time.monotonic()
            with _progress(len(replay), "replay alone", args.no_progress) as bar:
                for r in replay:
                    if time.monotonic() > deadline:
                        failures.append(f"replay stopped at --time-limit {args.time_limit:.0f} s")
                        break
                    again = execute(client, specs[r.index])
                    r.replay_texts = again.texts
                    r.replay_equal = again.ok and again.texts == r.texts
                    if not r.replay_equal and r.temperature == 0:
                        failures.append(f"request {r.index} ({r.kind}, {r.endpoint}, width {r.width}, "
                                        f"stream={r.stream}): T=0 replay differs: {r.texts!r} vs {again.texts!r}"
                                        + (f" ({again.error})" if again.error else ""))
                    bar.update(1)
            record["replay_s"] = round(time.monotonic() - t0, 1)
            try:
                record["health_end"] = client.get("/health", timeout=30)[0]
            except OSError as e:
                record["health_end"] = f"{type(e).__name__}: {e}"
            if record["health_end"] != 200:
                failures.append(f"/health after the replay: {record['health_end']}")
            probe(client)
            record["kv_end"] = kv_end = kv_reading(client)
            if kv_end["usage"] != kv_before["usage"]:
                failures.append(f"KV cache usage after the replay {kv_end['usage']} != {kv_before['usage']} at the "
                                "start")
        except _Abort:
            pass
        except Exception as e:  # noqa: BLE001
            failures.append(f"soak aborted: {type(e).__name__}: {e}")
        finally:
            record["shutdown"] = sd = stop_server(proc, args.shutdown_timeout)
            if not sd["exited_by_itself"]:
                failures.append(f"server did not exit within {args.shutdown_timeout:.0f} s of SIGTERM (killed)")
            if sd["children_left"]:
                failures.append(f"child processes left after the server exited: {sd['children_left']}")
    log_text = log_path.read_text(errors="replace")
    serving, _, shutting_down = log_text.partition("[shutdown]")  # vLLM's shutdown logs its own noise
    error_lines = [l for l in serving.splitlines() if " ERROR " in l]
    record["server_log"] = {
        "http_200": len(re.findall(r'HTTP/1\.1" 200 ', log_text)),
        "http_400": len(re.findall(r'HTTP/1\.1" 400 ', log_text)),
        "http_5xx": len(re.findall(r'HTTP/1\.1" 5\d\d ', log_text)),
        # vLLM logs a traceback at ERROR for a streaming request refused after its response started
        "error_lines_while_serving": len(error_lines),
        "error_messages_while_serving": sorted({l.split("] ", 1)[-1] for l in error_lines
                                                if "Error in" in l or "Error:" in l})[:20],
        "error_lines_at_shutdown": sum(" ERROR " in l for l in shutting_down.splitlines()),
    }
    if record["server_log"]["http_5xx"]:
        failures.append(f"{record['server_log']['http_5xx']} HTTP 5xx answers in the server log")
    record["requests"] = [asdict(r) for r in results]
    record["counts"] = c = _counts(results, specs)
    # requests aborted because their client went away (AsyncLLM logs them with --enable-log-requests)
    aborted = {i for line in serving.splitlines() if "Aborted request(s)" in line
               for i in line.split("Aborted request(s)", 1)[1].strip().rstrip(".").split(",")}
    c["engine_aborts"] = len(aborted)
    if results and c["engine_aborts"] != c["disconnect"]:
        failures.append(f"{c['disconnect']} clients disconnected mid-stream but the server aborted "
                        f"{c['engine_aborts']} requests")
    if failures:
        record["server_log_tail"] = tail(log_path, 6000)
        record["server_log_path"] = str(log_path)
    if args.log or not failures:  # keep the server log of a failed run
        shutil.rmtree(workdir, ignore_errors=True)
    record["wall_s"] = round(time.monotonic() - t_start, 1)
    record["ok"] = not failures
    return record


class _Abort(Exception):
    pass


def _wait_kv(client: Client, before: dict, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    polls = 0
    while True:
        probe(client)
        polls += 1
        now = kv_reading(client)
        if now["usage"] == before["usage"] or time.monotonic() > deadline:
            now["polls"] = polls
            return now
        time.sleep(1)


def _counts(results: list[Result], specs: list[Spec]) -> dict[str, Any]:
    by = lambda k: [r for r in results if r.kind == k]  # noqa: E731
    good = by("plain") + by("beam")
    replayed = [r for r in results if r.replay_equal is not None and r.temperature == 0]
    replayed1 = [r for r in results if r.replay_equal is not None and r.temperature == 1]
    return {
        "sent": len(results),
        "good": len(good),
        "good_ok": sum(r.ok for r in good),
        "plain": len(by("plain")),
        "beam": len(by("beam")),
        "streaming": sum(r.stream for r in good),
        "chat": sum(r.endpoint == "chat" for r in good),
        "t0": sum(r.temperature == 0 for r in good),
        "t1": sum(r.temperature == 1 for r in good),
        "width": {str(w): sum(r.width == w for r in by("plain")) for w in (1, 2, 4)},
        "bad": len(by("bad")),
        "bad_400": sum(r.ok for r in by("bad")),
        "bad_400_http": sum(r.ok and r.bad_form == "http 400" for r in by("bad")),
        "bad_400_in_stream": sum(r.ok and r.bad_form == "stream error event 400" for r in by("bad")),
        "disconnect": len(by("disconnect")),
        "disconnect_ok": sum(r.ok for r in by("disconnect")),
        "t0_replayed": len(replayed),
        "t0_equal": sum(bool(r.replay_equal) for r in replayed),
        "t1_seeded_replayed": len(replayed1),
        "t1_seeded_equal": sum(bool(r.replay_equal) for r in replayed1),
        "status": {str(s): sum(r.status == s for r in results) for s in sorted({r.status for r in results},
                                                                                 key=str)},
    }


def table(record: dict[str, Any]) -> str:
    c = record.get("counts", {})
    kb, ka = record.get("kv_before") or {}, record.get("kv_after") or {}
    sd = record.get("shutdown") or {}
    rows = [
        ("requests sent", c.get("sent")),
        ("good (plain + beam)", f"{c.get('good')} ({c.get('plain')} + {c.get('beam')}; {c.get('streaming')} "
                                f"streaming, {c.get('chat')} chat, T=0/T=1 {c.get('t0')}/{c.get('t1')}, "
                                f"widths 1/2/4 {'/'.join(str(v) for v in (c.get('width') or {}).values())})"),
        ("good ok (200, complete)", c.get("good_ok")),
        ("bad -> 400 naming the parameter", f"{c.get('bad_400')} / {c.get('bad')} ({c.get('bad_400_http')} HTTP 400, "
                                            f"{c.get('bad_400_in_stream')} as a stream's error event)"),
        ("disconnected mid-stream", f"{c.get('disconnect_ok')} / {c.get('disconnect')} (aborted by the server: "
                                    f"{c.get('engine_aborts')})"),
        ("DSBD counters over the soak", json.dumps(record.get("dsbd_metrics"))),
        ("T=0 equal when replayed alone", f"{c.get('t0_equal')} / {c.get('t0_replayed')}"),
        ("T=1 seeded equal alone (info)", f"{c.get('t1_seeded_equal')} / {c.get('t1_seeded_replayed')}"),
        ("HTTP status counts", json.dumps(c.get("status"))),
        ("/health after", record.get("health_after")),
        ("KV blocks in use before / after", f"{kb.get('used_blocks')} / {ka.get('used_blocks')} "
                                            f"of {kb.get('num_blocks')} (usage {kb.get('usage')} / "
                                            f"{ka.get('usage')}; after the replay "
                                            f"{(record.get('kv_end') or {}).get('used_blocks')})"),
        ("server exit on SIGTERM", f"rc {sd.get('returncode')} in {sd.get('exit_s')} s, "
                                   f"{len(sd.get('children_before') or [])} children, "
                                   f"{len(sd.get('children_left') or [])} left"),
        ("wall time", f"{record.get('wall_s')} s (start-up {record.get('startup_s')} s, concurrent "
                      f"{record.get('concurrent_s')} s, replay {record.get('replay_s')} s)"),
        ("result", "PASS" if record.get("ok") else f"FAIL ({len(record.get('failures', []))} failures)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def scrub(text: str) -> str:
    """Machine-local paths (server log excerpts) become placeholders, so a record can be committed."""
    repo = str(pathlib.Path(__file__).resolve().parents[2])
    for path, name in sorted([(repo, "<repo>"), (sys.prefix, "<venv>"), (tempfile.gettempdir(), "<tmp>"),
                              (str(pathlib.Path.home()), "<home>")], key=lambda x: -len(x[0])):
        if len(path) > 1:
            text = text.replace(path, name)
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="requests in the mix (default 200)")
    p.add_argument("--concurrency", type=int, default=16, help="client threads (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")
    p.add_argument("--port", type=int, default=0, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--out", help="write the JSON record here")
    p.add_argument("--log", help="server log file (default: in a temporary folder)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=120.0, help="socket timeout of one request")
    p.add_argument("--time-limit", type=float, default=1200.0,
                   help="the requests and the replay must finish within this many seconds (a hang fails)")
    p.add_argument("--kv-wait", type=float, default=30.0, help="how long the KV usage may take to come back")
    p.add_argument("--shutdown-timeout", type=float, default=60.0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    record = run_soak(args)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(scrub(json.dumps(record, indent=1)) + "\n")
    for f in record["failures"][:50]:
        print("FAIL:", f)
    if record["failures"] and record.get("server_log_tail"):
        print("--- server log (tail) ---\n" + scrub(record["server_log_tail"][-3000:]))
        print(f"server log: {record['server_log_path']}")
    print(table(record))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

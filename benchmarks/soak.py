"""Soak: sessions always in flight for minutes while stages are killed, then proof nothing drifted.

A random-weight Llama (default hidden 256, 4 layers, vocab 1024) runs as ``--stages`` Ray actors
(default 3) on an embedded local Ray.  ``--sessions`` sessions (default 8) are always in flight:
one coordinator stream over a long list of requests with ``max_in_flight`` = sessions, so as soon
as a session finishes the next one starts (new seeded prompt of 4-32 tokens, 16-64 new tokens,
greedy or seeded top-k sampling, alternately).  Finished sessions are closed on every stage, as a
server would, so the stages hold only the sessions in flight.

Every ``--kill-every`` seconds (default 120) one stage is killed -- stages in rotation 0, 1, 2, ...,
methods alternating ``ray.kill`` of the actor and SIGKILL of its worker process -- and the
coordinator must replace it and replay the lost sessions (``Coordinator.recoveries``).

Reported at the end (a table, or ``--json``):

* tokens generated, tokens/s overall and the median / worst of 10-second windows;
* failed sessions (target 0) and sessions left unfinished at the deadline (not failures);
* each kill: when, which stage and how, the recovery time the coordinator recorded (from the
  failure to the lost steps being resubmitted, the largest over the sessions it rebuilt), the
  stall seen by the driver (kill to the first token after the recovery) and the new pid;
* RSS (VmRSS from /proc/PID/status) of every stage process over time -- pids change when a stage
  is replaced -- and each process's growth from its first sample after ``--warmup`` seconds of its
  life to its last sample (target < ``--rss-target`` MB, default 50);
* exactness: the tokens of a sample of finished sessions -- every one that was rebuilt by a
  recovery, plus ``--check`` others chosen at random -- against the single-process reference
  (``dist_runtime.engine.LocalEngine``), which must be identical.

The stages' telemetry records (one per step, kept until someone fetches them, at most 200k) are
fetched every ``--drain-telemetry`` seconds (default 30), as a long-running server exporting
metrics would; ``--drain-telemetry 0`` leaves them to pile up, to see what that costs in RSS.

The exit status is 0 when every target is met (no failed session, every kill recovered, tokens
exact, RSS growth under the target), 1 otherwise.

    .venv/bin/python benchmarks/soak.py                        # 10 minutes, a kill every 2 minutes
    .venv/bin/python benchmarks/soak.py --minutes 1 --kill-every 20   # a quick run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from dist_runtime.examples import LlamaConfig, llama_graph, llama_metadata, llama_weights

KILL_METHODS = ("ray.kill", "SIGKILL")
WINDOW = 10.0  # seconds per tokens/s window


# -- the workload --------------------------------------------------------------------------------
def make_model(cfg: LlamaConfig, seed: int, directory: Path) -> Path:
    from dist_runtime.model import save_model

    path = directory / f"soak-h{cfg.hidden}-l{cfg.layers}-v{cfg.vocab}-s{seed}.model"
    save_model(path, llama_graph(cfg), llama_weights(cfg, seed=seed), llama_metadata(cfg)).close()
    return path


def make_request(i: int, seed: int, vocab: int, max_prompt: int, max_new: int):
    """Request ``i``: everything drawn from a generator seeded by (seed, i), so it can be rebuilt."""
    from dist_runtime.pipeline import Request, Sampling

    rng = np.random.default_rng([seed, i])
    prompt = tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(4, max_prompt + 1))))
    new = int(rng.integers(max(1, max_new // 4), max_new + 1))
    sampling = Sampling() if i % 2 == 0 else Sampling(temperature=0.8, top_k=40, seed=seed * 1_000_003 + i)
    return Request(f"s{i}", prompt, new, sampling)


def read_rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class RssSampler(threading.Thread):
    """Samples VmRSS of each stage's current process (``pipe.reports[k]['pid']``) and the driver."""

    def __init__(self, pipe, every: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.pipe, self.every, self.t0 = pipe, every, t0
        self.samples: list[dict] = []  # {t, stage, pid, rss_kb}; stage -1 is the driver
        self.stop = threading.Event()

    def sample(self) -> None:
        t = time.monotonic() - self.t0
        for k, report in enumerate(list(self.pipe.reports)):
            rss = read_rss_kb(report["pid"])
            if rss is not None:
                self.samples.append({"t": t, "stage": k, "pid": report["pid"], "rss_kb": rss})
        self.samples.append({"t": t, "stage": -1, "pid": os.getpid(), "rss_kb": read_rss_kb(os.getpid())})

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()


# -- the run -------------------------------------------------------------------------------------
def soak(args) -> dict:
    import ray

    from dist_runtime.pipeline import Pipeline, StageOptions
    from dist_runtime.pipeline.cluster import connect

    cfg = LlamaConfig(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, ffn=args.ffn or 2 * args.hidden)
    workdir = Path(tempfile.mkdtemp(prefix="dist-runtime-soak-"))
    path = make_model(cfg, args.seed, workdir)
    seconds = args.minutes * 60
    recovery_log: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: recovery_log.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dist_runtime.recovery")
    logger.addHandler(handler)
    logger.propagate = args.verbose

    connect(num_cpus=args.num_cpus or os.cpu_count())
    options = StageOptions(cpus=args.cpus_per_stage, fuse=not args.no_fuse, seed=args.seed)
    pipe = Pipeline(path, stages=args.stages, max_context=args.max_prompt + args.max_new + 8,
                    sessions=args.sessions, channel=args.channel, options=options)
    co = pipe.coordinator
    # Far more requests than the run can serve (stream() takes a list); the run stops at the deadline.
    n_requests = int(seconds * args.max_rate / (0.6 * args.max_new)) + 4 * args.sessions
    requests = [make_request(i, args.seed, cfg.vocab, args.max_prompt, args.max_new) for i in range(n_requests)]
    by_id = {r.session: r for r in requests}

    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    failed: dict[str, str] = {}
    kills: list[dict] = []
    windows: dict[int, int] = {}
    close_refs: list = []
    close_errors = 0
    drained = 0
    kill_times = [t for t in np.arange(args.kill_every, seconds, args.kill_every)
                  if t < seconds - min(15.0, args.kill_every / 2)] if args.kill_every > 0 else []
    next_drain = args.drain_telemetry or float("inf")

    def do_kill(i: int, now: float) -> None:
        stage, method = i % args.stages, KILL_METHODS[i % len(KILL_METHODS)]
        actor, pid = pipe.actors[stage], pipe.reports[stage]["pid"]
        if method == "ray.kill":
            ray.kill(actor, no_restart=True)
        else:
            os.kill(pid, signal.SIGKILL)
        kills.append({"at": now, "stage": stage, "method": method, "pid": pid,
                      "recoveries_before": len(co.recoveries), "resumed_at": None})

    t0 = time.monotonic()
    sampler = RssSampler(pipe, args.sample_every, t0)
    sampler.sample()
    sampler.start()
    try:
        stream = co.stream(requests, max_in_flight=args.sessions)
        try:
            for event in stream:
                now = time.monotonic() - t0
                sid = event.session
                if event.error is not None:
                    failed[sid] = f"{type(event.error).__name__}: {event.error}"
                else:
                    tokens.setdefault(sid, []).append(event.token)
                    windows[int(now // WINDOW)] = windows.get(int(now // WINDOW), 0) + 1
                    for k in kills:  # the first token after the coordinator recorded the recovery
                        if k["resumed_at"] is None and len(co.recoveries) > k["recoveries_before"]:
                            k["resumed_at"] = now
                if event.done:
                    if event.error is None:
                        finished.append(sid)
                    # Done with it: free its KV caches on every stage (not waiting for the replies).
                    close_refs.extend(a.close_session.remote(sid) for a in co.actors)
                    co.sessions.pop(sid, None)
                if len(close_refs) > 256:
                    ready, close_refs = ray.wait(close_refs, num_returns=len(close_refs) - 64, timeout=0)
                    for ref in ready:
                        try:
                            ray.get(ref)
                        except Exception:  # noqa: BLE001 -- the stage died since: its caches went with it
                            close_errors += 1
                if kill_times and now >= kill_times[0]:
                    kill_times.pop(0)
                    do_kill(len(kills), now)
                if now >= next_drain:
                    next_drain += args.drain_telemetry
                    try:
                        drained += sum(len(r) for r in ray.get([a.telemetry.remote() for a in co.actors], timeout=30))
                    except Exception:  # noqa: BLE001 -- a stage just died: the next drain gets it
                        pass
                if now >= seconds:
                    break
        finally:
            stream.close()
        elapsed = time.monotonic() - t0
    finally:
        sampler.stop.set()
        sampler.join()
        sampler.sample()
        final_pids = [r["pid"] for r in pipe.reports]
        pipe.close()
        ray.shutdown()
        logger.removeHandler(handler)

    # -- kills and their recoveries ----------------------------------------------------------------
    for i, k in enumerate(kills):
        end = kills[i + 1]["recoveries_before"] if i + 1 < len(kills) else len(co.recoveries)
        events = [e for e in co.recoveries[k.pop("recoveries_before"):end] if e.stage == k["stage"]]
        k["recovered"] = bool(events)
        k["recovery_s"] = max((e.seconds for e in events), default=None)
        k["sessions_rebuilt"] = sorted({e.session for e in events}, key=str)
        k["positions_replayed"] = sum(e.position for e in events)
        k["stall_s"] = None if k["resumed_at"] is None else k["resumed_at"] - k["at"]
    for k in kills:  # the replacement's pid: the next kill's victim of that stage, or the final one
        later = [q["pid"] for q in kills if q["at"] > k["at"] and q["stage"] == k["stage"]]
        k["new_pid"] = later[0] if later else final_pids[k["stage"]]

    # -- exactness against one process -------------------------------------------------------------
    from dist_runtime.executor import GraphExecutor
    from dist_runtime.model import load_model
    from dist_runtime.engine import LocalEngine, generate

    rebuilt = {e.session for e in co.recoveries}
    done = set(finished)
    sample = sorted(rebuilt & done, key=lambda s: int(s[1:]))
    others = sorted(done - rebuilt, key=lambda s: int(s[1:]))
    sample += random.Random(args.seed).sample(others, min(args.check, len(others)))
    with load_model(path) as model:
        want = generate(LocalEngine(GraphExecutor(model, fuse=not args.no_fuse)), [by_id[s] for s in sample]).tokens
    mismatched = [s for s in sample if want[s] != tokens[s]]

    # -- RSS per process ---------------------------------------------------------------------------
    processes = []
    for (stage, pid) in dict.fromkeys((s["stage"], s["pid"]) for s in sampler.samples if s["stage"] >= 0):
        series = [s for s in sampler.samples if s["stage"] == stage and s["pid"] == pid]
        born = series[0]["t"]
        settled = [s for s in series if s["t"] >= born + args.warmup]
        growth = (settled[-1]["rss_kb"] - settled[0]["rss_kb"]) / 1024 if len(settled) >= 2 else None
        processes.append({"stage": stage, "pid": pid, "from_s": born, "to_s": series[-1]["t"],
                          "first_mb": series[0]["rss_kb"] / 1024, "last_mb": series[-1]["rss_kb"] / 1024,
                          "peak_mb": max(s["rss_kb"] for s in series) / 1024,
                          "measured_from_s": settled[0]["t"] if settled else None,
                          "growth_mb": growth})
    driver = [s for s in sampler.samples if s["stage"] == -1]

    total = sum(len(v) for v in tokens.values())
    rates = [windows.get(w, 0) / WINDOW for w in range(int(elapsed // WINDOW))]  # whole windows only
    growths = [p["growth_mb"] for p in processes if p["growth_mb"] is not None]
    result = {
        "config": {"model": {k: getattr(cfg, k) for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn")},
                   "stages": args.stages, "sessions": args.sessions, "minutes": args.minutes,
                   "kill_every_s": args.kill_every, "channel": args.channel, "fuse": not args.no_fuse,
                   "seed": args.seed, "warmup_s": args.warmup, "cpus": args.num_cpus or os.cpu_count(),
                   "drain_telemetry_s": args.drain_telemetry},
        "elapsed_s": elapsed,
        "tokens": total,
        "tokens_per_s": total / elapsed,
        "window_tokens_per_s": {"median": statistics.median(rates) if rates else None,
                                "min": min(rates) if rates else None, "max": max(rates) if rates else None},
        "sessions_started": len(tokens) + len(set(failed) - set(tokens)),
        "sessions_finished": len(finished),
        "sessions_failed": len(failed),
        "failures": failed,
        "sessions_unfinished_at_deadline": len(set(tokens) - done - set(failed)),
        "kills": kills,
        "recovery_events": len(co.recoveries),
        "recovery_log_lines": len(recovery_log),
        "close_session_errors": close_errors,
        "telemetry_records_drained": drained,
        "rss": {"processes": processes, "max_growth_mb": max(growths) if growths else None,
                "target_mb": args.rss_target, "samples": sampler.samples,
                "driver_first_mb": driver[0]["rss_kb"] / 1024, "driver_last_mb": driver[-1]["rss_kb"] / 1024},
        "check": {"sessions": len(sample), "rebuilt_sessions_checked": len(rebuilt & done),
                  "mismatched": mismatched, "exact": not mismatched},
    }
    result["ok"] = (not failed and all(k["recovered"] for k in kills) and not mismatched and bool(sample)
                    and (not growths or max(growths) < args.rss_target))
    return result


# -- output --------------------------------------------------------------------------------------
def rss_timeline(result: dict, rows: int = 12) -> list[str]:
    """RSS per stage at ~``rows`` evenly spaced sample times; '*' marks a replaced process."""
    samples = [s for s in result["rss"]["samples"] if s["stage"] >= 0]
    times = sorted({s["t"] for s in samples})
    picks = [times[round(i * (len(times) - 1) / max(rows - 1, 1))] for i in range(min(rows, len(times)))]
    stages = result["config"]["stages"]
    first_pid = {k: next(s["pid"] for s in samples if s["stage"] == k) for k in range(stages)}
    lines = [f"{'t (s)':>7} " + " ".join(f"{'stage ' + str(k) + ' MB':>13}" for k in range(stages))]
    for t in dict.fromkeys(picks):
        cells = []
        for k in range(stages):
            s = next((s for s in samples if s["t"] == t and s["stage"] == k), None)
            cells.append(f"{'-':>13}" if s is None else
                         f"{s['rss_kb'] / 1024:>12.1f}{'*' if s['pid'] != first_pid[k] else ' '}")
        lines.append(f"{t:>7.0f} " + " ".join(cells))
    return lines


def print_table(r: dict) -> None:
    c = r["config"]
    m = c["model"]
    print(f"\nsoak: {c['minutes']:g} min, {c['sessions']} sessions in flight, {c['stages']} stages "
          f"({c['channel']} channel, {c['cpus']} CPUs), a kill every {c['kill_every_s']:g} s; model hidden "
          f"{m['hidden']}, {m['layers']} layers, vocab {m['vocab']}, seed {c['seed']}")
    w = r["window_tokens_per_s"]
    fmt = (lambda v: "-" if v is None else f"{v:.1f}")
    rows = [
        ("tokens generated", f"{r['tokens']:,}", ""),
        ("tokens/s (whole run)", f"{r['tokens_per_s']:.1f}", ""),
        (f"tokens/s per {WINDOW:g} s window: median / min / max", f"{fmt(w['median'])} / {fmt(w['min'])} / {fmt(w['max'])}", ""),
        ("sessions finished / unfinished at the deadline", f"{r['sessions_finished']} / {r['sessions_unfinished_at_deadline']}", ""),
        ("failed sessions", f"{r['sessions_failed']}", "0"),
        ("kills recovered", f"{sum(k['recovered'] for k in r['kills'])} / {len(r['kills'])}", "all"),
        ("max RSS growth per stage process after warm-up (MB)", fmt(r["rss"]["max_growth_mb"]), f"< {r['rss']['target_mb']:g}"),
        ("tokens identical to one process (sessions checked)",
         f"{'yes' if r['check']['exact'] else 'NO'} ({r['check']['sessions']}, "
         f"{r['check']['rebuilt_sessions_checked']} rebuilt by a recovery)", "yes"),
        ("driver RSS first / last (MB)", f"{r['rss']['driver_first_mb']:.1f} / {r['rss']['driver_last_mb']:.1f}", ""),
    ]
    print(f"{'what':<56} {'value':>30} {'target':>8}")
    for what, value, target in rows:
        print(f"{what:<56} {value:>30} {target:>8}")
    if r["kills"]:
        print(f"\n{'kill at (s)':>11} {'stage':>5} {'method':>9} {'old pid':>8} {'new pid':>8} {'recovery (s)':>12} "
              f"{'stall (s)':>9} {'rebuilt':>7} {'replayed':>8}")
        for k in r["kills"]:
            print(f"{k['at']:>11.1f} {k['stage']:>5} {k['method']:>9} {k['pid']:>8} {k['new_pid']:>8} "
                  f"{fmt(k['recovery_s']):>12} {fmt(k['stall_s']):>9} {len(k['sessions_rebuilt']):>7} "
                  f"{k['positions_replayed']:>8}")
        times = [k["recovery_s"] for k in r["kills"] if k["recovery_s"] is not None]
        if times:
            print(f"recovery time: median {statistics.median(times):.2f} s, max {max(times):.2f} s")
    print(f"\nRSS per stage process (growth measured from {r['config']['warmup_s']:g} s into each process's life):")
    print(f"{'stage':>5} {'pid':>8} {'alive (s)':>15} {'first MB':>9} {'peak MB':>8} {'last MB':>8} {'growth MB':>10}")
    for p in r["rss"]["processes"]:
        print(f"{p['stage']:>5} {p['pid']:>8} {p['from_s']:>7.0f}-{p['to_s']:<7.0f} {p['first_mb']:>9.1f} "
              f"{p['peak_mb']:>8.1f} {p['last_mb']:>8.1f} {fmt(p['growth_mb']):>10}")
    print("\nRSS over time ('*': a replacement process):")
    for line in rss_timeline(r):
        print(line)
    if r["failures"]:
        print("\nfailed sessions:")
        for sid, why in list(r["failures"].items())[:10]:
            print(f"  {sid}: {why}")
    if r["check"]["mismatched"]:
        print(f"\nMISMATCHED sessions: {r['check']['mismatched'][:20]}")
    print(f"\n{'OK: every target met' if r['ok'] else 'FAILED: a target was missed'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--minutes", type=float, default=10.0, help="how long to run (default: %(default)s)")
    run.add_argument("--kill-every", type=float, default=120.0, metavar="SECONDS",
                     help="kill a stage this often; 0: never (default: %(default)s)")
    run.add_argument("--sessions", type=int, default=8, help="sessions always in flight (default: %(default)s)")
    run.add_argument("--max-prompt", type=int, default=32, help="longest prompt; prompts are 4..N tokens (default: %(default)s)")
    run.add_argument("--max-new", type=int, default=64, help="most new tokens per session; each asks N/4..N (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="model weights and requests (default: %(default)s)")
    model = p.add_argument_group("model and pipeline")
    model.add_argument("--hidden", type=int, default=256, help="(default: %(default)s)")
    model.add_argument("--layers", type=int, default=4, help="(default: %(default)s)")
    model.add_argument("--heads", type=int, default=4, help="(default: %(default)s)")
    model.add_argument("--kv-heads", type=int, default=2, help="(default: %(default)s)")
    model.add_argument("--ffn", type=int, help="(default: 2 x hidden)")
    model.add_argument("--vocab", type=int, default=1024, help="(default: %(default)s)")
    model.add_argument("--stages", type=int, default=3, help="(default: %(default)s)")
    model.add_argument("--channel", default="direct", help="direct, chain, compiled or driver (default: %(default)s)")
    model.add_argument("--num-cpus", type=int, help="CPUs of the embedded Ray (default: all)")
    model.add_argument("--cpus-per-stage", type=float, help="(default: the CPUs shared evenly)")
    model.add_argument("--no-fuse", action="store_true", help="stages and reference without the fusion pre-pass")
    meas = p.add_argument_group("measurement")
    meas.add_argument("--sample-every", type=float, default=5.0, metavar="SECONDS", help="RSS sampling period (default: %(default)s)")
    meas.add_argument("--warmup", type=float, metavar="SECONDS",
                      help="RSS growth is measured from this far into each process's life "
                           "(default: 60, or a quarter of the run if shorter)")
    meas.add_argument("--rss-target", type=float, default=50.0, metavar="MB", help="(default: %(default)s)")
    meas.add_argument("--check", type=int, default=16, metavar="N",
                      help="finished sessions checked against one process besides every rebuilt one (default: %(default)s)")
    meas.add_argument("--drain-telemetry", type=float, default=30.0, metavar="SECONDS",
                      help="fetch the stages' step records this often; 0: never (default: %(default)s)")
    meas.add_argument("--max-rate", type=float, default=1000.0, help=argparse.SUPPRESS)  # sizes the request list
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the result as JSON (with every RSS sample)")
    out.add_argument("--json-out", metavar="FILE", help="also write the JSON result to FILE")
    out.add_argument("--verbose", action="store_true", help="also print the coordinator's recovery log lines")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(60.0, args.minutes * 60 / 4)
    # Ray prints worker deaths (the kills) on stdout: keep stdout for the table / the JSON alone.
    with contextlib.redirect_stdout(sys.stderr):
        result = soak(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, default=str))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_table(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Lock-step against continuous generation on one config's settings, and the generation time a weight update costs.

    .venv/bin/python benchmarks/continuous_generation.py --config configs/tiny_long_cpu.toml \
        --out benchmarks/results/continuous_generation/tiny_long_cpu.json

Same prompts (the config's training problems, its prompt encoder), same ``rollout.max_num_seqs``, temperature, top-p,
``max_response_tokens`` and seeds, one engine at a time on this machine:

* **lock-step**: ``VLLMEngine.generate`` calls of the rollout service's size (``cluster.rollout.prompts_per_call``, by
  default ceil(prompts_per_step / engines) prompts, x group_size samples), one after another, as the rollout service
  makes them. The *tail fraction* of a call is the share of its decode steps that run fewer sequences than the
  engine allows (``max_num_seqs``; 1.0 when a call is smaller than that), ``tail_fraction_call`` the share that run
  fewer than the call started with (its own tail): from the response lengths, step t runs the responses longer than
  t. Both count steps, not seconds (a step over fewer sequences is shorter).
* **continuous**: ``ContinuousEngine`` with the same prompts submitted as groups, a new group admitted whenever
  ``in_flight() + group_size <= max_num_seqs``. Tokens/s over the whole run (its last groups drain as a lock-step
  call's tail does) and over the admission window (until the last group was submitted: the steady state of a service
  that never runs out of prompts).
* **decode step time by batch size** (``--probe-sizes``): ``size`` sequences of exactly ``--probe-steps`` tokens on
  the lock-step engine. From it, the *bound in seconds*: the lock-step calls' decode time modelled step by step
  (step t over the responses longer than t) against the same tokens at ``max_num_seqs`` sequences per step. Where
  a step's time grows in proportion to its sequences (a compute-bound CPU), a short step is cheap and this bound
  is far below the step-counting one.
* **weight updates**: the continuous run again over ``--update-prompts`` prompts with one update (the same weights
  loaded as a new version) made from another thread at ``--update-at`` of the run's measured length without one, in
  each mode (``keep`` with and without KV recompute, ``wait``, ``abort``), ``--reps`` times with the modes and a run
  without an update interleaved; time lost = the median wall time with the update minus the median without, with the
  pause-to-resume time, the re-prefilled tokens and the resubmitted samples of each run.

The machine is shared (other jobs' load varies by the second): each run is stored with the load average at its start;
the throughput figures are one run each.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_io import write_result  # noqa: E402


def tail_fraction(lengths: list[int], full: int) -> float:
    """Share of a lock-step call's decode steps that run fewer than ``full`` sequences (all admitted at once; step t
    runs the responses longer than t)."""
    longest = max(lengths)
    short = sum(1 for t in range(longest) if sum(1 for n in lengths if n > t) < full)
    return short / longest


def percentiles(xs: list[int]) -> dict[str, float]:
    s = sorted(xs)
    q = statistics.quantiles(s, n=20)
    return {"n": len(s), "min": s[0], "p5": q[0], "p25": q[4], "median": statistics.median(s), "p75": q[14],
            "p95": q[18], "max": s[-1], "mean": statistics.fmean(s)}


def run_lockstep(engine, prompts, per_call, kw) -> dict:
    calls, lengths = [], []
    t0 = time.perf_counter()
    for c in range(0, len(prompts), per_call):
        batch = prompts[c:c + per_call]
        t = time.perf_counter()
        out = engine.generate(batch, seed=kw["seed"] + c, **{k: v for k, v in kw.items() if k != "seed"})
        lens = [len(s.token_ids) for g in out for s in g]
        calls.append({"seconds": time.perf_counter() - t, "tokens": sum(lens), "lengths": lens,
                      "tail_fraction": tail_fraction(lens, engine.spec.max_num_seqs),
                      "tail_fraction_call": tail_fraction(lens, min(len(lens), engine.spec.max_num_seqs))})
        lengths += lens
    wall = time.perf_counter() - t0
    return {"seconds": wall, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / wall, "calls": calls,
            "tail_fraction": statistics.fmean(c["tail_fraction"] for c in calls),
            "tail_fraction_call": statistics.fmean(c["tail_fraction_call"] for c in calls), "lengths": lengths}


def probe_batches(engine, prompts, kw, sizes: list[int], steps: int) -> dict[int, float]:
    """Seconds per decode step at each batch size: ``size`` sequences (``size / n`` prompts x ``n`` samples) of
    exactly ``steps`` tokens (``steps`` below the shortest response, so none ends early), prompt prefill included."""
    out = {}
    for size in sizes:
        batch = prompts[: max(1, size // kw["n"])]
        t = time.perf_counter()
        res = engine.generate(batch, **{**kw, "max_tokens": steps})
        lens = [len(s.token_ids) for g in res for s in g]
        out[size] = (time.perf_counter() - t) / max(lens)
        if min(lens) < steps:
            print(f"  probe at {size}: a response ended after {min(lens)} of {steps} tokens, so its steps ran "
                  "fewer sequences; lower --probe-steps below the shortest response", file=sys.stderr)
    return out


def step_seconds(probe: dict[int, float], b: int) -> float:
    """Seconds of one decode step over ``b`` sequences, interpolated linearly between the probed sizes."""
    sizes = sorted(probe)
    if b <= sizes[0]:
        return probe[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if b <= hi:
            return probe[lo] + (probe[hi] - probe[lo]) * (b - lo) / (hi - lo)
    return probe[sizes[-1]] * b / sizes[-1]


def seconds_bound(calls: list[dict], probe: dict[int, float], full: int) -> dict[str, float]:
    """The lock-step calls' decode time from the probed step times (step t runs the responses longer than t)
    against the same tokens at ``full`` sequences per step: the bound on continuous generation's gain counted in
    seconds, where the tail fraction counts steps (a step over fewer sequences is shorter)."""
    lock = sum(step_seconds(probe, sum(1 for n in c["lengths"] if n > t))
               for c in calls for t in range(max(c["lengths"])))
    tokens = sum(sum(c["lengths"]) for c in calls)
    ideal = tokens / full * step_seconds(probe, full)
    return {"lockstep_model_s": lock, "full_batch_model_s": ideal, "bound": lock / ideal}


def run_continuous(engine, prompts, kw, *, update=None) -> dict:
    """All ``prompts`` through ``engine`` kept at max_num_seqs sequences; ``update = (at_s, fn)`` runs ``fn`` in a
    thread ``at_s`` seconds in."""
    n = kw["n"]
    slots = engine.spec.max_num_seqs
    pending = list(enumerate(prompts))
    lengths, groups, last_submit = [], 0, None
    thread = None
    t0 = time.perf_counter()
    while pending or engine.in_flight():
        while pending and engine.in_flight() + n <= slots:
            i, p = pending.pop(0)
            engine.submit(f"p{i}", p, seed=kw["seed"] + i, **{k: v for k, v in kw.items() if k != "seed"})
            if not pending:
                last_submit = time.perf_counter() - t0
        if update is not None and thread is None and time.perf_counter() - t0 >= update[0]:
            thread = threading.Thread(target=update[1])
            thread.start()
        for fg in engine.finished(0.05):
            assert fg.error is None, fg.error
            groups += 1
            lengths += [len(s.token_ids) for s in fg.samples]
    wall = time.perf_counter() - t0
    if thread is not None:
        thread.join()
    return {"seconds": wall, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / wall, "groups": groups,
            "admission_window_s": last_submit, "lengths": lengths}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--calls", type=int, default=3, help="lock-step calls (prompts = calls x call size)")
    p.add_argument("--update-prompts", type=int, default=32)
    p.add_argument("--update-at", type=float, default=0.3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", default="keep,keep_no_recompute,wait,abort")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-sizes", default="8,32,64,128,256",
                   help="batch sizes whose decode step time is measured (the seconds-based bound)")
    p.add_argument("--probe-steps", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.continuous import ContinuousEngine
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task

    cfg = load_config([args.config], args.overrides)
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    train, held_out = load_task(cfg)
    encoder = PromptEncoder.from_config(cfg, tok)
    spec = EngineSpec.from_config(cfg, base, longest_prompt=encoder.longest(train + held_out))
    per_call = cfg.cluster.rollout.prompts_per_call or math.ceil(cfg.algo.prompts_per_step / cfg.rollout_engines())
    problems = train[: per_call * args.calls]
    prompts = [encoder(pr) for pr in problems]
    r = cfg.rollout
    kw = dict(n=cfg.algo.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_tokens,
              stop_token_ids=encoder.stop_ids, seed=args.seed)
    doc = {"config": args.config, "overrides": args.overrides, "base_model": str(base),
           "max_num_seqs": spec.max_num_seqs, "prompts_per_call": per_call, "group_size": cfg.algo.group_size,
           "prompts": len(prompts), "max_tokens": r.max_response_tokens, "temperature": r.temperature,
           "cpus": os.cpu_count()}

    print(f"lock-step: {len(prompts)} prompts in calls of {per_call} x {kw['n']} (load {os.getloadavg()[0]:.1f})",
          flush=True)
    eng = VLLMEngine(spec)
    try:
        eng.generate(prompts[:2], **kw)  # warm-up
        lock = run_lockstep(eng, prompts, per_call, kw)
        sizes = [int(x) for x in args.probe_sizes.split(",") if x] if args.probe_sizes else []
        probe = probe_batches(eng, prompts, kw, sizes, args.probe_steps) if sizes else {}
    finally:
        eng.close()
    print(f"  {lock['tokens_per_s']:.0f} tokens/s, tail fraction {lock['tail_fraction']:.3f}", flush=True)

    print(f"continuous (load {os.getloadavg()[0]:.1f})", flush=True)
    eng = ContinuousEngine(spec)
    updates = {}
    try:
        eng.generate(prompts[:2], **kw)  # warm-up
        cont = run_continuous(eng, prompts, kw)
        print(f"  {cont['tokens_per_s']:.0f} tokens/s", flush=True)
        state = load_file(str(base / "model.safetensors"))
        few = prompts[: args.update_prompts]
        runs: dict[str, list[dict]] = {}
        version = 0
        for _ in range(args.reps):  # the modes interleaved, so that the machine's load drifts over all of them alike
            for mode in ["none", *args.modes.split(",")]:
                load = os.getloadavg()[0]
                if mode == "none":
                    res = run_continuous(eng, few, kw)
                    runs.setdefault(mode, []).append({"seconds": res["seconds"], "load_average": load})
                    continue
                version += 1
                eng.weight_update = "keep" if mode.startswith("keep") else mode
                eng.recompute_kv_after_update = mode != "keep_no_recompute"
                before = eng.stats()

                def update(v=version):
                    eng.apply_weights(v, lambda: eng.load_weights(state, v))

                at = args.update_at * statistics.median(r["seconds"] for r in runs["none"])
                res = run_continuous(eng, few, kw, update=(at, update))
                after = eng.stats()
                st = eng.update_stats[-1]
                runs.setdefault(mode, []).append({
                    "seconds": res["seconds"], "pause_to_resume_s": st.total_s, "pause_s": st.pause_s,
                    "load_s": st.load_s, "in_flight_at_update": st.in_flight,
                    "reprefill_tokens": after["reprefill_tokens_total"] - before["reprefill_tokens_total"],
                    "resubmitted": after["resubmitted_total"] - before["resubmitted_total"], "load_average": load})
                print(f"  update {mode}: {res['seconds']:.2f} s, pause-to-resume {st.total_s:.2f} s", flush=True)
        plain = statistics.median(r["seconds"] for r in runs["none"])
        for mode, rs in runs.items():
            updates[mode] = {"runs": rs, "median_s": statistics.median(r["seconds"] for r in rs),
                             "median_lost_s": statistics.median(r["seconds"] for r in rs) - plain}
            if mode != "none":
                updates[mode]["median_pause_to_resume_s"] = statistics.median(r["pause_to_resume_s"] for r in rs)
    finally:
        eng.close()

    window = cont["admission_window_s"]
    doc["lockstep"] = {k: v for k, v in lock.items() if k != "lengths"}
    doc["continuous"] = {k: v for k, v in cont.items() if k != "lengths"}
    doc["speedup"] = cont["tokens_per_s"] / lock["tokens_per_s"]
    doc["tail_bound"] = 1 / (1 - lock["tail_fraction"]) if lock["tail_fraction"] < 1 else None
    doc["call_tail_bound"] = 1 / (1 - lock["tail_fraction_call"])
    doc["admission_window_s"] = window
    if probe:
        doc["batch_probe"] = {"steps": args.probe_steps, "step_s": {str(b): v for b, v in probe.items()},
                              "tokens_per_s": {str(b): b / v for b, v in probe.items()}}
        doc["seconds_bound"] = seconds_bound(lock["calls"], probe, spec.max_num_seqs)
    doc["lockstep"]["calls"] = [{**c, "lengths": percentiles(c["lengths"])} for c in lock["calls"]]
    doc["lengths"] = {"lockstep": percentiles(lock["lengths"]), "continuous": percentiles(cont["lengths"])}
    doc["updates"] = updates
    write_result(args.out, doc)
    print(f"speedup {doc['speedup']:.2f}x (lock-step tail fraction {lock['tail_fraction']:.3f}, of the call's own "
          f"size {lock['tail_fraction_call']:.3f})")
    if probe:
        print("decode tokens/s by batch size: " + ", ".join(f"{b}: {b / v:.0f}" for b, v in probe.items())
              + f"; bound in seconds {doc['seconds_bound']['bound']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

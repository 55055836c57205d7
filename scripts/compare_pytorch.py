#!/usr/bin/env python3
"""frugal side by side with PyTorch 2.x's own tools, on this machine, in one run.

Three comparisons, each run first in frugal (``frugal bench NAME --json-out``) and then in PyTorch
on the shapes, thread count and repetitions frugal's JSON reports:

1. checkpoint: bytes kept between forward and backward, and forward+backward time, per
   checkpointing policy (none, full, every_2, selective) against ``torch.utils.checkpoint``
   (non-reentrant; selective through ``create_selective_checkpoint_contexts`` keeping matrix
   products), on the pre-LN block of ``frugal account`` written again below.
2. optim-in-backward: peak bytes of a steady AdamW training step and step time, frugal's
   optimizer inside backward against PyTorch's tutorial way (one ``torch.optim.AdamW`` per
   parameter, stepped from ``register_post_accumulate_grad_hook``), and both in standard mode.
3. chunked-loss: peak bytes and time of frugal's chunked cross-entropy against
   ``F.cross_entropy`` on full logits and against a chunked loss built from PyTorch's own parts
   (each chunk's Linear + cross-entropy under non-reentrant checkpointing).

How PyTorch's bytes are measured. frugal's tracker observes every allocation and free that c10's
allocators report (``c10::reportMemoryUsageToProfiler`` to the reporter on the thread's
``ThreadLocalDebugInfo``). ``torch.profiler.profile(profile_memory=True)`` subscribes to the same
reports on CPU: each ``[memory]`` event is one allocation (+bytes) or free (-bytes) of the same
allocator, so live bytes summed from its events count exactly what the tracker counts. Kept bytes
are the sum over the forward; a peak is the highest running sum over the window, starting from
zero where frugal's tracker starts from zero (after the parameters and inputs exist). RSS deltas
would not be comparable: glibc's malloc keeps freed small blocks and returns large ones.
The seed's method (``saved_tensors_hooks``, unique storages, parameters and the input excluded)
is reported too; it cannot see what non-reentrant checkpointing keeps (its own hooks take over
inside the region, and the region's inputs are held by its recompute closure), so the
checkpointing ratios use the allocator's count on both sides.

Ratios are frugal / PyTorch: below 1 frugal uses fewer bytes or less time.
Run through ``scripts/compare_pytorch.sh``, which finds the torch 2.x virtual environment and the
frugal binary built against the same LibTorch.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Quick mode: tiny shapes and one repetition (the CTest entry); the numbers are not figures.
# (bench checkpoint also plans for 25% of the plain peak, which needs a few layers)
QUICK = {
    "checkpoint": ["--layers", "6", "--width", "32", "--heads", "2", "--batch", "2", "--seq", "16"],
    "optim-in-backward": ["--layers", "2", "--width", "32", "--heads", "2", "--batch", "1", "--seq", "16"],
    "chunked-loss": ["--tokens", "256", "--hidden", "32", "--vocab", "500", "--chunk", "64"],
}
# frugal's own defaults for the timed repetitions of each benchmark (frugal bench NAME --help)
DEFAULT_RUNS = {"checkpoint": 9, "optim-in-backward": 5, "chunked-loss": 3}
POLICIES = ("none", "full", "every_2", "selective")
# Bytes kept without checkpointing must agree within this fraction (checked by --check).
NONE_KEPT_TOLERANCE = 0.001


def fail(message: str, code: int = 2):
    print(f"compare_pytorch: {message}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# frugal's side: its benchmarks, run as processes, read back from --json-out.

def run_frugal(frugal: str, bench: str, flags: list[str], out_dir: Path, env: dict) -> dict:
    path = out_dir / f"frugal-{bench}.json"
    cmd = [frugal, "bench", bench, *flags, "--json-out", str(path)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        fail(f"'{' '.join(cmd)}' exited with {done.returncode}: {done.stderr.strip()}", 1)
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# PyTorch's side. torch is imported in main(), after the arguments are read.
torch = nn = F = None


def import_torch():
    global torch, nn, F
    import warnings
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # numpy is not needed here
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's "no GPU" complaint on a CPU machine
    import torch as _torch
    import torch.nn as _nn
    import torch.nn.functional as _F
    torch, nn, F = _torch, _nn, _F


class AllocationWindow:
    """Every CPU allocation and free in a window, from torch.profiler's memory events."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        cpu = torch._C._autograd.DeviceType.CPU
        # (time, bytes): +bytes an allocation, -bytes a free; sorted stably by time
        self.changes = sorted(((e.start_ns(), e.nbytes()) for e in events
                               if e.name() == "[memory]" and e.device_type() == cpu), key=lambda c: c[0])
        self.marks = {e.name(): e.start_ns() for e in events if e.name().startswith("mark:")}
        return False

    @staticmethod
    def mark(name: str):
        return torch.profiler.record_function("mark:" + name)

    def live_at(self, mark: str) -> int:
        t = self.marks["mark:" + mark]
        return sum(b for s, b in self.changes if s < t)

    def net(self) -> int:
        return sum(b for _, b in self.changes)

    def peak(self, since_mark: str | None = None) -> int:
        """Highest live bytes (counted from zero at the window's start), from since_mark on."""
        start = self.marks["mark:" + since_mark] if since_mark else None
        live, peak = 0, 0
        for s, b in self.changes:
            live += b
            if start is None or s >= start:
                peak = max(peak, live)
        return peak


def median_time(fn, warmup: int, runs: int) -> float:
    seconds = []
    for r in range(warmup + runs):
        t0 = time.perf_counter()
        fn()
        if r >= warmup:
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def causal_attention(q, k, v):
    """q, k, v: (B, H, T, dh) -> (B, H, T, dh); keeps the (B, H, T, T) probabilities, as frugal's."""
    T = q.size(2)
    scores = torch.matmul(q, k.transpose(-2, -1))  # (B, H, T, T)
    scores.mul_(1.0 / math.sqrt(q.size(3)))
    scores.add_(torch.full((T, T), float("-inf"), dtype=scores.dtype).triu_(1))
    return torch.matmul(torch.softmax(scores, -1), v)


def make_block(d: int, heads: int):
    """frugal's PreLNBlock (models/transformer_block.h), operation for operation:
    x -> x + proj(attention(qkv(ln1(x)))) -> x + fc2(gelu(fc1(ln2(x)))), no dropout."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):  # x: (B, T, d)
            B, T, _ = x.shape
            parts = self.qkv(self.ln1(x)).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)  # (3, B, H, T, dh)
            att = causal_attention(parts[0], parts[1], parts[2])  # (B, H, T, dh)
            x1 = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
            return x1 + self.fc2(F.gelu(self.fc1(self.ln2(x1))))

    return Block()


def keep_matmuls(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep the matrix products' outputs (frugal keeps its Linears')."""
    from torch.utils.checkpoint import CheckpointPolicy
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def run_chain(blocks, x, policy: str, sac_options=None):
    """x: (B, T, d) -> (B, T, d) under a policy named as frugal names them."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    k = int(policy.split("_")[1]) if policy.startswith("every_") else None
    for i, blk in enumerate(blocks):
        if policy == "full" or (k is not None and i % k == 0):
            x = checkpoint(blk, x, use_reentrant=False)
        elif policy == "selective":
            x = checkpoint(blk, x, use_reentrant=False, **(sac_options or {}),
                           context_fn=functools.partial(create_selective_checkpoint_contexts, keep_matmuls))
        else:
            x = blk(x)
    return x


def hook_saved_bytes(blocks, x, policy: str) -> int:
    """The seed's count: unique storages packed by saved_tensors_hooks, parameters and input excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in blocks.parameters()} | {x.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in excluded:
            seen[s.data_ptr()] = s.nbytes()
        return t

    # What selective checkpointing keeps bypasses outer hooks (the seed adds it from its policy);
    # said explicitly where torch asks for the choice.
    import inspect
    from torch.utils.checkpoint import checkpoint
    sac = ({"respect_saved_tensors_hooks": False}
           if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run_chain(blocks, x, policy, sac).pow(2).mean()
    loss.backward()
    blocks.zero_grad(set_to_none=True)
    return sum(seen.values())


def pytorch_checkpoint(cfg: dict, warmup: int) -> dict:
    L, d, H, B, T, runs = (cfg[k] for k in ("layers", "width", "heads", "batch", "seq", "runs"))
    torch.manual_seed(0)
    blocks = nn.ModuleList(make_block(d, H) for _ in range(L))
    x = torch.randn(B, T, d)
    out = {"saved_bytes": {}, "saved_bytes_hooks": {}, "time_s": {}, "max_grad_diff": {}}
    grads = {}
    for policy in POLICIES:
        blocks.zero_grad(set_to_none=True)
        with AllocationWindow() as w:
            loss = run_chain(blocks, x, policy).pow(2).mean()
        out["saved_bytes"][policy] = w.net()  # live at the end of forward, above its start
        loss.backward()
        grads[policy] = [p.grad.clone() for p in blocks.parameters()]
        blocks.zero_grad(set_to_none=True)
        out["saved_bytes_hooks"][policy] = hook_saved_bytes(blocks, x, policy)
        out["max_grad_diff"][policy] = max(
            (a - b).abs().max().item() for a, b in zip(grads[policy], grads["none"]))

    for policy in POLICIES:
        def step(policy=policy):
            blocks.zero_grad(set_to_none=True)
            run_chain(blocks, x, policy).pow(2).mean().backward()
        out["time_s"][policy] = median_time(step, warmup, runs)
    blocks.zero_grad(set_to_none=True)
    return out


def pytorch_optim_in_backward(cfg: dict, memory_steps: int = 3) -> dict:
    L, d, H, B, T, runs = (cfg[k] for k in ("layers", "width", "heads", "batch", "seq", "runs"))
    torch.manual_seed(0)
    standard = nn.ModuleList(make_block(d, H) for _ in range(L))
    in_backward = copy.deepcopy(standard)
    batches = [torch.randn(B, T, d) for _ in range(memory_steps + runs + 1)]  # each (B, T, d)
    options = dict(lr=1e-4, weight_decay=0.01)
    opt = torch.optim.AdamW(standard.parameters(), **options)
    # PyTorch's tutorial: one optimizer per parameter, stepped as soon as its gradient is accumulated
    per_param = {p: torch.optim.AdamW([p], foreach=False, **options) for p in in_backward.parameters()}

    def step_and_free(p):
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)

    for p in in_backward.parameters():
        p.register_post_accumulate_grad_hook(step_and_free)

    def step_standard(x):
        run_chain(standard, x, cfg["policy"]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step_in_backward(x):
        run_chain(in_backward, x, cfg["policy"]).pow(2).mean().backward()

    def steady_peak(step):
        # tracked from before the first step (which creates the optimizer state), as frugal's tracker
        with AllocationWindow() as w:
            for i in range(memory_steps):
                with AllocationWindow.mark(f"step{i}"):
                    pass
                step(batches[i])
        return w.peak(since_mark="step1")

    out = {"peak_bytes_standard": steady_peak(step_standard), "peak_bytes_in_backward": steady_peak(step_in_backward)}
    ts, tb = [], []
    for i in range(runs + 1):  # interleaved as frugal times them; the first pair warms up
        x = batches[memory_steps + i]
        t0 = time.perf_counter()
        step_standard(x)
        t1 = time.perf_counter()
        step_in_backward(x)
        t2 = time.perf_counter()
        if i > 0:
            ts.append(t1 - t0)
            tb.append(t2 - t1)
    out["time_s_standard"] = statistics.median(ts)
    out["time_s_in_backward"] = statistics.median(tb)
    out["max_param_diff"] = max((a - b).abs().max().item()
                                for a, b in zip(standard.parameters(), in_backward.parameters()))
    out["adamw_state_bytes"] = sum(t.numel() * t.element_size() for st in opt.state.values()
                                   for t in st.values() if torch.is_tensor(t))
    return out


def pytorch_chunked_loss(cfg: dict) -> dict:
    N, Hd, V, chunk, runs = (cfg[k] for k in ("tokens", "hidden", "vocab", "chunk", "runs"))
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    hidden = torch.randn(N, Hd).requires_grad_()             # (N, H)
    weight = (torch.randn(V, Hd) * 0.02).requires_grad_()     # (V, H)
    targets = torch.randint(0, V, (N,))                        # (N)

    def plain():
        return F.cross_entropy(F.linear(hidden, weight), targets)  # logits: (N, V)

    def chunk_sum(h, w, t):  # h: (n, H) -> summed loss of n tokens; the (n, V) logits live only here
        return F.cross_entropy(F.linear(h, w), t, reduction="sum")

    def chunked():
        total = hidden.new_zeros(())
        for s in range(0, N, chunk):
            total = total + checkpoint(chunk_sum, hidden[s:s + chunk], weight, targets[s:s + chunk],
                                       use_reentrant=False)
        return total / N

    def clear():
        hidden.grad = None
        weight.grad = None

    def peak(fn):
        clear()
        with AllocationWindow() as w:
            fn().backward()
        g = (hidden.grad.clone(), weight.grad.clone())
        clear()
        return w.peak(), g

    def timed(fn):
        def once():
            clear()
            fn().backward()
        t = median_time(once, 1, runs)
        clear()
        return t

    out = {}
    out["peak_bytes_plain"], gp = peak(plain)
    out["peak_bytes_chunked"], gc = peak(chunked)
    out["max_rel_grad_diff"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(gc, gp))
    out["time_s_plain"] = timed(plain)
    out["time_s_chunked"] = timed(chunked)
    return out


# ---------------------------------------------------------------------------------------------
# Side by side

def ratio(a, b):
    return a / b if b else None


def compare_checkpoint(fr: dict, py: dict) -> dict:
    frugal = {"saved_bytes": {p: v["saved_bytes"] for p, v in fr["variants"].items()},
              "time_s": {p: v["time_s"] for p, v in fr["variants"].items()},
              "max_grad_diff": {p: v["max_grad_diff"] for p, v in fr["variants"].items()}}
    policies = [p for p in POLICIES if p in frugal["saved_bytes"]]
    for side in (frugal, py):
        side["saved_ratio_vs_none"] = {p: side["saved_bytes"][p] / side["saved_bytes"]["none"] for p in policies}
        side["time_ratio_vs_none"] = {p: side["time_s"][p] / side["time_s"]["none"] for p in policies}
    return {"config": fr["config"], "frugal": frugal, "pytorch": py, "ratio": {
        "saved_bytes": {p: ratio(frugal["saved_bytes"][p], py["saved_bytes"][p]) for p in policies},
        "time_s": {p: ratio(frugal["time_s"][p], py["time_s"][p]) for p in policies}}}


def compare_optim(fr: dict, py: dict) -> dict:
    keys = ("peak_bytes_standard", "peak_bytes_in_backward", "time_s_standard", "time_s_in_backward")
    frugal = {k: fr[k] for k in keys + ("max_param_diff", "adamw_state_bytes")}
    for side in (frugal, py):
        side["memory_ratio"] = side["peak_bytes_in_backward"] / side["peak_bytes_standard"]
        side["time_ratio"] = side["time_s_in_backward"] / side["time_s_standard"]
    return {"config": fr["config"], "frugal": frugal, "pytorch": py,
            "ratio": {k: ratio(frugal[k], py[k]) for k in keys}}


def compare_loss(fr: dict, py: dict) -> dict:
    frugal = {k: fr[k] for k in ("peak_bytes_plain", "peak_bytes_chunked", "time_s_plain", "time_s_chunked",
                                 "max_rel_grad_diff")}
    r = {k: ratio(frugal[k], py[k]) for k in ("peak_bytes_plain", "peak_bytes_chunked", "time_s_plain", "time_s_chunked")}
    # frugal's chunked loss against PyTorch's plain loss: what a PyTorch user would otherwise run
    r["frugal_chunked_vs_pytorch_plain_peak"] = ratio(frugal["peak_bytes_chunked"], py["peak_bytes_plain"])
    r["frugal_chunked_vs_pytorch_plain_time"] = ratio(frugal["time_s_chunked"], py["time_s_plain"])
    return {"config": fr["config"], "frugal": frugal, "pytorch": py, "ratio": r}


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def ms(s):
    return f"{s * 1e3:.1f} ms"


def print_table(summary: dict):
    rows = []
    c = summary["checkpoint"]
    for p in c["ratio"]["saved_bytes"]:
        rows.append((f"checkpoint {p}: kept bytes", mib(c["frugal"]["saved_bytes"][p]),
                     mib(c["pytorch"]["saved_bytes"][p]), c["ratio"]["saved_bytes"][p]))
        rows.append((f"checkpoint {p}: fwd+bwd", ms(c["frugal"]["time_s"][p]), ms(c["pytorch"]["time_s"][p]),
                     c["ratio"]["time_s"][p]))
    o = summary["optim_in_backward"]
    for mode in ("standard", "in_backward"):
        rows.append((f"AdamW {mode}: step peak", mib(o["frugal"][f"peak_bytes_{mode}"]),
                     mib(o["pytorch"][f"peak_bytes_{mode}"]), o["ratio"][f"peak_bytes_{mode}"]))
        rows.append((f"AdamW {mode}: step time", ms(o["frugal"][f"time_s_{mode}"]),
                     ms(o["pytorch"][f"time_s_{mode}"]), o["ratio"][f"time_s_{mode}"]))
    lo = summary["chunked_loss"]
    for kind in ("plain", "chunked"):
        rows.append((f"loss {kind}: peak", mib(lo["frugal"][f"peak_bytes_{kind}"]),
                     mib(lo["pytorch"][f"peak_bytes_{kind}"]), lo["ratio"][f"peak_bytes_{kind}"]))
        rows.append((f"loss {kind}: fwd+bwd", ms(lo["frugal"][f"time_s_{kind}"]),
                     ms(lo["pytorch"][f"time_s_{kind}"]), lo["ratio"][f"time_s_{kind}"]))
    print(f"{'':34}{'frugal':>14}{'PyTorch':>14}{'frugal/PyTorch':>16}")
    for name, a, b, r in rows:
        print(f"{name:34}{a:>14}{b:>14}{r:>16.3f}")
    print(f"\nwithin each side (in-backward / standard): frugal peak {o['frugal']['memory_ratio']:.3f}, "
          f"PyTorch peak {o['pytorch']['memory_ratio']:.3f}; frugal time {o['frugal']['time_ratio']:.3f}, "
          f"PyTorch time {o['pytorch']['time_ratio']:.3f}")
    print(f"frugal's chunked loss against PyTorch's plain loss: peak "
          f"{lo['ratio']['frugal_chunked_vs_pytorch_plain_peak']:.3f}, time "
          f"{lo['ratio']['frugal_chunked_vs_pytorch_plain_time']:.3f}")
    print(f"kept bytes without checkpointing by saved_tensors_hooks (the seed's count): "
          f"{c['pytorch']['saved_bytes_hooks']['none']} B, frugal's tracker {c['frugal']['saved_bytes']['none']} B")


def check(summary: dict) -> list[str]:
    """What the CTest entry asserts: both sides' figures present, kept bytes of the plain run agree."""
    problems = []
    for name in ("checkpoint", "optim_in_backward", "chunked_loss"):
        for side in ("frugal", "pytorch"):
            if not summary.get(name, {}).get(side):
                problems.append(f"{name}: no {side} figures")
    if problems:
        return problems

    def numbers(d):
        for v in d.values():
            yield from (numbers(v) if isinstance(v, dict) else [v])

    for name in ("checkpoint", "optim_in_backward", "chunked_loss"):
        for side in ("frugal", "pytorch"):
            bad = [v for v in numbers(summary[name][side]) if not isinstance(v, (int, float)) or v < 0]
            if bad:
                problems.append(f"{name}: {side} has values that are not non-negative numbers: {bad[:3]}")
    c = summary["checkpoint"]
    f_none = c["frugal"]["saved_bytes"]["none"]
    for key in ("saved_bytes", "saved_bytes_hooks"):
        p_none = c["pytorch"][key]["none"]
        if abs(f_none - p_none) > NONE_KEPT_TOLERANCE * f_none:
            problems.append(f"checkpoint none: frugal keeps {f_none} B, PyTorch ({key}) {p_none} B: "
                            f"more than {NONE_KEPT_TOLERANCE:.1%} apart")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frugal", required=True, help="the frugal binary (built against the same LibTorch)")
    parser.add_argument("--out", default="out/compare-pytorch", help="folder for the JSON files")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repetition (a test, not figures)")
    parser.add_argument("--runs", type=int, default=None, help="timed repetitions per measurement on both sides "
                        "(default: each frugal benchmark's own; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads on both sides (default: LibTorch's choice, read from frugal's JSON)")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 unless both sides have figures and the kept bytes without checkpointing "
                             f"agree within {NONE_KEPT_TOLERANCE:.1%}")
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        fail(f"--runs must be at least 1, got {args.runs}")
    if args.threads is not None and args.threads < 1:
        fail(f"--threads must be at least 1, got {args.threads}")
    if not os.access(args.frugal, os.X_OK):
        fail(f"--frugal {args.frugal}: not an executable file")

    import_torch()
    version = subprocess.run([args.frugal, "--version"], capture_output=True, text=True).stdout.strip()
    libtorch = version.rsplit("LibTorch ", 1)[-1]
    if libtorch != torch.__version__.split("+")[0]:
        fail(f"{args.frugal} is built against LibTorch {libtorch}, this Python has torch {torch.__version__}: "
             f"the comparison needs the same version on both sides", 3)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)

    def frugal_bench(bench):
        runs = args.runs or (1 if args.quick else DEFAULT_RUNS[bench])
        flags = (QUICK[bench] if args.quick else []) + ["--runs", str(runs)]
        result = run_frugal(args.frugal, bench, flags, out_dir, env)
        threads = result["config"]["threads"]
        if args.threads and threads != args.threads:
            fail(f"frugal ran {bench} on {threads} threads, not the {args.threads} asked for", 1)
        torch.set_num_threads(threads)
        return result, dict(result["config"], runs=runs)

    summary = {"torch": torch.__version__, "frugal": version}
    fr, cfg = frugal_bench("checkpoint")
    print("+ PyTorch: checkpointing", file=sys.stderr, flush=True)
    summary["checkpoint"] = compare_checkpoint(fr, pytorch_checkpoint(cfg, warmup=2))
    fr, cfg = frugal_bench("optim-in-backward")
    print("+ PyTorch: AdamW after and inside backward", file=sys.stderr, flush=True)
    summary["optim_in_backward"] = compare_optim(fr, pytorch_optim_in_backward(cfg))
    fr, cfg = frugal_bench("chunked-loss")
    print("+ PyTorch: plain and chunked cross-entropy", file=sys.stderr, flush=True)
    summary["chunked_loss"] = compare_loss(fr, pytorch_chunked_loss(cfg))
    summary["threads"] = torch.get_num_threads()
    summary["ratios_are"] = "frugal / PyTorch (below 1: frugal uses fewer bytes or less time)"

    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    print(f"\nwrote {path}")
    if args.check:
        problems = check(summary)
        for p in problems:
            print(f"compare_pytorch: check failed: {p}", file=sys.stderr)
        if problems:
            return 1
        print("compare_pytorch: check passed (both sides' figures present; kept bytes without checkpointing "
              f"agree within {NONE_KEPT_TOLERANCE:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

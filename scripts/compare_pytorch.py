#!/usr/bin/env python3
"""frugal side by side with PyTorch 2.x's own tools, on this machine, in one run.

Four comparisons, each run first in frugal (``frugal bench NAME --json-out``) and then in PyTorch
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
4. optim-state: the time of one AdamW step per parameter on ``frugal bench optim-state``'s work
   (2048-wide fp32 matrices, fresh gradients, the median of the timed steps), frugal's fp32, bf16,
   8-bit and 4-bit state against ``torch.optim.AdamW`` with ``fused=True`` and ``foreach=True``,
   and SGD with momentum 0.9 against ``torch.optim.SGD`` with ``fused=True``; and, from frugal's
   own JSON, the fp32 AdamW and SGD steps against LibTorch's fused kernels (``at::_fused_adamw_``,
   ``at::_fused_sgd_``: what ``fused=True`` calls) alternating in one process.
   Also in 2.: PyTorch's step with ``fused=True`` AdamW, after and inside backward.
5. whole-step (``--whole-step``; heavy, minutes): a recipe's model (default: the default recipe's
   Llama) trained by PyTorch through ``transformers``' LlamaForCausalLM (sdpa attention) in eager
   fp32 with foreach and with fused AdamW, eager bf16 autocast, and ``torch.compile`` (inductor)
   fp32 and bf16, beside ``frugal bench train``'s four corners (fp32/bf16 products, techniques
   off/on). On a CPU without bf16 instructions (``frugal bench train``'s ``bf16_corners`` false)
   the bf16 rows of both sides are left out and ``bf16_skipped`` says why. Each PyTorch variant and each frugal corner also runs in a process of its own for its
   peak resident memory (VmHWM, which each process reads from its own /proc/self/status); PyTorch's allocator peak of one step is counted as in 1.
   Rounds are interleaved and each figure is the median over rounds; compile time is reported apart.

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

Ratios are frugal / PyTorch: below 1 frugal uses fewer bytes or less time. The two optimizer
comparisons (2. and 4.) run --rounds times, the sides alternating, and take each figure's median.
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
    "optim-state": ["--params", "65536"],
}
# frugal's own defaults for the timed repetitions of each benchmark (frugal bench NAME --help)
DEFAULT_RUNS = {"checkpoint": 9, "optim-in-backward": 5, "chunked-loss": 3, "optim-state": 5}
OPTIM_STATE_WIDTH = 2048  # bench optim-state's matrices: OPTIM_STATE_WIDTH wide, as many rows as fit
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
    # the same two with PyTorch's fused CPU AdamW kernel (one pass over each parameter's state)
    standard_fused, in_backward_fused = copy.deepcopy(standard), copy.deepcopy(standard)
    opt_fused = torch.optim.AdamW(standard_fused.parameters(), fused=True, **options)
    per_param.update({p: torch.optim.AdamW([p], fused=True, **options) for p in in_backward_fused.parameters()})

    def step_and_free(p):
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)

    for p in [*in_backward.parameters(), *in_backward_fused.parameters()]:
        p.register_post_accumulate_grad_hook(step_and_free)

    def step_standard(x, model=standard, optimizer=opt):
        run_chain(model, x, cfg["policy"]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step_in_backward(x, model=in_backward):
        run_chain(model, x, cfg["policy"]).pow(2).mean().backward()

    def steady_peak(step):
        # tracked from before the first step (which creates the optimizer state), as frugal's tracker
        with AllocationWindow() as w:
            for i in range(memory_steps):
                with AllocationWindow.mark(f"step{i}"):
                    pass
                step(batches[i])
        return w.peak(since_mark="step1")

    out = {"peak_bytes_standard": steady_peak(step_standard), "peak_bytes_in_backward": steady_peak(step_in_backward)}
    steps = {"standard": step_standard, "in_backward": step_in_backward,
             "standard_fused": functools.partial(step_standard, model=standard_fused, optimizer=opt_fused),
             "in_backward_fused": functools.partial(step_in_backward, model=in_backward_fused)}
    times = {k: [] for k in steps}
    for i in range(runs + 1):  # interleaved as frugal times them; the first round warms up
        x = batches[memory_steps + i]
        for k, step in steps.items():
            t0 = time.perf_counter()
            step(x)
            if i > 0:
                times[k].append(time.perf_counter() - t0)
    for k, t in times.items():
        out[f"time_s_{k}"] = statistics.median(t)
    out["max_param_diff"] = max((a - b).abs().max().item()
                                for a, b in zip(standard.parameters(), in_backward.parameters()))
    out["adamw_state_bytes"] = sum(t.numel() * t.element_size() for st in opt.state.values()
                                   for t in st.values() if torch.is_tensor(t))
    return out


def pytorch_optim_state(params_timed: int, runs: int) -> dict:
    """One AdamW step on bench optim-state's work: ns per parameter, median of `runs` steps after a
    first (which makes the state), fused and foreach, with fresh random gradients each step."""
    rows = params_timed // OPTIM_STATE_WIDTH
    sizes = [OPTIM_STATE_WIDTH] * (rows // OPTIM_STATE_WIDTH)
    if rows % OPTIM_STATE_WIDTH or not sizes:
        sizes[-1:] = [sizes[-1] + rows % OPTIM_STATE_WIDTH] if sizes else [rows]
    out = {"params_timed": rows * OPTIM_STATE_WIDTH}

    def ns_per_param(make_optimizer) -> float:
        torch.manual_seed(0)
        weights = [torch.randn(r, OPTIM_STATE_WIDTH, requires_grad=True) for r in sizes]
        opt = make_optimizer(weights)
        times = []
        for r in range(runs + 1):
            for w in weights:
                w.grad = torch.randn_like(w)
            t0 = time.perf_counter()
            opt.step()
            if r > 0:
                times.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
        return statistics.median(times) * 1e9 / out["params_timed"]

    for name, kind in (("fused", dict(fused=True)), ("foreach", dict(foreach=True))):
        out[f"ns_per_param_{name}"] = ns_per_param(lambda w: torch.optim.AdamW(w, lr=1e-3, weight_decay=0.01, **kind))
    # SGD with momentum as bench optim-state times it (momentum 0.9, weight decay 0.01), fused=True
    out["ns_per_param_sgd_momentum_fused"] = ns_per_param(
        lambda w: torch.optim.SGD(w, lr=1e-3, momentum=0.9, weight_decay=0.01, fused=True))
    return out


# ---------------------------------------------------------------------------------------------
# The whole training step: a recipe's model in PyTorch (transformers' Llama) and in frugal.

WHOLE_STEP_VARIANTS = {  # name: (compiled, bf16 autocast, AdamW implementation)
    "eager_fp32_foreach": (False, False, "foreach"),
    "eager_fp32_fused": (False, False, "fused"),
    "eager_bf16_fused": (False, True, "fused"),
    "compiled_fp32_fused": (True, False, "fused"),
    "compiled_bf16_fused": (True, True, "fused"),
}
# frugal's corners: the recipe as it is (techniques on) and train::without_techniques's keys (off),
# each with fp32 and with bf16 matrix products
TECHNIQUES_OFF = ["memory.checkpointing=none", "memory.activation_budget=0", "memory.chunked_loss=false",
                  "optimizer.in_backward=false", "optimizer.state_precision=fp32", "optimizer.state_placement=device",
                  "optimizer.stochastic_rounding=false"]
FRUGAL_CORNERS = {
    "fp32_all_off": TECHNIQUES_OFF + ["model.compute_dtype=fp32"],
    "bf16_all_off": TECHNIQUES_OFF + ["model.compute_dtype=bf16"],
    "fp32_all_on": ["model.compute_dtype=fp32"],
    "bf16_all_on": ["model.compute_dtype=bf16"],
}
QUICK_WHOLE_STEP = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=176",
                    "train.batch_size=2", "train.seq_len=32", "memory.activation_budget=0"]


def recipe_values(recipe_path: Path, overrides: list[str]) -> dict:
    """The recipe's model, batch and optimizer keys with section.key=value overrides applied."""
    import yaml
    r = yaml.safe_load(recipe_path.read_text())
    for o in overrides:
        key, _, value = o.partition("=")
        section, _, name = key.partition(".")
        r.setdefault(section, {})[name] = yaml.safe_load(value)
    m, t, o, d = r["model"], r["train"], r.get("optimizer", {}), r.get("data", {})
    out_dir = Path(t.get("out_dir", "out"))  # where frugal keeps the recipe's tokenizer and tokens
    if m.get("arch", "llama") != "llama" or not m.get("vocab_size"):
        fail(f"--whole-step needs a llama recipe with its vocab_size set ({recipe_path})")
    return {"vocab": m["vocab_size"], "dim": m["dim"], "layers": m["n_layers"], "heads": m["n_heads"],
            "kv_heads": m.get("n_kv_heads", m["n_heads"]), "ffn": m["ffn_dim"], "max_seq": m["max_seq_len"],
            "tied": bool(m.get("tie_embeddings", False)), "rope_theta": m.get("rope_theta", 10000.0),
            "norm_eps": m.get("norm_eps", 1e-5), "batch": t["batch_size"], "seq": t["seq_len"],
            "lr": o.get("lr", 1e-3), "weight_decay": o.get("weight_decay", 0.0),
            "betas": [o.get("beta1", 0.9), o.get("beta2", 0.999)],
            "tokenizer": d.get("tokenizer") or str(out_dir / "tokenizer.model"),
            "tokens": d.get("tokens") or str(out_dir / "corpus.tokens")}


def whole_step_child(variant: str, cfg: dict) -> dict:
    """One PyTorch variant in this process: warm-up, timed steps, one step's allocator peak."""
    from transformers import LlamaConfig, LlamaForCausalLM
    compiled, bf16, impl = WHOLE_STEP_VARIANTS[variant]
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=cfg["ffn"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["max_seq"],
                         tie_word_embeddings=cfg["tied"], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["norm_eps"])
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]),
                            weight_decay=cfg["weight_decay"], **{impl: True})
    forward = torch.compile(model) if compiled else model
    B, T, V = cfg["batch"], cfg["seq"], cfg["vocab"]
    batches = [torch.randint(0, V, (B, T + 1)) for _ in range(4)]

    def step(i):
        ids = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    step(0)  # makes the optimizer state; compiles where compiled
    first_s = time.perf_counter() - t0
    step(1)
    times = []
    for i in range(cfg["steps"]):
        t0 = time.perf_counter()
        step(2 + i)
        times.append(time.perf_counter() - t0)
    live = sum(t.numel() * t.element_size() for t in model.parameters())
    live += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    with AllocationWindow() as w:
        step(0)
    median = statistics.median(times)
    return {"tokens_per_s": B * T / median, "step_s": median, "first_step_s": first_s,
            "compile_s": max(0.0, first_s - median) if compiled else 0.0, "allocator_peak_bytes": live + w.peak(),
            "peak_rss_bytes": peak_rss_of_this_process()}


def peak_rss_of_this_process() -> int:
    """VmHWM of /proc/self/status in bytes: this process's resident high-water mark since its exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    fail("/proc/self/status has no VmHWM line (the whole-step comparison needs Linux)", 1)


def run_child(cmd: list[str], env: dict) -> str:
    """Runs cmd; its standard output. Each child reports its own peak resident memory (VmHWM):
    wait4's ru_maxrss cannot be used, as Linux counts in it the forked copy of this process's
    memory before exec, so every child would show this (large) process's resident size."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"'{' '.join(cmd[:6])} ...' exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}", 1)
    return proc.stdout


def whole_step(frugal: str, recipe: str, overrides: list[str], steps: int, rounds: int, threads: int,
               out_dir: Path, env: dict) -> dict:
    """Both sides' whole training step; see the module's description (5.)."""
    recipe_path = Path(recipe)
    if not recipe_path.is_file():
        recipe_path = Path(__file__).resolve().parent.parent / "recipes" / f"{recipe}.yaml"
    cfg = recipe_values(recipe_path, overrides)
    cfg.update(steps=steps, threads=threads)
    corners, variants = dict(FRUGAL_CORNERS), dict(WHOLE_STEP_VARIANTS)
    pytorch = {v: {"tokens_per_s": [], "peak_rss_bytes": [], "allocator_peak_bytes": [], "compile_s": []}
               for v in variants}
    rss_frugal = {c: [] for c in corners}
    fr_rounds = []
    bf16_skipped = None
    for r in range(rounds):
        # frugal: bench train's four corners (their speeds and tracked peaks), then each corner alone for its RSS
        fr_rounds.append(run_frugal(frugal, "train", ["--recipe", str(recipe_path), "--steps", str(steps + 2),
                                                      "--rounds", "1", *overrides], out_dir, env))
        if r == 0 and not fr_rounds[0].get("bf16_corners", True):
            # a CPU without bf16 instructions: both sides would time emulated bf16 products (minutes
            # a step, and not what either would run there), so the bf16 rows are left out
            bf16_skipped = fr_rounds[0]["fast_bf16_reason"]
            print(f"+ bf16 rows skipped on both sides: {bf16_skipped}", file=sys.stderr, flush=True)
            corners = {c: k for c, k in corners.items() if not c.startswith("bf16")}
            variants = {v: k for v, k in variants.items() if not k[1]}
            pytorch = {v: pytorch[v] for v in variants}
            rss_frugal = {c: rss_frugal[c] for c in corners}
        for corner, keys in corners.items():
            run_dir = out_dir / f"whole-step-{corner}"
            cmd = [frugal, "train", str(recipe_path), *overrides, *keys, f"train.steps={steps + 2}",
                   f"train.out_dir={run_dir}", "train.checkpoint_interval=0", "train.eval_interval=0", "schedule.warmup_steps=1",
                   "train.sample_tokens=0", f"data.tokenizer={cfg['tokenizer']}", f"data.tokens={cfg['tokens']}"]
            print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
            run_child(cmd + ["--json-out", str(run_dir / "summary.json")], env)
            rss_frugal[corner].append(json.loads((run_dir / "summary.json").read_text())["peak_rss_bytes"])
        for variant in variants:
            print(f"+ PyTorch whole step: {variant} (round {r + 1} of {rounds})", file=sys.stderr, flush=True)
            out = run_child([sys.executable, __file__, "--frugal", frugal, "--whole-step-child", variant,
                                     "--whole-step-config", json.dumps(cfg)], env)
            got = json.loads(out.strip().splitlines()[-1])
            for k in ("tokens_per_s", "allocator_peak_bytes", "compile_s"):
                pytorch[variant][k].append(got[k])
            pytorch[variant]["peak_rss_bytes"].append(got["peak_rss_bytes"])
    med = statistics.median
    py = {v: {k: med(x) for k, x in d.items()} for v, d in pytorch.items()}
    fr = {}
    for corner in corners:
        suffix = {"fp32_all_off": "all_off", "bf16_all_off": "all_off_bf16", "fp32_all_on": "all_on",
                  "bf16_all_on": "all_on_bf16"}[corner]
        fr[corner] = {"tokens_per_s": med([x[f"tokens_per_s_{suffix}"] for x in fr_rounds]),
                      "tracked_peak_bytes": med([x[f"peak_bytes_{suffix}"] for x in fr_rounds]),
                      "peak_rss_bytes": med(rss_frugal[corner])}
    best_eager_fp32 = max(py["eager_fp32_foreach"]["tokens_per_s"], py["eager_fp32_fused"]["tokens_per_s"])
    best_fp32 = max(best_eager_fp32, py["compiled_fp32_fused"]["tokens_per_s"])
    ratios = {  # speed ratios: frugal / PyTorch tokens/s (above 1: frugal faster); memory: frugal / PyTorch
        "fp32_all_off_speed_vs_best_pytorch_fp32": fr["fp32_all_off"]["tokens_per_s"] / best_fp32,
        "fp32_all_off_speed_vs_compiled_fp32": fr["fp32_all_off"]["tokens_per_s"] / py["compiled_fp32_fused"]["tokens_per_s"],
        "fp32_all_on_rss_vs_pytorch_eager_fp32": fr["fp32_all_on"]["peak_rss_bytes"] / py["eager_fp32_foreach"]["peak_rss_bytes"],
    }
    if bf16_skipped is None:
        best_bf16 = max(py["eager_bf16_fused"]["tokens_per_s"], py["compiled_bf16_fused"]["tokens_per_s"])
        ratios.update({
            "bf16_all_off_speed_vs_best_pytorch_bf16": fr["bf16_all_off"]["tokens_per_s"] / best_bf16,
            "bf16_all_on_speed_vs_pytorch_eager_bf16": fr["bf16_all_on"]["tokens_per_s"] / py["eager_bf16_fused"]["tokens_per_s"],
            "bf16_all_on_rss_vs_pytorch_eager_bf16": fr["bf16_all_on"]["peak_rss_bytes"] / py["eager_bf16_fused"]["peak_rss_bytes"],
            "bf16_all_on_rss_vs_pytorch_eager_fp32": fr["bf16_all_on"]["peak_rss_bytes"] / py["eager_fp32_foreach"]["peak_rss_bytes"],
            "bf16_all_off_speed_vs_compiled_bf16": fr["bf16_all_off"]["tokens_per_s"] / py["compiled_bf16_fused"]["tokens_per_s"],
        })
    return {"config": {k: cfg[k] for k in cfg}, "recipe": str(recipe_path), "overrides": overrides, "rounds": rounds,
            "frugal": fr, "pytorch": py, "ratio": ratios, "bf16_skipped": bf16_skipped}


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


def median_of_rounds(results: list[dict]) -> dict:
    """One result from several rounds of the same measurement: the median of each number (nested
    dicts alike); anything else (names, the configuration's strings) from the first round."""
    first = results[0]
    out = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = median_of_rounds([r[k] for r in results])
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in results)
        else:
            out[k] = v
    return out


def compare_optim(fr: dict, py: dict) -> dict:
    keys = ("peak_bytes_standard", "peak_bytes_in_backward", "time_s_standard", "time_s_in_backward")
    frugal = {k: fr[k] for k in keys + ("max_param_diff", "adamw_state_bytes")}
    for side in (frugal, py):
        side["memory_ratio"] = side["peak_bytes_in_backward"] / side["peak_bytes_standard"]
        side["time_ratio"] = side["time_s_in_backward"] / side["time_s_standard"]
    r = {k: ratio(frugal[k], py[k]) for k in keys}
    for mode in ("standard", "in_backward"):  # against PyTorch's fused CPU AdamW in the same place
        r[f"time_s_{mode}_vs_fused"] = ratio(frugal[f"time_s_{mode}"], py[f"time_s_{mode}_fused"])
    return {"config": fr["config"], "frugal": frugal, "pytorch": py, "ratio": r}


def compare_optim_state(fr: dict, py: dict) -> dict:
    if fr["params_timed"] != py["params_timed"]:
        fail(f"optim-state: frugal timed {fr['params_timed']} parameters, PyTorch {py['params_timed']}", 1)
    frugal = {p: {k: v[k] for k in ("ns_per_param", "bytes_per_param", "bytes_moved_per_param", "achieved_gbs")}
              for p, v in fr["precisions"].items()}
    frugal["sgd_momentum"] = {k: fr["sgd_momentum"][k] for k in ("ns_per_param", "bytes_per_param",
                                                                   "bytes_moved_per_param", "achieved_gbs")}
    frugal["copy_bandwidth_gbs"] = fr["copy_bandwidth_gbs"]
    config = {k: fr[k] for k in ("params_timed", "threads", "dense_kernel", "adam_dense_kernel", "quantized_kernel")}
    r = {f"{p}_vs_fused": ratio(fr["precisions"][p]["ns_per_param"], py["ns_per_param_fused"]) for p in fr["precisions"]}
    r["sgd_momentum_vs_fused"] = ratio(fr["sgd_momentum"]["ns_per_param"], py["ns_per_param_sgd_momentum_fused"])
    # the same kernels PyTorch's fused=True calls, timed alternately with frugal's in frugal's own
    # process (null with a LibTorch before 2.4): the ratio a noisy machine disturbs least
    inproc = fr.get("against_libtorch_fused")
    if inproc:
        r["fp32_vs_libtorch_fused_in_process"] = inproc["adamw_fp32"]["ratio"]
        r["sgd_momentum_vs_libtorch_fused_in_process"] = inproc["sgd_momentum"]["ratio"]
    return {"config": config, "frugal": frugal, "pytorch": py, "ratio": r, "in_process": inproc}


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
    for mode in ("standard", "in_backward"):
        rows.append((f"AdamW {mode}: vs fused=True", ms(o["frugal"][f"time_s_{mode}"]),
                     ms(o["pytorch"][f"time_s_{mode}_fused"]), o["ratio"][f"time_s_{mode}_vs_fused"]))
    lo = summary["chunked_loss"]
    for kind in ("plain", "chunked"):
        rows.append((f"loss {kind}: peak", mib(lo["frugal"][f"peak_bytes_{kind}"]),
                     mib(lo["pytorch"][f"peak_bytes_{kind}"]), lo["ratio"][f"peak_bytes_{kind}"]))
        rows.append((f"loss {kind}: fwd+bwd", ms(lo["frugal"][f"time_s_{kind}"]),
                     ms(lo["pytorch"][f"time_s_{kind}"]), lo["ratio"][f"time_s_{kind}"]))
    st = summary["optim_state"]
    for p in ("fp32", "bf16", "int8", "int4"):
        rows.append((f"AdamW step {p} state: ns/param", f"{st['frugal'][p]['ns_per_param']:.3f}",
                     f"{st['pytorch']['ns_per_param_fused']:.3f}", st["ratio"][f"{p}_vs_fused"]))
    rows.append(("SGD momentum step: ns/param", f"{st['frugal']['sgd_momentum']['ns_per_param']:.3f}",
                 f"{st['pytorch']['ns_per_param_sgd_momentum_fused']:.3f}", st["ratio"]["sgd_momentum_vs_fused"]))
    if st.get("in_process"):
        for name, key in (("AdamW fp32, one process: ns/param", "adamw_fp32"), ("SGD momentum, one process: ns/param", "sgd_momentum")):
            f = st["in_process"][key]
            rows.append((name, f"{f['frugal_ns_per_param']:.3f}", f"{f['fused_ns_per_param']:.3f}", f["ratio"]))
    print(f"{'':34}{'frugal':>14}{'PyTorch':>14}{'frugal/PyTorch':>16}")
    for name, a, b, r in rows:
        print(f"{name:34}{a:>14}{b:>14}{r:>16.3f}")
    print(f"\nwithin each side (in-backward / standard): frugal peak {o['frugal']['memory_ratio']:.3f}, "
          f"PyTorch peak {o['pytorch']['memory_ratio']:.3f}; frugal time {o['frugal']['time_ratio']:.3f}, "
          f"PyTorch time {o['pytorch']['time_ratio']:.3f}")
    print(f"frugal's chunked loss against PyTorch's plain loss: peak "
          f"{lo['ratio']['frugal_chunked_vs_pytorch_plain_peak']:.3f}, time "
          f"{lo['ratio']['frugal_chunked_vs_pytorch_plain_time']:.3f}")
    print(f"AdamW step on {st['config']['params_timed']} parameters: PyTorch fused=True "
          f"{st['pytorch']['ns_per_param_fused']:.3f} ns/param, foreach {st['pytorch']['ns_per_param_foreach']:.3f}; "
          f"frugal fp32 moves {st['frugal']['fp32']['bytes_moved_per_param']:.0f} B/param at "
          f"{st['frugal']['fp32']['achieved_gbs']:.1f} GB/s (a copy: {st['frugal']['copy_bandwidth_gbs']:.1f} GB/s), "
          f"dense kernel {st['config']['dense_kernel']}")
    if "whole_step" in summary:
        ws = summary["whole_step"]
        print(f"\nwhole training step, {ws['recipe']} ({ws['config']['batch']} x {ws['config']['seq']} tokens, "
              f"median of {ws['rounds']} rounds): tokens/s, process peak RSS, tensors' peak")
        for name, d in [*(("frugal " + k, v) for k, v in ws["frugal"].items()),
                        *(("PyTorch " + k, v) for k, v in ws["pytorch"].items())]:
            tensors = d.get("tracked_peak_bytes", d.get("allocator_peak_bytes"))
            extra = f", compile {d['compile_s']:.0f} s" if d.get("compile_s") else ""
            print(f"  {name:30}{d['tokens_per_s']:>10.0f}{mib(d['peak_rss_bytes']):>14}{mib(tensors):>14}{extra}")
        for k, v in ws["ratio"].items():
            print(f"  {k}: {v:.3f}")
        if ws.get("bf16_skipped"):
            print(f"  bf16 rows skipped: {ws['bf16_skipped']}")
    print(f"kept bytes without checkpointing by saved_tensors_hooks (the seed's count): "
          f"{c['pytorch']['saved_bytes_hooks']['none']} B, frugal's tracker {c['frugal']['saved_bytes']['none']} B")


def check(summary: dict) -> list[str]:
    """What the CTest entry asserts: both sides' figures present, kept bytes of the plain run agree."""
    problems = []
    for name in ("checkpoint", "optim_in_backward", "chunked_loss", "optim_state"):
        for side in ("frugal", "pytorch"):
            if not summary.get(name, {}).get(side):
                problems.append(f"{name}: no {side} figures")
    if problems:
        return problems

    def numbers(d):
        for v in d.values():
            yield from (numbers(v) if isinstance(v, dict) else [v])

    for name in ("checkpoint", "optim_in_backward", "chunked_loss", "optim_state"):
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of the two optimizer comparisons (1 with --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads on both sides (default: LibTorch's choice, read from frugal's JSON)")
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 unless both sides have figures and the kept bytes without checkpointing "
                             f"agree within {NONE_KEPT_TOLERANCE:.1%}")
    parser.add_argument("--whole-step", action="store_true",
                        help="also compare whole training steps of a recipe's model (heavy: minutes; see 5. above)")
    parser.add_argument("--recipe", default="default", help="the recipe for --whole-step (a file or a shipped name)")
    parser.add_argument("--whole-step-steps", type=int, default=6, help="timed steps per whole-step run")
    parser.add_argument("--whole-step-rounds", type=int, default=3, help="interleaved rounds of every whole-step run")
    parser.add_argument("--whole-step-child", help=argparse.SUPPRESS)
    parser.add_argument("--whole-step-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.whole_step_child:  # one PyTorch variant, in a process of its own (see whole_step)
        import_torch()
        print(json.dumps(whole_step_child(args.whole_step_child, json.loads(args.whole_step_config))))
        return 0
    if args.whole_step_steps < 1 or args.whole_step_rounds < 1:
        fail("--whole-step-steps and --whole-step-rounds must be at least 1")
    if args.rounds < 1:
        fail(f"--rounds must be at least 1, got {args.rounds}")
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
    # The two optimizer comparisons are short: both sides run `rounds` times, alternately (frugal,
    # PyTorch, frugal, ...), so a slow spell of the shared machine hits both; each figure is the
    # median over the rounds.
    rounds = 1 if args.quick else args.rounds
    frs, pys = [], []
    for r in range(rounds):
        fr, cfg = frugal_bench("optim-in-backward")
        print(f"+ PyTorch: AdamW after and inside backward (round {r + 1} of {rounds})", file=sys.stderr, flush=True)
        frs.append(fr)
        pys.append(pytorch_optim_in_backward(cfg))
    summary["optim_in_backward"] = compare_optim(median_of_rounds(frs), median_of_rounds(pys))
    fr, cfg = frugal_bench("chunked-loss")
    print("+ PyTorch: plain and chunked cross-entropy", file=sys.stderr, flush=True)
    summary["chunked_loss"] = compare_loss(fr, pytorch_chunked_loss(cfg))
    runs = args.runs or (1 if args.quick else DEFAULT_RUNS["optim-state"])
    frs, pys = [], []
    for r in range(rounds):
        fr = run_frugal(args.frugal, "optim-state", (QUICK["optim-state"] if args.quick else []) + ["--runs", str(runs)],
                        out_dir, env)
        torch.set_num_threads(fr["threads"])
        print(f"+ PyTorch: AdamW step, fused and foreach (round {r + 1} of {rounds})", file=sys.stderr, flush=True)
        frs.append(fr)
        pys.append(pytorch_optim_state(fr["params_timed"], runs))
    summary["optim_state"] = compare_optim_state(median_of_rounds(frs), median_of_rounds(pys))
    if args.whole_step:
        print("+ whole training steps, frugal and PyTorch", file=sys.stderr, flush=True)
        summary["whole_step"] = whole_step(args.frugal, args.recipe, QUICK_WHOLE_STEP if args.quick else [],
                                           1 if args.quick else args.whole_step_steps,
                                           1 if args.quick else args.whole_step_rounds, fr["threads"], out_dir, env)
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

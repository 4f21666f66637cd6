"""Where a small model's training step spends its host time (GPU): the S2 hybrid against LlamaForCausalLM.

    python bench/profile_training_host.py --out bench/results/training_host_h100.json      # ~4 min, cold caches
    python bench/profile_training_host.py --out /tmp/host.json --tiny                       # CPU smoke run

Model: the 113M hybrid of ``quality_study.py --study scratch`` (12 layers, layers 0-1 dense; hidden 768, 12 query /
4 KV heads, head dim 64; block 64, local 4, every 8th block) on 16 x 2048 tokens; bf16 autocast over float32 weights
(``Trainer(bf16=True)``), non-reentrant checkpointing, fused AdamW, gradient clipping. Arms, on the same tokens:

* ``s2-packed``: the 16 sequences flattened into one row with ``cu_seq_lens`` (the Trainer's padding-free path);
* ``s2-batch``: a ``[16, 2048]`` batch;
* ``llama-batch``: ``LlamaForCausalLM`` with ``sdpa`` on that batch (``is_causal``, no mask): the control.

Per arm:

* **steps**: ms a step synchronized, alternating the backward on the autograd engine's device thread (PyTorch's
  default) and on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), ``--rounds`` rounds of
  ``--steps`` steps each; and the host's time to issue one step that starts on an idle GPU (the step's host work when
  nothing makes it wait). A step shorter to issue than to run is GPU-bound; one about as long is host-bound.
* **timeline** (``torch.profiler`` over two steps): GPU busy time (the union of kernel intervals), the idle gaps
  grouped by the kernels on either side (a gap before a kernel is mostly the host preparing its launch), the time
  spent inside launch calls, and the CPU ops with the most self time.
* **syncs**: every call of one step that synchronizes with the GPU (``torch.cuda.set_sync_debug_mode``), by where it
  comes from.

Then **ops**: the host cost of one attention call (forward without grad, forward and backward) at a size whose kernels
take microseconds, S2 (batch and packed) against SDPA. ``S2_ATTENTION_AUTOTUNE`` is left as it is: with it unset the
first calls of each shape time the tile candidates (warm-up steps absorb that), ``0`` takes the first candidate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch.autograd import DeviceType
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_study import DEFAULT_PATTERN, SCRATCH_CONFIG, TINY_CONFIG, TINY_PATTERN  # noqa: E402

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity  # noqa: E402
from s2_models.kernels import S2Pattern, s2_attention  # noqa: E402
from s2_models.training.train import parse_overrides  # noqa: E402

ARMS = ("s2-packed", "s2-batch", "llama-batch")
RUN = dict(batch=16, length=2048, vocab_size=49152, config=SCRATCH_CONFIG, pattern=DEFAULT_PATTERN)
# --tiny: a CPU smoke run of this script (tiny model, PyTorch attention path); its numbers mean nothing.
TINY_RUN = dict(batch=2, length=128, vocab_size=512, config=TINY_CONFIG, pattern=TINY_PATTERN)


def arm_inputs(arm: str, run: dict, device: str) -> dict:
    """The model inputs of ``arm``: the same tokens for every arm (seeded)."""
    batch, length = run["batch"], run["length"]
    tokens = torch.randint(0, run["vocab_size"], (batch, length), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    if arm != "s2-packed":
        return dict(input_ids=tokens, labels=tokens)
    flat = tokens.view(1, -1)
    offsets = torch.arange(0, batch * length + 1, length, device=device, dtype=torch.int32)
    return dict(input_ids=flat, labels=flat, position_ids=torch.arange(length, device=device).repeat(batch)[None],
                cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=length, max_length_k=length)


def build(arm: str, run: dict, device: str):
    """The arm's model (float32 weights, checkpointing, training mode) and its AdamW."""
    torch.manual_seed(0)
    fields = dict(parse_overrides(run["config"]), vocab_size=run["vocab_size"])
    if arm.startswith("s2"):
        sparsity = hybrid_sparsity(fields["num_hidden_layers"], run["pattern"], dense_layers=(0, 1))
        model = S2LlamaForCausalLM(S2LlamaConfig(**fields, sparsity=sparsity))
    else:
        model = LlamaForCausalLM(LlamaConfig(**fields, attn_implementation="sdpa"))
    model.to(device).train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")


def train_step(model, optimizer, inputs: dict, device: str) -> None:
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- measurements
def time_steps(step, device: str, rounds: int, steps: int) -> dict:
    """Synchronized ms a step and the issue time of one step from an idle GPU, backward on each thread, alternated."""
    results = {mode: {"step_ms": [], "issue_ms": []} for mode in ("device_thread", "calling_thread")}
    try:
        for _ in range(rounds):
            for mode in results:
                torch.autograd.set_multithreading_enabled(mode == "device_thread")
                step()
                synchronize(device)
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                synchronize(device)
                results[mode]["step_ms"].append((time.perf_counter() - start) / steps * 1e3)
                start = time.perf_counter()
                step()
                results[mode]["issue_ms"].append((time.perf_counter() - start) * 1e3)
                synchronize(device)
    finally:
        torch.autograd.set_multithreading_enabled(True)
    return results


def timeline(step, device: str, steps: int = 2) -> dict:
    """``torch.profiler`` over ``steps`` steps: GPU busy and idle time, idle gaps by the kernels around them, launch
    calls, and CPU self time by op; every figure per step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    kernels, launches = [], []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA:
            kernels.append((event.start_ns(), event.start_ns() + event.duration_ns(), event.name()))
        elif "LaunchKernel" in event.name():
            launches.append(event.duration_ns())
    result = {"self_time_ms": [
        {"op": e.key, "ms": e.self_cpu_time_total / steps / 1e3, "calls": e.count / steps}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    ]}
    if not kernels:
        return result
    kernels.sort()
    busy, end, previous = 0, kernels[0][0], None
    gaps = defaultdict(lambda: [0, 0])  # (kernel before, kernel after) -> [ns, count]
    for start, stop, name in kernels:
        if start > end and previous is not None:
            gaps[(previous[:60], name[:60])][0] += start - end
            gaps[(previous[:60], name[:60])][1] += 1
        busy += max(0, stop - max(start, end))
        if stop >= end:
            end, previous = stop, name
    span = end - kernels[0][0]
    top_gaps = sorted(gaps.items(), key=lambda item: -item[1][0])[:15]
    return dict(result, span_ms=span / steps / 1e6, busy_ms=busy / steps / 1e6, idle_ms=(span - busy) / steps / 1e6,
                gaps_per_step=sum(count for _, count in gaps.values()) / steps,
                launch_calls_per_step=len(launches) / steps, launch_call_ms=sum(launches) / steps / 1e6,
                idle_by_kernels=[{"before": before, "after": after, "ms": ns / steps / 1e6, "count": count / steps}
                                 for (before, after), (ns, count) in top_gaps])


def synchronizing_calls(step, device: str) -> dict:
    """Where one step synchronizes with the GPU: each synchronizing call's six innermost Python frames, counted. The
    backward runs on the calling thread here: a sync on the engine's device thread has no Python stack there (its
    warning surfaces at the main thread's next Python call)."""
    if device != "cuda":
        return {}
    sites = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        # (the first switch to "warn" in a process emits a message of its own: not a call of the step)
        if "synchronizing" in str(message) and frames[-1].name != "set_sync_debug_mode":
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in frames[-6:][::-1])] += 1

    synchronize(device)
    torch.autograd.set_multithreading_enabled(False)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.autograd.set_multithreading_enabled(True)
    synchronize(device)
    return dict(sites.most_common(12))


def attention_host_costs(device: str, calls: int, run: dict) -> dict:
    """Host us a call of the attention ops at a size whose kernels take microseconds (best of 3 loops): the arms'
    heads and head dim over 512 tokens (two packed sequences of 256 in the packed case)."""
    fields = parse_overrides(run["config"])
    heads, kv_heads, head_dim = (fields[name] for name in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pattern = S2Pattern(**run["pattern"])
    q = torch.randn(1, heads, 512, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 512, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "kv")
    grad = torch.randn_like(q)
    offsets = torch.tensor([0, 256, 512], device=device, dtype=torch.int32)
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=256, max_seqlen_k=256)

    def per_call_us(fn, no_grad: bool) -> float:
        with torch.set_grad_enabled(not no_grad):
            for _ in range(5):
                fn()
            synchronize(device)
            loops = []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                loops.append((time.perf_counter() - start) / calls * 1e6)
                synchronize(device)
        return min(loops)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    arms = {"s2 batch": lambda: s2_attention(q, k, v, pattern), "s2 packed": lambda: s2_attention(q, k, v, pattern,
                                                                                                 **packed),
            "sdpa": sdpa}
    return {name: {"forward_no_grad_us": per_call_us(fn, no_grad=True),
                   "forward_backward_us": per_call_us(lambda fn=fn: fn().backward(grad), no_grad=False)}
            for name, fn in arms.items()}


# ---------------------------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON results")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of each threading mode")
    parser.add_argument("--steps", type=int, default=10, help="synchronized steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (autotuning happens there)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the script (tiny model)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    for arm in arms:
        if arm not in ARMS:
            parser.error(f"--arms: {arm!r} is not one of {list(ARMS)}")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a GPU (or --tiny for the CPU smoke run)")
    run = TINY_RUN if args.tiny else RUN
    results = {
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "autotune": os.environ.get("S2_ATTENTION_AUTOTUNE", "1"), "run": run, "arms": {},
    }
    for arm in arms:
        model, optimizer = build(arm, run, device)
        inputs = arm_inputs(arm, run, device)

        def step(model=model, optimizer=optimizer, inputs=inputs):
            train_step(model, optimizer, inputs, device)

        for _ in range(args.warmup):
            step()
        measured = {"steps": time_steps(step, device, args.rounds, args.steps), "timeline": timeline(step, device),
                    "syncs": synchronizing_calls(step, device)}
        results["arms"][arm] = measured
        steps = measured["steps"]
        print(f"{arm}: ms a step, backward on the device thread "
              f"{' / '.join(f'{v:.1f}' for v in steps['device_thread']['step_ms'])}, on the calling thread "
              f"{' / '.join(f'{v:.1f}' for v in steps['calling_thread']['step_ms'])}; issue from idle "
              f"{' / '.join(f'{v:.1f}' for v in steps['device_thread']['issue_ms'])}; GPU busy "
              f"{measured['timeline'].get('busy_ms', float('nan')):.1f} ms a step", flush=True)
        del model, optimizer, step
        if device == "cuda":
            torch.cuda.empty_cache()
    results["attention_host_us"] = attention_host_costs(device, 5 if args.tiny else 200, run)
    for name, costs in results["attention_host_us"].items():
        print(f"{name}: host {costs['forward_no_grad_us']:.0f} us a forward (no grad), "
              f"{costs['forward_backward_us']:.0f} us a forward and backward")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], args.out.name).write_text(args.out.read_text())


if __name__ == "__main__":
    main()

"""Generation benchmark (GPU): compact S2 KV cache vs dense DynamicCache, decode/prefill speed vs dense SDPA Llama.

    python bench/bench_generation.py --out bench/results/generation_h100.json

A ~1B-parameter hybrid (Llama-3.2-1B shapes, random weights, bf16): 16 layers, layers 0-1 dense, the others S2
(block 64, local 16 blocks = 1024 tokens, every 16th block). The dense baselines are the same model with every layer
dense under SDPA (dynamic cache; PyTorch's default backend choice, and without cuDNN), and transformers' own Llama
with its static cache, which ``generate`` compiles with ``torch.compile(mode="reduce-overhead")``: CUDA graphs,
like the S2 static cache. Speed is measured through ``generate`` (time to first token, median step time). Each
section records its error instead of aborting the run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
import traceback
from dataclasses import asdict

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import S2CacheLayer, kv_cache_bytes
from s2_models.kernels.decode import s2_decode_attention
from s2_models.kernels.decode_triton import DecodeTiles, decode_attention_triton
from s2_models.kernels.triton_setup import tl, triton
from s2_models.static_cache_s2_llama import S2StaticCache

PATTERN = {"block_size": 64, "local_blocks": 16, "vert_stride": 16}
SHAPES = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=140_000, tie_word_embeddings=True)


def build(dense: bool, implementation: str | None = None) -> S2LlamaForCausalLM:
    """The hybrid (``"s2"`` attention) or the all-dense model (``"sdpa"`` unless ``implementation`` says)."""
    sparsity = "dense" if dense else hybrid_sparsity(16, PATTERN, dense_layers=(0, 1))
    config = S2LlamaConfig(**SHAPES, sparsity=sparsity)
    model = S2LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation(implementation or ("sdpa" if dense else "s2"))
    return model


def timed(fn, repeats=1):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, result


@torch.no_grad()
def prefill(model, batch, length, cache=None):
    ids = torch.randint(0, SHAPES["vocab_size"], (batch, length), device="cuda")
    seconds, out = timed(lambda: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1))
    return seconds, out


def section(results, name, fn):
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
        results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    torch.cuda.empty_cache()
    print(name, json.dumps(results[name], indent=1)[:1500], flush=True)


def memory(sparse, length):
    _, out = prefill(sparse, 1, length)
    sizes = kv_cache_bytes(out.past_key_values)
    num_sparse = sum(isinstance(layer, S2CacheLayer) for layer in out.past_key_values.layers)
    per_layer_dense = 2 * SHAPES["num_key_value_heads"] * length * SHAPES["head_dim"] * 2  # K and V, bf16
    from s2_models.kernels.pattern import S2Pattern

    pattern = S2Pattern(**PATTERN)
    blocks = -(-length // pattern.block_size)
    kept_blocks = min(blocks, pattern.local_blocks) + max(0, blocks - pattern.local_blocks) // pattern.vert_stride
    del out
    _, out = prefill(sparse, 1, length, cache=S2StaticCache(sparse.config, max_cache_len=length))
    static_sparse_bytes = kv_cache_bytes(out.past_key_values)["s2"]
    return {
        "context": length,
        "dense_dynamic_cache_bytes": per_layer_dense * SHAPES["num_hidden_layers"],
        "static_cache_sparse_layers_fraction_of_dense": static_sparse_bytes / (per_layer_dense * num_sparse),
        "s2_model_cache_bytes": sizes["dense"] + sizes["s2"],
        "sparse_layers_bytes": sizes["s2"],
        "sparse_layers_fraction_of_dense": sizes["s2"] / (per_layer_dense * num_sparse),
        "sparse_layers_rollback_bytes": sizes["s2_rollback"],  # part of sparse_layers_bytes: room for crop
        "theoretical_kept_fraction": kept_blocks / blocks,
        "whole_model_ratio": (sizes["dense"] + sizes["s2"]) / (per_layer_dense * SHAPES["num_hidden_layers"]),
    }


class StepTimes(StoppingCriteria):
    """Stopping criterion that never stops and records when ``generate`` finished each step. It syncs at the first
    step (the prompt's end: the time to first token) and, with ``sync_every_step``, at every step; otherwise not,
    so that it does not hold back a ``generate`` whose host runs a step ahead of the GPU (S2's deferred stop check):
    the intervals between steps are the step time either way, once the steps are warm."""

    def __init__(self, sync_every_step: bool = False):
        self.times = []
        self.sync_every_step = sync_every_step

    def __call__(self, input_ids, scores, **kwargs):
        if self.sync_every_step or not self.times:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_speed(model, batch, length, steps=48, **generate_kwargs):
    """End to end through ``generate`` (greedy, no EOS): time to the first token (the prefill) and the median time
    of the later steps. The warm-up call compiles what needs compiling (Triton tiles, torch.compile graphs)."""
    # no pad token (0) in the prompt: generate would read it as padding and mask it
    ids = torch.randint(1, SHAPES["vocab_size"], (batch, length), device="cuda")
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, **generate_kwargs)
    model.generate(ids, max_new_tokens=4, **kwargs)
    stamps = StepTimes()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, stopping_criteria=StoppingCriteriaList([stamps]), **kwargs)
    intervals = sorted(b - a for a, b in zip(stamps.times[3:], stamps.times[4:]))  # from the 4th step: warm
    step = intervals[len(intervals) // 2]
    return {"batch": batch, "prompt": length, "time_to_first_token_s": stamps.times[0] - start,
            "decode_step_ms": step * 1e3, "decode_tokens_per_s": batch / step, "steps_timed": len(intervals)}


@torch.no_grad()
def graph_replay_step(model, batch, length, replays=20):
    """The decode step's GPU time alone: its CUDA graph (``S2StaticCache``'s, captured by two forwards after a prompt
    of ``length``) replayed back to back, so no host work sits between steps. The median of 5 rounds of ``replays``;
    what ``generate`` adds to it is host time (its per-step Python and the sync that ends each step)."""
    cache = S2StaticCache(model.config, max_cache_len=length + 4 * replays * 5)  # room for the replays' tokens
    prefill(model, batch, length, cache=cache)
    ids = torch.randint(1, SHAPES["vocab_size"], (batch, 1), device="cuda")
    for _ in range(3):  # eager, capture, replay
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    (captured,) = cache._graphs.values()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            captured.graph.replay()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / replays)
    return sorted(rounds)[len(rounds) // 2]


class MarkedStepTimes(StepTimes):
    """``StepTimes`` that also marks each step's end in the profiler's timeline: after the criterion's sync (every
    step), the GPU work between two marks is exactly one decode step (graph replay, argmax, the token appended)."""

    def __init__(self):
        super().__init__(sync_every_step=True)

    def __call__(self, input_ids, scores, **kwargs):
        done = super().__call__(input_ids, scores, **kwargs)
        with torch.profiler.record_function(STEP_MARK):
            pass
        return done


STEP_MARK = "decode_step_end"
# Kernel-name patterns (searched in order) -> category of the step profile. Eager RMSNorm is pow, mean, add, rsqrt,
# mul and casts; rotary is mul, neg, cat, add: those share kernels with other elementwise work, so "norms" and
# "rotary" count only the kernels only they launch and "elementwise" holds the rest (the per-name table is exact).
# The fused kernels (kernels/fused_triton.py) have names of their own; the decode-sized projections are matmuls.
KERNEL_CATEGORIES = (
    ("decode attention", ("s2_decode_fwd",)),
    ("cache append", ("s2_cache_append",)),
    ("matmuls", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "cublas", "wgmma", "_linear_group",
                 "_linear_swiglu")),
    ("sampling/argmax", ("argmax", "argmin", "topk", "sort")),
    ("norms", ("meanops", "rsqrt", "pow_tensor", "norm")),
    ("rotary", ("_rotary_kernel", "catarray", "neg_kernel", "cat_", "sin_", "cos_")),
    ("swiglu", ("_swiglu_fwd",)),
    ("embedding", ("indexselect", "embedding")),
    ("copies", ("memcpy", "memset", "copy_kernel", "direct_copy")),
    ("elementwise", ("elementwise", "triton_poi", "triton_per", "triton_red", "reduce_kernel")),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    return next((category for category, keys in KERNEL_CATEGORIES if any(k in lowered for k in keys)), "other")


@torch.no_grad()
def profile_step(model, batch, length, steps=10, **generate_kwargs):
    """The GPU kernels of one decode step through ``generate`` (torch.profiler with CUDA activities; kernels replayed
    from CUDA graphs are recorded too): per category and per kernel name, the count per step and the time per step,
    against the step's wall time between two step marks; the difference is the GPU idle time (gaps). Steps from the
    4th on (warm: graphs captured)."""
    import tempfile

    ids = torch.randint(1, SHAPES["vocab_size"], (batch, length), device="cuda")
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, **generate_kwargs)
    marks = MarkedStepTimes()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        model.generate(ids, max_new_tokens=steps, stopping_criteria=StoppingCriteriaList([marks]), **kwargs)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace_file:
        prof.export_chrome_trace(trace_file.name)
        with open(trace_file.name) as f:
            trace = json.load(f)["traceEvents"]
    bounds = sorted(e["ts"] for e in trace if e.get("name") == STEP_MARK and e.get("ph") == "X")[3:]
    kernels = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    windows = list(zip(bounds, bounds[1:]))
    per_name, per_category, wall, busy = {}, {}, [], []
    for begin, end in windows:
        inside = sorted((e for e in kernels if begin <= e["ts"] < end), key=lambda e: e["ts"])
        wall.append(end - begin)
        busy.append(sum(e["dur"] for e in inside))
        for e in inside:
            for table, key in ((per_name, e["name"][:120]), (per_category, kernel_category(e["name"]))):
                count, total = table.get(key, (0, 0.0))
                table[key] = (count + 1, total + e["dur"])

    def per_step(table):
        rows = [{"name": k, "count_per_step": c / len(windows), "us_per_step": t / len(windows)}
                for k, (c, t) in table.items()]
        return sorted(rows, key=lambda r: -r["us_per_step"])

    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"batch": batch, "prompt": length, "steps_profiled": len(windows),
            "step_wall_us": median(wall), "kernel_busy_us": median(busy), "gaps_us": median(wall) - median(busy),
            "kernels_per_step": sum(len([e for e in kernels if b <= e["ts"] < end]) for b, end in windows)
            / len(windows),
            "by_category": per_step(per_category), "by_kernel": per_step(per_name)[:40]}


def print_profile(name, profile):
    """The short table: categories, then the step's wall time, kernel time and gaps."""
    print(f"==== step profile: {name} (batch {profile['batch']}, {profile['prompt']} context)")
    print(f"{'category':<20}{'kernels/step':>14}{'us/step':>10}")
    for row in profile["by_category"]:
        print(f"{row['name']:<20}{row['count_per_step']:>14.1f}{row['us_per_step']:>10.1f}")
    print(f"{'kernels, all':<20}{profile['kernels_per_step']:>14.1f}{profile['kernel_busy_us']:>10.1f}")
    print(f"{'step (wall)':<20}{'':>14}{profile['step_wall_us']:>10.1f}")
    print(f"{'gaps':<20}{'':>14}{profile['gaps_us']:>10.1f}", flush=True)


def dense_llama() -> LlamaForCausalLM:
    """The dense baseline in transformers' own Llama form (same shapes), for its static-cache compiled path."""
    return LlamaForCausalLM(LlamaConfig(**SHAPES, attn_implementation="sdpa")).to("cuda", torch.bfloat16).eval()


# name -> (model builder, generate kwargs, SDPA backends or None for PyTorch's default choice)
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SPEED_VARIANTS = {
    "s2_dynamic_cache": (functools.partial(build, dense=False), {}, None),
    "s2_static_cache_cuda_graphs": (functools.partial(build, dense=False), {"cache_implementation": "static"}, None),
    # transformers' compiled decode step (Inductor fuses norms, rotary, residual adds) instead of our graphs
    "s2_static_cache_compiled": (functools.partial(build, dense=False),
                                 {"cache_implementation": "static", "compile_config": CompileConfig()}, None),
    "dense_sdpa_dynamic_cache": (functools.partial(build, dense=True), {}, None),
    "dense_sdpa_no_cudnn_dynamic_cache": (functools.partial(build, dense=True), {}, NO_CUDNN),
    "dense_llama_static_cache_compiled": (dense_llama, {"cache_implementation": "static"}, None),
    # Not SDPA: the all-dense model on the S2 static cache (split-KV decode kernel, CUDA graphs). The same machinery
    # as the S2 static cache, so the ratio of the two is what sparsity alone buys.
    "dense_s2_kernels_static_cache_cuda_graphs": (functools.partial(build, dense=True, implementation="s2"),
                                                  {"cache_implementation": "static"}, None),
}


def speed_sections(results, variants, batches=(1, 8), length=32768, profile=False):
    """Every variant at every batch size, then the speedups of the S2 variants over the fastest dense one. With
    ``profile``, each timed variant's decode step is also profiled kernel by kernel (``profile_step``)."""
    for name in variants:
        builder, generate_kwargs, backends = SPEED_VARIANTS[name]
        model = builder()
        for batch in batches:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                section(results, f"{name}_b{batch}_32k",
                        functools.partial(generate_speed, model, batch, length, **generate_kwargs))
                if name == "s2_static_cache_cuda_graphs" and "decode_step_ms" in results[f"{name}_b{batch}_32k"]:
                    results[f"{name}_b{batch}_32k"]["graph_replay_step_ms"] = graph_replay_step(model, batch, length)
                if profile:
                    section(results, f"{name}_b{batch}_32k_profile",
                            functools.partial(profile_step, model, batch, length, **generate_kwargs))
        del model
        torch._dynamo.reset()  # drop compiled graphs and their CUDA-graph memory
        torch.cuda.empty_cache()
    for batch in batches:
        runs = {name: results.get(f"{name}_b{batch}_32k", {}) for name in variants}
        runs = {name: run for name, run in runs.items() if "decode_step_ms" in run}
        sdpa = {n: r for n, r in runs.items() if n.startswith("dense") and "s2_kernels" not in n}
        if not sdpa:
            continue
        fastest = min(sdpa, key=lambda n: sdpa[n]["decode_step_ms"])
        same_machinery = runs.get("dense_s2_kernels_static_cache_cuda_graphs")
        for name, run in runs.items():
            if name.startswith("s2"):
                results[f"{name}_decode_speedup_b{batch}"] = {
                    "vs": fastest, "speedup": sdpa[fastest]["decode_step_ms"] / run["decode_step_ms"],
                    "time_to_first_token_speedup": min(r["time_to_first_token_s"] for r in sdpa.values())
                    / run["time_to_first_token_s"],
                    "speedup_vs_dense_s2_kernels_static": None if same_machinery is None
                    else same_machinery["decode_step_ms"] / run["decode_step_ms"]}


def graph_seconds(run, calls: int, replays: int = 20) -> float:
    """Seconds per ``run()`` from replays of a CUDA graph of ``calls`` calls: launch overhead stays out."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    return replay_seconds(graph, replays) / calls


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay of ``graph``, from ``replays`` back-to-back replays (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def copy_bandwidth(gib: int = 4) -> float:
    """The ceiling of issue 9: bytes read plus bytes written per second of ``dst.copy_(src)`` over ``gib`` GiB
    (``triton.testing.do_bench``'s median, which clears the L2 cache between runs)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    milliseconds = triton.testing.do_bench(functools.partial(dst.copy_, src), return_mode="median")
    return 2 * (gib << 30) / (milliseconds / 1e3)


# the one-token tile needs >= 16 keys in each of its two key groups a warp, which rules out 64 keys x 4 or 8 warps
# and 128 keys x 8 warps
DECODE_TILES = [DecodeTiles(n, warps, stages) for n in (64, 128, 256) for warps in (4, 8) for stages in (1, 2, 3)
                if n // (2 * warps) >= 16]
DECODE_SPLITS = (None, 1, 2, 4, 8, 16)  # None: the launcher's heuristic


def kernel_bandwidth(sparse, batch, length):
    """The decode kernel over the static cache ``generate(cache_implementation="static")`` decodes from, per layer
    kind (the sparse layers' compact caches; the dense layers, which hold every token), for every launch shape and
    the launcher's own choice (``default``: what the model runs).
    Each timing is a CUDA graph over all layers of the kind in turn (so the L2 cache does not serve the reads and
    launch overhead stays out); bandwidth counts the K and V bytes of the filled slots, against the copy ceiling
    measured in this run. Returns the best shape per kind and what the whole step's attention then costs."""
    cache = S2StaticCache(sparse.config, max_cache_len=length)  # exactly full: every allocated slot is read
    prefill(sparse, batch, length, cache=cache)
    q = torch.randn(batch, SHAPES["num_attention_heads"], 1, SHAPES["head_dim"], device="cuda", dtype=torch.bfloat16)
    scale = SHAPES["head_dim"] ** -0.5
    copy_bw = copy_bandwidth()
    results = {"batch": batch, "context": length, "copy_GBps": copy_bw / 1e9}
    for kind, layers in (("sparse", [x for x in cache.layers if x.is_sparse]),
                         ("dense", [x for x in cache.layers if not x.is_sparse])):
        first = layers[0]
        reference = s2_decode_attention(q.float(), first.keys.float(), first.values.float(), first.seq_lens,
                                        layout=first.layout, num_ring_slots=first.num_ring, backend="torch")
        read = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in layers)  # K and V
        configs = []
        for tiles, splits in ((t, s) for t in (None, *DECODE_TILES) for s in DECODE_SPLITS):  # None: the launcher's
            def run_all(tiles=tiles, splits=splits, layers=layers):
                for layer in layers:
                    decode_attention_triton(q, layer.keys, layer.values, layer.seq_lens, layer.layout, layer.num_ring,
                                            scale, splits, tiles, split_counters=layer.split_counters)

            shape = {"tiles": "auto"} if tiles is None else asdict(tiles)
            try:
                seconds = graph_seconds(run_all, calls=2)
                check = decode_attention_triton(q, first.keys, first.values, first.seq_lens, first.layout,
                                                first.num_ring, scale, splits, tiles)
                configs.append({**shape, "num_splits": splits, "us_per_layer": seconds / len(layers) * 1e6,
                                "TBps": read / seconds / 1e12, "fraction_of_copy_bandwidth": read / seconds / copy_bw,
                                "max_error_vs_torch": (check.float() - reference).abs().max().item()})
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one shape; record and go on
                configs.append({**shape, "num_splits": splits, "error": f"{type(e).__name__}: {e}"[:300]})
        timed_configs = [c for c in configs if "us_per_layer" in c]
        # what the model runs: the launcher's own shape and split count (on an H200 its stages follow the launch)
        default = next(c for c in timed_configs if c.get("tiles") == "auto" and c["num_splits"] is None)
        results[kind] = {"layers": len(layers), "bytes_read_per_layer": read // len(layers), "default": default,
                         "best": min(timed_configs, key=lambda c: c["us_per_layer"]), "configs": configs}
    results["step_attention_us"] = {
        which: sum(results[kind][which]["us_per_layer"] * results[kind]["layers"] for kind in ("sparse", "dense"))
        for which in ("default", "best")}
    return results


@torch.no_grad()
def stop_check_ab(sparse, length=32768, batches=(8, 1), rounds=2):
    """The decode step through ``generate`` (static cache, CUDA graphs) with S2's sampling loop, which reads the
    stop flag one step late (``_S2DeferredStopCheck``: the host queues the next step while the GPU runs this one),
    and with transformers' loop (a sync at every step's stop check), alternated ``rounds`` times, beside the graph
    replayed back to back (the GPU's part of a step)."""
    from transformers import GenerationMixin

    arms = {"deferred_stop_check": S2LlamaForCausalLM._sample, "per_step_stop_check": GenerationMixin._sample}
    results = {}
    for batch in batches:
        results[f"graph_replay_step_ms_b{batch}"] = graph_replay_step(sparse, batch, length)
        try:
            for round_ in range(rounds):
                for arm, sample in arms.items():
                    S2LlamaForCausalLM._sample = sample
                    run = generate_speed(sparse, batch, length, cache_implementation="static")
                    results[f"{arm}_b{batch}_{round_}"] = run
        finally:
            S2LlamaForCausalLM._sample = arms["deferred_stop_check"]
    return results


LAUNCH_SHAPES = ((8, 4096), (8, 8192), (8, 16384), (8, 32768), (8, 65536), (8, 131072), (1, 32768), (4, 32768),
                 (16, 32768), (32, 32768))  # (batch, context) of one sparse layer's decode launch


@triton.jit
def streaming_sum_kernel(x, partials, num_elements, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """``partials[p]`` = the float32 sum of program ``p``'s share of ``x`` (grid-stride, ``BLOCK`` elements a step):
    a read of the whole buffer with as little else as one launch can do."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(0, num_elements, tl.num_programs(0) * BLOCK, num_stages=STAGES):
        index = start + offsets
        total += tl.load(x + index, mask=index < num_elements, other=0.0).to(tl.float32)
    tl.store(partials + tl.program_id(0), tl.sum(total, 0))


# (programs per SM, elements a step, pipeline stages) of streaming_sum_kernel tried for the read ceiling
READ_LAUNCHES = [(programs, block, stages) for programs in (1, 2, 4, 8) for block in (2048, 8192) for stages in (1, 3)]


def read_ceiling(flat: list[torch.Tensor], partials: torch.Tensor, calls: int = 2) -> dict:
    """The fastest of ``READ_LAUNCHES`` reading each buffer of ``flat`` in one launch: how fast one launch of this
    size can read its bytes at all, the bound for a decode kernel that must read them. Seconds per buffer."""
    num_sms = torch.cuda.get_device_properties(flat[0].device).multi_processor_count
    best = None
    for programs, block, stages in READ_LAUNCHES:
        grid = (programs * num_sms,)

        def run(block=block, stages=stages, grid=grid):
            for x in flat:
                streaming_sum_kernel[grid](x, partials, x.numel(), BLOCK=block, STAGES=stages, num_warps=8)

        seconds = min(graph_seconds(run, calls=calls) for _ in range(3)) / len(flat)
        if best is None or seconds < best["seconds"]:
            best = {"seconds": seconds, "programs_per_sm": programs, "block": block, "stages": stages}
    return best


def launch_sizes(sparse):
    """How far one launch's size limits its bandwidth: the decode kernel on full compact caches of a sparse layer
    (synthetic, ``LAUNCH_SHAPES``) beside PyTorch's ``sum`` (reads the same bytes), ``copy_`` (reads half, writes
    half) of the same bytes and the fastest read of them in one launch (``read_ceiling``), as fractions of the copy
    ceiling of this run. Fit over batch 8: time = fixed + bytes / bandwidth."""
    cache = S2StaticCache(sparse.config, max_cache_len=256)
    prefill(sparse, 1, 128, cache=cache)  # fixes the layers' layouts (the static cache's ring size)
    layout = next(layer for layer in cache.layers if layer.is_sparse).layout
    copy_bw = copy_bandwidth()
    rows = []
    for batch, length in LAUNCH_SHAPES:
        rows.append({"batch": batch, "context": length, **launch_size_row(layout, batch, length, copy_bw)})
        torch.cuda.empty_cache()
    batch8 = [r for r in rows if r["batch"] == 8]
    slope, fixed = np.polyfit([r["bytes"] for r in batch8], [r["decode"]["us"] for r in batch8], 1)
    return {"copy_GBps": copy_bw / 1e9, "rows": rows, "decode_fit_batch8": {"fixed_us": fixed, "TBps": 1 / slope / 1e6}}


def full_caches(layout, batch, length, spare_slots=0, query_tokens=1) -> dict:
    """Random full compact caches of one sparse layer, enough distinct ones (>= 400 MB in all) that a CUDA graph over
    them finds none in the L2 cache; a query and the row lengths. ``spare_slots``: slots a row holds beyond those its
    ``length`` fills (a static cache allocated for longer rows; they change the rows' strides, and are not read).
    ``query_tokens``: new tokens a row (a verify chunk of speculative decoding, a prefill chunk).
    ``split_counters``: the zeroed counters the decode kernel leaves zeroed, one per (row, KV head, query row), kept
    across launches as the model's caches keep theirs (without them every launch would also zero a fresh buffer)."""
    num_ring = layout.num_ring_slots(length)
    d = SHAPES["head_dim"]
    used_slots = num_ring + layout.num_vertical_slots(length)
    shape = (batch, layout.num_kv_heads, (used_slots + spare_slots) * layout.block_size, d)
    nbytes = 2 * 2 * batch * layout.num_kv_heads * used_slots * layout.block_size * d  # K and V read, bf16
    count = max(4, -(-400_000_000 // nbytes))
    caches = [[torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(count)]
    q = torch.randn(batch, layout.num_q_heads, query_tokens, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    split_counters = torch.zeros(batch * layout.num_kv_heads * query_tokens * layout.q_heads_per_kv,
                                 device="cuda", dtype=torch.int32)
    return {"caches": caches, "q": q, "seq_lens": seq_lens, "num_ring": num_ring, "bytes": nbytes,
            "split_counters": split_counters}


def launch_size_row(layout, batch, length, copy_bw):
    """One row of ``launch_sizes``: each timing a CUDA graph over ``full_caches``."""
    setup = full_caches(layout, batch, length)
    caches, q, seq_lens, num_ring, nbytes, counters = (
        setup[key] for key in ("caches", "q", "seq_lens", "num_ring", "bytes", "split_counters"))
    buffers, d = len(caches), SHAPES["head_dim"]
    flat = [torch.cat([k.flatten(), v.flatten()]) for k, v in caches]
    halves = [(x[: x.numel() // 2], torch.empty(x.numel() // 2, device="cuda", dtype=x.dtype)) for x in flat]
    total = torch.empty((), device="cuda", dtype=torch.float32)
    runs = {
        "decode": lambda: [decode_attention_triton(q, k, v, seq_lens, layout, num_ring, d ** -0.5, None,
                                                   split_counters=counters) for k, v in caches],
        "torch_sum": lambda: [torch.sum(x, dim=(0,), dtype=torch.float32, out=total) for x in flat],
        "torch_copy": lambda: [dst.copy_(src) for src, dst in halves],
    }
    row = {"bytes": nbytes}
    for name, run in runs.items():
        seconds = min(graph_seconds(run, calls=2) for _ in range(3)) / buffers
        row[name] = {"us": seconds * 1e6, "fraction_of_copy_bandwidth": nbytes / seconds / copy_bw}
    partials = torch.empty(8 * torch.cuda.get_device_properties(q.device).multi_processor_count, device="cuda")
    ceiling = read_ceiling(flat, partials)
    seconds = ceiling.pop("seconds")
    row["read_ceiling"] = {"us": seconds * 1e6, "fraction_of_copy_bandwidth": nbytes / seconds / copy_bw,
                           "launch": ceiling}
    row["decode"]["fraction_of_read_ceiling"] = row["read_ceiling"]["us"] / row["decode"]["us"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="memory32k,memory128k,speed,bandwidth,launches,host")
    parser.add_argument("--variants", default=",".join(SPEED_VARIANTS), help="speed: which of SPEED_VARIANTS")
    parser.add_argument("--batches", default="1,8", help="speed: batch sizes")
    parser.add_argument("--profile", action="store_true", help="speed: also profile each variant's decode step")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES,
               "pattern": PATTERN}
    wanted = args.sections.split(",")
    sparse = build(dense=False)
    results["parameters"] = sum(p.numel() for p in sparse.parameters())
    if "memory32k" in wanted:
        section(results, "memory_32k", functools.partial(memory, sparse, 32768))
    if "memory128k" in wanted:
        section(results, "memory_128k", functools.partial(memory, sparse, 131072))
    if "bandwidth" in wanted:
        section(results, "decode_kernel_bandwidth_b8_32k", functools.partial(kernel_bandwidth, sparse, 8, 32768))
    if "launches" in wanted:
        section(results, "decode_launch_sizes", functools.partial(launch_sizes, sparse))
    if "host" in wanted:
        section(results, "stop_check_32k", functools.partial(stop_check_ab, sparse))
    del sparse
    torch.cuda.empty_cache()
    if "speed" in wanted:
        speed_sections(results, args.variants.split(","), tuple(int(b) for b in args.batches.split(",")),
                       profile=args.profile)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for name, run in results.items():  # the short tables last
        if name.endswith("_profile") and "by_category" in run:
            print_profile(name, run)


if __name__ == "__main__":
    main()

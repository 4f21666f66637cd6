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

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import S2CacheLayer, kv_cache_bytes
from s2_models.kernels.decode import s2_decode_attention
from s2_models.kernels.decode_triton import DecodeTiles, decode_attention_triton
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
    """Stopping criterion that never stops and records when ``generate`` finished each step (after a sync)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
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


def dense_llama() -> LlamaForCausalLM:
    """The dense baseline in transformers' own Llama form (same shapes), for its static-cache compiled path."""
    return LlamaForCausalLM(LlamaConfig(**SHAPES, attn_implementation="sdpa")).to("cuda", torch.bfloat16).eval()


# name -> (model builder, generate kwargs, SDPA backends or None for PyTorch's default choice)
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SPEED_VARIANTS = {
    "s2_dynamic_cache": (functools.partial(build, dense=False), {}, None),
    "s2_static_cache_cuda_graphs": (functools.partial(build, dense=False), {"cache_implementation": "static"}, None),
    "dense_sdpa_dynamic_cache": (functools.partial(build, dense=True), {}, None),
    "dense_sdpa_no_cudnn_dynamic_cache": (functools.partial(build, dense=True), {}, NO_CUDNN),
    "dense_llama_static_cache_compiled": (dense_llama, {"cache_implementation": "static"}, None),
    # Not SDPA: the all-dense model on the S2 static cache (split-KV decode kernel, CUDA graphs). The same machinery
    # as the S2 static cache, so the ratio of the two is what sparsity alone buys.
    "dense_s2_kernels_static_cache_cuda_graphs": (functools.partial(build, dense=True, implementation="s2"),
                                                  {"cache_implementation": "static"}, None),
}


def speed_sections(results, variants, batches=(1, 8), length=32768):
    """Every variant at every batch size, then the speedups of the S2 variants over the fastest dense one."""
    for name in variants:
        builder, generate_kwargs, backends = SPEED_VARIANTS[name]
        model = builder()
        for batch in batches:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                section(results, f"{name}_b{batch}_32k",
                        functools.partial(generate_speed, model, batch, length, **generate_kwargs))
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read and written: the fastest of a few
    element types (narrow ones may not get the widest vector accesses), so the ceiling is not understated."""
    rates = []
    for dtype in (torch.uint8, torch.bfloat16, torch.float32):
        src = torch.empty((1 << 31) // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device="cuda")
        dst = torch.empty_like(src)
        rates.append(2 * (1 << 31) / graph_seconds(functools.partial(dst.copy_, src), calls=5))
    torch.cuda.empty_cache()
    return max(rates)


DECODE_TILES = [DecodeTiles(n, warps, stages) for n in (64, 128) for warps in (4, 8) for stages in (1, 2, 3)]
DECODE_SPLITS = (None, 1, 2, 4, 8)  # None: the launcher's heuristic


def kernel_bandwidth(sparse, batch, length):
    """The decode kernel over every sparse layer's compact cache in turn (so the L2 cache does not serve the
    reads), for each launch shape: time, bandwidth over the bytes of the compact caches, error vs the PyTorch path."""
    _, out = prefill(sparse, batch, length)
    layers = [layer for layer in out.past_key_values.layers if isinstance(layer, S2CacheLayer)]
    q = torch.randn(batch, SHAPES["num_attention_heads"], 1, SHAPES["head_dim"], device="cuda", dtype=torch.bfloat16)
    first = layers[0]
    reference = s2_decode_attention(q.float(), first.keys.float(), first.values.float(), first.seq_lens,
                                    layout=first.layout, num_ring_slots=first.num_ring, backend="torch")
    read = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in layers)  # K and V
    copy_bw = copy_bandwidth()
    configs = []
    for tiles, splits in ((t, s) for t in DECODE_TILES for s in DECODE_SPLITS):
        def run_all(tiles=tiles, splits=splits):
            for layer in layers:
                decode_attention_triton(q, layer.keys, layer.values, layer.seq_lens, layer.layout, layer.num_ring,
                                        SHAPES["head_dim"] ** -0.5, splits, tiles)

        try:
            seconds = graph_seconds(run_all, calls=2)
            check = decode_attention_triton(q, first.keys, first.values, first.seq_lens, first.layout, first.num_ring,
                                            SHAPES["head_dim"] ** -0.5, splits, tiles)
            configs.append({**asdict(tiles), "num_splits": splits, "us_per_layer": seconds / len(layers) * 1e6,
                            "fraction_of_copy_bandwidth": read / seconds / copy_bw,
                            "max_error_vs_torch": (check.float() - reference).abs().max().item()})
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for one shape; record and go on
            configs.append({**asdict(tiles), "num_splits": splits, "error": f"{type(e).__name__}: {e}"[:300]})
    best = min((c for c in configs if "us_per_layer" in c), key=lambda c: c["us_per_layer"])
    default = configs[DECODE_TILES.index(DecodeTiles()) * len(DECODE_SPLITS)]
    return {"batch": batch, "context": length, "sparse_layers": len(layers),
            "bytes_read_per_layer": read // len(layers), "copy_GBps": copy_bw / 1e9, "default": default, "best": best,
            "configs": configs}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="memory32k,memory128k,speed,bandwidth")
    parser.add_argument("--variants", default=",".join(SPEED_VARIANTS), help="speed: which of SPEED_VARIANTS")
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
    del sparse
    torch.cuda.empty_cache()
    if "speed" in wanted:
        speed_sections(results, args.variants.split(","))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

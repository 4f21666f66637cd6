"""Generation benchmark (GPU): compact S2 KV cache vs dense DynamicCache, decode/prefill speed vs dense SDPA Llama.

    python bench/bench_generation.py --out bench/results/generation_h100.json

A ~1B-parameter hybrid (Llama-3.2-1B shapes, random weights, bf16): 16 layers, layers 0-1 dense, the others S2
(block 64, local 16 blocks = 1024 tokens, every 16th block). The dense baseline is the same model with every layer
dense under SDPA. Each section records its error instead of aborting the run.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback
from dataclasses import asdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import S2CacheLayer, kv_cache_bytes
from s2_models.kernels.decode import s2_decode_attention
from s2_models.kernels.decode_triton import DecodeTiles, decode_attention_triton

PATTERN = {"block_size": 64, "local_blocks": 16, "vert_stride": 16}
SHAPES = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=140_000, tie_word_embeddings=True)


def build(dense: bool) -> S2LlamaForCausalLM:
    sparsity = "dense" if dense else hybrid_sparsity(16, PATTERN, dense_layers=(0, 1))
    config = S2LlamaConfig(**SHAPES, sparsity=sparsity)
    model = S2LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation("sdpa" if dense else "s2")
    return model


def timed(fn, repeats=1):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats, result


@torch.no_grad()
def prefill(model, batch, length):
    ids = torch.randint(0, SHAPES["vocab_size"], (batch, length), device="cuda")
    seconds, out = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
    return seconds, out


@torch.no_grad()
def decode_step_seconds(model, cache, batch, steps=32):
    token = torch.randint(0, SHAPES["vocab_size"], (batch, 1), device="cuda")
    model(token, past_key_values=cache, use_cache=True)  # warm-up
    seconds, _ = timed(lambda: model(token, past_key_values=cache, use_cache=True, logits_to_keep=1), steps)
    return seconds


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
    return {
        "context": length,
        "dense_dynamic_cache_bytes": per_layer_dense * SHAPES["num_hidden_layers"],
        "s2_model_cache_bytes": sizes["dense"] + sizes["s2"],
        "sparse_layers_bytes": sizes["s2"],
        "sparse_layers_fraction_of_dense": sizes["s2"] / (per_layer_dense * num_sparse),
        "theoretical_kept_fraction": kept_blocks / blocks,
        "whole_model_ratio": (sizes["dense"] + sizes["s2"]) / (per_layer_dense * SHAPES["num_hidden_layers"]),
    }


def speed(model, batch, length):
    prefill(model, batch, length)  # warm-up: kernel compilation and tile tuning stay out of the timing
    prefill_s, out = prefill(model, batch, length)
    cache = out.past_key_values
    del out
    step = decode_step_seconds(model, cache, batch)
    return {"batch": batch, "prompt": length, "prefill_s": prefill_s, "decode_step_ms": step * 1e3,
            "decode_tokens_per_s": batch / step}


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
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES,
               "pattern": PATTERN}
    wanted = args.sections.split(",")
    sparse = build(dense=False)
    results["parameters"] = sum(p.numel() for p in sparse.parameters())
    if "memory32k" in wanted:
        section(results, "memory_32k", lambda: memory(sparse, 32768))
    if "memory128k" in wanted:
        section(results, "memory_128k", lambda: memory(sparse, 131072))
    if "bandwidth" in wanted:
        section(results, "decode_kernel_bandwidth_b8_32k", lambda: kernel_bandwidth(sparse, 8, 32768))
    if "speed" in wanted:
        for batch in (1, 8):
            section(results, f"s2_speed_b{batch}_32k", lambda b=batch: speed(sparse, b, 32768))
        del sparse
        torch.cuda.empty_cache()
        dense = build(dense=True)
        for batch in (1, 8):
            section(results, f"dense_sdpa_speed_b{batch}_32k", lambda b=batch: speed(dense, b, 32768))
            # SDPA may pick cuDNN, which rebuilds its plan for every new key length while decoding: also measure
            # the dense model without it, and compare with the faster of the two.
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                section(results, f"dense_sdpa_no_cudnn_speed_b{batch}_32k", lambda b=batch: speed(dense, b, 32768))
        for batch in (1, 8):
            s2 = results.get(f"s2_speed_b{batch}_32k", {})
            dense_runs = [results.get(f"dense_sdpa{v}_speed_b{batch}_32k", {}) for v in ("", "_no_cudnn")]
            dense_runs = [r for r in dense_runs if "decode_step_ms" in r]
            if "decode_step_ms" in s2 and dense_runs:
                best_step = min(r["decode_step_ms"] for r in dense_runs)
                results[f"decode_speedup_b{batch}"] = best_step / s2["decode_step_ms"]
                results[f"prefill_speedup_b{batch}"] = min(r["prefill_s"] for r in dense_runs) / s2["prefill_s"]
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""torch.compile benchmark (GPU): what compiling gives the training step and the decode loop.

    python bench/bench_compile.py --out bench/results/compile_h100.json          # ~3-4 min on an H100
    python bench/bench_compile.py --quick --out /tmp/compile_quick.json         # smoke run, ~1.5 min

The ~1B hybrid of ``bench_generation.py`` (Llama-3.2-1B shapes, 16 layers, layers 0-1 dense, the rest block 64 /
local 16 / stride 16; random weights, bf16):

* ``train_step_eager`` / ``train_step_compiled``: forward + backward of a causal-LM loss at batch 1, T = 8192,
  eager vs ``torch.compile(fullgraph=True)`` (Inductor, default mode; the S2 kernels are custom ops inside the graph).
  The optimizer step is the same for both and not timed. Median of the timed steps, after warm-up (the compile time
  is reported apart).
* ``decode_cuda_graphs`` / ``decode_compiled``: ``generate(cache_implementation="static")`` at 32k context, batch 8,
  greedy: the S2 static cache's own CUDA graphs (the default) vs transformers' compiled decode step
  (``compile_config=CompileConfig()``: Inductor, ``mode="reduce-overhead"``, i.e. CUDA graphs around the compiled
  step). Median decode step and time to first token, through ``generate``.

Each section records its error instead of aborting the run; ``speedups`` compares the pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
import triton
from bench_generation import PATTERN, SHAPES, generate_speed, section
from transformers import CompileConfig

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity


def hybrid(num_layers: int) -> S2LlamaForCausalLM:
    config = S2LlamaConfig(**{**SHAPES, "num_hidden_layers": num_layers},
                           sparsity=hybrid_sparsity(num_layers, PATTERN, dense_layers=(0, 1)))
    return S2LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def train_step(model, length: int, compiled: bool, steps: int) -> dict:
    """Forward + backward at batch 1 (``use_cache=False``, as training does); the first call compiles."""
    model.train()
    ids = torch.randint(1, SHAPES["vocab_size"], (1, length), device="cuda")

    def loss():
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    forward = torch.compile(loss, fullgraph=True) if compiled else loss  # its backward is compiled with it

    def run():
        forward().backward()
        model.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    run()  # a second warm-up (autotuned Triton configs, allocator)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    torch._dynamo.reset()
    return {"tokens": length, "step_ms": statistics.median(times) * 1e3, "first_call_s": first,
            "tokens_per_s": length / statistics.median(times), "steps_timed": steps,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def decode(model, batch: int, length: int, steps: int, compiled: bool) -> dict:
    model.eval()
    extra = {"compile_config": CompileConfig()} if compiled else {}
    start = time.perf_counter()
    result = generate_speed(model, batch, length, steps=steps, cache_implementation="static", **extra)
    result["wall_s_including_warmup"] = time.perf_counter() - start
    torch._dynamo.reset()  # drop compiled graphs and their CUDA-graph memory
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--quick", action="store_true", help="4 layers, T=2048 training, 4k context decode")
    args = parser.parse_args()
    layers, train_length, decode_length, steps = (4, 2048, 4096, 16) if args.quick else (16, 8192, 32768, 48)

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "transformers": transformers.__version__, "layers": layers, "quick": args.quick}
    model = hybrid(layers)
    for compiled in (False, True):
        name = "train_step_compiled" if compiled else "train_step_eager"
        torch.cuda.reset_peak_memory_stats()
        section(results, name, lambda compiled=compiled: train_step(model, train_length, compiled, steps=10))
    for compiled in (False, True):
        name = "decode_compiled" if compiled else "decode_cuda_graphs"
        section(results, name, lambda compiled=compiled: decode(model, 8, decode_length, steps, compiled))

    speedups = {}
    for eager, compiled, key in (("train_step_eager", "train_step_compiled", "step_ms"),
                                 ("decode_cuda_graphs", "decode_compiled", "decode_step_ms")):
        if key in results.get(eager, {}) and key in results.get(compiled, {}):
            speedups[f"{compiled}_vs_{eager}"] = results[eager][key] / results[compiled][key]
    results["speedups"] = speedups  # > 1: the compiled variant is faster
    print("speedups", json.dumps(speedups, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""What a speculative verify forward (+ crop) does on the host, against a plain one-token decode step (CPU or GPU).

    python bench/profile_speculative.py                    # the 113M hybrid's shapes, random weights, 2048 context
    python bench/profile_speculative.py --context 6144 --steps 32

Speculative decoding over the compact cache was slower than plain greedy on an H200 (bench/NOTES.md): a verify
forward of ~11 tokens cost ~170 ms against ~17 ms for a plain step. GPU time cannot explain it, so this script counts,
per forward, the host-side work that is cheap on a CPU but expensive on a GPU: ATen ops (kernel launches), host
syncs (``.item()``/``bool()``/``int()`` of a tensor, ``nonzero``), SDPA calls that cuDNN may take (cuDNN builds an
execution plan per new shape: tens of ms), Triton launches whose specialisation was never seen before (each one a
JIT compile on a GPU: ~0.3-1 s), tile autotuning (``_pick_config`` timing runs), storage moves of the compact cache
(``_relayout``) and chunks run token by token. It replays what assisted decoding does: a forward of ``1 + drafts``
tokens, then ``crop`` of the rejected ones, with draft counts and acceptances drawn as prompt lookup produces them.
The model is the quality study's 113M hybrid shape (layers 0-1 dense, the others block 64 / local 4 / stride 8).
Times include the counting's own overhead: compare them with each other, not with bench_speculative.py's.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import time

import torch

if not torch.cuda.is_available():  # before any Triton kernel is decorated: the Triton pass runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, cache_s2_llama, hybrid_sparsity  # noqa: E402
from s2_models.kernels import decode, decode_triton, layouts, pattern, triton_impl  # noqa: E402

SHAPES = dict(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
PATTERN = {"block_size": 64, "local_blocks": 4, "vert_stride": 8, "homo_head": False}
ALWAYS_REPORTED = ("tile autotuning: a tune key never seen (do_bench on a GPU)", "block lists built (s2_attention)",
                   "block masks built", "compact storage moved (_relayout)")
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::item", "aten::is_nonzero"}


class OpCounter(TorchDispatchMode):
    """Counts ATen ops (one kernel launch each on a GPU, roughly) and the ones that wait for the device."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func._schema.name
        if name in SYNC_OPS or (name == "aten::index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))):
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


class Counters:
    """Monkeypatched counters of the expensive host-side events (see the module docstring)."""

    def __init__(self):
        self.events = collections.Counter()
        self.seen_specialisations = set()
        self._patch()

    def _count(self, owner, name, event, condition=None):
        original = getattr(owner, name)
        events = self.events

        def wrapper(*args, **kwargs):
            if condition is None or condition(*args, **kwargs):
                events[event] += 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def _count_cache_misses(self, owner, name, event):
        """Count the calls of the ``functools.lru_cache``-d ``owner.name`` that miss its cache (a rebuild)."""
        cached = getattr(owner, name)
        events = self.events

        def wrapper(*args, **kwargs):
            misses = cached.cache_info().misses
            result = cached(*args, **kwargs)
            events[event] += cached.cache_info().misses - misses
            return result

        wrapper.cache_info = cached.cache_info
        setattr(owner, name, wrapper)

    def _patch(self):
        tune_keys = set()

        def new_tune_key(kind, key, *args):
            new = (kind, key) not in tune_keys
            tune_keys.add((kind, key))
            return new

        self._count(triton_impl, "_pick_config", "tile autotuning: a tune key never seen (do_bench on a GPU)",
                    new_tune_key)
        self._count(triton_impl, "build_unit_lists", "block lists built (s2_attention)")
        self._count_cache_misses(pattern, "_block_mask", "block masks built")
        self._count_cache_misses(decode, "_layout_from_ints", "CompactLayout made from op arguments")
        self._count_cache_misses(layouts, "_tables", "slot tables built and copied to the device")
        layer = cache_s2_llama.S2CacheLayer
        original_relayout = layer._relayout
        events = self.events

        def relayout(cache, *args, **kwargs):
            keys = cache.keys
            result = original_relayout(cache, *args, **kwargs)
            if cache.keys is not keys:
                events["compact storage moved (_relayout)"] += 1
            return result

        layer._relayout = relayout
        self._count(layer, "_attend_new_tokens", "new-token attentions (> 1 per sparse layer: token by token)")
        original_sdpa = F.scaled_dot_product_attention

        def sdpa(query, key, *args, **kwargs):
            if query.shape[-2] != key.shape[-2] and torch.backends.cuda.cudnn_sdp_enabled():
                events["SDPA over a cache with cuDNN allowed"] += 1
                shape = ("sdpa", tuple(query.shape), tuple(key.shape))
                if shape not in self.seen_specialisations:
                    self.seen_specialisations.add(shape)
                    events["  ... of a shape new to cuDNN (a plan build on a GPU)"] += 1
            return original_sdpa(query, key, *args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        for kernel in (decode_triton.s2_decode_fwd_kernel, decode_triton.s2_cache_append_kernel):
            self._watch_specialisations(kernel)

    def _watch_specialisations(self, kernel):
        """Count launches of ``kernel`` whose Triton specialisation is new in this process: each would be a JIT
        compile on a GPU."""
        run, events, seen = kernel.run, self.events, self.seen_specialisations

        def watched(*args, grid, warmup, **kwargs):
            key = (kernel.fn.__name__, decode_triton.launch_specialisation(kernel, args, kwargs))
            if key not in seen:
                seen.add(key)
                events[f"new Triton specialisation: {kernel.fn.__name__}"] += 1
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = watched


def build(backend: str) -> S2LlamaForCausalLM:
    torch.manual_seed(0)
    config = S2LlamaConfig(**SHAPES, sparsity=hybrid_sparsity(SHAPES["num_hidden_layers"], PATTERN,
                                                               dense_layers=(0, 1)), s2_backend=backend)
    return S2LlamaForCausalLM(config).eval()


def draft_schedule(steps: int, max_drafts: int, seed: int = 0) -> list[tuple[int, int]]:
    """``(tokens in the verify forward, tokens cropped after it)`` per step, as prompt lookup makes them: mostly
    full draft windows, sometimes shorter ones (a match near the end) or none, and a varying number accepted."""
    rng = random.Random(seed)
    schedule = []
    for _ in range(steps):
        drafts = rng.choice([max_drafts] * 6 + list(range(0, max_drafts)))
        accepted = rng.randint(0, drafts)
        schedule.append((1 + drafts, drafts - accepted))
    return schedule


@torch.no_grad()
def replay(model, counters: Counters, context: int, schedule, label: str, device):
    """Prefill ``context`` tokens, then forwards of the schedule's lengths, each followed by its crop."""
    vocab = SHAPES["vocab_size"]
    ids = torch.randint(1, vocab, (1, context), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, seen = out.past_key_values, context
    times, per_forward = [], []
    for tq, cropped in schedule:
        counters.events.clear()
        tokens = torch.randint(1, vocab, (1, tq), device=device)
        mask = torch.ones(1, seen + tq, dtype=torch.long, device=device)  # generate passes the full mask
        with OpCounter() as ops:
            start = time.perf_counter()
            model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
            cache.crop(-cropped)  # what assisted decoding calls after every verify forward (0 included)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seen += tq - cropped
        per_forward.append((tq, ops.ops, sum(ops.syncs.values()), dict(counters.events)))
    report(label, times, per_forward)


def report(label, times, per_forward):
    print(f"==== {label}: {len(times)} forwards, median {1e3 * statistics.median(times):.1f} ms "
          f"(first {1e3 * times[0]:.1f} ms)")
    totals = collections.Counter(dict.fromkeys(ALWAYS_REPORTED, 0))
    for _, _, _, events in per_forward:
        totals.update(events)
    ops = [n for _, n, _, _ in per_forward]
    syncs = [s for _, _, s, _ in per_forward]
    print(f"  ATen ops per forward: median {statistics.median(ops):.0f}; host syncs per forward: median "
          f"{statistics.median(syncs):.0f} (max {max(syncs)})")
    for event, count in sorted(totals.items()):
        print(f"  {event}: {count} in all, {count / len(per_forward):.2f} per forward")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--drafts", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--triton_context", type=int, default=512, help="context of the (interpreted) Triton pass")
    parser.add_argument("--triton_steps", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counters = Counters()
    torch.manual_seed(0)

    model = build("torch").to(device)
    replay(model, counters, args.context, [(1, 0)] * args.steps, "plain steps, torch path", device)
    replay(model, counters, args.context, draft_schedule(args.steps, args.drafts),
           "verify forwards + crop, torch path", device)

    model = build("triton").to(device)
    counters.seen_specialisations.clear()
    replay(model, counters, args.triton_context, [(1, 0)] * args.triton_steps, "plain steps, Triton kernels",
           device)
    replay(model, counters, args.triton_context, draft_schedule(args.triton_steps, args.drafts, seed=1),
           "verify forwards + crop, Triton kernels (after the plain steps)", device)


if __name__ == "__main__":
    main()

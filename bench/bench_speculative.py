"""Prompt-lookup (speculative) decoding over the compact S2 KV cache vs plain greedy decoding (GPU).

    python bench/bench_speculative.py --out bench/results/speculative_h100.json          # 8k and 32k prompts
    python bench/bench_speculative.py --quick --out /tmp/speculative.json               # 4k prompt, fewer tokens

The task is input-grounded: a long "document" whose continuation repeats parts of it (an editing / summarising
workload, where prompt lookup pays). The model is the ~1B hybrid of ``bench_generation.py`` (Llama-3.2-1B shapes,
layers 0-1 dense, the others S2 block 64 / local 16 / stride 16) with **random weights**: it has not learnt to copy
from its input, so the document is built from a few passages repeated many times, and how many drafts are accepted
comes from that repetition and from the cycles greedy decoding of a random model falls into. The acceptance
(``tokens_per_target_forward``) is recorded next to the speed so the speed-up can be read against it; a trained
model on a real editing task accepts according to how much of the output it copies.

Every variant runs through ``generate`` at batch 1 (prompt lookup's only batch size), bf16, on the default dynamic
cache: plain greedy, and ``prompt_lookup_num_tokens`` (drafts are verified in one forward and the rejected ones
cropped from the compact cache). Recorded: time to first token, decode tokens/s after it, target forwards, the time
of each forward after the prompt's (device synchronized around it: medians and means of the one-token forwards and
of the verify forwards, and the decode time per target forward, crop and drafting included), whether
the tokens equal plain greedy's (bf16: a chunked verify and a one-token step round differently, so a near-tie can
flip; the first differing index is recorded), and the KV memory incl. the rollback room
(``kv_cache_bytes(...)["s2_rollback"]``).

With ``--model`` (a trained S2 checkpoint, e.g. the hybrid of ``bench/quality_study.py``) and ``--text`` (a uint16
token file, e.g. the corpus' ``heldout.bin``) the document is real held-out text and the prompt ends by restarting
it (its first ``RESTART_TOKENS`` tokens again): an editing task, where a trained model continues by copying the
document and the drafts that prompt lookup takes from it are accepted as often as the model copies::

    python bench/bench_speculative.py --model /tmp/study2/hybrid/final --text /tmp/corpus/heldout.bin \
        --contexts 2048,6144 --out $OUT/speculative_trained.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import numpy as np
import torch
from bench_generation import PATTERN, SHAPES  # the 1B hybrid of the generation bench

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity
from s2_models.cache_s2_llama import kv_cache_bytes

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)


def document(length: int, passage_length: int = 256, num_passages: int = 8, seed: int = 0) -> torch.Tensor:
    """``[1, length]`` token ids: passages drawn (with repetition) from a few random ones, ending inside a passage."""
    generator = torch.Generator().manual_seed(seed)
    passages = torch.randint(1, SHAPES["vocab_size"], (num_passages, passage_length), generator=generator)
    order = torch.randint(0, num_passages, (-(-length // passage_length) + 1,), generator=generator)
    return passages[order].flatten()[:length][None].cuda()


RESTART_TOKENS = 32


def restarted_text(path: str, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of real text: its first ``length - RESTART_TOKENS`` tokens, then their first
    ``RESTART_TOKENS`` again, so that the text's own continuation is to copy the document from there."""
    if length <= 2 * RESTART_TOKENS:
        raise ValueError(f"a context must exceed {2 * RESTART_TOKENS} tokens, got {length}")
    tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16, count=length - RESTART_TOKENS).astype(np.int64))
    if len(tokens) < length - RESTART_TOKENS:
        raise ValueError(f"--text {path} holds {len(tokens)} tokens, fewer than the context {length} needs")
    return torch.cat([tokens, tokens[:RESTART_TOKENS]])[None].cuda()


class ForwardTimer:
    """Times every forward of the target model (device synchronized around it; generate's loop waits for each
    forward's tokens anyway at batch 1) with the number of tokens it took, so that the cost of one plain decode step
    and of one verify forward can be read apart from the acceptance."""

    def __init__(self, model):
        self.forwards: list[tuple[int, float]] = []  # (input tokens, seconds)
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        model.register_forward_hook(self._stop, with_kwargs=True)

    def _start(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        torch.cuda.synchronize()
        self._tokens, self._started = ids.shape[1], time.perf_counter()

    def _stop(self, module, args, kwargs, output):
        torch.cuda.synchronize()
        self.forwards.append((self._tokens, time.perf_counter() - self._started))

    def summary(self) -> dict:
        """Forward times in ms after the prompt's forward (the first): medians of the one-token forwards (plain
        steps, or rounds where prompt lookup found no draft) and of the verify forwards (drafts + 1 tokens), means
        (a JIT compile or plan build shows in the mean, not the median), and how many of each."""
        one, verify = ([1e3 * s for n, s in self.forwards[1:] if predicate(n)] for predicate in
                       (lambda n: n == 1, lambda n: n > 1))
        return {
            "one_token_forwards": len(one),
            "one_token_forward_ms_median": statistics.median(one) if one else None,
            "one_token_forward_ms_mean": statistics.fmean(one) if one else None,
            "verify_forwards": len(verify),
            "verify_forward_ms_median": statistics.median(verify) if verify else None,
            "verify_forward_ms_mean": statistics.fmean(verify) if verify else None,
            "verify_forward_tokens_median": statistics.median(
                n for n, _ in self.forwards[1:] if n > 1) if verify else None,
        }


def timed_generate(model, ids, **kwargs):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **GREEDY, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


@torch.no_grad()
def run(model, timer, ids, new_tokens, **kwargs):
    # Warm-up on the full prompt: the prompt's shapes tune and compile their kernels here, not inside the timed time
    # to first token (a shorter warm-up prompt left that in it: on an H100 it exceeded the whole timed generate).
    timed_generate(model, ids, max_new_tokens=8, **kwargs)
    first_token_s, _ = timed_generate(model, ids, max_new_tokens=1, **kwargs)
    timer.forwards.clear()
    seconds, out = timed_generate(model, ids, max_new_tokens=new_tokens, **kwargs)
    sizes = kv_cache_bytes(out.past_key_values)
    generated = out.sequences.shape[1] - ids.shape[1]
    return out.sequences[0, ids.shape[1]:].cpu(), {
        "new_tokens": generated,
        "seconds": seconds,
        "time_to_first_token_s": first_token_s,
        "decode_tokens_per_s": (generated - 1) / max(seconds - first_token_s, 1e-9),
        "target_forwards": len(timer.forwards),
        "tokens_per_target_forward": generated / len(timer.forwards),
        "decode_ms_per_target_forward": 1e3 * (seconds - first_token_s) / max(1, len(timer.forwards) - 1),
        **timer.summary(),
        "kv_cache_bytes": sizes,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="one 4k prompt, 128 new tokens")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    parser.add_argument("--model", default=None, help="a trained S2 checkpoint (default: the random-weight 1B hybrid)")
    parser.add_argument("--text", default=None, help="with --model: uint16 token file the documents come from")
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths (default 8192,32768)")
    parser.add_argument("--new_tokens", type=int, default=None, help="tokens to generate (default 256)")
    args = parser.parse_args()
    if (args.model is None) != (args.text is None):
        raise ValueError("--model and --text go together (a trained model on real text)")
    contexts, new_tokens = ((4096,), 128) if args.quick else ((8192, 32768), 256)
    if args.contexts:
        contexts = tuple(int(n) for n in args.contexts.split(","))
    new_tokens = args.new_tokens or new_tokens
    torch.manual_seed(0)
    if args.model is None:
        config = S2LlamaConfig(**SHAPES, sparsity=hybrid_sparsity(16, PATTERN, dense_layers=(0, 1)))
        model = S2LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
        described = {"shapes": SHAPES, "pattern": PATTERN, "weights": "random"}
    else:
        model = S2LlamaForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to("cuda").eval()
        described = {"model": args.model, "sparsity": model.config.sparsity, "text": args.text,
                     "prompt": f"held-out text, its first {RESTART_TOKENS} tokens repeated at the end"}
    timer = ForwardTimer(model)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **described,
               "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens, "runs": {}}
    for context in contexts:
        ids = document(context) if args.text is None else restarted_text(args.text, context)
        entry = results["runs"][str(context)] = {}
        try:
            plain_tokens, entry["plain_greedy"] = run(model, timer, ids, new_tokens)
            lookup_tokens, entry["prompt_lookup"] = run(
                model, timer, ids, new_tokens, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens
            )
            differ = (plain_tokens != lookup_tokens).nonzero()
            entry["tokens_equal_plain_greedy"] = not len(differ)
            entry["first_differing_token"] = int(differ[0]) if len(differ) else None
            entry["decode_speedup"] = (
                entry["prompt_lookup"]["decode_tokens_per_s"] / entry["plain_greedy"]["decode_tokens_per_s"]
            )
        except Exception as e:  # noqa: BLE001 - a benchmark records failures and goes on
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["trace"] = traceback.format_exc()[-2000:]
        print(context, json.dumps(entry, indent=1), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

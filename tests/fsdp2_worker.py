"""FSDP2 gradient check across processes, run by tests/test_training_distributed.py as
``torchrun --standalone --nproc_per_node 2 tests/fsdp2_worker.py --device cuda`` (or ``--device cpu``, gloo).

Every rank builds the same small S2 hybrid (4 layers, head_dim 64, tied embeddings; on CUDA its sparse and packed
dense layers run the Triton kernels, on the CPU the PyTorch path), shards each decoder layer and then the model with
``fully_shard`` as the accelerate FSDP2 config does, and runs two steps (forward and backward each, an AdamW step
between them). Each step's global batch is a list of sequences packed with ``DataCollatorWithFlattening`` (the
collator ``s2-train --packing`` uses); each rank packs its share of the sequences, so the ranks hold different numbers
of tokens. Rank 0 also runs an unsharded float32 copy (same initial weights) on the whole batch, and a float64 copy on
the CPU as the exact reference.

The loss is token-weighted as ``Trainer`` weights it: each rank's summed token losses are divided by the token count
of the whole global batch and multiplied by the world size, and FSDP averages the gradients over the ranks, so the
gradient is that of the full batch's mean loss whatever the split.

Checked at every step, the references first set to the sharded model's current weights (so all three differentiate
at the same point): the loss and every gradient, where the sharded run's error against the float64 reference may be
at most 2x (the loss) or 3x (gradients) that of the unsharded run in the same precision, plus a floor of a few units
of rounding (the quality bar's rule). Between steps, the sharded AdamW step: its update of every parameter must be
the one AdamW makes on the unsharded model from the same gradients (gathered from the shards), to float32 rounding.
(The references do not train on their own gradients: AdamW's first update is about ``lr * sign(grad)``, so where a
gradient is near zero, rounding flips whole ``lr``-sized steps and the second step's gradients would differ by far
more than rounding in any two runs.) Precisions (``--precisions``):

- ``fp32``: float32 weights and compute; both runs err at ~1e-6, so a wrong weighting or a lost shard fails at once.
- ``bf16``: what ``accelerate launch --config_file training/accelerate/fsdp2.yaml`` applies, i.e. FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)`` under bf16 autocast, against the
  unsharded float32 model under bf16 autocast (what ``Trainer(bf16=True)`` runs on one GPU or under DDP).

Exits with status 1 and a message naming the parameter on a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import DataCollatorWithFlattening

from s2_models import S2LlamaConfig, S2LlamaForCausalLM, hybrid_sparsity

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
PATTERN = {"block_size": 16, "local_blocks": 2, "vert_stride": 4}  # sparse from 48 tokens on
DENSE_LAYERS = (0,)
# The global batch of each step: sequence lengths (odd, shorter than a block, spanning many blocks); rank r packs
# the r-th contiguous share. The shares hold different token counts (step 1: 439 vs 554).
STEPS = ((203, 77, 9, 150, 190, 87, 64, 213), (31, 256, 100, 48, 17, 333, 129, 96))
LEARNING_RATE = 1e-3
PRECISIONS = {
    "fp32": {"policy": MixedPrecisionPolicy(), "autocast": False},
    "bf16": {
        "policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       output_dtype=torch.bfloat16),
        "autocast": True,
    },
}
EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}
# The same float32 AdamW arithmetic on the same inputs, sharded or whole: only its operation order may differ. A lost
# shard, a wrong learning rate or a step skipped errs by a whole update (relative error ~1).
UPDATE_RTOL = 1e-5


def sequences(lengths, generator) -> list[dict]:
    return [{"input_ids": torch.randint(0, CONFIG["vocab_size"], (n,), generator=generator).tolist()} for n in lengths]


def predicted_tokens(batch) -> int:
    """Tokens the loss counts: the model shifts the labels, and each sequence's first label is -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def float64_loss(model, batch) -> torch.Tensor:
    """The float64 copy's mean token loss, computed here in float64 (the models' loss function computes in float32)."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100, reduction="sum") / (
        predicted_tokens(batch))


def on(batch, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((x.double().cpu() - reference).norm() / reference.norm().clamp_min(1e-30))


def run(precision: str, device: torch.device, rank: int, world: int) -> list[str]:
    """``len(STEPS)`` steps sharded (every rank) and unsharded (rank 0); returns rank 0's failures."""
    policy, autocast = PRECISIONS[precision]["policy"], PRECISIONS[precision]["autocast"]
    torch.manual_seed(0)  # the same initial weights on every rank
    sparsity = hybrid_sparsity(CONFIG["num_hidden_layers"], PATTERN, dense_layers=DENSE_LAYERS)
    model = S2LlamaForCausalLM(S2LlamaConfig(**CONFIG, sparsity=sparsity))
    # rank 0's references: the unsharded model in the same precision, and float64 on the CPU (the exact answer)
    references = {} if rank != 0 else {
        "unsharded": copy.deepcopy(model).to(device), "float64": copy.deepcopy(model).to(torch.float64)
    }
    # AdamW on the unsharded model, fed the sharded run's gradients: the update the sharded step must make
    ref_optimizer = torch.optim.AdamW(references["unsharded"].parameters(), lr=LEARNING_RATE) if references else None
    mesh = init_device_mesh(device.type, (world,))
    sharded = model.to(device)
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(sharded, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=LEARNING_RATE)

    def mixed(model_device: torch.device, enabled: bool):
        return torch.autocast(model_device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()

    def gathered(tensors: dict) -> dict:
        """Every sharded tensor whole (a collective: every rank gathers, in the same order); rank 0 keeps them."""
        whole = {name: t.full_tensor() for name, t in tensors.items()}
        return whole if references else {}

    failures = []
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    generator = torch.Generator().manual_seed(1)  # the same tokens on every rank
    for step, lengths in enumerate(STEPS, start=1):
        batch = sequences(lengths, generator)
        share = len(batch) // world
        full, mine = collate(batch), collate(batch[rank * share : (rank + 1) * share])
        with mixed(device, autocast):
            loss = sharded(**on(mine, device), num_items_in_batch=predicted_tokens(full)).loss * world
        loss.backward()
        reported = loss.detach().float() / world
        dist.all_reduce(reported)  # the ranks' shares add up to the full batch's mean loss
        losses = {"sharded": reported.item()}
        for name, ref in references.items():
            ref_device = next(ref.parameters()).device
            if name == "float64":
                ref_loss = float64_loss(ref, full)
            else:
                with mixed(ref_device, autocast):
                    ref_loss = ref(**on(full, ref_device)).loss
            ref_loss.backward()
            losses[name] = ref_loss.detach().item()
        grads = gathered({name: param.grad for name, param in sharded.named_parameters()})
        if references:
            error, ref_error = (abs(losses[name] - losses["float64"]) for name in ("sharded", "unsharded"))
            # floor: one unit of rounding (bf16 returns the loss in bf16: output_dtype; half a unit per rank's share)
            bound = 2 * ref_error + EPS[precision] * abs(losses["float64"])
            print(f"[{precision}] step {step} loss: " + ", ".join(f"{k} {v:.7f}" for k, v in losses.items())
                  + f"; sharded error {error:.3g}, bound {bound:.3g}", flush=True)
            if error > bound:
                failures.append(f"[{precision}] step {step} loss: sharded {losses['sharded']!r} is {error:.3g} from "
                                f"float64 {losses['float64']!r}, over the bound {bound:.3g} (2x the unsharded run's "
                                f"{ref_error:.3g} + floor)")
            failures += check_gradients(grads, references, precision, step)
        if step == len(STEPS):
            break
        optimizer.step()
        optimizer.zero_grad()
        weights = gathered({name: param.detach() for name, param in sharded.named_parameters()})
        if references:
            failures += check_update(weights, grads, references["unsharded"], ref_optimizer, precision, step)
            for ref in references.values():  # the next step's gradients at the sharded run's weights
                ref.zero_grad()
                with torch.no_grad():
                    for name, param in ref.named_parameters():
                        param.copy_(weights[name])
    return failures


def check_gradients(grads: dict, references: dict, precision: str, step: int) -> list[str]:
    """Each gathered gradient's error against float64 within 3x the unsharded run's, plus a floor."""
    failures, worst = [], 0.0
    for name, grad in grads.items():
        exact = references["float64"].get_parameter(name).grad
        error = relative_error(grad, exact)
        ref_error = relative_error(references["unsharded"].get_parameter(name).grad, exact)
        bound = 3 * ref_error + 2 * EPS[precision]
        worst = max(worst, error / bound)
        if error > bound:
            failures.append(f"[{precision}] step {step} gradient of {name}: relative error {error:.3g} against "
                            f"float64, over the bound {bound:.3g} (3x the unsharded run's {ref_error:.3g} + floor)")
    print(f"[{precision}] step {step} gradients: largest sharded error / bound = {worst:.3f}", flush=True)
    return failures


def check_update(weights: dict, grads: dict, unsharded, ref_optimizer, precision: str, step: int) -> list[str]:
    """The sharded AdamW step's update of each parameter against AdamW's on the unsharded model (at the same
    weights, with its state fed the same gradients so far) from the same gradients, within ``UPDATE_RTOL``."""
    before = {name: param.detach().clone() for name, param in unsharded.named_parameters()}
    for name, param in unsharded.named_parameters():
        param.grad = grads[name].to(param.dtype)
    ref_optimizer.step()
    failures, worst = [], 0.0
    for name, param in unsharded.named_parameters():
        expected, actual = param.detach() - before[name], weights[name] - before[name]
        error = float((actual - expected).double().norm() / expected.double().norm().clamp_min(1e-30))
        worst = max(worst, error)
        if error > UPDATE_RTOL:
            failures.append(f"[{precision}] step {step} AdamW update of {name}: relative error {error:.3g} against "
                            f"AdamW on the unsharded model from the same gradients, over {UPDATE_RTOL}")
    print(f"[{precision}] step {step} AdamW updates: largest relative error {worst:.3g}", flush=True)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {list(PRECISIONS)}")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if any(len(lengths) % world for lengths in STEPS):
        raise ValueError(f"the world size {world} must divide each step's {[len(s) for s in STEPS]} sequences")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        failures = []
        for precision in args.precisions.split(","):
            failures += run(precision, device, rank, world)
        # every rank done with its collectives before either tears the group down: a gloo rank destroyed while its
        # peer still has work in flight aborts ("terminate called without an active exception", exit -6)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        print("FSDP2 gradients differ from the unsharded model's:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

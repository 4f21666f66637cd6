"""Training on 2 GPUs (issue 12): one GPU vs DDP vs FSDP2, through ``s2-train`` and ``accelerate launch``.

The model: a ~113M-parameter S2 hybrid trained from scratch (``quality_study.SCRATCH_CONFIG``: 12 layers, hidden 768,
12 query / 4 KV heads of 64, SmolLM2's 49152-token vocabulary, tied embeddings; layers 0-1 dense, the others
``quality_study.DEFAULT_PATTERN``: blocks of 64, 4 local blocks, every 8th block, stripes shifted per head). Every
arm runs ``s2-train`` with the same seed, data order (``--train_sampling_strategy sequential``) and global batch:
16 packed chunks of up to 2048 tokens a step (~32k tokens), ``--bf16``, AdamW (lr 6e-4, 5 warm-up steps, linear
decay), activation checkpointing, 50 steps. ``--bf16`` is autocast on fp32 weights for ``single`` and ``ddp``; under
the FSDP2 config accelerate also keeps bf16 copies of the weights for compute and reduces gradients in bf16:

- ``single``: one GPU (the first visible), per-device batch 16, ``--gradient_checkpointing``;
- ``ddp``: ``accelerate launch --config_file training/accelerate/ddp.yaml --num_processes 2``, per-device batch 8,
  ``--gradient_checkpointing``;
- ``fsdp2``: ``accelerate launch --config_file training/accelerate/fsdp2.yaml --num_processes 2
  --fsdp_activation_checkpointing true``, per-device batch 8 (FSDP checkpoints each decoder layer itself).

Each arm runs this file as a worker (``--worker``) that calls ``s2_models.training.train.main`` with a callback
timing every step (CUDA-synchronized wall clock between step ends, so data loading and logging count) and reading
``state.num_input_tokens_seen`` (all ranks' tokens). Per arm the JSON holds the exact command and the environment it
added, the 50 losses, tokens/s and the median step time over steps 11-50 (11-48 with ``--profile``; steps 1-10
include Triton's compilation and the kernels' autotuning), the peak memory of the fullest GPU
(``train_peak_memory_gib`` of s2-train's train metrics), how the model was wrapped and checkpointed, and the wall
time; for ``ddp`` and ``fsdp2`` also the largest ``|loss - single's loss|`` over the steps. The three loss curves go
on one PNG beside the JSON (if matplotlib is installed). An arm that fails or passes ``--timeout`` is recorded with
the tail of its output; the others still run.

NVLink multicast (NVLS) stays off: ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` are set here and in every launched process's environment.

Commands::

    # 1. on a machine of the project with SmolLM2's tokenizer cached (the CPU machine): tokenizer + 7.5 MB of text
    python bench/bench_distributed.py --prepare .gpu/dist
    # 2. on the 2-GPU machine, .gpu/dist carried along (and the device wheels' `datasets`): all three arms, 218 s on
    #    2 H100s (2026-11-27): the first arm's first step took 79 s (Triton's compilation, cold, and the tuning),
    #    each arm's 50 steps ~12 s, the rest start-up and the final save
    python bench/bench_distributed.py --data .gpu/dist --out bench/results/distributed_<gpu>.json

``--arms ddp,fsdp2`` runs some arms only; ``--arms single_half`` adds one GPU at a 2-GPU arm's per-device batch (8):
the step a rank would take with free communication, so ``2 x single_half`` tokens/s is the ideal 2-GPU rate.
``--profile`` has every process profile the last two steps (``torch.profiler``; they are then not timed): the record
gains their wall time per step, the time some GPU work ran (the union of kernel, copy and set intervals on all
streams), NCCL's share and the part of it no other GPU work overlapped, and the host's self time in the operations
it recorded; the arm's log gets the busiest kernels and host operations. ``--plot RESULTS.json`` redraws a run's
loss plot (beside the JSON).
``--tiny`` is a CPU smoke run of this script (a tiny model, the cached tiny tokenizer, a few steps, gloo; ``--prepare
DIR --tiny`` writes its data): ``single`` and ``ddp`` (torchrun, as ``accelerate launch`` starts one process only
with ``--cpu``), while ``fsdp2`` is recorded as skipped (accelerate applies FSDP on GPUs only; tests/fsdp2_worker.py
checks FSDP2 itself on the CPU). Its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quality_study import DEFAULT_PATTERN, SCRATCH_CONFIG, TINY_CONFIG, TINY_PATTERN

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = REPO / "training" / "accelerate"
# NVLink multicast off in every process (NCCL's NVLS algorithms, PyTorch's symmetric memory, NVSHMEM): on the shared
# GPU hosts this runs on, a program that uses it can put every GPU of the host out of service.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ARMS = ("single", "ddp", "fsdp2")
# Run only when named in --arms: one GPU doing one rank's share of a 2-GPU step (half the global batch), with no
# exchange. Its step time is what the 2-GPU arms would take if communication were free; its losses are of another
# batch, so they are not compared.
OPTIONAL_ARMS = ("single_half",)
NUM_PROCESSES = 2  # GPUs of the ddp and fsdp2 arms
PROFILE_ENV = "S2_BENCH_PROFILE_STEPS"  # how the driver tells the workers which steps to profile (--profile)
ROW_CHUNKS = 16  # --prepare joins documents into rows of about this many chunks (see prepare)

# What a run is: model, data and schedule. --tiny swaps in its own.
GPU_RUN = dict(config=SCRATCH_CONFIG, pattern=DEFAULT_PATTERN, dense_layers="0,1", block_size=2048, global_batch=16,
               steps=50, skip_steps=10, learning_rate=6e-4, warmup_steps=5, bf16=True, tokenizer="smollm2")
TINY_RUN = dict(config=TINY_CONFIG, pattern=TINY_PATTERN, dense_layers="0", block_size=128, global_batch=4,
                steps=6, skip_steps=2, learning_rate=3e-3, warmup_steps=1, bf16=False, tokenizer="tiny")
DATA_MARGIN = 0.1  # --prepare writes this share more chunks than the run reads


# ---------------------------------------------------------------------------------------------------------- data
def prepare(folder: Path, run: dict) -> dict:
    """``folder/tokenizer`` and ``folder/train.jsonl`` (rows ``{"text": ...}``) holding at least the run's chunks
    plus ``DATA_MARGIN``, and ``folder/manifest.json`` counting them.

    s2-train cuts each row into ``block_size``-token chunks and never lets a chunk span two rows; the bundled
    documents are short (median ~480 SmolLM2 tokens), so as rows they would leave the average 2048-token chunk half
    empty. Consecutive documents are therefore joined (by a blank line) into rows of about ``ROW_CHUNKS`` chunks:
    only each row's last chunk is partial.
    """
    from s2_models.training.data import iter_documents
    from s2_models.training.train import ModelArguments, load_tokenizer

    tokenizer = load_tokenizer(ModelArguments(tokenizer_name=run["tokenizer"]))
    block = run["block_size"]
    needed = math.ceil(run["steps"] * run["global_batch"] * (1 + DATA_MARGIN))
    rows, pending, pending_tokens, chunks, tokens = [], [], 0, 0, 0
    for document in iter_documents("train"):
        pending.append(document.text)
        pending_tokens += len(tokenizer(document.text, add_special_tokens=False)["input_ids"])
        if pending_tokens < ROW_CHUNKS * block:
            continue
        text = "\n\n".join(pending)
        row_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # s2-train appends EOS
        rows.append(text)
        chunks += math.ceil(row_tokens / block)
        tokens += row_tokens
        pending, pending_tokens = [], 0
        if chunks >= needed:
            break
    else:
        raise RuntimeError(f"the bundled text holds {chunks} chunks of {block} tokens, fewer than the {needed} needed")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": row}) + "\n" for row in rows)
    manifest = {"rows": len(rows), "chunks": chunks, "tokens": tokens, "block_size": block,
                "planned_chunks": run["steps"] * run["global_batch"], "tokenizer": run["tokenizer"],
                "source": "s2_models.training.data.iter_documents('train'), consecutive documents joined",
                "bytes": (folder / "train.jsonl").stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------------------- worker
def worker(record_path: str, s2_train_argv: list[str]) -> None:
    """One arm's process (each rank under a launcher): ``s2-train`` with the step timer. Rank 0 writes the record
    when training ends (so a failure while saving the model keeps the measurements), then adds the train metrics."""
    import torch
    from transformers import TrainerCallback

    from s2_models.training import train

    # transformers 5.2x renamed the model's flag (the old name warns there); 5.17 has only the old one
    checkpointing_flag = next(name for name in ("is_activation_checkpointing", "is_gradient_checkpointing")
                              if hasattr(train.S2LlamaForCausalLM, name))

    class StepTimer(TrainerCallback):
        """Wall-clock time at every step's end (after the GPU finished it), tokens seen, logged losses."""

        def __init__(self):
            self.record = {"steps": [], "losses": []}
            self.writes_record = False  # rank 0 only
            self.profiler = None  # torch.profiler over the profiled steps (--profile)

        def _now(self, args) -> float:
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)
            return time.perf_counter()

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
            from torch.distributed.fsdp import FSDPModule

            self.writes_record = state.is_world_process_zero
            modules = list(model.modules())
            self.record.update(
                model_class=type(model).__name__,
                parameters=sum(p.numel() for p in model.parameters()),  # DTensors count their global size
                world_size=args.world_size,
                parallel_mode=str(args.parallel_mode),
                fsdp_modules=sum(isinstance(m, FSDPModule) for m in modules),
                hf_gradient_checkpointing=bool(getattr(model, checkpointing_flag, False)),
                checkpoint_wrapped_modules=sum(isinstance(m, CheckpointWrapper) for m in modules),  # FSDP's own AC
                bf16=args.bf16,
                device=torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
            )
            self.start = self._now(args)

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now(args)
            self.record["steps"].append({"step": state.global_step, "seconds": now - self.start,
                                         "tokens_seen": state.num_input_tokens_seen})
            if profiled and state.global_step == profiled[0] - 1:  # the window: whole steps, data included
                activities = [torch.profiler.ProfilerActivity.CPU]
                if args.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.start()
                self.profile_start = time.perf_counter()
            elif profiled and state.global_step == profiled[-1]:
                self.profiler.stop()
                self.record["profile"] = profile_summary(self.profiler, now - self.profile_start, profiled,
                                                         f"process {args.process_index}")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.record["losses"].append(logs["loss"])

        def on_train_end(self, args, state, control, **kwargs):
            if self.writes_record:
                Path(record_path).write_text(json.dumps(self.record))

    profiled = tuple(int(x) for x in os.environ[PROFILE_ENV].split("-")) if PROFILE_ENV in os.environ else ()
    timer = StepTimer()
    train.main(s2_train_argv, callbacks=[timer])
    if not timer.writes_record:
        return
    output_dir = Path(s2_train_argv[s2_train_argv.index("--output_dir") + 1])
    metrics = output_dir / "train_results.json"  # written by rank 0 (Trainer.save_metrics)
    if metrics.is_file() and Path(record_path).is_file():
        timer.record["train_metrics"] = json.loads(metrics.read_text())
        Path(record_path).write_text(json.dumps(timer.record))


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_time_split(trace_events: list[dict], wall_s: float, steps: int) -> dict:
    """Per step, in ms, from a Chrome trace's events (``torch.profiler``'s export): ``wall``; ``gpu_busy``, the time
    some kernel, copy or set ran on any stream; ``nccl``, the time a NCCL kernel ran; ``nccl_exposed``, the part of
    ``gpu_busy`` when only NCCL kernels ran (the exchange the computation did not hide); ``gpu_idle``, ``wall -
    gpu_busy`` (the GPU waiting for the host)."""
    gpu = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" not in e["name"].lower()]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower()]
    busy = busy_us(spans)
    split = {"wall": 1e6 * wall_s, "gpu_busy": busy, "nccl": busy_us(nccl), "nccl_exposed": busy - busy_us(other)}
    split["gpu_idle"] = split["wall"] - busy
    return {name: round(us / 1e3 / steps, 2) for name, us in split.items()}


def profile_summary(profiler, wall_s: float, steps: tuple[int, ...], process: str) -> dict:
    """A profiled window's time split (``gpu_time_split``); prints it and the busiest kernels and host operations
    (the arm's log), and returns it for the record."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    split = {"steps": list(steps), "ms_per_step": gpu_time_split(events, wall_s, len(steps))}
    averages = profiler.key_averages()
    # the host's own time in the operations the profiler records (a step is host-bound when this nears "wall")
    split["ms_per_step"]["host_self"] = round(averages.self_cpu_time_total / 1e3 / len(steps), 2)
    print(f"profile of steps {steps}, {process}: {json.dumps(split)}\n"
          + averages.table(sort_by="self_device_time_total", row_limit=20) + "\n"
          + averages.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    return split


# ---------------------------------------------------------------------------------------------------------- driver
def s2_train_args(run: dict, data: Path, output_dir: Path, arm: str, per_device_batch: int, tiny: bool) -> list[str]:
    args = [
        "--tokenizer_name", str(data / "tokenizer"), "--config_overrides", run["config"], "--sparsity", "hybrid",
        "--dense_layers", run["dense_layers"], "--pattern", json.dumps(run["pattern"]),
        "--train_file", str(data / "train.jsonl"), "--validation_split_percentage", "0", "--do_train",
        "--block_size", str(run["block_size"]), "--packing", "true", "--output_dir", str(output_dir),
        "--max_steps", str(run["steps"]), "--per_device_train_batch_size", str(per_device_batch),
        "--learning_rate", str(run["learning_rate"]), "--warmup_steps", str(run["warmup_steps"]),
        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--seed", "0",
        "--disable_tqdm", "true", "--train_sampling_strategy", "sequential",
        # true is "all" in transformers 5.17 and 5.23 (their parser reads this str-or-bool field as a bool)
        "--include_num_input_tokens_seen", "true",
    ]
    if arm != "fsdp2":  # FSDP checkpoints the decoder layers itself (--fsdp_activation_checkpointing)
        args.append("--gradient_checkpointing")
    if run["bf16"]:
        args.append("--bf16")
    if tiny:
        args.append("--use_cpu")
        if arm == "ddp":
            args += ["--ddp_backend", "gloo"]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arm_launch(arm: str, tiny: bool) -> tuple[list[str], dict]:
    """``(launcher argv up to the script, environment additions)`` of an arm."""
    if arm in ("single", "single_half"):
        if tiny:
            return [sys.executable], {}
        first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        # one GPU: Trainer would otherwise wrap the model in DataParallel over every visible GPU
        return [sys.executable], {"CUDA_VISIBLE_DEVICES": first_gpu}
    if tiny:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(NUM_PROCESSES)], {}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ACCELERATE_CONFIGS / f"{arm}.yaml"), "--num_processes", str(NUM_PROCESSES),
                "--main_process_port", str(free_port())]
    if arm == "fsdp2":
        launcher += ["--fsdp_activation_checkpointing", "true"]
    return launcher, {}


def profile_steps(run: dict) -> tuple[int, int]:
    """The steps ``--profile`` profiles: the last two. They are left out of the timed steps (``summarize``), and so is
    the profile's processing after them (seconds, on the host: inside a timed step it would weigh as ~20 steps)."""
    return run["steps"] - 1, run["steps"]


def arm_command(arm: str, run: dict, data: Path, work: Path, tiny: bool, profile: bool = False
                ) -> tuple[list[str], dict]:
    """The full command of an arm and the environment it adds to this process's."""
    launcher, env = arm_launch(arm, tiny)
    per_device_batch = run["global_batch"] // (1 if arm == "single" else NUM_PROCESSES)
    args = s2_train_args(run, data, work / "output", arm, per_device_batch, tiny)
    env = {**NVLS_OFF, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    if profile:
        env[PROFILE_ENV] = "-".join(str(step) for step in profile_steps(run))
    if tiny:
        env["OMP_NUM_THREADS"] = "1"  # two processes on a CI machine's two cores
    return [*launcher, str(Path(__file__).resolve()), "--worker", str(work / "record.json"), *args], env


def run_arm(arm: str, command: list[str], env: dict, work: Path, timeout: float, log_dir: Path | None) -> dict:
    """Run one arm in its own process group (a timeout kills the launcher and its workers)."""
    log_path = (log_dir or work) / f"{arm}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=REPO, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    result = {"command": shlex.join(command), "env": env, "wall_s": time.perf_counter() - start,
              "log": str(log_path) if log_dir else None}
    record = work / "record.json"
    if record.is_file():
        result.update(json.loads(record.read_text()))
    if returncode != 0:
        result["error"] = f"timed out after {timeout:.0f} s" if returncode is None else f"exit status {returncode}"
        result["output_tail"] = log_path.read_text(errors="replace")[-4000:]
    return result


def summarize(result: dict, skip_steps: int) -> None:
    """Throughput and step time over the steps after ``skip_steps`` (and before any profiled ones), peak memory, from
    the raw record."""
    profiled = result.get("profile", {}).get("steps")
    steps = [s for s in result.get("steps", []) if not profiled or s["step"] < profiled[0]]
    if len(steps) <= skip_steps + 1:
        result.setdefault("error", f"only {len(steps)} steps recorded, need more than {skip_steps + 1}")
        return
    base, last = steps[skip_steps - 1], steps[-1]
    window = steps[skip_steps - 1 :]
    result["timed_steps"] = f"{base['step'] + 1}-{last['step']}"
    result["tokens_per_s"] = (last["tokens_seen"] - base["tokens_seen"]) / (last["seconds"] - base["seconds"])
    result["median_step_ms"] = statistics.median(1e3 * (b["seconds"] - a["seconds"]) for a, b in zip(window,
                                                                                                       window[1:]))
    result["tokens_per_step"] = (last["tokens_seen"] - base["tokens_seen"]) / (last["step"] - base["step"])
    # s2-train's metric, absent on the CPU (and when the worker failed after training)
    result["peak_memory_gib"] = result.get("train_metrics", {}).get("train_peak_memory_gib")


def compare_losses(arms: dict) -> None:
    single = arms.get("single", {}).get("losses")
    for name in ("ddp", "fsdp2"):
        losses = arms.get(name, {}).get("losses")
        if single and losses and len(losses) == len(single):
            differences = [abs(a - b) for a, b in zip(losses, single)]
            arms[name]["max_abs_loss_difference_to_single"] = max(differences)
            arms[name]["loss_difference_step"] = 1 + differences.index(max(differences))


def plot_losses(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no loss plot written to {path}")
        return None
    fig, (loss_ax, diff_ax) = plt.subplots(1, 2, figsize=(11, 4))
    single = results["arms"].get("single", {}).get("losses")
    plotted = [(name, arm["losses"]) for name, arm in results["arms"].items()
               if arm.get("losses") and name not in OPTIONAL_ARMS]  # an optional arm trained on another batch
    for color, (name, losses) in zip(("C0", "C1", "C2"), plotted):  # an arm's color in both panels
        steps = range(1, len(losses) + 1)
        loss_ax.plot(steps, losses, label=name, linewidth=1, color=color)
        if name != "single" and single and len(single) == len(losses):
            diff_ax.plot(steps, [a - b for a, b in zip(losses, single)], label=f"{name} - single", linewidth=1,
                         color=color)
    loss_ax.set(xlabel="step", ylabel="training loss", title="training loss")
    diff_ax.set(xlabel="step", ylabel="loss difference", title="difference to one GPU")
    for ax in (loss_ax, diff_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"S2 hybrid, same global batch and data order ({results['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "triton": triton_version, "python": platform.python_version()}


def main(argv=None) -> dict | Path | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # --worker RECORD, then s2-train's own arguments
        return worker(argv[1], argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="write the tokenizer and training text to DIR")
    parser.add_argument("--data", type=Path, default=REPO / ".gpu" / "dist", help="a folder written by --prepare")
    parser.add_argument("--out", type=Path, help="the JSON results (the loss plot goes beside it, .png)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS + OPTIONAL_ARMS)}")
    parser.add_argument("--timeout", type=float, default=300, help="seconds an arm may take before it is killed")
    parser.add_argument("--log_dir", type=Path, help="keep each arm's full output here (default: discarded)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run of the script (tiny model, gloo)")
    parser.add_argument("--plot", type=Path, metavar="JSON", help="only redraw the loss plot of a results JSON")
    parser.add_argument("--profile", action="store_true",
                        help="profile the last two steps in every process (GPU time split); they are not timed")
    args = parser.parse_args(argv)
    if args.plot:
        return plot_losses(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
    run = TINY_RUN if args.tiny else GPU_RUN
    os.environ.update(NVLS_OFF)
    if args.prepare:
        manifest = prepare(args.prepare, run)
        print(f"wrote {args.prepare}: {json.dumps(manifest)}")
        return manifest
    if args.out is None:
        parser.error("--out is required to run the arms")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS + OPTIONAL_ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS + OPTIONAL_ARMS)}")
    manifest_path = args.data / "manifest.json"
    if not manifest_path.is_file():
        parser.error(f"--data {args.data} has no manifest.json: write it with --prepare {args.data}")
    manifest = json.loads(manifest_path.read_text())
    planned = run["steps"] * run["global_batch"]
    if manifest["block_size"] != run["block_size"] or manifest["chunks"] < planned:
        parser.error(f"--data {args.data} holds {manifest['chunks']} chunks of {manifest['block_size']} tokens; "
                     f"this run reads {planned} of {run['block_size']} (prepared {'with' if args.tiny else 'without'}"
                     " --tiny?)")
    gpus = None
    if not args.tiny:
        import torch

        if not torch.cuda.is_available():
            parser.error("this benchmark needs CUDA GPUs (or --tiny for a CPU smoke run of the script)")
        gpus = torch.cuda.device_count()  # counts without creating a CUDA context in this process
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    results = {
        "benchmark": "bench/bench_distributed.py" + (" --tiny" if args.tiny else ""),
        "device": None,
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "run": {**run, "num_processes": NUM_PROCESSES, "data": manifest},
        "nvls_off": NVLS_OFF,
        "arms": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        if arm == "fsdp2" and args.tiny:
            results["arms"][arm] = {"skipped": "accelerate applies FSDP on GPUs only (a --cpu launch is a single "
                                               "process); tests/fsdp2_worker.py checks FSDP2 on the CPU"}
            continue
        if arm in ("ddp", "fsdp2") and not args.tiny and gpus < NUM_PROCESSES:
            results["arms"][arm] = {"skipped": f"needs {NUM_PROCESSES} GPUs, {gpus} visible"}
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-distributed-{arm}-") as work:
            command, env = arm_command(arm, run, args.data.resolve(), Path(work), args.tiny, args.profile)
            print(f"[{arm}] {shlex.join(command)}", flush=True)
            result = run_arm(arm, command, env, Path(work), args.timeout, args.log_dir)
        summarize(result, run["skip_steps"])
        results["arms"][arm] = result
        results["device"] = results["device"] or result.get("device")
        print(f"[{arm}] " + json.dumps({k: v for k, v in result.items() if k in (
            "error", "tokens_per_s", "median_step_ms", "peak_memory_gib", "wall_s")}), flush=True)
        compare_losses(results["arms"])
        args.out.write_text(json.dumps(results, indent=1) + "\n")  # after every arm: a later failure keeps it
    plot = plot_losses(results, args.out.with_suffix(".png"))
    results["plot"] = str(plot) if plot else None
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, arm in results["arms"].items():
        print(f"{name}: " + json.dumps({k: arm.get(k) for k in (
            "skipped", "error", "tokens_per_s", "median_step_ms", "peak_memory_gib", "wall_s",
            "max_abs_loss_difference_to_single")}))
    print(f"results: {args.out}")
    return results


if __name__ == "__main__":
    main()

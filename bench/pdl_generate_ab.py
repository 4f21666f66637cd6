"""``generate``'s decode step with programmatic dependent launch off and on, alternated in one process (GPU).

The 1B hybrid of ``bench_generation.py`` with a 32k-token prompt, static cache + CUDA graphs: for each round, each of
``S2_ATTENTION_PDL=0`` and ``1`` (read at every launch; each ``generate`` captures its own graphs), the median step
through ``generate`` and the step's graph replayed back to back (``bench_generation.graph_replay_step``). The first
arm of a process has run faster than the same arm later (this H100's clocks drift as it warms), so ``--pdl-first``
reverses the order::

    python bench/pdl_generate_ab.py --rounds 3 --batches 8,1 --out $OUT/pdl_generate_ab.json
"""

import argparse
import json
import os

import torch
from bench_generation import build, generate_speed, graph_replay_step

from s2_models.kernels.dependent_launch import ENV_SWITCH


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="8,1")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--pdl-first", action="store_true", help="each round times PDL on before off")
    args = parser.parse_args()
    model = build(dense=False)
    rows = []
    for round_ in range(args.rounds):
        for pdl in ("1", "0") if args.pdl_first else ("0", "1"):
            os.environ[ENV_SWITCH] = pdl
            for batch in (int(b) for b in args.batches.split(",")):
                row = generate_speed(model, batch, args.context, cache_implementation="static")
                row["graph_replay_step_ms"] = graph_replay_step(model, batch, args.context)
                row.update(pdl=pdl == "1", round=round_)
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("pdl", "round", "batch", "decode_step_ms",
                                                      "graph_replay_step_ms")}), flush=True)
                with open(args.out, "w") as f:  # after each row: a run cut by its time limit keeps what it measured
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

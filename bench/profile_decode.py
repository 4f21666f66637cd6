"""Profile one decode step of the generation benchmark's S2 hybrid (GPU): where does the time go?"""

import torch
from bench_generation import build, prefill

model = build(dense=False)
for batch in (1, 8):
    _, out = prefill(model, batch, 32768)
    cache = out.past_key_values
    del out
    token = torch.randint(0, 1000, (batch, 1), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
    print(f"==== batch {batch}: by CUDA time")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(f"==== batch {batch}: by CPU time")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    del cache
    torch.cuda.empty_cache()

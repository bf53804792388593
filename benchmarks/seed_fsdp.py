"""docs/SEED.md section 1's `train_fsdp.py`, unchanged in what it computes, with timing added so it can be
compared with `python -m src.run +exp=fsdp4`:

    torchrun --standalone --nproc_per_node=N benchmarks/seed_fsdp.py --steps 20

Additions (marked `# bench:`): a --steps argument (the seed runs 5), a device sync and a timer
around each step on every rank, the host memory (RSS) after each step, a --compile option
(torch.compile each block before fully_shard, as torchtitan does: the compiled block is a wrapper
module that FSDP2 shards, its hooks outside the graph), a --profile DIR option (a torch.profiler
trace per rank of steps 2-4, for `python -m src.profiling.anatomy DIR/trace_rank0.json
--flops-per-step F`), and a last JSON line with tokens/s per GPU, MFU, peak memory, the growth of
host memory after the warm-up steps, and the model FLOPs per step (F).
"""
import argparse  # bench:
import json  # bench:
import os
import statistics  # bench:
import time  # bench:

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # bench: the private path is gone in newer torch; same functions
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class TransformerBlock(nn.Module):
    def __init__(self, dim=2048, n_heads=16):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.norm2 = nn.RMSNorm(dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim * 4, bias=False),
            nn.SiLU(),
            nn.Linear(dim * 4, dim, bias=False),
        )

    def forward(self, x):
        h = self.norm1(x)
        attn_out, _ = self.attn(h, h, h, need_weights=False)
        x = x + attn_out
        return x + self.ffn(self.norm2(x))


class MiniLLM(nn.Module):
    def __init__(self, vocab_size=32000, dim=2048, n_layers=12):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim) for _ in range(n_layers)])
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()  # bench:
    parser.add_argument("--steps", type=int, default=5)  # bench:
    parser.add_argument("--warmup", type=int, default=2)  # bench: steps left out of the medians
    parser.add_argument("--compile", action="store_true")  # bench: torch.compile each block (torchtitan's order)
    parser.add_argument("--profile", default="")  # bench: a folder for torch.profiler traces of steps 2-4
    args = parser.parse_args()  # bench:

    # 1. Initialize NCCL process group
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # 2. Build model on meta device or standard CUDA, then shard layer-by-layer
    model = MiniLLM().to(device)
    n_non_embedding = sum(p.numel() for p in model.parameters()) - model.embed.weight.numel()  # bench:
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    if args.compile:  # bench:
        for i, layer in enumerate(model.layers):  # bench:
            model.layers.register_module(str(i), torch.compile(layer))  # bench:
    # Shard each TransformerBlock independently to prefetch weights on the fly
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    step_times = []  # bench:
    rss_mb = []  # bench: resident host memory after each step (/proc/self/statm: pages)
    prof = None  # bench:
    if args.profile:  # bench: wait 1, warmup 1, active 3: task=profile's schedule
        from torch.profiler import ProfilerActivity, profile, schedule  # bench:
        os.makedirs(args.profile, exist_ok=True)  # bench:
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=3, repeat=1),  # bench:
                       on_trace_ready=lambda p: p.export_chrome_trace(f"{args.profile}/trace_rank{dist.get_rank()}.json"))  # bench:
        prof.start()  # bench:
    # 3. Distributed Training Step (All-Gather -> Compute -> Reduce-Scatter)
    for step in range(args.steps):
        torch.cuda.synchronize()  # bench:
        t0 = time.perf_counter()  # bench:
        tokens = torch.randint(0, 32000, (8, 1024), device=device)
        targets = torch.randint(0, 32000, (8, 1024), device=device)
        optimizer.zero_grad()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.view(-1, 32000), targets.view(-1))
        loss.backward()
        optimizer.step()
        if local_rank == 0:
            mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
            print(f"Step {step} | Loss: {loss.item():.4f} | Peak VRAM/GPU: {mem_gb:.2f} GB")
        torch.cuda.synchronize()  # bench:
        step_times.append(time.perf_counter() - t0)  # bench:
        with open("/proc/self/statm") as f:  # bench:
            rss_mb.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6)  # bench:
        if prof is not None:  # bench:
            prof.step()  # bench:
    if prof is not None:  # bench:
        prof.stop()  # bench:

    if local_rank == 0:  # bench: the figures src.run reports, by the same formulas
        steady = step_times[args.warmup:] or step_times[-1:]
        tps = 8 * 1024 / statistics.median(steady)
        fpt = 6 * n_non_embedding + 6 * 12 * 16 * (2 * 128) * 1024
        peak = 989e12 if any(k in torch.cuda.get_device_name(device) for k in ("H100", "H200")) else None
        print("SEED_RESULT " + json.dumps({
            "tokens_per_s_per_device": tps,
            "mfu": 100 * fpt * tps / peak if peak else None,
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "step_time_s": statistics.median(steady),
            "final_loss": loss.item(),
            "world_size": dist.get_world_size(),
            "host_rss_mb": rss_mb[-1],
            "host_rss_growth_mb": rss_mb[-1] - rss_mb[min(args.warmup, len(rss_mb) - 1)],
            "compile": args.compile,
            "flops_per_step": fpt * 8 * 1024,
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The quickstart MLP training (notebooks/01_quickstart.ipynb), timed inside the ranks.

The part above the ``ENTRY POINT`` line is sent verbatim as a notebook cell to the kernel
that runs it under sgpu_magic; torchrun runs this whole file as a script. So both run the
same code: SimpleMLP 10->64->64->1 with Dropout 0.2, Adam lr 1e-3, MSELoss, DDP, batch 32,
5000 random samples sharded by a DistributedSampler. ``warmup_epochs`` are not timed; the
timed loop is the remaining epochs (``loop_s``; ``loop_cpu_s``: the rank process's CPU seconds over it, all
its threads), measured on each rank. ``log_metrics=True`` adds
what the seed example does at every step, ``mlflow.log_metric(f"loss_rank{rank}", loss, step=step)``
(for the tracking benchmark); ``max_steps`` ends each epoch early.
"""

import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class SimpleMLP(nn.Module):
    def __init__(self, input_dim: int = 10, hidden_dim: int = 64, output_dim: int = 1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x):
        return self.net(x)


def mlp_train(
    epochs: int, warmup_epochs: int = 1, batch_size: int = 32, log_metrics: bool = False, max_steps: int | None = None
):
    t_start = time.perf_counter()
    if log_metrics:
        import mlflow
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    generator = torch.Generator().manual_seed(42)
    features = torch.randn(5000, 10, generator=generator)
    targets = torch.randn(5000, 1, generator=generator)
    dataset = TensorDataset(features, targets)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    ddp_model = DDP(SimpleMLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    steps, total_loss, t0, logged = 0, 0.0, None, 0
    for epoch in range(warmup_epochs + epochs):
        if epoch == warmup_epochs:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
        sampler.set_epoch(epoch)
        ddp_model.train()
        total_loss = 0.0
        for step, (features_b, targets_b) in enumerate(loader):
            if max_steps is not None and step >= max_steps:
                break
            features_b, targets_b = features_b.to(device), targets_b.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(features_b), targets_b)
            loss.backward()
            optimizer.step()
            step_loss = loss.item()
            total_loss += step_loss
            if log_metrics:
                mlflow.log_metric(f"loss_rank{rank}", step_loss, step=logged)
                logged += 1
            if t0 is not None:
                steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    loop_s, loop_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    result = {
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "steps": steps,
        "loop_s": loop_s,
        "steps_per_s": steps / loop_s,
        "setup_s": t0 - t_start,
        "final_loss": round(total_loss, 4),
        "threads": torch.get_num_threads(),
        "logged": logged,
        "loop_cpu_s": loop_cpu_s,
    }
    del ddp_model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return result


# ---- ENTRY POINT (torchrun) ----
if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    res = mlp_train(args.epochs, args.warmup_epochs)
    with open(os.path.join(args.out, f"rank_{res['rank']}.json"), "w") as f:
        json.dump(res, f)

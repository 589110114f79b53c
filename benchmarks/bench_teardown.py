"""Teardown soak: consecutive warm launches of the DDP tutorial's ``main()``, hangs and teardown graces counted.

The function is pytorch/examples' ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` (with
``datautils.py``) adapted only for CPU: gloo, no ``.to(gpu)``, no snapshot. A ``Trainer`` object
holds the DDP model, ``main()`` ends with ``destroy_process_group()`` and returns ``None``, so the
Trainer is freed as ``main()`` returns: the shape that wedged warm ranks in ``~ProcessGroupGloo``
(8 of 56 warm launches before issue 17). Every launch runs in one warm kernel (2 CPU ranks); a
launch that has not finished within 60 s is a hang (the kernel is killed and a new one started).
A rank that needed the teardown grace (``DistributedMagics.teardown_grace_s``) is counted from the
job's notes.
"""

from __future__ import annotations

from .common import Context, Section, Table, Target, fmt, fmt_range, measure, median

TUTORIAL = """\
import os
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[CPU{{self.gpu_id}}] Epoch {{epoch}} | Batchsize: {{b_sz}} | Steps: {{len(self.train_data)}}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset))


@distributed(gpus={ranks}, **_KW)
def main(save_every: int, total_epochs: int, batch_size: int):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every)
    trainer.train(total_epochs)
    destroy_process_group()
"""

LAUNCH = """\
_t0 = time.perf_counter()
_r = main.distributed(10, 1, 32)
_dt = time.perf_counter() - _t0
assert _r == [None] * {ranks}, _r
_emit(kernel_s=_dt, start_method=_start_method(main.last_job),
      graced=sum("needed the teardown grace" in n for n in main.last_job.notes))
"""

RANKS = 2
HANG_S = 60.0


def run(ctx: Context) -> Section:
    n = ctx.cfg.teardown_launches

    def warm_kernel():
        k = ctx.sgpu_kernel("teardown", warm=True)
        k.run(TUTORIAL.format(ranks=RANKS), timeout_s=ctx.cfg.cell_timeout_s)
        return k

    soak = {
        "launches": n,
        "ok": 0,
        "hangs": 0,
        "graced_ranks": 0,
        "graced_launches": 0,
        "errors": [],
        "kernel": [],
        "start_methods": [],
    }
    kernel = None
    for i in range(n):
        kernel, cell, problem = measure(warm_kernel, kernel, LAUNCH.format(ranks=RANKS), HANG_S)
        if problem is None:
            soak["ok"] += 1
            soak["kernel"].append(cell.data["kernel_s"])
            soak["start_methods"].append(cell.data.get("start_method"))
            soak["graced_ranks"] += cell.data["graced"]
            soak["graced_launches"] += bool(cell.data["graced"])
        elif problem.startswith("hang"):
            soak["hangs"] += 1
        else:
            soak["errors"].append(problem)
        if (i + 1) % 25 == 0:
            print(
                f"  teardown: {i + 1}/{n} warm launches, {soak['hangs']} hangs, {soak['graced_ranks']} ranks needed "
                f"the grace, {len(soak['errors'])} errors",
                flush=True,
            )
    if kernel is not None and not kernel.closed:
        kernel.shutdown()
    return _report(soak)


def _report(soak: dict) -> Section:
    methods: dict[str, int] = {}
    for m in soak["start_methods"]:
        methods[m] = methods.get(m, 0) + 1
    sec = Section(raw=soak)
    t = Table(
        f"Teardown soak: {soak['launches']} consecutive warm launches of the DDP tutorial's main() ({RANKS} CPU ranks)",
        [
            "launches",
            "ok",
            "hangs (> 60 s)",
            "ranks that needed the teardown grace",
            "errors",
            "in kernel median (s)",
            "min-max",
            "start method",
        ],
        [
            [
                soak["launches"],
                soak["ok"],
                soak["hangs"],
                f"{soak['graced_ranks']} (in {soak['graced_launches']} launches)",
                len(soak["errors"]),
                fmt(median(soak["kernel"])),
                fmt_range(soak["kernel"]),
                ", ".join(f"{m} x{c}" for m, c in methods.items()) or "-",
            ]
        ],
    )
    for e in soak["errors"][:5]:
        t.notes.append(f"failed: {e.splitlines()[0][:300]}")
    t.notes += [
        "the function: pytorch/examples' ddp-tutorial-series multigpu_torchrun.py + datautils.py on CPU (gloo, no "
        ".to(gpu), no snapshot): a Trainer holding DDP, destroy_process_group() at the end of main(), 1 epoch of "
        "2048 samples at batch size 32; before issue 17, 8 of 56 such warm launches hung.",
        "a rank needed the teardown grace when it had not exited teardown_grace_s (10 s) after its value was "
        "written and the launch host ended it (the job still succeeds with its values).",
    ]
    sec.tables.append(t)
    sec.targets.append(
        Target(
            f"teardown soak: no hang in {soak['launches']} warm launches of the DDP tutorial",
            "0 hangs",
            f"{soak['hangs']} hangs, {soak['graced_ranks']} ranks graced, {len(soak['errors'])} errors",
            not soak["hangs"] and not soak["errors"],
        )
    )
    return sec

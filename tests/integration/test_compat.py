"""The serverless GPU API's names, both generations (issue 17): ``remote=``, ``num_accelerators=`` /
``accelerator_type=``, the runtime helpers, and the notebooks written in the API's own style.

Sources (public docs only): ``@distributed(gpus=8, gpu_type='A10', remote=True)`` from
docs.databricks.com/aws/ja/compute/serverless/distributed-training and the English
docs.databricks.com/aws/en/machine-learning/ai-runtime/distributed-training (``from serverless_gpu import
distributed``); ``@distributed()`` (every GPU of the node) and ``num_accelerators`` from
docs.databricks.com/aws/en/machine-learning/ai-runtime/connecting/distributed-training and
``@databricks.air.distributed(num_accelerators=8, accelerator_type="GPU_8xH100")`` from
pypi.org/project/databricks-sdk-air; the ``GPU_<n>x<model>`` values (GPU_1xA10, GPU_1xH100,
GPU_8xH100) from the Databricks SDK's ComputeSpec reference; the runtime helpers from
api-docs.databricks.com/python/serverless_gpu/api/generated/serverless_gpu.runtime.html.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from sgpu_magic import distributed, run_script, runtime
from sgpu_magic.errors import SpecError
from sgpu_magic.front.spec_options import REMOTE_CLUSTER_ENV, remote_cluster
from sgpu_magic.spec import parse_accelerator_type

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def f():
    return 1


@pytest.fixture
def no_remote(ip, monkeypatch):
    """No remote cluster configured: neither the trait nor the environment variable."""
    monkeypatch.delenv(REMOTE_CLUSTER_ENV, raising=False)
    ip.run_line_magic("config", "DistributedMagics.remote_cluster = ''")
    yield
    ip.run_line_magic("config", "DistributedMagics.remote_cluster = ''")


# ----------------------------------------------------------------------------- accelerator_type / num_accelerators


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("GPU_8xH100", (8, "H100")),
        ("GPU_1xA10", (1, "A10")),
        ("gpu_2XA100", (2, "A100")),
        (" GPU_16xH200 ", (16, "H200")),
    ],
)
def test_accelerator_types_are_parsed(text, parsed):
    assert parse_accelerator_type(text) == parsed


@pytest.mark.parametrize(
    "value, tail",
    [
        ("H100", r"got 'H100' \(for a GPU model alone, write gpu_type='H100'\)$"),
        ("GPU_0xH100", r"got 'GPU_0xH100'$"),
        ("GPU_8x", r"got 'GPU_8x'$"),
        ("8xH100", r"got '8xH100' \(write 'GPU_8xH100'\)$"),
        ("GPU_8xH100 extra", r"got 'GPU_8xH100 extra'$"),
        (8, r"got 8$"),
        ("", r"got ''$"),
    ],
    ids=["model-only", "zero", "no-model", "no-prefix", "trailing", "int", "empty"],
)
def test_bad_accelerator_types_are_refused_with_the_form(value, tail):
    with pytest.raises(
        SpecError,
        match=r"^accelerator_type takes the serverless GPU API's form 'GPU_<n>x<model>' with "
        r"n >= 1, such as 'GPU_8xH100' or 'GPU_1xA10'; " + tail,
    ):
        distributed(accelerator_type=value)


def test_the_current_names_mean_gpus_and_gpu_type():
    spec = distributed(num_accelerators=2, accelerator_type="GPU_8xH100")(f).spec
    assert (spec.gpus, spec.gpu_type) == (2, "H100")  # 2 of the node's 8 H100s, as the API's docs use it
    spec = distributed(accelerator_type="GPU_4xA10")(f).spec
    assert (spec.gpus, spec.gpu_type) == (4, "A10")  # no count: every GPU of that node
    assert distributed(num_accelerators=3)(f).spec.gpus == 3
    spec = distributed(gpus=2, num_accelerators=2, gpu_type="h100", accelerator_type="GPU_2xH100")(f).spec
    assert (spec.gpus, spec.gpu_type) == (2, "h100")  # the same thing twice is not a conflict


def test_a_conflicting_pair_is_a_spec_error():
    with pytest.raises(
        SpecError,
        match=r"^gpus=4 and num_accelerators=8 disagree: num_accelerators is the current "
        r"serverless GPU API's name for gpus; give one of them$",
    ):
        distributed(gpus=4, num_accelerators=8)
    with pytest.raises(
        SpecError,
        match=r"^gpu_type='A10' and accelerator_type='GPU_8xH100' name different GPU "
        r"models; give one of them$",
    ):
        distributed(gpu_type="A10", accelerator_type="GPU_8xH100")
    with pytest.raises(SpecError, match=r"^num_accelerators must be between 1 and 1024, got 0$"):
        distributed(num_accelerators=0)
    with pytest.raises(
        SpecError,
        match=r"^num_accelerators must be an int >= 1 \(the number of ranks\), got '2' of "
        r"type str$",
    ):
        distributed(num_accelerators="2")


def test_no_count_is_every_gpu_of_the_machine(monkeypatch):
    """databricks.air's ``@distributed()``: every GPU of the node (here a fake inventory), 1 CPU rank without GPUs."""
    monkeypatch.delenv("SGPU_MAGIC_FAKE_GPUS", raising=False)
    assert distributed()(f).spec.gpus == 1
    monkeypatch.setenv("SGPU_MAGIC_FAKE_GPUS", "4 x H100")
    assert distributed()(f).spec.gpus == 4
    assert distributed(gpu_ids=[1, 3])(f).spec.gpus == 2  # one rank per GPU named


# ----------------------------------------------------------------------------- remote=


def test_remote_false_is_this_machine(no_remote):
    assert distributed(gpus=2, remote=False)(f).spec.cluster is None


def test_remote_true_without_a_configured_cluster_says_how_to_configure_one(settled, ip, no_remote, tmp_path):
    message = (
        r"^remote=True runs the job on this kernel's remote cluster, and none is configured: set %config "
        r"DistributedMagics\.remote_cluster = 'ray://head:10001' \(or SGPU_MAGIC_REMOTE_CLUSTER in the kernel's "
        r"environment\), pass cluster='ray://head:10001', or use remote=False to run on this machine$"
    )
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    with settled():
        with pytest.raises(SpecError, match=message):
            distributed(gpus=2, remote=True)
        with pytest.raises(SpecError, match=message):
            run_script(str(script), gpus=2, remote=True)
        with pytest.raises(UsageError, match=message):
            ip.run_cell_magic("distributed", "--gpus 2 --remote", "x = 1")
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic("distributed_run", f"--gpus 2 --remote {script}")


def test_remote_true_takes_the_configured_cluster_trait_first(ip, no_remote, monkeypatch):
    monkeypatch.setenv(REMOTE_CLUSTER_ENV, "ray://from-env:10001")
    assert remote_cluster() == "ray://from-env:10001"
    assert distributed(gpus=2, remote=True)(f).spec.cluster == "ray://from-env:10001"
    ip.run_line_magic("config", "DistributedMagics.remote_cluster = 'ray://head:10001'")
    spec = distributed(gpus=2, remote=True)(f).spec
    assert spec.cluster == "ray://head:10001"
    assert distributed(gpus=2, remote=True, cluster="ray://head:10001")(f).spec.cluster == "ray://head:10001"
    with pytest.raises(
        SpecError,
        match=r"^remote=True runs on the configured remote cluster 'ray://head:10001' but "
        r"cluster='auto' names another; give one of them$",
    ):
        distributed(gpus=2, remote=True, cluster="auto")
    with pytest.raises(
        SpecError,
        match=r"^a job on a Ray cluster needs its number of ranks: give gpus=N \(or "
        r"num_accelerators=N, or accelerator_type='GPU_<n>x<model>'\)$",
    ):
        distributed(remote=True)
    with pytest.raises(SpecError, match=r"^gpu_ids cannot be used with cluster="):
        distributed(gpus=2, remote=True, gpu_ids=[0, 1])


def test_a_bad_configured_remote_cluster_is_named(ip, no_remote):
    ip.run_line_magic("config", "DistributedMagics.remote_cluster = 'nowhere'")
    with pytest.raises(SpecError, match=r"^cluster='nowhere' is not a Ray address"):
        distributed(gpus=2, remote=True)


# ----------------------------------------------------------------------------- runtime helpers


def test_every_runtime_helper_the_api_lists_is_here_with_its_signature():
    """The serverless GPU runtime reference lists get_global_rank([group]), get_local_rank(), get_local_world_size(),
    get_node_rank(), get_replica_rank(), get_world_size(); outside a job they describe one process."""
    assert (
        runtime.get_global_rank(),
        runtime.get_local_rank(),
        runtime.get_world_size(),
        runtime.get_local_world_size(),
        runtime.get_node_rank(),
        runtime.get_replica_rank(),
    ) == (0, 0, 1, 1, 0, 0)
    for name in (
        "get_global_rank",
        "get_local_rank",
        "get_world_size",
        "get_local_world_size",
        "get_node_rank",
        "get_replica_rank",
    ):
        assert name in runtime.__all__ and getattr(runtime, name).__doc__


def test_runtime_helpers_inside_ranks_with_a_process_group():
    @distributed(gpus=2, mlflow=False, widgets=False)
    def ranks():
        import torch.distributed as dist

        from sgpu_magic import runtime as rt

        dist.init_process_group("gloo")
        sub = dist.new_group([1])
        seen = (
            rt.get_global_rank(),
            rt.get_global_rank(dist.group.WORLD),
            rt.get_local_rank(),
            rt.get_world_size(),
            rt.get_local_world_size(),
            rt.get_node_rank(),
            rt.get_replica_rank(),
            rt.get_global_rank(sub) if dist.get_rank() == 1 else None,
        )
        # without a collective, rank 1 may leave while gloo still connects rank 0's side of the world group
        # ("Connection closed by peer"): a plain torchrun run of this code fails the same way now and then
        dist.barrier()
        dist.destroy_process_group()
        return seen

    assert ranks.distributed() == [(0, 0, 0, 2, 2, 0, 0, None), (1, 1, 1, 2, 2, 0, 0, 0)]


# ----------------------------------------------------------------------------- the notebooks in the API's style

COMPAT_NOTEBOOKS = {
    "serverless_gpu_api.ipynb": {
        "from sgpu_magic import distributed": "from serverless_gpu import distributed",
        "from sgpu_magic.runtime import get_global_rank, get_local_rank, get_world_size": "from serverless_gpu.runtime import get_global_rank, get_local_rank, get_world_size",
    },
    "databricks_air_api.ipynb": {"from sgpu_magic import distributed": "from databricks.air import distributed"},
}


@pytest.mark.parametrize("notebook", sorted(COMPAT_NOTEBOOKS))
def test_the_api_notebooks_differ_from_the_api_only_in_their_import_lines(notebook):
    """The only lines of these notebooks (run by nbval in the suite) that name sgpu_magic are the import lines, each
    right below a ``# was: <the API's import>`` comment; no magic, no sgpu_magic-only helper."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    lines = [line.rstrip("\n") for c in cells if c["cell_type"] == "code" for line in c["source"]]
    ours = {i: line for i, line in enumerate(lines) if "sgpu_magic" in line}
    assert sorted(ours.values()) == sorted(COMPAT_NOTEBOOKS[notebook])
    for i, line in ours.items():
        assert lines[i - 1] == f"# was: {COMPAT_NOTEBOOKS[notebook][line]}"
    code = "\n".join(line for line in lines)
    assert not any(line.lstrip().startswith(("%", "!")) for line in lines)
    ast.parse(code)  # plain Python, as on the API's side

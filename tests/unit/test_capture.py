"""Capture: which globals are sent, warnings for large or unpicklable ones, refused arguments."""

import threading

import pytest
import torch

from sgpu_magic import capture
from sgpu_magic.errors import CaptureError, UnpicklableGlobalError


def test_cell_global_names_sees_nested_reads():
    src = "import os\nx = y + 1\ndef f():\n    return z\nclass C:\n    w = q\nprint(len(x))\n"
    names = capture.cell_global_names(src)
    assert names >= {"y", "z", "q"} and "print" not in names
    assert "x" not in names  # bound by the cell before it reads it: the notebook's x is not needed


def test_code_global_names_ignores_attributes_and_locals():
    data = 1  # noqa: F841 - a local of the caller, not a global of fn

    def fn(a):
        import math

        b = a.data + helper(SCALE)  # noqa: F821 - undefined on purpose: the globals capture looks for
        return [math.pi for _ in range(b)]

    names = capture.code_global_names(fn.__code__)
    assert {"helper", "SCALE", "range"} <= names
    assert "data" not in names and "b" not in names and "a" not in names


def test_modules_by_reference_values_by_value():
    import math

    def helper(x):
        return x

    out = capture.capture_names(
        {"math", "helper", "n", "missing", "len"}, {"math": math, "helper": helper, "n": 3, "len": len}
    )
    assert out.entries["math"] == ("module", "math")
    assert out.entries["helper"][0] == "value" and out.entries["n"][0] == "value"
    assert "missing" not in out.entries and "len" not in out.entries
    assert out.warnings == []


def test_unpicklable_global_warns_and_becomes_a_placeholder():
    out = capture.capture_names({"stats_lock"}, {"stats_lock": threading.Lock()})
    assert out.entries["stats_lock"][0] == "unpicklable"
    (warning,) = out.warnings
    assert "global 'stats_lock' (_thread.lock) cannot be pickled" in warning
    assert "not sent to the ranks" in warning and "Create it inside the cell" in warning
    placeholder = capture.Unpicklable(*out.entries["stats_lock"][1:])
    with pytest.raises(
        UnpicklableGlobalError,
        match=r"global 'stats_lock' \(_thread.lock\) was not sent to the ranks: it cannot be pickled",
    ):
        with placeholder:
            pass
    with pytest.raises(UnpicklableGlobalError, match="stats_lock"):
        placeholder.acquire()
    assert "stats_lock" in repr(placeholder)


def test_large_tensor_warns_before_pickling():
    big = torch.empty(2**28, dtype=torch.uint8)  # 256 MiB, estimated from its shape
    out = capture.capture_names({"big"}, {"big": big}, max_bytes=2**27)
    assert out.warnings and "global 'big' (torch.Tensor, 256.0 MiB) is larger than 128.0 MiB" in out.warnings[0]
    assert "it is pickled and copied to every rank. Load or create it inside the cell" in out.warnings[0]


def test_large_plain_object_warns_from_its_pickle_size():
    out = capture.capture_names({"rows"}, {"rows": list(range(1000))}, max_bytes=100)
    assert "global 'rows' (list," in out.warnings[0]


def test_generator_argument_refused_and_not_consumed():
    gen = (i * i for i in range(10))
    with pytest.raises(
        CaptureError,
        match=r"argument 0 of consume.distributed is a generator, which cannot be sent "
        r"to the ranks .*pass a list .*build the generator inside the function",
    ):
        capture.capture_arguments("consume.distributed", (gen,), {})
    assert next(gen) == 0


def test_keyword_argument_named():
    with pytest.raises(CaptureError, match=r"keyword argument 'lock' of g.distributed is a _thread.lock"):
        capture.capture_arguments("g.distributed", (1,), {"lock": threading.Lock()})


def test_function_from_importable_module_goes_by_reference():
    part = capture.capture_function(capture.format_bytes)
    from sgpu_magic.wire.payload import FunctionRef

    assert part.kind == "ref" and part.body == FunctionRef("sgpu_magic.capture", "format_bytes")


def test_unpicklable_closure_refused():
    lock = threading.Lock()

    def fn():
        return lock

    with pytest.raises(CaptureError, match=r"default arguments or closure cannot be pickled"):
        capture.capture_function(fn)


def test_format_bytes():
    assert capture.format_bytes(512) == "512 B"
    assert capture.format_bytes(3 * 2**20) == "3.0 MiB"
    assert capture.format_bytes(2**30) == "1.0 GiB"


def test_a_large_array_is_warned_about_before_anything_is_pickled():
    """The warning callback runs before the first global is pickled (a 1 GiB array takes seconds to pickle)."""
    import numpy as np

    events = []

    class Witness:
        def __reduce__(self):
            events.append("pickled")
            return (Witness, ())

    big = np.ones(2**20)  # 8 MiB, over a 1 MiB limit
    out = capture.capture_names(
        {"a_witness", "big"},
        {"a_witness": Witness(), "big": big},
        max_bytes=2**20,
        warn=lambda text: events.append(text),
    )
    assert events[0].startswith("global 'big' (numpy.ndarray, 8.0 MiB) is larger than 1.0 MiB")
    assert events[1:] == ["pickled"] and out.warnings == [events[0]]


def test_a_lazy_linecache_entry_is_passed_over(tmp_path):
    # traceback.StackSummary.extract(..., lookup_lines=False) leaves (get_lines,) entries in linecache for the
    # module files it passes; the sources sent to the ranks take only cells whose lines are cached
    import importlib.util
    import linecache

    path = tmp_path / "lazy_mod.py"
    path.write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("lazy_mod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assert linecache.lazycache(str(path), module.__dict__)
        assert capture.source_cache({str(path)}) == {}
    finally:
        linecache.cache.pop(str(path), None)


def test_the_large_global_warning_says_how_many_ranks_get_a_copy():
    """The warning counts the copies: the decorator's payload for gpus=2 says 2 ranks, one rank says 1 rank."""
    import numpy as np

    from sgpu_magic import distributed
    from sgpu_magic.front.decorator import function_payload

    namespace = {"big": np.ones(2**17)}  # 1 MiB, over a 1 KiB limit: a global of the function below
    exec("def uses_big():\n    return big.sum()\n", namespace)
    warned: list[str] = []
    function_payload(distributed(gpus=2, max_capture_bytes=1024)(namespace["uses_big"]), (), {}, warned.append)
    assert warned == [
        "global 'big' (numpy.ndarray, 1.0 MiB) is larger than 1.0 KiB; it is pickled and copied to 2 ranks. "
        "Load or create it inside the cell or function instead."
    ]
    out = capture.capture_names({"big"}, {"big": b"x" * 2048}, max_bytes=1024, ranks=1)
    assert "it is pickled and copied to 1 rank." in out.warnings[0]

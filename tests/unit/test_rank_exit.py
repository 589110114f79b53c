"""The rank's exit path (sgpu_magic.rank.exit) in this process: what it does to the interpreter's own registries."""

import gc
import weakref

import torch.library  # noqa: F401 - the exit path looks for torch.library's finalizers

from sgpu_magic.rank import exit as rank_exit


class _Cycle:
    pass


def test_skipping_torch_library_finalizers_survives_a_collection_that_runs_finalizers():
    """A garbage collection while the finalizer registry is copied ran finalizers that deleted their entries:
    ``RuntimeError: dictionary changed size during iteration`` in ranks that had returned their value
    (MLflow's async logging leaves such cycles behind). Cyclic garbage with finalizers, and a collection on
    nearly every allocation, makes that collection happen during the copy."""
    fired = []
    threshold = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        holder = []
        for i in range(2000):
            c = _Cycle()
            c.me = c
            weakref.finalize(c, fired.append, i)
            holder.append(c)
        del c
        gc.collect(0)  # the cycles move to the middle generation, which a collection reaches every 10th time
        del holder  # now they are garbage only a collection frees
        gc.set_threshold(1)
        gc.enable()
        rank_exit._skip_torch_library_finalizers()
    finally:
        gc.set_threshold(*threshold)
        gc.enable()
        gc.collect()
    assert len(fired) == 2000  # the cycles were collected (after the copy), their finalizers ran once


def test_the_exit_path_reports_a_failing_speed_up_and_still_runs_the_atexit_handlers(monkeypatch, capfd):
    ran = []

    def broken():
        raise RuntimeError("dictionary changed size during iteration")

    import atexit

    monkeypatch.setattr(rank_exit, "_skip_torch_library_finalizers", broken)
    atexit.register(ran.append, "atexit")
    try:
        rank_exit.exit_like_python()
    finally:
        atexit.unregister(ran.append)
    assert ran == ["atexit"]
    assert "RuntimeError: dictionary changed size during iteration" in capfd.readouterr().err

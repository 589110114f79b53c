"""Every record that crosses a process, typed, with its codec: the one place their keys are spelt.

``launch`` holds :class:`LaunchRecord` (``launch.json``); ``state`` the one state vocabulary (:class:`RunState`, the
public :class:`~sgpu_magic.JobState`) and why a run was stopped (:class:`StopReason`), as ``status.json`` holds them;
``errors`` a rank's exception (:class:`RankError`, ``errors/rank_<r>.json``), its ``sys.exit(0)``
(``RankExit``) and a Ray rank's end (``RankOutcome``); ``host`` the commands to the launch
host and the run keeper and the stacks answer; ``session`` a live session's commands, its ranks' replies and
debugger frames, the control line and ``session.json``; ``payload`` what a rank runs (``payload.pkl``); ``attach`` a detached job's attach record (``attach.pkl``); ``mlflow``
the job's MLflow run (``mlflow.json``). The package imports only :mod:`sgpu_magic.errors` and
:mod:`sgpu_magic._util` (an import contract), so the kernel, the launch host, the run keeper, the Ray agents and the
ranks all read it at no cost.
"""

from sgpu_magic.wire.errors import RankError
from sgpu_magic.wire.launch import GPUS_ENV, LAUNCH_SCHEMA, LaunchRecord
from sgpu_magic.wire.state import RunState, StopReason, read_state

__all__ = ["GPUS_ENV", "LAUNCH_SCHEMA", "LaunchRecord", "RankError", "RunState", "StopReason", "read_state"]

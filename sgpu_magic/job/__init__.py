"""The Job handle and the shared start pipeline (layer 3): what a started job is to the layers above."""

from sgpu_magic.job.follow import JobSink
from sgpu_magic.job.handle import Job, jobs
from sgpu_magic.job.state import JobState

__all__ = ["Job", "JobState", "JobSink", "jobs"]

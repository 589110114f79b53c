"""The Job handle and the shared start pipeline (layer 3): what a started job is to the layers above."""

from sgpu_magic.job.handle import Job, JobSink, JobState, jobs

__all__ = ["Job", "JobState", "JobSink", "jobs"]

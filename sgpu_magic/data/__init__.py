"""Data inside ranks (aside from the layers): ``VolumeDataset`` and ``DataLoader`` with a per-machine file cache.

Usage in a rank::

    from sgpu_magic.data import VolumeDataset, DataLoader
"""

from sgpu_magic.data.dataset import DataLoader, VolumeDataset

__all__ = ["VolumeDataset", "DataLoader"]

"""Files/s through VolumeDataset's cache vs reading a plain local directory.

Usage: ``.venv/bin/python -m benchmarks.data_cache [--files 2000] [--kib 64] [--repeats 5]``.
Writes ``--files`` files of ``--kib`` KiB to a temporary directory, serves it over HTTP on
127.0.0.1 (``python -m http.server`` in its own process), and reads every file's bytes in one process:

- first epoch through ``VolumeDataset(http://...)``: every file fetched over HTTP into the cache, one at a
  time (``prefetch_files=1``) and 8 ahead (the default);
- later epochs through the same dataset: served from the cache (no request; checked);
- the same directory read as plain local files (sorted ``os.scandir`` + ``open().read()``);
- ``VolumeDataset(<local dir>)`` second epoch (the cache over a local volume).

Prints files/s (median of ``--repeats`` epochs) and the ratio cache / plain. Not a test.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _read_all(paths) -> int:
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            total += len(f.read())
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _file_gets(log: Path) -> int:
    return sum('"GET /f' in line for line in log.read_text().splitlines())


def _plain(directory: Path):
    return sorted(e.path for e in os.scandir(directory) if e.is_file())


def _rate(fn, n_files: int, repeats: int) -> tuple[float, list[float]]:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(n_files / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sgpu_bench_data_"))
    volume = work / "volume"
    volume.mkdir()
    payload = os.urandom(args.kib * 1024)
    for i in range(args.files):
        (volume / f"f{i:06d}.bin").write_bytes(payload)

    port = _free_port()
    log = open(work / "http.log", "w")  # noqa: SIM115 - the server writes to it until it is stopped
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(volume)],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}/"
    _wait_listening(port)
    from sgpu_magic.data import VolumeDataset

    one_at_a_time = VolumeDataset(url, cache_dir=work / "cache1", prefetch_files=1)
    http_ds = VolumeDataset(url, cache_dir=work / "cache")
    local_ds = VolumeDataset(volume, cache_dir=work / "cache")
    first_1, _ = _rate(lambda: _read_all(one_at_a_time), args.files, 1)
    first, _ = _rate(lambda: _read_all(http_ds), args.files, 1)
    fetched = _file_gets(work / "http.log")
    list(local_ds)  # fill its cache
    rows = [
        ("VolumeDataset(http), first epoch, prefetch_files=1", first_1),
        ("VolumeDataset(http), first epoch, prefetch_files=8", first),
    ]
    cached, _ = _rate(lambda: _read_all(http_ds), args.files, args.repeats)
    plain, _ = _rate(lambda: _read_all(_plain(volume)), args.files, args.repeats)
    cached_local, _ = _rate(lambda: _read_all(local_ds), args.files, args.repeats)
    after = _file_gets(work / "http.log")
    rows += [
        ("VolumeDataset(http), later epochs (cache)", cached),
        ("plain local directory read", plain),
        ("VolumeDataset(local dir), later epochs (cache)", cached_local),
    ]
    server.terminate()
    server.wait()
    print(f"{args.files} files x {args.kib} KiB, one process, median of {args.repeats} epochs")
    for name, rate in rows:
        print(f"  {name:<48} {rate:10.0f} files/s  ({rate * args.kib / 1024:7.1f} MiB/s)")
    print(f"  cache / plain local: {cached / plain:.2f}x (http volume), {cached_local / plain:.2f}x (local volume)")
    print(f"  HTTP file requests: {fetched} in the two first epochs (2 caches), {after - fetched} after them")


if __name__ == "__main__":
    main()

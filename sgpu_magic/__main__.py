"""``python -m sgpu_magic doctor [--json] [--port P] [--cluster ADDRESS]``: check this machine for sgpu_magic jobs.

Prints the doctor's table (see :mod:`sgpu_magic.front.doctor`) and exits 1 when a row is an error, 0 otherwise
(2 for bad options, as argparse does). ``--json`` prints it for machines instead.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sgpu_magic", description="sgpu_magic's command line.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="check what a job will use here and what is wrong (exit 1 when a check is an error)",
        description="Check what a job will use on this machine — Python, torch, GPUs and their holders, GPU leases, "
        "ports, the MLflow tracking URI, widgets and Jupyter, Ray, DeepSpeed — and what is wrong, "
        "each with the remedy. Exits 1 when a check is an error.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--port", type=int, default=None, help="also check that this pinned MASTER_PORT is free")
    doctor.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="check this Ray cluster (default: $SGPU_MAGIC_REMOTE_CLUSTER, if set)",
    )
    doctor.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the MLflow server and a Ray cluster get to answer (default 2)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    from sgpu_magic.front.doctor import NETWORK_TIMEOUT_S, DoctorConfig, diagnose

    timeout_s = NETWORK_TIMEOUT_S if args.timeout_s is None else args.timeout_s
    report = diagnose(DoctorConfig(port=args.port, cluster=args.cluster, timeout_s=timeout_s))
    print(report.to_json() if args.json else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

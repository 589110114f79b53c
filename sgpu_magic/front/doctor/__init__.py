"""``python -m sgpu_magic doctor`` and ``%distributed_doctor``: what a job will use here, and what is wrong.

One table, one row per thing a job depends on — Python, torch (its CUDA and NCCL), the GPUs NVML
sees and who holds them (the lease registry of :mod:`sgpu_magic.launch.leases` and NVML's compute
processes), the lease directory, rendezvous ports, sgpu_magic's home, the kernel's launch host and
its warm forkserver, the MLflow tracking URI and whether it answers, ipywidgets and its frontend
extensions, Jupyter, Ray when a cluster is configured, DeepSpeed's JIT ops — each ``ok``,
``warning`` or ``error``, with the remedy. Nothing is started, leased or created, and network
checks give up after ``timeout_s``. Heavy modules (torch, mlflow) are imported only when the checks
run, never when this module is imported.

Example::

    report = diagnose()                    # the same checks as the command line
    [row.name for row in report.errors]    # e.g. ['mlflow'] when the tracking server does not answer
    print(report.to_json())                # what ``python -m sgpu_magic doctor --json`` prints
"""

from __future__ import annotations

import html
import json
import logging
import textwrap
from dataclasses import dataclass, field

from sgpu_magic.front.doctor._rows import NETWORK_TIMEOUT_S, Check, DoctorConfig, Status, warning

__all__ = ["Status", "Check", "Report", "DoctorConfig", "diagnose", "NETWORK_TIMEOUT_S"]

_log = logging.getLogger(__name__)


@dataclass
class Report:
    """The doctor's table: ``rows`` in the order checked. Shown as an HTML table in Jupyter
    (``_repr_html_``) and as aligned text elsewhere (``str``); :meth:`to_json` for machines."""

    rows: list[Check] = field(default_factory=list)

    @property
    def errors(self) -> list[Check]:
        return [row for row in self.rows if row.status is Status.ERROR]

    @property
    def warnings(self) -> list[Check]:
        return [row for row in self.rows if row.status is Status.WARNING]

    @property
    def ok(self) -> bool:
        """No row is an error."""
        return not self.errors

    def summary(self) -> str:
        """``sgpu_magic doctor: 1 error, 2 warnings`` / ``sgpu_magic doctor: all 17 checks ok``."""
        if not self.errors and not self.warnings:
            return f"sgpu_magic doctor: all {len(self.rows)} checks ok"
        parts = [
            f"{len(rows)} {word}{'s' if len(rows) != 1 else ''}"
            for rows, word in ((self.errors, "error"), (self.warnings, "warning"))
            if rows
        ]
        return f"sgpu_magic doctor: {', '.join(parts)} (of {len(self.rows)} checks)"

    def to_json(self) -> str:
        """``{"ok": bool, "errors": n, "warnings": n, "checks": [{"name", "status", "details", "remedy"}]}``."""
        return json.dumps(
            {
                "ok": self.ok,
                "errors": len(self.errors),
                "warnings": len(self.warnings),
                "checks": [
                    {"name": r.name, "status": r.status.value, "details": r.details, "remedy": r.remedy}
                    for r in self.rows
                ],
            },
            indent=1,
        )

    def __str__(self) -> str:
        name_w = max([len("check"), *(len(r.name) for r in self.rows)])
        status_w = len("warning")
        indent = " " * (name_w + status_w + 4)
        lines = [self.summary(), f"{'check'.ljust(name_w)}  {'status'.ljust(status_w)}  details"]
        for row in self.rows:
            text = textwrap.wrap(row.details, 100, break_long_words=False, break_on_hyphens=False) or [""]
            lines.append(f"{row.name.ljust(name_w)}  {row.status.value.ljust(status_w)}  {text[0]}")
            lines += [indent + more for more in text[1:]]
            if row.remedy:
                lines += [
                    indent + part
                    for part in textwrap.wrap(
                        "remedy: " + row.remedy, 100, break_long_words=False, break_on_hyphens=False
                    )
                ]
        return "\n".join(lines)

    __repr__ = __str__

    _COLOURS = {Status.OK: "#1a7f37", Status.WARNING: "#9a6700", Status.ERROR: "#cf222e"}

    def _repr_html_(self) -> str:
        body = []
        for row in self.rows:
            colour = self._COLOURS[row.status]
            remedy = f"<br><i>remedy: {html.escape(row.remedy)}</i>" if row.remedy else ""
            body.append(
                f'<tr><td>{html.escape(row.name)}</td><td style="color:{colour};font-weight:bold">'
                f'{row.status.value}</td><td style="text-align:left">{html.escape(row.details)}{remedy}'
                f"</td></tr>"
            )
        return (
            f'<b>{html.escape(self.summary())}</b><table class="sgpu-doctor"><thead><tr><th>check</th>'
            f"<th>status</th><th>details</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
        )


def diagnose(config: DoctorConfig | None = None) -> Report:
    """Run every check and return the report; nothing is started, leased or created.

    Args:
        config: what to check against; default ``DoctorConfig()`` (the environment's settings).
    Returns:
        Report: one :class:`Check` per row; ``report.ok`` is False when a row is an error.
    """
    from sgpu_magic.front.doctor import _machine, _services, _system

    config = config or DoctorConfig()
    facts = _machine.Facts.gather(config)
    report = Report()
    for section in (
        _machine.python_rows,
        _machine.torch_rows,
        _machine.gpu_rows,
        _machine.lease_rows,
        _system.port_rows,
        _system.home_rows,
        _system.host_rows,
        _services.mlflow_rows,
        _services.frontend_rows,
        _services.ray_rows,
        _services.deepspeed_rows,
    ):
        try:
            report.rows += section(config, facts)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            _log.warning("sgpu_magic doctor: %s failed", section.__name__, exc_info=True)
            name = section.__name__.removesuffix("_rows")
            report.rows.append(
                warning(
                    name,
                    f"could not be checked ({type(exc).__name__}: {exc})",
                    "report it as a bug of sgpu_magic's doctor, with this line",
                )
            )
    return report

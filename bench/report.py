"""The bench's tables: flat-out calls/s, latency and CPU per scenario, and latency at fixed rates.

Each target of issue 7 is judged beside the row it is about (`met` or `missed`), and again in one
line under its table, so a log can be searched for `target missed`. A row run several times
(`--repeat`) shows its median run, judged, and what each run measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from bench import load
from bench.scenarios import BASELINE, Paced, Scenario

R = TypeVar("R", bound="Repeated")

#: A fixed-rate row counts as run at its rate when h2load achieved at least this share of it.
ACHIEVED_SHARE = 0.95


@dataclass
class Result:
    """One measured row: a scenario flat out, or at the offered rate of `paced`."""

    scenario: Scenario
    paced: Paced | None = None
    load: load.LoadResult | None = None
    server_us_per_call: float = 0.0
    #: CPU µs per call of the backing services, by report column (a cluster's nodes summed).
    service_us_per_call: dict[str, float] = field(default_factory=dict)
    response: str = ""
    error: str | None = None
    #: With `--repeat`: what each run of the row measured (server µs/call flat out, p99 ms at a
    #: fixed rate), sorted. This Result is the median run (see `median_run`).
    runs: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        return self.paced.label if self.paced else self.scenario.name


class Repeated(Protocol):
    """A row that can be run several times: it keeps what each run measured."""

    runs: tuple[float, ...]


def median_run(runs: Sequence[R], key: Callable[[R], float], failed: Callable[[R], bool]) -> R:
    """The run of a repeated row whose `key` is the median, with every run's `key`, sorted, in
    its `runs`. Of an even count, the upper middle one: every key here (CPU, latency) is better
    low, so a tie goes against the target. A failed run makes the row failed."""
    failed_run = next((r for r in runs if failed(r)), None)
    if failed_run is not None:
        return failed_run
    ordered = sorted(runs, key=key)
    chosen = ordered[len(ordered) // 2]
    chosen.runs = tuple(key(r) for r in ordered)
    return chosen


def failed(result: Result) -> bool:
    return result.load is None


def server_us(result: Result) -> float:
    return result.server_us_per_call


def p99_ms(result: Result) -> float:
    assert result.load is not None
    return result.load.p99_ms


def _runs_cell(result: Result, digits: int) -> str:
    return " ".join(f"{value:.{digits}f}" for value in result.runs)


def throughput(results: Sequence[Result]) -> str:
    """The flat-out table: calls/s, share of the no-op servicer, p50/p99, CPU per call, targets."""
    baseline = next((r for r in results if r.scenario.name == BASELINE and r.load), None)
    columns = _service_columns(results)
    repeated = any(len(r.runs) > 1 for r in results)
    header = ["scenario", "calls/s", f"vs {BASELINE}", "p50 ms", "p99 ms", "server µs/call"]
    header += ["each run"] if repeated else []
    header += [f"{name} µs/call" for name in columns] + ["target"]
    rows = [header]
    for r in results:
        if r.load is None:
            rows.append([r.label, "FAILED"] + [""] * (len(header) - 2))
            continue
        rows.append(
            [
                r.label,
                f"{r.load.calls_per_second:,.0f}",
                f"{_ratio(r, baseline):.1%}" if baseline else "-",
                f"{r.load.p50_ms:.2f}",
                f"{r.load.p99_ms:.2f}",
                f"{r.server_us_per_call:.0f}",
                *([_runs_cell(r, 0)] if repeated else []),
                *_service_cells(r, columns),
                "; ".join(verdict.cell for verdict in _throughput_verdicts(r, baseline)),
            ]
        )
    lines = ["", table(rows), ""]
    lines += [verdict.line for r in results for verdict in _throughput_verdicts(r, baseline)]
    lines += [f"{r.label} FAILED: {r.error}" for r in results if r.error]
    return "\n".join(lines)


def fixed_rate(results: Sequence[Result], clients: int) -> str:
    """The fixed-rate table: offered and achieved calls/s, p50/p99, CPU per call, the p99 target."""
    columns = _service_columns(results)
    repeated = any(len(r.runs) > 1 for r in results)
    header = ["scenario", "offered/s", "achieved/s", "p50 ms", "p99 ms"]
    header += ["each run's p99"] if repeated else []
    header += ["server µs/call"] + [f"{name} µs/call" for name in columns] + ["target"]
    rows = [header]
    verdicts = [_p99_verdict(r, _floor(r, results)) for r in results]
    for r, verdict in zip(results, verdicts, strict=True):
        assert r.paced is not None
        offered = f"{r.paced.calls_per_second:,}"
        if r.load is None:
            rows.append([r.scenario.name, offered, "FAILED"] + [""] * (len(header) - 3))
            continue
        rows.append(
            [
                r.scenario.name,
                offered,
                f"{r.load.calls_per_second:,.0f}",
                f"{r.load.p50_ms:.2f}",
                f"{r.load.p99_ms:.2f}",
                *([_runs_cell(r, 2)] if repeated else []),
                f"{r.server_us_per_call:.0f}",
                *_service_cells(r, columns),
                verdict.cell if verdict else "",
            ]
        )
    lines = [
        "",
        f"fixed rate: h2load --rps (offered/s split over {clients} connections), "
        "latency from each request's send to its answer",
        table(rows),
        "",
    ]
    lines += [verdict.line for verdict in verdicts if verdict]
    lines += [f"{r.label} FAILED: {r.error}" for r in results if r.error]
    return "\n".join(lines)


def table(rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned numbers, the last column left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:-1], strict=True)]
        cells.append(row[-1])
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class _Verdict:
    subject: str
    goal: str
    met: bool | None  # None: could not be judged
    measured: str

    @property
    def line(self) -> str:
        state = {True: "target met", False: "target missed", None: "target not judged"}[self.met]
        return f"{state} ({self.subject} {self.goal}): {self.measured}"

    @property
    def cell(self) -> str:
        state = {True: "met", False: "missed", None: "not judged"}[self.met]
        return f"{state} ({self.goal})"


def _throughput_verdicts(result: Result, baseline: Result | None) -> list[_Verdict]:
    scenario, verdicts = result.scenario, []
    if scenario.target_ratio is not None:
        goal = f">= {scenario.target_ratio:.0%} of {BASELINE} calls/s"
        if result.load is None:
            verdicts.append(_Verdict(scenario.name, goal, False, "failed"))
        elif baseline is None:
            verdicts.append(_Verdict(scenario.name, goal, None, f"no {BASELINE} run"))
        else:
            ratio = _ratio(result, baseline)
            met = ratio >= scenario.target_ratio
            verdicts.append(_Verdict(scenario.name, goal, met, f"{ratio:.1%}"))
    if scenario.target_cpu_us is not None:
        goal = f"<= {scenario.target_cpu_us:g} server µs/call"
        if result.load is None:
            verdicts.append(_Verdict(scenario.name, goal, False, "failed"))
        else:
            us = result.server_us_per_call
            verdicts.append(
                _Verdict(scenario.name, goal, us <= scenario.target_cpu_us, f"{us:.0f}")
            )
    return verdicts


def _floor(result: Result, results: Sequence[Result]) -> Result | None:
    """The no-op server's row at the same rate: whether the machine could offer that rate."""
    assert result.paced is not None
    rate = result.paced.calls_per_second
    return next(
        (
            r
            for r in results
            if r.paced and r.paced.calls_per_second == rate and r.scenario.name.startswith("noop")
        ),
        None,
    )


def _p99_verdict(result: Result, floor: Result | None) -> _Verdict | None:
    """p99 within the target, at (nearly) the offered rate: a slower run did not meet it,
    unless the no-op server fell short too, and then the machine could not offer the rate."""
    paced = result.paced
    if paced is None or paced.target_p99_ms is None:
        return None
    goal = f"p99 <= {paced.target_p99_ms:g} ms at {paced.calls_per_second:,} calls/s"
    if result.load is None:
        return _Verdict(paced.scenario.name, goal, False, "failed")
    p99, achieved = result.load.p99_ms, result.load.calls_per_second
    measured = f"p99 {p99:.2f} ms at {achieved:,.0f} calls/s"
    if achieved < ACHIEVED_SHARE * paced.calls_per_second:
        measured += f", under {ACHIEVED_SHARE:.0%} of the offered rate"
        if (
            floor
            and floor.load
            and floor.load.calls_per_second < ACHIEVED_SHARE * paced.calls_per_second
        ):
            measured += (
                f"; {floor.scenario.name} achieved only {floor.load.calls_per_second:,.0f} "
                "calls/s too, so this machine could not offer the rate"
            )
            return _Verdict(paced.scenario.name, goal, None, measured)
        return _Verdict(paced.scenario.name, goal, False, measured)
    return _Verdict(paced.scenario.name, goal, p99 <= paced.target_p99_ms, measured)


def _service_columns(results: Sequence[Result]) -> list[str]:
    return sorted({name for r in results for name in r.service_us_per_call})


def _service_cells(result: Result, columns: list[str]) -> list[str]:
    return [
        f"{result.service_us_per_call[name]:.0f}" if name in result.service_us_per_call else "-"
        for name in columns
    ]


def _ratio(result: Result, baseline: Result) -> float:
    assert result.load is not None and baseline.load is not None
    return result.load.calls_per_second / baseline.load.calls_per_second

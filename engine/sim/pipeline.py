"""Pipeline parallelism as a schedule: micro-batches flowing through stages, simulated.

A step's batch is split into m micro-batches; stage s runs micro-batch j for `times[j][s]`
seconds (its layers, step_model prices them), then sends it on to stage s + 1 over the boundary's
link for `transfers[j][s]` seconds. Each stage runs its micro-batches in order, one at a time;
each boundary's link carries one send at a time; a send leaves the stage free at once (vLLM's
and SGLang's asynchronous point-to-point sends), and a micro-batch starts on a stage when the
stage is free and its activations have arrived:

    start[j][s] = max(end[j - 1][s], arrive[j][s])
    arrive[j][s] = max(end[j][s - 1], link free) + transfers[j][s - 1]   (arrive[j][0] = 0)

`flush` is one step as a synchronous engine runs it (GPipe's forward: the pipeline fills, runs
and drains within the step); its bubble is the stages' idle share of stage time over the step,
1 - sum(times) / (p * makespan), which for equal stage times t and no transfers is exactly
(p - 1) / (m + p - 1) (makespan (m + p - 1) t). Unequal stages or transfers only lengthen the
makespan for the same work: the bubble grows.

`steady` is the same micro-batches kept in flight across steps (each re-enters stage 0 when its
previous pass has left the last stage and its sampled tokens are back: vLLM's and SGLang's PP
schedulers keep pp batches in flight): the period of a step once the pipeline never drains,
at least the slowest stage's m micro-batches and at least one micro-batch's round trip.

Plain Python arithmetic: exact with Fractions (what the bubble test checks), cheap at the sizes
a pipeline has (m x p cells).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineRun:
    makespan: float  # seconds from the first micro-batch's start on stage 0 to the last one's end on the last stage
    busy: float  # the stages' compute, summed over stages and micro-batches
    stages: int
    start: list[list[float]]  # [micro-batch][stage]
    end: list[list[float]]
    send_start: list[list[float]]  # [micro-batch][boundary]: when its send began
    send_end: list[list[float]]

    @property
    def bubble(self) -> float:
        """The stages' idle share: 1 - busy / (stages x makespan)."""
        whole = self.stages * self.makespan
        return (whole - self.busy) / whole if whole else 0.0


def _per_micro_batch(transfers, m: int, p: int) -> list[list[float]]:
    """`transfers` as [micro-batch][boundary]: given so, one value per boundary for all, or none
    (free)."""
    if p == 1:
        return [[] for _ in range(m)]
    if not len(transfers):  # none given: free
        return [[0] * (p - 1) for _ in range(m)]
    if len(transfers) == m and all(isinstance(row, (list, tuple)) for row in transfers):
        return [list(row) for row in transfers]
    if len(transfers) != p - 1:
        raise ValueError(f"transfers: expected {p - 1} boundaries (or [micro-batch][boundary]), got {len(transfers)}")
    return [list(transfers) for _ in range(m)]


def flush(times, transfers=()) -> PipelineRun:
    """One step of m micro-batches over p stages, filled and drained (the module's docstring).
    times: [m][p] seconds; transfers: [p - 1] per boundary, or [m][p - 1]."""
    m = len(times)
    p = len(times[0]) if m else 0
    if not m or not p or any(len(row) != p for row in times):
        raise ValueError("times: a [micro-batch][stage] table with at least one of each")
    sends = _per_micro_batch(transfers, m, p)
    stage_free = [0] * p
    link_free = [0] * (p - 1)
    start = [[0] * p for _ in range(m)]
    end = [[0] * p for _ in range(m)]
    send_start = [[0] * (p - 1) for _ in range(m)]
    send_end = [[0] * (p - 1) for _ in range(m)]
    for j in range(m):
        ready = 0
        for s in range(p):
            start[j][s] = max(ready, stage_free[s])
            end[j][s] = stage_free[s] = start[j][s] + times[j][s]
            if s < p - 1:
                send_start[j][s] = max(end[j][s], link_free[s])
                send_end[j][s] = link_free[s] = ready = send_start[j][s] + sends[j][s]
    busy = sum(sum(row) for row in times)
    return PipelineRun(stage_free[-1], busy, p, start, end, send_start, send_end)


def steady(times, transfers=(), back: float = 0.0, rounds: int | None = None) -> float:
    """The period of a step when the m micro-batches stay in flight across steps: micro-batch j's
    next pass starts on stage 0 once its last pass ended on the last stage and `back` (its sampled
    tokens returned to the first stage) has passed. The mean period of the later half of
    `rounds` passes (default 2 (m + p) + 8: past the fill, which a max-plus schedule leaves within
    m + p passes)."""
    m, p = len(times), len(times[0])
    sends = _per_micro_batch(transfers, m, p)
    rounds = 2 * (m + p) + 8 if rounds is None else rounds
    stage_free = [0] * p
    link_free = [0] * (p - 1)
    done = [0] * m  # when micro-batch j's last pass left the last stage
    marks = []
    for r in range(rounds):
        for j in range(m):
            ready = done[j] + back if r else 0
            for s in range(p):
                begin = max(ready, stage_free[s])
                stage_free[s] = begin + times[j][s]
                if s < p - 1:
                    link_free[s] = ready = max(stage_free[s], link_free[s]) + sends[j][s]
            done[j] = stage_free[-1]
        marks.append(stage_free[-1])
    half = rounds // 2
    return (marks[-1] - marks[half - 1]) / (rounds - half)


def uniform_bubble(stages: int, micro_batches: int) -> float:
    """(p - 1) / (m + p - 1): the bubble of equal stages without transfers."""
    return (stages - 1) / (micro_batches + stages - 1)

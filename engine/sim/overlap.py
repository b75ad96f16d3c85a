"""Overlap as a schedule: the deployments' two micro-batches laid out kernel chunk by kernel chunk
on a compute stream and a communication stream, and multi-token prediction's accepted tokens.
Simulated; the inputs are step_model's per-part seconds of one micro-batch (half the batch).

Each micro-batch's layer is chunks of compute (attention before the core: projections and the
small ops; the core, the output projection and the gate; the shared experts; the routed experts)
and two all-to-alls (dispatch after the gate, combine after the experts). The compute stream runs
its chunks in the deployment's order, one at a time; the communication stream its all-to-alls in
order, one at a time; a chunk that needs an all-to-all's result waits for it (plus a
synchronisation), an all-to-all starts when the chunk that issues it is done and its stream is
free. Orders, per layer and micro-batch pair (A, B):

* two-batch (SGLang's two-batch overlap; DeepSeek's 2-micro-batch prefill):
  compute  attn+shared(A) attn+shared(B) experts(A) experts(B)
  comm     dispatch(A) after attn(A), dispatch(B) after attn(B), combine(A) after experts(A), ...
* five-stage (DeepSeek's decode, Day 6's figure: attention split in two, 5 stages a micro-batch):
  compute  shared(A) attn0(B) experts(A) attn1(B) shared(B) attn0(A) experts(B) attn1(A)
  comm     dispatch(A) combine(A) dispatch(B) combine(B)
  (A's shared experts and experts there are its previous layer's: the cycle lags one layer for A)
What this prices that max(compute, comm) does not: each half's GEMMs run at half the rows (a lower
efficiency on the GEMM curve), every kernel's floor is paid by both halves, a chunk with nothing
to hide behind waits, a normal-mode all-to-all's SMs are taken from compute for the overlapped step
(`share` of the card is left to it), a low-latency one holds SMs while it sends and receives (`held`
of its time).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    micro_batch: int
    part: str  # attn0, attn1, shared, experts, pre (attn0 + attn1 + shared)
    waits: str | None = None  # the all-to-all whose result it needs: "dispatch" or "combine" (the previous layer's)
    issues: str | None = None  # the all-to-all it starts when done
    lag: int = 0  # 1: the work of the micro-batch's previous layer (its experts run in the next cycle)


ORDERS = {
    "two-batch": (Chunk(0, "pre", "combine", "dispatch"), Chunk(1, "pre", "combine", "dispatch"),
                  Chunk(0, "experts", "dispatch", "combine"), Chunk(1, "experts", "dispatch", "combine")),
    "five-stage": (Chunk(0, "shared", lag=1), Chunk(1, "attn0", "combine"),
                   Chunk(0, "experts", "dispatch", "combine", lag=1), Chunk(1, "attn1", None, "dispatch"),
                   Chunk(1, "shared"), Chunk(0, "attn0", "combine"), Chunk(1, "experts", "dispatch", "combine"),
                   Chunk(0, "attn1", None, "dispatch")),
}


def micro_batch_schedule(half, overlap: str, share: float, sync_s: float, held: float = 0.0) -> list[float]:
    """Seconds per MoE layer of the step with two micro-batches of `half` (step_model.LayerTimes
    of one half), laid out on the two streams in `overlap`'s order (the module's docstring): each
    layer's share is the time its cycle moved the compute stream on; the drain (a lagging
    micro-batch's last experts, the last combines) is added to the last layer. `share`: of the SMs,
    what compute is given for the step (a normal-mode all-to-all holds the rest); `held`: of a low-latency
    all-to-all's time, its kernels hold SMs (sending, receiving) and compute waits for them;
    `sync_s`: each wait for an all-to-all's result.

    The SMs are partitioned for the whole overlapped step, as DeepSeek's prefill figure draws it
    ("Computation 108 SMs", "Communication 24 SMs"): the compute kernels are launched on their
    share whether or not an all-to-all runs at that moment."""
    projections = float((half.attention - half.attention_core).max())
    parts = {
        "attn0": projections / 2 + float(half.small_moe.max()),
        "attn1": float(half.attention_core.max()) + projections / 2 + float(half.router.max()),
        "shared": float(half.shared.max()),
    }
    parts["pre"] = parts["attn0"] + parts["attn1"] + parts["shared"]
    order, layers = ORDERS[overlap], len(half.expert)
    if not layers:
        return []
    compute_free = comm_free = 0.0
    done = {}  # (micro-batch, all-to-all) -> when its latest one finished
    out = []
    for cycle in range(layers + 1):  # one more: the lagging micro-batch's last layer
        start = compute_free
        for chunk in order:
            layer = cycle - chunk.lag
            if not 0 <= layer < layers:
                continue
            ready = compute_free
            if chunk.waits is not None and (chunk.micro_batch, chunk.waits) in done:
                ready = max(ready, done[chunk.micro_batch, chunk.waits] + sync_s)
            work = half.expert[layer] if chunk.part == "experts" else parts[chunk.part]
            compute_free = ready + work / share
            if chunk.issues is not None:
                took = half.dispatch[layer] if chunk.issues == "dispatch" else half.combine[layer]
                begin = max(compute_free, comm_free)
                comm_free = done[chunk.micro_batch, chunk.issues] = begin + took
                compute_free += held * took  # its send and receive hold SMs the compute stream waits for
        out.append(compute_free - start)
    drain = out.pop() + max(0.0, comm_free - compute_free)  # the lagging experts, the last combines
    out[-1] += drain
    return out


def mtp_tokens_per_step(draft: int, accept: float) -> float:
    """A sequence's tokens per decode step with `draft` MTP tokens, each accepted with probability
    `accept` given the ones before it were: 1 + accept + accept^2 + ..."""
    return 1.0 + sum(accept ** k for k in range(1, draft + 1))

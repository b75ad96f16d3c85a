"""Expert prefetch: predict the experts a layer will need before it runs, and record what it did.

Predictors see what the model's probe sees (`on_hidden(i, x)`: x enters decoder layer i, i=0 the
embeddings; `on_routing(layer, counts, ids)`: the layer's real top-k choice) and return
predictions {layer: [experts, most confident first]} for layers that have not routed yet.

* RouterPredictor(lookahead=0) -- the "next-layer router" predictor. The real input of layer j's
  router is post_norm(x + attention(x)), which exists only once layer j's attention has run. It
  uses instead the hidden state entering layer j (the output of layer j-1), passed through layer
  j's post-attention norm and router: approximate (it misses layer j's attention update to the
  residual stream) but cheap, and available as soon as layer j-1 is done, so the previous
  layer's working set is already released when its copies are issued; they overlap layer j's
  attention. Per token the top (k + extra) experts, united over the batch, ranked by summed
  router probability. It predicts the first layer too (from the embeddings).
* RouterPredictor(lookahead=1) -- the same on the hidden state entering layer j-1 (before layer
  j-1 runs): more lead time (the copies overlap all of layer j-1), less accuracy. No prediction
  for the first MoE layer.
* CoactivationPredictor -- P(expert b at layer j | expert a at the previous MoE layer), counted
  online per token from the real routing; predicted when layer j-1 has routed (the copies
  overlap layer j-1's experts and layer j's attention): per token the top (k + extra) experts
  of the mean over its k choices of P(b | a). The first MoE layer of a step is predicted from
  the previous step's first layer (temporal locality of decode batches).

RoutingRecorder is a RoutingProbe (so the engine's per-step routing counts keep working) that
records, per forward step and MoE layer, each device's working set under a Placement and every
predictor's prediction for that layer, so LRU, LRU + prefetch and Belady can be compared offline
on exactly the same access sequence (`RoutingRecorder.compare`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from moectl.engine.core.model_runner import RoutingProbe
from moectl.engine.experts.expert_cache import belady, simulate
from moectl.engine.experts.replica_routing import RoutingState, assign_replicas, prepare
from moectl.engine.models.moe import MoEBlock
from moectl.placement.placement import Placement


def _moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)]


def _rank(score: torch.Tensor) -> list[int]:
    """Experts with a positive score, highest first."""
    score = score.float().cpu()
    order = torch.argsort(score, descending=True, stable=True)
    return [int(e) for e in order.tolist() if score[e] > 0]


class Predictor:
    """Base class: no predictions. `release_before_prefetch` says whether the previous layer's
    working set is done by the time this predictor's guesses for a layer are issued."""

    name = "none"
    release_before_prefetch = False
    lead = ""  # what the copies it issues can overlap


    def start_step(self) -> None:
        pass

    def on_hidden(self, index: int, x: torch.Tensor) -> dict[int, list[int]]:
        return {}

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> dict[int, list[int]]:
        return {}


class RouterPredictor(Predictor):
    def __init__(self, model, extra: int = 0, lookahead: int = 0, name: str | None = None):
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead: 0 or 1 layers, got {lookahead!r}")
        if extra < 0:
            raise ValueError(f"extra: must be >= 0, got {extra!r}")
        self.model = model
        self.extra = extra
        self.lookahead = lookahead
        self.moe = set(_moe_layers(model))
        self.name = name or ("router" if lookahead == 0 else "router_early") + (f"+{extra}" if extra else "")
        self.release_before_prefetch = lookahead == 0
        self.lead = ("the layer's attention" if lookahead == 0
                     else "the previous layer's attention and experts, and the layer's attention")

    def predict(self, layer: int, x: torch.Tensor) -> list[int]:
        """Layer `layer`'s router on its post-attention norm of x: top (k + extra) per token,
        united over the tokens, ranked by summed probability."""
        block = self.model.layers[layer]
        mlp = block.mlp
        with torch.no_grad():
            # _compute: in the weights' dtype (x is fp32 when mixed precision keeps the residual so)
            preference, weight = mlp.selection_scores(block._compute(block.post_norm(x)))
            top, ids = torch.topk(preference, min(mlp.top_k + self.extra, mlp.num_experts), dim=-1)
            eligible = torch.isfinite(top)  # not in one of DeepSeek's masked groups
            score = torch.zeros(mlp.num_experts, dtype=torch.float32, device=ids.device)
            score.index_add_(0, ids[eligible], weight.gather(1, ids)[eligible])
        return _rank(score)

    def on_hidden(self, index: int, x: torch.Tensor) -> dict[int, list[int]]:
        target = index + self.lookahead
        if target in self.moe and x.shape[0]:
            return {target: self.predict(target, x)}
        return {}


class CoactivationPredictor(Predictor):
    def __init__(self, model, extra: int = 0, name: str | None = None):
        if extra < 0:
            raise ValueError(f"extra: must be >= 0, got {extra!r}")
        cfg = model.cfg
        self.moe = _moe_layers(model)
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.extra = extra
        self.name = name or "coact" + (f"+{extra}" if extra else "")
        self.lead = "the previous layer's experts and the layer's attention"
        self.next_of = dict(zip(self.moe, self.moe[1:]))
        self.prev_of = {b: a for a, b in self.next_of.items()}
        # transitions into layer j: [E, E] counts of (expert at prev layer, expert at j) per token
        self.table = {j: torch.zeros(cfg.num_experts, cfg.num_experts, dtype=torch.float64) for j in self.moe[1:]}
        self._ids: dict[int, torch.Tensor] = {}
        self._first_counts: torch.Tensor | None = None

    def start_step(self) -> None:
        self._ids.clear()

    def on_hidden(self, index: int, x: torch.Tensor) -> dict[int, list[int]]:
        if index == 0 and self.moe and self._first_counts is not None:
            return {self.moe[0]: _rank(self._first_counts)}
        return {}

    def conditional(self, layer: int) -> torch.Tensor:
        """[E, E] P(expert b at `layer` | expert a at the previous MoE layer), rows without data 0."""
        t = self.table[layer]
        rows = t.sum(1, keepdim=True)
        return torch.where(rows > 0, t / rows.clamp_min(1), torch.zeros_like(t))

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> dict[int, list[int]]:
        ids = ids.detach().long().cpu()
        if layer == (self.moe[0] if self.moe else None):
            self._first_counts = counts.detach().cpu().clone()
        prev = self.prev_of.get(layer)
        if prev is not None and prev in self._ids and self._ids[prev].shape[0] == ids.shape[0]:
            a = self._ids[prev]
            k_a, k_b = a.shape[1], ids.shape[1]
            rows = a.unsqueeze(2).expand(-1, k_a, k_b).reshape(-1)
            cols = ids.unsqueeze(1).expand(-1, k_a, k_b).reshape(-1)
            self.table[layer].view(-1).index_add_(0, rows * self.num_experts + cols,
                                                  torch.ones(rows.numel(), dtype=torch.float64))
        self._ids[layer] = ids
        nxt = self.next_of.get(layer)
        if nxt is None or not ids.shape[0]:
            return {}
        per_token = self.conditional(nxt)[ids].mean(1)  # [N, E]
        p, top = torch.topk(per_token, min(self.top_k + self.extra, self.num_experts), dim=-1)
        score = torch.zeros(self.num_experts, dtype=torch.float64)
        score.index_add_(0, top.flatten(), p.flatten())
        return {nxt: _rank(score)}


class RoutingRecorder(RoutingProbe):
    """A probe that records the per-device expert access sequence and the predictors' guesses.

    Attach it as the model runner's probe (`engine.runner.probe = recorder`). Each forward step
    becomes one record (with `step_kind`, which the caller may set before a step, e.g. "decode"
    or "prefill"); nothing is recorded while `recording` is False, but predictors keep learning.
    The access sequence of device d is one layer-step per (recorded step, MoE layer): the experts
    on d that received tokens (with replicas, the replicas the routing policy picked, tokens
    spread over devices round robin)."""

    def __init__(self, model, placement: Placement | None = None, predictors: Iterable[Predictor] = (),
                 replica_policy: str = "locality"):
        cfg = model.cfg
        super().__init__(cfg.num_layers, cfg.num_experts)
        self.model = model
        self.moe_layers = _moe_layers(model)
        placement = placement or Placement.contiguous(cfg.num_layers, cfg.num_experts, 1)
        if placement.num_layers != cfg.num_layers or placement.num_experts != cfg.num_experts:
            raise ValueError(f"placement: {placement.num_layers} layers x {placement.num_experts} experts, the model "
                             f"has {cfg.num_layers} x {cfg.num_experts}")
        self.placement = placement
        prepare(placement)
        self.replica_policy = replica_policy
        self.routing_state = RoutingState()
        self.predictors = list(predictors)
        names = [p.name for p in self.predictors]
        if len(set(names)) != len(names):
            raise ValueError(f"predictors: names must be unique, got {names}")
        self.num_devices = placement.num_devices
        self._single = bool(placement.replica_counts().max() <= 1)
        self._device_of = {}
        self.local = [{layer: frozenset(placement.experts_on(layer, d)) for layer in self.moe_layers}
                      for d in range(self.num_devices)]
        for layer in self.moe_layers:
            dev = np.full(cfg.num_experts, -1, dtype=np.int64)
            for d in range(self.num_devices):
                dev[placement.experts_on(layer, d)] = d
            self._device_of[layer] = dev
        self.steps: list[dict] = []
        self.step_kind = "step"
        self.recording = True
        self._cur: dict | None = None

    # -- probe callbacks
    def on_hidden(self, index: int, x: torch.Tensor) -> None:
        if index == 0:
            self._cur = None
            if self.recording:
                self._cur = {"kind": self.step_kind, "tokens": int(x.shape[0]), "used": {}, "device_sets": {},
                             "pred": {p.name: {} for p in self.predictors}}
                self.steps.append(self._cur)
            for p in self.predictors:
                p.start_step()
        for p in self.predictors:
            self._note(p.name, p.on_hidden(index, x))

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> None:
        super().on_routing(layer, counts, ids)
        cur = self._cur
        if cur is not None:
            counts_l = counts.detach().cpu()
            used = torch.nonzero(counts_l).flatten().tolist()
            cur["used"][layer] = used
            sets: list[list[int]] = [[] for _ in range(self.num_devices)]
            if self._single:
                dev = self._device_of[layer]
                for e in used:
                    sets[dev[e]].append(e)
            else:
                ids_c = ids.detach().long().cpu()
                token_device = torch.arange(ids_c.shape[0]) % self.num_devices
                devices = assign_replicas(self.placement, layer, ids_c, token_device, self.replica_policy,
                                                         self.routing_state)
                for d, e in sorted(set(zip(devices.flatten().tolist(), ids_c.flatten().tolist()))):
                    sets[d].append(e)
            cur["device_sets"][layer] = sets
        for p in self.predictors:
            self._note(p.name, p.on_routing(layer, counts, ids))

    def _note(self, name: str, predictions: dict[int, list[int]]) -> None:
        cur = self._cur
        if cur is None:
            return
        for layer, experts in predictions.items():
            if layer not in cur["used"]:  # a guess counts only if made before the layer routes
                cur["pred"][name][layer] = list(experts)

    # -- the recorded sequences
    def clear(self) -> None:
        self.steps.clear()
        self._cur = None

    def _selected(self, kinds) -> list[dict]:
        kinds = None if kinds is None else set([kinds] if isinstance(kinds, str) else kinds)
        return [s for s in self.steps if (kinds is None or s["kind"] in kinds) and s["device_sets"]]

    def accesses(self, device: int, kinds=None) -> list[list[tuple[int, int]]]:
        """Device `device`'s access sequence: one working set of (layer, expert) keys per
        (recorded step of the given kinds, MoE layer), possibly empty, in execution order."""
        out = []
        for step in self._selected(kinds):
            for layer in self.moe_layers:
                sets = step["device_sets"].get(layer)
                out.append([(layer, e) for e in (sets[device] if sets else [])])
        return out

    def predictions(self, name: str, device: int, kinds=None) -> list[list[tuple[int, int]]]:
        """Aligned with accesses(): predictions[t] is what predictor `name` guessed for layer-step
        t (before it ran), restricted to the experts on `device`, most confident first."""
        out = []
        local = self.local[device]
        for step in self._selected(kinds):
            guesses = step["pred"].get(name, {})
            for layer in self.moe_layers:
                out.append([(layer, e) for e in guesses.get(layer, []) if e in local[layer]])
        return out

    def max_working_set(self, device: int | None = None, kinds=None) -> int:
        devices = range(self.num_devices) if device is None else [device]
        return max((len(s) for d in devices for s in self.accesses(d, kinds)), default=0)

    def prediction_quality(self, name: str, kinds=None) -> dict:
        """Over all layer-steps (all devices): recall = share of used experts that were predicted,
        precision = share of predicted experts that were used, and the mean predicted set size."""
        hit = used_n = pred_n = n = 0
        for step in self._selected(kinds):
            guesses = step["pred"].get(name, {})
            for layer in self.moe_layers:
                used = set(step["used"].get(layer, []))
                pred = set(guesses.get(layer, []))
                hit += len(used & pred)
                used_n += len(used)
                pred_n += len(pred)
                n += 1
        return {"recall": hit / used_n if used_n else 1.0, "precision": hit / pred_n if pred_n else 1.0,
                "mean_predicted": pred_n / n if n else 0.0, "mean_used": used_n / n if n else 0.0}

    def compare(self, device: int, capacity: int, kinds=None) -> dict:
        """LRU, LRU + each predictor's prefetch and Belady on device `device`'s recorded sequence."""
        acc = self.accesses(device, kinds)
        out = {"device": device, "capacity": capacity, "layer_steps": len(acc),
               "lru": simulate(acc, capacity), "belady": belady(acc, capacity), "prefetch": {}}
        for p in self.predictors:
            out["prefetch"][p.name] = simulate(acc, capacity, self.predictions(p.name, device, kinds),
                                               release_before_prefetch=p.release_before_prefetch)
        return out


class CachePrefetcher(RoutingProbe):
    """Online prefetch: a probe that turns a predictor's guesses into ExpertCache.prefetch calls on
    every device's cache as the model runs (each cache ignores experts it does not serve)."""

    def __init__(self, model, caches, predictor: Predictor):
        cfg = model.cfg
        super().__init__(cfg.num_layers, cfg.num_experts)
        self.caches = list(caches)
        self.predictor = predictor

    def _issue(self, predictions: dict[int, list[int]]) -> None:
        for layer, experts in predictions.items():
            for cache in self.caches:
                cache.prefetch(layer, experts, release_current=self.predictor.release_before_prefetch)

    def on_hidden(self, index: int, x: torch.Tensor) -> None:
        if index == 0:
            self.predictor.start_step()
        self._issue(self.predictor.on_hidden(index, x))

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> None:
        super().on_routing(layer, counts, ids)
        self._issue(self.predictor.on_routing(layer, counts, ids))

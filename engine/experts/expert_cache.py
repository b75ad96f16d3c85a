"""Tiered expert memory: a per-device cache of expert weights in front of the host tier.

When a device's HBM cannot hold all of its experts, the full stacked weights stay in the host
tier (the model's StackedExperts tensors, in CPU memory) and each device keeps an ExpertCache:
`capacity` expert slots of real buffers (w13_cache [C, 2I, H], w2_cache [C, H, I]) on the device.
A layer asks the cache for the experts it is about to run; a miss copies that expert's weights
from the host tier into a slot. A prefetcher (engine/prefetch.py) may issue copies early.

Semantics (the online cache, the simulation and Belady share them, so they compare fairly):

* One cache per device, shared by all layers: keys are (layer, expert). A shared pool is what a
  real device has (one HBM budget), and it lets a hot layer use slots a cold layer does not.
* The access sequence is a list of *layer-steps*: each is the working set of one MoE layer in
  one forward step (the device's experts that received tokens). A layer-step's working set is
  needed together: all of it is resident while the layer runs and none of it can be evicted
  until the next layer-step starts (it is pinned).
* Capacity rule (checked when the cache is configured): capacity >= the largest working set a
  layer can have on this device, i.e. min(experts the device holds for one layer,
  top_k x tokens per step when a bound is given). Anything smaller would have to stream a
  layer's experts in several rounds, which this cache does not do: it raises ValueError
  ("expert cache of C slots cannot hold one layer's working set ...") instead.
* Eviction: least recently used among the unpinned entries. A prefetch cannot evict the
  current layer's working set (it is still being computed) nor keys of the same prefetch.
* Prefetch(keys), issued before the layer that needs them: keys already resident are touched
  (moved to most recently used); missing ones get a slot (free, or LRU victim) and a copy, in
  the given order (most confident first) until no slot can be freed. A prefetched key that the
  layer then uses is a hit and counts as a useful prefetch; one evicted before any use counts
  as wasted.
* Hit rate = hits / (hits + misses) over demand accesses. Note that this is not bounded by
  Belady: Belady is the best a *demand* cache can do (which entry to evict), while a prefetch
  that guesses right turns a cold miss into a hit. The copies a prefetcher spends (wasted ones
  included) are reported next to its hit rate.

Copies are real. On CUDA the host tensors are pinned, copies run with non_blocking=True on a
dedicated copy stream, each filled slot gets a ready event, and `lookup` makes the compute
stream wait only for the events of the slots it needs; a slot is refilled only after the
compute stream has passed the point where its previous expert was last used (a free event is
recorded when a layer's working set is released). The time the compute stream stalls on copies
is measured with timing events around those waits (resolved lazily, in `stats()`). On CPU a
copy is a plain synchronous `copy_`; a demand copy blocks compute for its whole duration, which
is what `miss_wait_seconds` measures there (prefetch copies are timed separately, as
`prefetch_copy_seconds`: on CPU nothing overlaps them).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import combinations

import torch

from moectl.engine.kernels import small_batch
from moectl.engine.models.moe import SWIGLU

Key = Hashable  # (layer, expert) in the engine; any hashable in the simulations


def _dedupe(keys: Iterable[Key]) -> list[Key]:
    seen: set = set()
    out = []
    for k in keys:
        if k not in seen:
            seen.add(k)
            out.append(k)
    return out


def _check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity: must be an integer >= 1 expert slots, got {capacity!r}")
    return capacity


def _too_small(capacity: int, need: int, where: str = "") -> ValueError:
    return ValueError(f"expert cache of {capacity} slots cannot hold one layer's working set of {need} experts"
                      f"{where}; a layer's experts are needed together, so give capacity >= {need}")


# ---- the policy: slot bookkeeping shared by the real cache and the simulation ---------------

class CachePolicy:
    """LRU with pinned working sets and prefetch, on slot ids only (no tensors).

    ExpertCache drives one of these and performs the copies it asks for; `simulate` drives one
    on a recorded access sequence. Both therefore make exactly the same decisions."""

    def __init__(self, capacity: int):
        self.capacity = _check_capacity(capacity)
        self._map: OrderedDict[Key, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._pending: set = set()  # prefetched, not used yet
        self.pinned: frozenset = frozenset()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.hits = self.misses = self.evictions = 0
        self.prefetch_issued = self.prefetch_useful = self.prefetch_wasted = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def slot_of(self, key: Key) -> int | None:
        return self._map.get(key)

    def resident(self) -> dict:
        """key -> slot, least recently used first."""
        return dict(self._map)

    def _take_slot(self, protect) -> tuple[int | None, Key | None]:
        if self._free:
            return self._free.pop(), None
        for key in self._map:  # least recently used first
            if key not in protect:
                slot = self._map.pop(key)
                self.evictions += 1
                if key in self._pending:
                    self._pending.discard(key)
                    self.prefetch_wasted += 1
                return slot, key
        return None, None

    def access(self, keys: Iterable[Key]) -> tuple[list[int], list[tuple[Key, int]]]:
        """Make a layer-step's working set resident and pin it (until the next access or release).
        Returns (slot of every key, in order; [(key, slot)] that missed and must be filled)."""
        keys = _dedupe(keys)
        if len(keys) > self.capacity:
            raise _too_small(self.capacity, len(keys))
        self.pinned = frozenset(keys)
        slots: dict = {}
        missing = []
        for k in keys:
            slot = self._map.get(k)
            if slot is None:
                missing.append(k)
                continue
            self._map.move_to_end(k)
            self.hits += 1
            if k in self._pending:
                self._pending.discard(k)
                self.prefetch_useful += 1
            slots[k] = slot
        fills = []
        for k in missing:
            slot, _ = self._take_slot(self.pinned)  # never None: len(keys) <= capacity
            self._map[k] = slot
            slots[k] = slot
            fills.append((k, slot))
        self.misses += len(missing)
        return [slots[k] for k in keys], fills

    def release(self) -> None:
        """The current working set is done: its entries become evictable."""
        self.pinned = frozenset()

    def prefetch(self, keys: Iterable[Key]) -> list[tuple[Key, int]]:
        """Bring predicted keys in ahead of use, most confident first, as far as slots allow.
        Returns [(key, slot)] to fill."""
        protect = set(self.pinned)
        fills = []
        for k in _dedupe(keys):
            protect.add(k)
            if k in self._map:
                self._map.move_to_end(k)
                continue
            slot, _ = self._take_slot(protect)
            if slot is None:
                break
            self._map[k] = slot
            self._pending.add(k)
            self.prefetch_issued += 1
            fills.append((k, slot))
        return fills

    def counters(self) -> dict:
        accesses = self.hits + self.misses
        return {
            "capacity": self.capacity, "accesses": accesses, "hits": self.hits, "misses": self.misses,
            "hit_rate": self.hits / accesses if accesses else 1.0, "evictions": self.evictions,
            "prefetch_issued": self.prefetch_issued, "prefetch_useful": self.prefetch_useful,
            "prefetch_wasted": self.prefetch_wasted, "prefetch_pending": len(self._pending),
            "copies": self.misses + self.prefetch_issued,
        }


# ---- offline evaluation on a recorded access sequence ---------------------------------------

def _steps(accesses: Sequence[Iterable[Key]], capacity: int) -> list[list[Key]]:
    _check_capacity(capacity)
    steps = [_dedupe(s) for s in accesses]
    for t, s in enumerate(steps):
        if len(s) > capacity:
            raise _too_small(capacity, len(s), f" (layer-step {t})")
    return steps


def simulate(accesses: Sequence[Iterable[Key]], capacity: int,
             predictions: Sequence[Iterable[Key]] | None = None, release_before_prefetch: bool = False) -> dict:
    """LRU (with prefetch when `predictions` is given) on an access sequence.

    accesses[t]: the keys of layer-step t (its working set, needed together).
    predictions[t]: the keys predicted for layer-step t, prefetched before it runs, i.e. after
      layer-step t-1's access while its working set is still pinned (or, with
      release_before_prefetch, once it is done: a predictor that only produces its guess after the
      previous layer has finished). Same length as accesses; empty/None entries prefetch nothing.
    Returns CachePolicy.counters() (hits, misses, hit_rate, prefetch_issued/useful/wasted, copies).
    """
    steps = _steps(accesses, capacity)
    if predictions is not None and len(predictions) != len(steps):
        raise ValueError(f"predictions: need one entry per layer-step ({len(steps)}), got {len(predictions)}")
    policy = CachePolicy(capacity)
    for t, keys in enumerate(steps):
        if predictions is not None and predictions[t]:
            if release_before_prefetch:
                policy.release()
            policy.prefetch(predictions[t])
        policy.access(keys)
    return policy.counters()


def lru_hit_rate(accesses: Sequence[Iterable[Key]], capacity: int) -> float:
    return simulate(accesses, capacity)["hit_rate"]


def belady(accesses: Sequence[Iterable[Key]], capacity: int) -> dict:
    """Belady's MIN with working sets: on a miss, evict the unpinned entry (not in the current
    layer-step) whose next use is furthest in the future (never = infinitely far). Optimal among
    demand caches that hold each layer-step's working set together (tests check it against brute
    force). Returns accesses, hits, misses, hit_rate."""
    steps = _steps(accesses, capacity)
    never = len(steps)
    next_use: list[dict] = [{} for _ in steps]
    last: dict = {}
    for t in range(len(steps) - 1, -1, -1):
        for k in steps[t]:
            next_use[t][k] = last.get(k, never)
        for k in steps[t]:
            last[k] = t
    cache: dict = {}  # key -> index of its next use
    hits = misses = 0
    for t, keys in enumerate(steps):
        missing = [k for k in keys if k not in cache]
        hits += len(keys) - len(missing)
        misses += len(missing)
        excess = len(cache) + len(missing) - capacity
        if excess > 0:
            current = set(keys)
            victims = heapq.nlargest(excess, (k for k in cache if k not in current), key=cache.__getitem__)
            for v in victims:
                del cache[v]
        for k in keys:
            cache[k] = next_use[t][k]
    total = hits + misses
    return {"capacity": capacity, "accesses": total, "hits": hits, "misses": misses,
            "hit_rate": hits / total if total else 1.0}


def belady_hit_rate(accesses: Sequence[Iterable[Key]], capacity: int) -> float:
    return belady(accesses, capacity)["hit_rate"]


def brute_force_min_misses(accesses: Sequence[Iterable[Key]], capacity: int) -> int:
    """Fewest misses any policy can get (exhaustive search; tiny sequences only, for tests).
    Every layer-step's working set must be resident together; between layer-steps a policy may
    evict any unpinned subset of entries, not only what a miss needs."""
    steps = _steps(accesses, capacity)
    states = {frozenset(): 0}  # cache contents after a layer-step -> fewest misses to get there
    for keys in steps:
        need = set(keys)
        nxt: dict = {}
        for cache, cost in states.items():
            cost += len(need - cache)
            others = sorted(cache - need, key=repr)
            room = capacity - len(need)
            # keep any subset of the other entries that fits next to the working set
            for r in range(min(room, len(others)) + 1):
                for kept in combinations(others, r):
                    state = frozenset(need | set(kept))
                    if cost < nxt.get(state, 1 << 60):
                        nxt[state] = cost
        states = nxt
    return min(states.values()) if states else 0


# ---- the real cache --------------------------------------------------------------------------

def _host_stack(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The host-tier (w13, w2) of a StackedExperts, or of PlacedExperts (its `logical` stack)."""
    logical = getattr(experts, "logical", experts)
    return logical.w13.data, logical.w2.data


def moe_host_tier(model) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer index -> the model's stacked (w13 [E, 2I, H], w2 [E, H, I]) host tensors."""
    from moectl.engine.models.moe import MoEBlock

    return {layer.mlp.layer_idx: _host_stack(layer.mlp.experts) for layer in model.layers
            if isinstance(layer.mlp, MoEBlock)}


def max_working_set(experts_per_layer: int, top_k: int | None = None, max_tokens: int | None = None) -> int:
    """The capacity rule: a layer can need all the experts it holds on a device at once, or
    top_k x tokens of them when the tokens per step are bounded (e.g. decode of B sequences)."""
    if top_k is not None and max_tokens is not None:
        return max(1, min(experts_per_layer, top_k * max_tokens))
    return max(1, experts_per_layer)


class ExpertCache:
    """A device's cache of expert weights in front of the host tier (see the module docstring).

    host: layer -> (w13 [E, 2I, H], w2 [E, H, I]) host tensors (every layer the same shapes).
    capacity: expert slots (shared by all layers).
    device: where the cache buffers live ("cpu", "cuda:0", ...).
    local_experts: layer -> the experts this device serves (None: all of them); lookups of others
      are refused. The default max_working_set is the largest of these per layer.
    max_working_set: the most experts one layer may need at once (see `max_working_set()`);
      ValueError at construction when capacity is smaller.
    pin_host: on CUDA, pin host tensors that are not pinned yet (this makes a pinned *copy*; pin
      the model's own tensors beforehand to avoid doubling host memory).
    """

    def __init__(self, host: Mapping[int, tuple[torch.Tensor, torch.Tensor]], capacity: int,
                 device: str | torch.device = "cpu", *, local_experts: Mapping[int, Iterable[int]] | None = None,
                 max_working_set: int | None = None, pin_host: bool = True, name: str = "", ffn=None,
                 disk=None):
        """disk: a DiskExperts (disk_tier.py) that fills come from instead of the host tensors,
        which are then meta tensors that only give the shapes."""
        capacity = _check_capacity(capacity)
        self.disk = disk
        self.ffn = ffn or SWIGLU  # what an expert computes (gpt-oss: clamped, with biases in the weights)
        if not host:
            raise ValueError("host: no expert layers given")
        self.name = name
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        shapes = {(tuple(w13.shape[1:]), tuple(w2.shape[1:]), w13.dtype) for w13, w2 in host.values()}
        if len(shapes) != 1:
            raise ValueError("host: every layer's experts must have the same shapes and dtype")
        (s13, s2, dtype), = shapes
        self.num_experts = {layer: int(w13.shape[0]) for layer, (w13, _) in host.items()}
        if local_experts is None:
            self.local = {layer: frozenset(range(n)) for layer, n in self.num_experts.items()}
        else:
            self.local = {layer: frozenset(int(e) for e in local_experts.get(layer, ())) for layer in host}
        widest = max(len(v) for v in self.local.values())
        need = max_working_set if max_working_set is not None else widest
        if capacity < need:
            raise ValueError(f"expert cache of {capacity} slots cannot hold one layer's working set: up to {need} "
                             f"experts of a layer can be active at once on this device (it holds up to {widest} "
                             f"per layer); give capacity >= {need}")
        if self.cuda and pin_host:
            host = {layer: tuple(t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t for t in pair)
                    for layer, pair in host.items()}
        self.host = dict(host)
        self.capacity = capacity
        self.max_working_set = need
        self.w13_cache = torch.zeros((capacity, *s13), dtype=dtype, device=self.device)
        self.w2_cache = torch.zeros((capacity, *s2), dtype=dtype, device=self.device)
        self.expert_bytes = self.w13_cache[0].nbytes + self.w2_cache[0].nbytes
        self.policy = CachePolicy(capacity)
        self.slot_key: list[Key | None] = [None] * capacity
        self._current: list[int] = []
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self._ready: list = [None] * capacity  # copy done (copy stream)
            self._free_after: list = [None] * capacity  # last use done (compute stream)
            self._stalls: list = []  # (start, end) timing events around compute-stream waits
        self.reset_stats()

    @classmethod
    def for_device(cls, model, placement, device_index: int, capacity: int, device: str | torch.device = "cpu",
                   *, max_tokens: int | None = None, pin_host: bool = True, disk=None) -> ExpertCache:
        """The cache of one device of a Placement: it serves the experts placed on that device
        (layer index = the decoder layer index, as in Placement). max_tokens bounds the tokens
        of one step (decode of B sequences: B) and so the working set: min(held, top_k x B)."""
        host = moe_host_tier(model)
        local = {layer: placement.experts_on(layer, device_index) for layer in host}
        widest = max(len(set(v)) for v in local.values())
        need = max_working_set(widest, model.cfg.top_k, max_tokens)
        ffn = next(layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts"))
        return cls(host, capacity, device, local_experts=local, max_working_set=need, pin_host=pin_host,
                   name=f"device {device_index}", ffn=getattr(ffn, "logical", ffn).ffn, disk=disk)

    # -- stats
    def reset_stats(self) -> None:
        self.policy.reset_counters()
        self.bytes_copied = 0
        self._miss_wait = 0.0
        self.prefetch_copy_seconds = 0.0
        if self.cuda:
            self._stalls.clear()

    @property
    def miss_wait_seconds(self) -> float:
        """Time the compute path blocked on copies. CUDA: measured stall of the compute stream
        (synchronizes to read the timing events); CPU: duration of the demand copies."""
        if self.cuda and self._stalls:
            torch.cuda.synchronize(self.device)
            self._miss_wait += sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3
            self._stalls.clear()
        return self._miss_wait

    def stats(self) -> dict:
        out = self.policy.counters()
        out.update(name=self.name, expert_bytes=self.expert_bytes, bytes_copied=self.bytes_copied,
                   miss_wait_seconds=self.miss_wait_seconds, prefetch_copy_seconds=self.prefetch_copy_seconds,
                   resident=len(self.policy), device=str(self.device))
        return out

    # -- copies
    def _check_key(self, layer: int, expert: int) -> tuple[int, int]:
        layer, expert = int(layer), int(expert)
        if layer not in self.local:
            raise ValueError(f"layer {layer}: not an expert layer of this cache")
        if expert not in self.local[layer]:
            raise ValueError(f"expert {expert} of layer {layer} is not served by this cache ({self.name or 'device'})")
        return layer, expert

    def _fill(self, key: tuple[int, int], slot: int, demand: bool) -> None:
        layer, expert = key
        # one expert's weights, from the host tier, or read through it from disk (that wait is the disk's)
        w13, w2 = self.disk.fetch(layer, expert, demand) if self.disk is not None else (
            self.host[layer][0][expert], self.host[layer][1][expert])
        self.slot_key[slot] = key
        self.bytes_copied += self.expert_bytes
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self._free_after[slot] is not None:  # the slot's previous expert may still be in use
                    self.copy_stream.wait_event(self._free_after[slot])
                    self._free_after[slot] = None
                self.w13_cache[slot].copy_(w13, non_blocking=True)
                self.w2_cache[slot].copy_(w2, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            self._ready[slot] = ready
            return
        t0 = time.perf_counter()
        self.w13_cache[slot].copy_(w13)
        self.w2_cache[slot].copy_(w2)
        dt = time.perf_counter() - t0
        if demand:
            self._miss_wait += dt
        else:
            self.prefetch_copy_seconds += dt

    def _wait_for(self, slots: list[int]) -> None:
        """CUDA: the compute stream waits for the in-flight copies of these slots only."""
        pending = [s for s in slots if self._ready[s] is not None]
        if not pending:
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for s in pending:
            stream.wait_event(self._ready[s])
            self._ready[s] = None
        end.record(stream)
        self._stalls.append((start, end))

    # -- the API the expert execution path calls
    def release(self) -> None:
        """The current layer's experts have been enqueued: their slots may be refilled once the
        compute stream passes this point. lookup() calls it for the previous layer."""
        if self.cuda and self._current:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            for s in self._current:
                self._free_after[s] = done
        self._current = []
        self.policy.release()

    def lookup(self, layer: int, experts: Iterable[int]) -> tuple[list[int], list[int]]:
        """Make `experts` of `layer` resident and pin them; releases the previous layer's set.
        Returns (cache slot of each expert, in order; the experts that missed and were copied).
        On CUDA the current stream waits (on device, not the CPU) for their copies."""
        keys = [self._check_key(layer, e) for e in experts]
        self.release()
        slots, fills = self.policy.access(keys)
        for key, slot in fills:
            self._fill(key, slot, demand=True)
        if self.cuda:
            self._wait_for(slots)
        self._current = list(slots)
        return slots, [key[1] for key, _ in fills]

    def prefetch(self, layer: int, experts: Iterable[int], release_current: bool = False) -> list[int]:
        """Start copies for predicted experts of `layer` (most confident first), as far as free or
        evictable slots allow; the current layer's working set is never evicted unless
        release_current (call it once that layer's compute has been enqueued). Experts this
        device does not serve are ignored. Returns the experts whose copies were issued."""
        return [e for _, e in self.prefetch_keys([(layer, e) for e in experts], release_current)]

    def prefetch_keys(self, keys: Iterable[tuple[int, int]], release_current: bool = False) -> list[tuple[int, int]]:
        """prefetch() for (layer, expert) keys of any layers, in one priority order. Returns the
        keys whose copies were issued."""
        keys = [(int(l), int(e)) for l, e in keys if int(e) in self.local.get(int(l), ())]
        if release_current:
            self.release()
        fills = self.policy.prefetch(keys)
        for key, slot in fills:
            self._fill(key, slot, demand=False)
        return [key for key, _ in fills]

    def weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) views of a cache slot."""
        return self.w13_cache[slot], self.w2_cache[slot]

    def run_experts(self, layer: int, x_sorted: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """StackedExperts.forward on cached weights: x_sorted holds tokens grouped by expert in id
        order, counts[e] of them for expert e (every expert with tokens must be served here)."""
        active = [e for e, n in enumerate(counts) if n]
        return self.run_groups(layer, x_sorted, active, [counts[e] for e in active])

    def run_groups(self, layer: int, x_grouped: torch.Tensor, experts: Sequence[int],
                   rows: Sequence[int]) -> torch.Tensor:
        """x_grouped holds rows[i] tokens for experts[i], group after group, in that order. Looks
        the experts up first (copying the misses in), then runs each group on its cached weights."""
        slots, _ = self.lookup(layer, experts)
        ffn = self.ffn
        if not ffn.biased and ffn.limit is None and small_batch.grouped_takes(x_grouped, self.w13_cache, self.w2_cache):
            # the kernel the uncached experts run: the same bits from the cache (small_batch.py)
            return small_batch.grouped_swiglu(x_grouped, list(slots), list(rows), self.w13_cache, self.w2_cache)
        out = torch.empty_like(x_grouped)
        start = 0
        for slot, n in zip(slots, rows):
            out[start:start + n] = self.ffn(x_grouped[start:start + n], self.w13_cache[slot], self.w2_cache[slot])
            start += n
        return out


def replay(cache: ExpertCache, accesses: Sequence[Iterable[tuple[int, int]]],
           predictions: Sequence[Iterable[tuple[int, int]]] | None = None,
           release_before_prefetch: bool = False) -> dict:
    """Drive a real ExpertCache (real copies) through a recorded access sequence, with the same
    prefetch timing as `simulate`; returns its stats(). Its hit counts equal simulate()'s."""
    for t, keys in enumerate(accesses):
        if predictions is not None and predictions[t]:
            cache.prefetch_keys(predictions[t], release_current=release_before_prefetch)
        keys = _dedupe(keys)
        layers = {layer for layer, _ in keys}
        if len(layers) > 1:
            raise ValueError(f"accesses[{t}]: a layer-step holds one layer's experts, got layers {sorted(layers)}")
        if keys:
            cache.lookup(keys[0][0], [e for _, e in keys])
        else:
            cache.release()
    cache.release()
    return cache.stats()

"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import numpy as np
import torch

from moectl.engine.core import paged_decode, retention
from moectl.engine.core.kv_cache import KVCache
from moectl.engine.core.paged_attention import DecodeGroup, PagedContext, PrefillSlice
from moectl.engine.core.sampling import LOGPROB_ROWS, token_logprobs
from moectl.engine.core.sequence import Sequence
from moectl.engine.models.decoder import MoEForCausalLM


class RoutingProbe:
    """Per-step token counts per (layer, expert): what the routing heat map shows."""

    splittable = True  # counts add up: a step run as two micro-batches reports the same (two_batch.py)

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)

    def reset(self) -> None:
        self.counts.zero_()

    def on_routing(self, layer: int, counts: torch.Tensor, ids: torch.Tensor) -> None:
        self.counts[layer] += counts.to(self.counts.device)

    def on_hidden(self, index: int, x: torch.Tensor) -> None:
        pass


class ModelRunner:
    def __init__(self, model: MoEForCausalLM, cache: KVCache, device: torch.device):
        self.model = model
        self.experts = None  # the engine's expert layer, told which device each token's attention ran on
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size
        self.probe = RoutingProbe(model.cfg.num_layers, model.cfg.num_experts)
        # decodes read the cache in place (one table per row, no padding mask) when the kernel serves it
        self.decode_kernel = paged_decode.serves(cache)
        self.prompt_scores: dict = {}  # the last step's, for sequences scoring their prompt (_score_prompts)
        self.knobs = None  # the engine's SchedulerKnobs: KV retention's scored policies need attention scores

    def _slots(self, table: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        table = np.asarray(table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_groups(self, decodes: list[tuple[Sequence, int]], tables: list[list[int]],
                       first_positions: list[int] | None = None, max_waste: float = 0.25,
                       max_groups: int = 8) -> list[DecodeGroup]:
        """Split decodes (in batch order; tables[i] the blocks decode i reads, first_positions[i] the
        position its first block starts at) into groups whose padded width wastes at most about
        max_waste of the blocks gathered. With the in-place kernel nothing is gathered: one group,
        whose padded table costs only its int64 entries."""
        if self.decode_kernel:
            max_groups = 1
        lens = [len(t) for t in tables]
        bounds, start = [], 0
        for i in range(1, len(lens) + 1):
            if i == len(lens) or (lens[i] > lens[start] * (1 + max_waste) and len(bounds) < max_groups - 1):
                bounds.append((start, i))
                start = i
        groups = []
        bs = self.block_size
        firsts = np.asarray(first_positions if first_positions is not None else [0] * len(decodes), dtype=np.int64)
        for a, b in bounds:
            width = max(lens[a:b])
            table = np.zeros((b - a, width), dtype=np.int64)
            ctx_lens = np.empty(b - a, dtype=np.int64)
            for row, ((seq, _), blocks) in enumerate(zip(decodes[a:b], tables[a:b])):
                table[row, :len(blocks)] = blocks
                ctx_lens[row] = seq.num_computed + 1 - firsts[a + row]
            mask = None
            if self.decode_kernel:
                group = DecodeGroup(a, b, torch.from_numpy(table).to(self.device), width, None,
                                    lens=torch.from_numpy(ctx_lens).to(self.device))
            else:
                if (ctx_lens != width * bs).any():
                    mask = torch.from_numpy(np.arange(width * bs)[None, :] < ctx_lens[:, None])[:, None, None, :]
                    mask = mask.to(self.device)
                group = DecodeGroup(a, b, torch.from_numpy(table.reshape(-1)).to(self.device), width, mask)
            if first_positions is not None:
                group.first_positions = torch.from_numpy(firsts[a:b]).to(self.device)
            groups.append(group)
        return groups

    def _window_context(self, ordered, decodes, prefills, decode_lens) -> PagedContext:
        """The sliding layers' view of the step: their own cache, each sequence's blocks from the
        first one still held."""
        bs, dev = self.block_size, self.device
        slots = np.concatenate([self._slots(s.window_table, s.num_computed, s.num_computed + n) for s, n in ordered])
        ctx = PagedContext(cache=self.cache.window, slot_mapping=torch.from_numpy(slots).to(dev))
        if decodes:
            ctx.num_decodes, ctx.decode_context_lens = len(decodes), decode_lens
            ctx.decode_groups = self._decode_groups(decodes, [s.window_table[s.window_first:] for s, _ in decodes],
                                                    [s.window_first * bs for s, _ in decodes])
        offset = len(decodes)
        for seq, n in prefills:
            held = torch.tensor(seq.window_table[seq.window_first:], dtype=torch.int64, device=dev)
            ctx.prefills.append(PrefillSlice(offset, offset + n, seq.num_computed, held, seq.window_first * bs))
            offset += n
        return ctx

    def _score_prompts(self, ordered, hidden: torch.Tensor) -> dict:
        """id(seq) -> (first prompt position scored, [(logprob, top)...]) for sequences scoring their
        prompt: row q predicts token q + 1, up to the last prompt token (whose logits sample).
        Scored LOGPROB_ROWS rows at a time, so a long prefill chunk never holds its whole
        [tokens, vocab] logits (the memory plan counts logits for one row per sequence)."""
        out, cursor = {}, 0
        for seq, n in ordered:
            if seq.wants_prompt_logits:
                start = seq.num_computed
                lo, hi = max(start, seq.prompt_scored - 1), min(start + n, seq.num_prompt_tokens - 1)
                scored = []
                for a in range(lo, hi, LOGPROB_ROWS):
                    b = min(a + LOGPROB_ROWS, hi)
                    logits = self.model.logits(hidden[cursor + a - start:cursor + b - start])
                    scored += token_logprobs(logits, seq.token_ids[a + 1:b + 1], [seq.params.prompt_logprobs] * (b - a))
                if scored:
                    out[id(seq)] = (lo + 1, scored)
            cursor += n
        return out

    def _keep_scores(self, decodes, prefills, ctx: PagedContext) -> None:
        """Hand each sequence the attention mass its held blocks drew this step (scored retention)."""
        fresh = self.knobs.kv_retention == "snapkv"  # SnapKV: a prefill chunk's window replaces the scores

        for g in ctx.decode_groups:
            mass = g.mass.sum(1).cpu().numpy()
            for row, (seq, _) in enumerate(decodes[g.start:g.end]):
                where = seq.held_positions
                retention.add_scores(seq, where, mass[row, :len(where)], fresh=False)
        for (seq, _), p in zip(prefills, ctx.prefills):
            retention.add_scores(seq, seq.held_positions, p.mass.cpu().numpy(), fresh=fresh)

    @torch.inference_mode()
    def run(self, items: list[tuple[Sequence, int]], all_logits: bool = False, probe=None) -> torch.Tensor:
        """Runs one step. Returns fp32 logits for every sequence that completes its pending tokens
        (in `items` order), or for every token when all_logits is set."""
        # decodes sorted by context length, so similar lengths share a padded attention batch
        decodes = sorted(((s, n) for s, n in items if n == 1), key=lambda item: len(item[0].held_blocks))
        prefills = [(s, n) for s, n in items if n > 1]
        ordered = decodes + prefills
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for seq, n in ordered:
            start = seq.num_computed
            ids.extend(seq.token_ids[start:start + n])
            positions.append(np.arange(start, start + n))
            slots.append(self._slots(seq.block_table, start, start + n))
        dev = self.device
        ctx = PagedContext(cache=self.cache, slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev))
        # KV retention: each sequence's held blocks, first_position the tokens evicted before them
        scoring = self.knobs is not None and retention.scored(self.knobs)
        if decodes:
            ctx.num_decodes = len(decodes)
            ctx.decode_context_lens = torch.tensor([s.num_computed + 1 for s, _ in decodes], device=dev)
            evicted = [s.kv_evicted_tokens for s, _ in decodes]
            ctx.decode_groups = self._decode_groups(decodes, [s.held_blocks for s, _ in decodes],
                                                    evicted if any(evicted) else None)
            if scoring:
                for g in ctx.decode_groups:
                    g.mass = torch.zeros(g.end - g.start, self.cache.k.shape[3], g.width, device=dev)
        offset = len(decodes)
        for seq, n in prefills:
            held = seq.held_blocks
            ctx.prefills.append(PrefillSlice(offset, offset + n, seq.num_computed,
                                             torch.tensor(held, dtype=torch.int64, device=dev), seq.kv_evicted_tokens))
            if scoring:
                ctx.prefills[-1].observe = retention.observed_rows(self.knobs, n)
                ctx.prefills[-1].mass = torch.zeros(len(held), device=dev)
            offset += n
        if self.cache.window is not None:
            ctx.window = self._window_context(ordered, decodes, prefills, ctx.decode_context_lens)
        if self.experts is not None:
            homes = np.repeat([s.home_device for s, _ in ordered], [n for _, n in ordered])
            self.experts.begin_step(torch.from_numpy(homes).to(dev))
        hidden = self.model(torch.tensor(ids, device=dev), torch.from_numpy(np.concatenate(positions)).to(dev),
                            ctx, probe or self.probe)
        if scoring:
            self._keep_scores(decodes, prefills, ctx)
        watch = getattr(self.model, "watch", None)
        if watch is not None and watch.enabled:  # the small tensors it held for this forward
            watch.flush()
        if all_logits:
            return self.model.logits(hidden)
        if any(s.prompt_logprobs is not None for s, _ in ordered):
            self.prompt_scores = self._score_prompts(ordered, hidden)
        # map back to `items` order, keeping only sequences that will sample
        last_index, cursor = {}, 0
        for seq, n in ordered:
            cursor += n
            if seq.num_computed + n == seq.num_tokens:
                last_index[id(seq)] = cursor - 1
        rows = [last_index[id(s)] for s, _ in items if id(s) in last_index]
        return self.model.logits(hidden[rows]) if rows else hidden.new_zeros((0, self.model.cfg.vocab_size))

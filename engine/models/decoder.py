"""The MoE decoder: embeddings, N x (attention + MoE or dense MLP), final norm, LM head.

All supported architectures are this one module; ModelConfig says which pieces a checkpoint
uses (GQA or latent attention, softmax or grouped sigmoid routing, shared expert, q/k norms,
attention bias, dense layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moectl.engine.kernels.small_batch import Linear
from moectl.engine.models.attention import Attention, DenseContext
from moectl.engine.models.config import ModelConfig
from moectl.engine.models.layers import DenseMLP, RMSNorm, RotaryEmbedding
from moectl.engine.models.mla import MLAttention
from moectl.engine.models.moe import ExpertFFN, GroupedSigmoidRouter, MoEBlock
from moectl.engine.models.numerics import NORM_INPUT, NULL_WATCH, OUTPUT
from moectl.engine.models.tracing import NULL_TRACER, NullTracer
from moectl.engine.models.yield_points import Stages, run_stages


class DecoderLayer(nn.Module):
    def __init__(self, idx: int, cfg: ModelConfig, rope: RotaryEmbedding):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = (MLAttention if cfg.attention == "mla" else Attention)(idx, cfg, rope)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sparse_layers[idx]:
            grouped = (GroupedSigmoidRouter(cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
                       if cfg.router == "grouped_sigmoid" else None)
            ffn = ExpertFFN(biased=cfg.expert_bias, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
            self.mlp = MoEBlock(idx, cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.expert_intermediate_size,
                                cfg.norm_topk_prob, cfg.shared_expert_intermediate_size,
                                shared_gated=cfg.shared_expert_gated, grouped_sigmoid=grouped,
                                softmax_after_topk=cfg.router == "topk_softmax", router_bias=cfg.router_bias, ffn=ffn)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        self.watch = NULL_WATCH  # the numerics watch (MoEForCausalLM.set_watch)
        self.compute_dtype = None  # the weights' dtype when the residual stream is kept wider (set_residual_dtype)

    def forward(self, x, positions, ctx, probe=None, tracer: NullTracer = NULL_TRACER):
        return run_stages(self.stages(x, positions, ctx, probe, tracer))

    def stages(self, x, positions, ctx, probe=None, tracer: NullTracer = NULL_TRACER) -> Stages:
        """The layer, yielding at its collectives (see yield_points): the attention output's
        all_reduce when tensor parallelism set `output_collective`, the expert layer's own."""
        mark = tracer.mark()
        layer, watch = self.attn.layer_idx, self.watch
        if watch.enabled:
            watch.note(layer, NORM_INPUT, x)
        attn = self.attn(self._compute(self.input_norm(x)), positions, ctx)
        reduce = getattr(self.attn, "output_collective", None)
        if reduce is not None:
            yield reduce(attn)  # in place: attn is read only after the wait
        tracer.close(mark, "attention", 0, layer)
        x = x + attn  # a residual kept in fp32 (mixed precision) stays fp32: type promotion
        if watch.enabled:
            watch.note(layer, NORM_INPUT, x)
        h = self._compute(self.post_norm(x))
        if isinstance(self.mlp, MoEBlock):
            out = yield from self.mlp.stages(h, probe, tracer)
        else:
            mark = tracer.mark()
            out = self.mlp(h)
            tracer.close(mark, "dense_mlp", 0, layer)
        if watch.enabled:
            watch.note(layer, OUTPUT, out)
        return x + out

    def _compute(self, h: torch.Tensor) -> torch.Tensor:
        """A norm's output in the weights' dtype (it is fp32 when the residual stream is)."""
        return h if self.compute_dtype is None or h.dtype == self.compute_dtype else h.to(self.compute_dtype)


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(i, cfg, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tracer = NULL_TRACER  # the engine's SpanRecorder while it records spans
        self.residual_dtype = None  # set_residual_dtype: mixed precision
        self.watch = NULL_WATCH  # set_watch: the numerics watch
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, probe=None) -> torch.Tensor:
        """Flat tokens in, final normed hidden states out ([N, H]). `ctx` says where K/V live."""
        return run_stages(self.stages(input_ids, positions, ctx, probe))

    def stages(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, probe=None, tracer=None) -> Stages:
        """The forward as stages with yield points at every collective (one micro-batch's, when
        the distributed backend overlaps two: moectl.engine.parallel.two_batch). tracer: the
        micro-batch's own (default: the model's)."""
        tracer = self.tracer if tracer is None else tracer
        x = self.embed(input_ids)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        if probe is not None:
            probe.on_hidden(0, x)
        for i, layer in enumerate(self.layers):
            x = yield from layer.stages(x, positions, ctx, probe, tracer)
            if probe is not None:
                probe.on_hidden(i + 1, x)
        if self.watch.enabled:  # the last layer's output: the final norm's input
            self.watch.note(len(self.layers) - 1, NORM_INPUT, x)
        out = self.norm(x)
        return out if self.residual_dtype is None else out.to(self.embed.weight.dtype)

    def set_watch(self, watch) -> None:
        """The numerics watch every layer notes its activations to (numerics.NULL_WATCH: none)."""
        self.watch = watch
        for layer in self.layers:
            layer.watch = layer.attn.watch = watch

    def set_residual_dtype(self, dtype: torch.dtype | None) -> None:
        """Mixed precision: the residual stream (and so every norm's input and the sums into it)
        kept in `dtype`, typically fp32 under fp16 weights; the matmuls stay in the weights'
        dtype. None: the residual stream in the weights' dtype, as the reference runs it."""
        weights = self.embed.weight.dtype
        self.residual_dtype = None if dtype in (None, weights) else dtype
        for layer in self.layers:
            layer.compute_dtype = None if self.residual_dtype is None else weights

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def training_loss(self, tokens: torch.Tensor, aux_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token cross-entropy on a [B, T] batch plus the load-balancing loss."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).repeat(b)
        hidden = self.forward(tokens.flatten(), positions, DenseContext(b, t))
        logits = self.logits(hidden).view(b, t, -1)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        aux = [layer.mlp.last_aux_loss for layer in self.layers if isinstance(layer.mlp, MoEBlock)]
        aux_loss = torch.stack(aux).mean() if aux else ce.new_zeros(())
        return ce, aux_loss

    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif p.dim() == 1:
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

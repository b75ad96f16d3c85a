"""One simulated step of an MoE model on a cluster described by a hardware profile: every figure
is modeled (simulated), none measured.

The layout is the seeds' (and DeepSeek's and SGLang's large-scale deployments'): attention data
parallel (each device its own batch; or tensor parallel over `tp` devices, whose group then holds
`tp` devices' tokens), routed experts expert-parallel over all devices under a placement, the
tokens' rows sent to their experts' devices and back by all-to-all (dispatch, combine), shared
experts and dense layers on every device for its own tokens.

Each part's time is a roofline with the profile's achieved efficiencies: a GEMM takes the longer
of its multiply-accumulates at (peak x GEMM efficiency at its rows) and its weights streamed at
(HBM bandwidth x memory-bound efficiency); attention the longer of its core work at the BF16 peak
and its KV reads at HBM bandwidth, each at the attention kernel's efficiencies; an all-to-all its
busiest link's bytes at the link's achieved bandwidth plus a latency. Where the profile has kernel
tables (kernel_tables.py) they price what a roofline misses: the GEMMs' and attention's
efficiencies fitted on a real profile, the small ops between the GEMMs, a floor under every
kernel, the low-latency all-to-all of decode deployments, the SMs a normal-mode all-to-all takes
from the compute beside it, and a step's fixed time. Expert rows per device come from the routing
shares and the placement (replicas share an expert's rows evenly). Every device syncs at dispatch
and combine, so a layer's expert time is its slowest device's; that is where balance shows.

Overlap (overlap.py) splits the batch into two micro-batches and lays their chunks out on a
compute and a communication stream in the deployment's order (SGLang's two-batch overlap,
DeepSeek's five-stage decode); MTP's draft tokens are verified by every layer and counted by
their acceptance.

Pipeline stages (`pp`, pipeline.py; docs/sim.md "Pipeline stages"): the devices in pp stages of
consecutive devices, each a contiguous run of layers (`balanced_stages`), all of the above within
a stage; the batch flows as micro-batches, each stage's share priced as above, the sends between
stages over the link the two stages' devices sit across, laid out filled and drained in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from moectl.engine.planning.memory_plan import parse_pp_layers, split_layers, stage_ranges
from moectl.engine.sim.hardware import HardwareProfile
from moectl.engine.sim.model_shape import SimModel
from moectl.engine.sim.overlap import micro_batch_schedule, mtp_tokens_per_step
from moectl.engine.sim.pipeline import flush, steady, uniform_bubble
from moectl.placement.placement import Placement
from moectl.placement.placement_file import fit_to_model, model_identity

MAX_SIM_DEVICES = 1024
MAX_MICRO_BATCHES = 1024
PHASES = ("prefill", "decode")
OVERLAPS = ("none", "two-batch", "five-stage")  # overlap.py: two micro-batches, SGLang's or DeepSeek's decode
COMMS = ("auto", "normal", "low-latency")  # the all-to-all's mode (auto: low-latency in decode where tabled)
# how expert rows travel: all-to-all (DeepEP, SGLang, vLLM: dispatch to the experts' devices and
# back) or all-reduce (moectl's ranks: every rank holds every token, computes its experts' rows
# and the outputs are summed over the ranks)
EXCHANGES = ("all-to-all", "all-reduce")
PARTS = ("attention", "router", "dispatch", "expert_gemm", "combine", "shared_dense", "small_ops", "lm_head", "mtp",
         "overhead", "overlap_cost", "idle")


@dataclass
class SimSpec:
    model: SimModel
    hardware: HardwareProfile
    devices: int
    routing: np.ndarray  # [MoE layers, experts]: each expert's share of a layer's (token, choice) pairs
    phase: str = "decode"
    tokens_per_device: int = 128  # decode: sequences (one token each); prefill: prompt tokens
    context: int = 4096  # decode: KV length; prefill: prompt length
    tp: int = 1  # attention tensor parallel (1: data-parallel attention)
    ep: int | None = None  # expert-parallel group size (default: all devices); groups run alike
    placement: Placement | None = None  # over one EP group's devices; default contiguous
    overlap: str = "none"
    exchange: str = "all-to-all"
    comm: str = "auto"
    comm_sms: int | None = None  # normal mode's SMs taken from compute (None: the profile's)
    mtp_draft: int = 0  # decode: multi-token prediction's draft tokens per step
    mtp_accept: float = 0.0  # ... each one's acceptance, given the ones before it were accepted
    # pipeline parallel (pipeline.py): `pp` stages of devices / pp consecutive devices, stage s a
    # contiguous run of layers (`pp_layers` per stage, else `balanced_stages`); TP, EP and the
    # attention groups are within a stage, and a step's batch flows as `micro_batches` (default pp)
    pp: int = 1
    micro_batches: int | None = None
    pp_layers: tuple[int, ...] | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        m = self.model.shape
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) \
                or not 1 <= self.devices <= MAX_SIM_DEVICES:
            raise ValueError(f"--devices: must be an integer in [1, {MAX_SIM_DEVICES}], got {self.devices!r}")
        if self.phase not in PHASES:
            raise ValueError(f"--phase: {self.phase!r} is not one of {', '.join(PHASES)}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"--overlap: {self.overlap!r} is not one of {', '.join(OVERLAPS)}")
        if self.comm not in COMMS:
            raise ValueError(f"--comm: {self.comm!r} is not one of {', '.join(COMMS)}")
        tables = self.hardware.kernels
        if self.comm_sms is not None and (isinstance(self.comm_sms, bool) or not isinstance(self.comm_sms, int)
                                          or tables is None or not tables.device_sms
                                          or not 0 <= self.comm_sms < tables.device_sms):
            if tables is None or not tables.device_sms:
                raise ValueError(f"--comm-sms: hardware {self.hardware.key} gives no SM count (kernels.comm.device_sms)")
            raise ValueError(f"--comm-sms: must be an integer in [0, {tables.device_sms:g}), got {self.comm_sms!r}")
        if isinstance(self.mtp_draft, bool) or not isinstance(self.mtp_draft, int) or not 0 <= self.mtp_draft <= 4:
            raise ValueError(f"--mtp-draft: must be an integer in [0, 4], got {self.mtp_draft!r}")
        if isinstance(self.mtp_accept, bool) or not isinstance(self.mtp_accept, (int, float)) \
                or not 0 <= self.mtp_accept <= 1:
            raise ValueError(f"--mtp-accept: must be a fraction in [0, 1], got {self.mtp_accept!r}")
        if self.mtp_draft and self.phase != "decode":
            raise ValueError("--mtp-draft: multi-token prediction is a decode option")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange: {self.exchange!r} is not one of {', '.join(EXCHANGES)}")
        stage = self._check_pipeline()
        where = f"the {self.devices} devices" if self.pp == 1 else f"the {stage} devices of a pipeline stage"
        if not isinstance(self.tp, int) or self.tp < 1 or stage % self.tp or m.num_heads % self.tp:
            raise ValueError(f"--tp: {self.tp!r} must divide both {where} and the model's {m.num_heads} heads")
        if not isinstance(self.tokens_per_device, int) or self.tokens_per_device < 1:
            flag = "--batch-seqs" if self.phase == "decode" else "--batch-tokens"
            raise ValueError(f"{flag}: must be a positive integer per device, got {self.tokens_per_device!r}")
        if not isinstance(self.context, int) or not 1 <= self.context <= m.max_position_embeddings:
            raise ValueError(f"--context: must be in [1, {m.max_position_embeddings}] (the model's "
                             f"max_position_embeddings), got {self.context!r}")
        self.ep = stage if self.ep is None else self.ep
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or stage % self.ep \
                or self.ep % self.tp:
            raise ValueError(f"--ep: {self.ep!r} must divide {where} and be a multiple of --tp")
        if self.pp > 1:
            group = self.tokens_per_device * self.tp
            if self.micro_batches > group:
                unit = "sequences" if self.phase == "decode" else "prompt tokens"
                raise ValueError(f"--micro-batches: {self.micro_batches} exceeds the {group} {unit} of an attention "
                                 f"group's batch (each micro-batch needs one)")
        per_node = self.hardware.gpus_per_node
        if self.ep % per_node and per_node % self.ep:
            raise ValueError(f"--ep: {self.ep} must be a multiple or a divisor of the {per_node} devices per node, so "
                             f"that every expert-parallel group spans nodes alike")
        if self.tp > per_node:
            raise ValueError(f"--tp: {self.tp} exceeds the {per_node} devices of a node")
        if self.routing.shape != (m.num_sparse, m.num_experts):
            raise ValueError(f"routing: expected [{m.num_sparse}, {m.num_experts}] shares, got {list(self.routing.shape)}")
        if self.placement is None:
            self.placement = Placement.contiguous(m.num_sparse, m.num_experts, self.ep)
        if (self.placement.num_devices, self.placement.num_layers, self.placement.num_experts) != \
                (self.ep, m.num_sparse, m.num_experts):
            raise ValueError(f"--placement: is for {self.placement.num_devices} devices x {self.placement.num_layers} "
                             f"MoE layers x {self.placement.num_experts} experts, not {self.ep} x {m.num_sparse} x "
                             f"{m.num_experts} (one expert-parallel group)")


    def _check_pipeline(self) -> int:
        """The pipeline's options (ValueError naming the flag); the devices of a stage."""
        m = self.model.shape
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise ValueError(f"--pp: must be a positive integer (pipeline stages), got {self.pp!r}")
        if self.pp > m.num_layers:
            raise ValueError(f"--pp: {self.pp} stages exceed the model's {m.num_layers} layers (a stage holds at "
                             f"least one)")
        if self.devices % self.pp:
            raise ValueError(f"--pp: {self.pp} must divide the {self.devices} devices (every stage has the same "
                             f"devices)")
        if self.pp == 1:
            if self.micro_batches not in (None, 1):
                raise ValueError("--micro-batches: goes with --pp > 1 (micro-batches flow through pipeline stages)")
            if self.pp_layers is not None:
                raise ValueError("--pp-layers: goes with --pp > 1")
            self.micro_batches = 1
            return self.devices
        mb = self.pp if self.micro_batches is None else self.micro_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_MICRO_BATCHES:
            raise ValueError(f"--micro-batches: must be an integer in [1, {MAX_MICRO_BATCHES}], got {mb!r}")
        self.micro_batches = mb
        if self.overlap == "five-stage":
            raise ValueError("--overlap five-stage: not with --pp > 1 (its cycle runs one micro-batch a layer behind "
                             "the other across the whole layer stack, which a stage boundary cuts); give two-batch "
                             "or none")
        if self.exchange == "all-reduce":
            raise ValueError("exchange all-reduce: moectl's ranks run no pipeline stages; give --pp 1")
        if self.pp_layers is not None:
            self.pp_layers = tuple(parse_pp_layers(self.pp_layers, self.pp, m.num_layers))
        return self.devices // self.pp


def cluster_placement(shape, devices: int, redundant: int, chosen: Placement | None = None,
                      planned_for: dict | None = None) -> Placement:
    """The placement a simulated cluster runs, `moectl sim` and the simulated backend alike: a
    row for every layer, a dense layer's unused. `chosen`: a placement file's, with the model it
    was planned for (placement_file.fit_to_model refuses one for another model and widens rows
    of the MoE layers only); else each MoE layer's experts contiguous over the devices with
    `redundant` spare slots on each (Placement.contiguous)."""
    if chosen is not None:
        return fit_to_model(chosen, planned_for, model_identity(shape, shape.name))
    return Placement.contiguous(shape.num_layers, shape.num_experts, devices, redundant)


def moe_rows(placement: Placement, shape) -> Placement:
    """The MoE layers' rows of a placement with a row for every layer: what SimSpec prices."""
    return Placement(placement.slots[np.asarray(shape.sparse_layers)], placement.num_experts)


class Roofline:
    """Part times on one device of `hw` for `model`, in seconds."""

    def __init__(self, model: SimModel, hw: HardwareProfile):
        self.model, self.hw = model, hw
        self.peak = hw.peak_tflops(model.gemm_dtype) * 1e12  # fp8 falls back to bf16 without FP8
        # what attention and the high-precision GEMMs (router, LM head) run at: BF16, fp32 in an fp32 model
        self.bf16 = hw.peak_tflops("fp32" if model.gemm_dtype == "fp32" else "bf16") * 1e12
        self.hbm = hw.need("hbm_gbps") * 1e9

    def gemms(self, rows, macs_per_row: float, weight_bytes: float, bf16: bool = False,
              dense: bool = False, kernels: int = 0) -> np.ndarray:
        """One GEMM per entry of `rows` (0 rows cost nothing). Rows may be an expectation below 1
        (an expert's share of a small batch): its weights are then streamed only when it is hit,
        with probability 1 - exp(-rows). dense: a projection's GEMM, at the kernel tables'
        dense-GEMM efficiency where the profile has one; kernels: the launches it takes, each at
        least the tables' kernel floor (0: no floor, the grouped GEMM's experts, floored per
        device by the caller)."""
        rows = np.asarray(rows, dtype=np.float64)
        safe = np.maximum(rows, 1e-12)
        peak = self.bf16 if bf16 else self.peak
        tables = self.hw.kernels
        curve = self.hw.grouped_gemm
        if tables is not None and (tables.dense_gemm if dense else tables.grouped_gemm) is not None:
            curve = tables.dense_gemm if dense else tables.grouped_gemm
        compute = 2 * safe * macs_per_row / (peak * curve.at_many(safe))
        stream = weight_bytes * -np.expm1(-safe) / (self.hbm * self.hw.memory_bound_gemm)
        seconds = np.maximum(compute, stream)
        if kernels and tables is not None:
            seconds = np.maximum(seconds, kernels * tables.kernel_floor_us * 1e-6)
        return np.where(rows > 0, seconds, 0.0)

    def gemm(self, rows: float, macs_per_row: float, weight_bytes: float, bf16: bool = False) -> float:
        return float(self.gemms(rows, macs_per_row, weight_bytes, bf16))

    def links(self, intra_bytes, inter_bytes) -> np.ndarray:
        """One all-to-all per entry: the seconds of the device whose links carry these bytes
        (NVLink and NIC at once). A link with no bytes needs no bandwidth figure."""
        intra = np.asarray(intra_bytes, dtype=np.float64)
        inter = np.asarray(inter_bytes, dtype=np.float64)
        t_intra = intra / (self.hw.need("intra_node_gbps") * 1e9 * self.hw.a2a_intra_node) if intra.any() \
            else np.zeros_like(intra)
        t_inter = inter / (self.hw.need("inter_node_gbps") * 1e9 * self.hw.a2a_inter_node) if inter.any() \
            else np.zeros_like(inter)
        busy = (intra > 0) | (inter > 0)
        return np.where(busy, np.maximum(t_intra, t_inter) + self.hw.a2a_latency_us * 1e-6, 0.0)

    def link(self, intra_bytes: float, inter_bytes: float) -> float:
        return float(self.links(intra_bytes, inter_bytes))

def window_classes(shape) -> tuple[list[int], np.ndarray]:
    """The model's distinct attention windows (0: the whole context) and the fraction of its
    layers each covers: attention is priced once per class and weighted by it."""
    windows = list(shape.layer_windows or (0,) * shape.num_layers)
    classes = sorted(set(windows))
    return classes, np.array([windows.count(w) / len(windows) for w in classes])


def _capped(keys, window: int):
    return np.minimum(keys, window) if window else keys


@dataclass
class StepLoad:
    """One step's work in one expert-parallel group, per attention group (the group's devices /
    tp; each a data-parallel batch): what `layer_times` prices. Key counts are per window class
    (`window_classes`): [classes, groups]."""
    tokens: np.ndarray  # [G] tokens (prefill and decode) of each attention group
    sequences: np.ndarray  # [G] sequences that sample a token (the LM head's rows)
    decode_keys: np.ndarray  # [W, G] keys the decode tokens attend, summed
    prefill_keys: np.ndarray  # [W, G] keys the prefill tokens attend (causal), summed
    kv_reads: np.ndarray  # [W, G] keys read from the KV cache (once per sequence and layer)
    pairs: np.ndarray  # [MoE layers, experts] (token, choice) pairs routed to each expert, the group's
    prefill: np.ndarray | None = None  # [G] of `tokens`, the prompt tokens (None: none)

    def __post_init__(self):
        if self.prefill is None:
            self.prefill = np.zeros_like(self.tokens)

    def half(self) -> StepLoad:
        """One of two-batch overlap's halves (the larger, for both)."""
        return StepLoad(np.ceil(self.tokens / 2), np.ceil(self.sequences / 2), self.decode_keys / 2,
                        self.prefill_keys / 2, self.kv_reads / 2, self.pairs / 2, np.ceil(self.prefill / 2))

    def split(self, parts: int) -> StepLoad:
        """One of `parts` equal pipeline micro-batches: every figure over `parts` (an expectation:
        rows below one are priced as the step model prices a small batch's expert rows)."""
        return StepLoad(self.tokens / parts, self.sequences / parts, self.decode_keys / parts,
                        self.prefill_keys / parts, self.kv_reads / parts, self.pairs / parts, self.prefill / parts)


def uniform_load(spec: SimSpec, tokens_per_device: int | None = None) -> StepLoad:
    """The load of `spec`'s batch: every device the same tokens at the same context, the routing
    shares spread over the group's (token, choice) pairs."""
    shape, tp = spec.model.shape, spec.tp
    T = spec.tokens_per_device if tokens_per_device is None else tokens_per_device
    groups = spec.ep // tp
    decode = spec.phase == "decode"
    verified = 1 + spec.mtp_draft if decode else 1  # MTP: each sequence verifies its draft tokens too
    group_tokens = float(T * tp * verified)
    sequences = group_tokens if decode else max(1.0, group_tokens / spec.context)
    windows, _ = window_classes(shape)
    keys = np.array([_capped(spec.context, w) for w in windows], dtype=np.float64)[:, None] * np.ones(groups)
    if decode:  # the KV cache is read once per sequence, however many tokens it verifies
        decode_keys, prefill_keys, reads = group_tokens * keys, 0 * keys, group_tokens / verified * keys
    else:  # causal: each prompt token over half its prompt on average
        decode_keys, prefill_keys, reads = 0 * keys, group_tokens * keys / 2, sequences * keys
    ones = np.ones(groups)
    pairs = spec.routing * (T * verified * spec.ep * shape.top_k)
    return StepLoad(group_tokens * ones, sequences * ones, decode_keys, prefill_keys, reads, pairs,
                    0 * ones if decode else group_tokens * ones)


def chunk_loads(spec: SimSpec, parts: int) -> list[StepLoad]:
    """Prefill with fewer prompts per attention group than micro-batches: each prompt cut into
    `parts` chunks in order (SGLang's chunked pipeline parallelism), micro-batch j holding chunk j
    of every prompt: its tokens attend the prompt before the chunk and, causally, half the chunk,
    read the KV up to the chunk's end, and only the last chunk samples (the LM head). Later chunks
    cost more: the non-uniform micro-batches SGLang's dynamic chunking evens out."""
    whole = uniform_load(spec)
    windows, _ = window_classes(spec.model.shape)
    tokens, sequences, context = whole.tokens / parts, whole.sequences, spec.context
    out = []
    for j in range(parts):
        attended = np.array([_capped((j + 0.5) * context / parts, w) for w in windows], dtype=np.float64)[:, None]
        read = np.array([_capped((j + 1) * context / parts, w) for w in windows], dtype=np.float64)[:, None]
        out.append(StepLoad(tokens, sequences * (j == parts - 1), 0 * whole.decode_keys, tokens * attended,
                            sequences * read, whole.pairs / parts, tokens))
    return out


@dataclass
class LayerTimes:
    """One load's per-part seconds: per device the parts every layer has (attention, router,
    shared, dense, LM head, the small ops before the dispatch), and per MoE layer its slowest
    device's expert work (grouped GEMMs and the small ops around them) and all-to-alls."""
    attention: np.ndarray  # [D] per layer
    router: np.ndarray
    shared: np.ndarray
    dense: np.ndarray
    lm_head: np.ndarray
    expert: list[float]  # per MoE layer, the slowest device
    dispatch: list[float]
    combine: list[float]
    device_expert: np.ndarray  # [devices] expert seconds over the MoE layers
    rows: np.ndarray  # [MoE layers, devices] expert rows
    layer_expert: np.ndarray  # [MoE layers, devices] expert seconds
    active: np.ndarray  # [MoE layers, devices] experts hit, as the cost model counts them (min(1, rows) a slot)
    small_moe: np.ndarray | None = None  # [D] a MoE layer's small ops before its dispatch (kernel tables)
    small_dense: np.ndarray | None = None  # [D] a dense layer's small ops
    attention_core: np.ndarray | None = None  # [D] of `attention`, the core (the rest: projections)
    small_expert: np.ndarray | None = None  # [MoE layers, D] of `layer_expert`, the small ops around the experts

    def __post_init__(self):
        zeros = np.zeros_like(self.attention)
        self.small_moe = zeros if self.small_moe is None else self.small_moe
        self.small_dense = zeros if self.small_dense is None else self.small_dense
        self.attention_core = zeros if self.attention_core is None else self.attention_core
        if self.small_expert is None:
            self.small_expert = np.zeros_like(self.layer_expert)

    @property
    def pre_moe(self) -> float:
        """A MoE layer's part before its dispatch, the slowest device's: every device syncs there."""
        return float((self.attention + self.router + self.shared + self.small_moe).max())

    @property
    def dense_layer(self) -> float:
        return float((self.attention + self.dense + self.small_dense).max())

    @property
    def moe_compute(self) -> list[float]:
        return [self.pre_moe + e for e in self.expert]

    @property
    def moe_comm(self) -> list[float]:
        return [a + b for a, b in zip(self.dispatch, self.combine)]


def allreduce_seconds(spec: SimSpec, nbytes: float) -> float:
    """moectl's ranks' exchange on one node: a ring all-reduce of `nbytes` (each rank sends and
    receives 2 (D - 1) / D of them in 2 (D - 1) hops) and the wait probe (a few bytes, the same
    hops), at the intra-node link's bandwidth and latency."""
    D, hw = spec.ep, spec.hardware
    if D == 1:
        return 0.0
    if D > hw.gpus_per_node:
        raise ValueError(f"exchange all-reduce: {D} ranks span nodes; it is modeled within one node")
    bandwidth = hw.need("intra_node_gbps") * 1e9 * hw.a2a_intra_node
    return 2 * (D - 1) / D * nbytes / bandwidth + 2 * 2 * (D - 1) * hw.a2a_latency_us * 1e-6


def comm_mode(spec: SimSpec, load: StepLoad) -> str:
    """The all-to-all a step of `load` runs: --comm, or as SGLang's DeepEP "auto" mode picks it per
    batch: low-latency for a batch of decode tokens only (where the profile has that mode's
    table), normal for one holding prompt tokens."""
    if spec.comm != "auto":
        return spec.comm
    tables = spec.hardware.kernels
    decode_only = not float(np.asarray(load.prefill).sum())
    return "low-latency" if decode_only and tables is not None and tables.low_latency is not None else "normal"


def layer_times(spec: SimSpec, load: StepLoad) -> LayerTimes:
    """Per-part seconds of `load`, for one expert-parallel group (every group runs alike)."""
    m, hw, D, tp = spec.model, spec.hardware, spec.ep, spec.tp
    shape, roof, tables = m.shape, Roofline(m, hw), hw.kernels
    group_of = np.arange(D) // tp
    T = load.tokens[group_of] / tp  # each device's tokens in the MoE layers

    # -- attention, per attention group: projections, the core by window class, and with tp > 1
    #    o_proj's all-reduce (ring: 2 (tp - 1) / tp of the data) over NVLink
    windows, weight = window_classes(shape)
    macs_decode, kv_per_key = m.attention_core(tp, 1, True)
    macs_prefill, _ = m.attention_core(tp, 1, False)
    prefill_compute = tables.attention_prefill if tables is not None and tables.attention_prefill else \
        hw.attention_compute
    compute = 2 * load.decode_keys * macs_decode / (roof.bf16 * hw.attention_compute) \
        + 2 * load.prefill_keys * macs_prefill / (roof.bf16 * prefill_compute)
    reads = load.kv_reads * kv_per_key / (roof.hbm * hw.attention_bandwidth)
    core = (np.maximum(compute, reads) * weight[:, None]).sum(0)  # the layers' mean
    if tables is not None:
        core = np.where(load.tokens > 0, np.maximum(core, tables.kernel_floor_us * 1e-6), 0.0)
    projections = 5 if shape.attention == "mla" else 2  # MLA: q_a, q_b, kv_a, kv_b, o; else qkv, o
    attention = roof.gemms(load.tokens, m.attention_projection_macs(tp), m.attention_weight_bytes(tp), dense=True,
                           kernels=projections) + core
    if tp > 1:
        attention = attention + roof.links(2 * (tp - 1) / tp * load.tokens * shape.hidden_size * m.high_bytes,
                                           0 * load.tokens)
    # a calibrated CPU profile's per-prompt-token cost beyond the kernels (the prefill path's masks,
    # copies and gathers) is work inside the layers, spread over them: a micro-batch carries its share
    attention = attention + hw.prompt_token_overhead_us * 1e-6 * load.prefill / shape.num_layers
    attention, core = attention[group_of], core[group_of]
    # the router, embeddings and LM head stay BF16 in fp8 and mxfp4 checkpoints
    router = roof.gemms(T, m.router_macs(), m.part_bytes("router"), bf16=True, dense=True, kernels=1)
    shared = roof.gemms(T, m.shared_macs(), m.part_bytes("shared"), dense=True, kernels=2)
    dense = roof.gemms(T, m.dense_macs(), m.part_bytes("dense"), dense=True, kernels=2)
    lm_head = roof.gemms(load.sequences[group_of] / tp, m.head_macs(), m.head_macs() * m.high_bytes, bf16=True,
                         dense=True, kernels=1)
    small_moe = tables.small_seconds(T, moe=True, side="pre") if tables is not None else None
    small_dense = tables.small_seconds(T, moe=False) if tables is not None else None

    # -- MoE layers: rows per device from the routed pairs and the placement, then the all-to-alls
    node_of = np.arange(D) // hw.gpus_per_node
    nodes = int(node_of[-1]) + 1
    same_node = node_of[:, None] == node_of[None, :]
    fp8 = m.gemm_dtype == "fp8" and hw.fp8_tflops is not None
    dispatch_bytes = shape.hidden_size * (1.0 + 4 / 128 if fp8 else m.high_bytes)  # fp8 rows carry block scales
    combine_bytes = shape.hidden_size * m.high_bytes
    off_node_tokens = T.sum() - np.bincount(node_of, weights=T, minlength=nodes)  # [nodes]
    exchange_s = allreduce_seconds(spec, float(load.tokens.max()) * shape.top_k * shape.hidden_size * m.high_bytes) \
        if spec.exchange == "all-reduce" else 0.0
    low_latency = comm_mode(spec, load) == "low-latency"
    if low_latency and (tables is None or tables.low_latency is None):
        raise ValueError(f"--comm low-latency: hardware {hw.key} has no low-latency all-to-all table "
                         f"(kernels.comm.low_latency)")
    floor = tables.kernel_floor_us * 1e-6 if tables is not None else 0.0
    expert, dispatch, combine, rows_all, seconds_all, active_all, small_all = [], [], [], [], [], [], []
    device_expert = np.zeros(D)
    for layer in range(shape.num_sparse):
        slots = spec.placement.slots[layer]  # [D, S] expert ids, -1 empty
        replicas = np.bincount(slots[slots >= 0], minlength=shape.num_experts)
        per_replica = load.pairs[layer] / np.maximum(replicas, 1)  # replicas share an expert's rows
        rows = np.where(slots >= 0, per_replica[np.maximum(slots, 0)], 0.0)  # [D, S]
        per_device = rows.sum(1)
        seconds = roof.gemms(rows, m.expert_macs(), m.expert_bytes()).sum(1)
        if tables is not None:  # the grouped GEMM's two launches and the small ops on the rows received
            small = tables.small_seconds(per_device / shape.top_k, moe=True, side="expert")
            seconds = np.where(per_device > 0, np.maximum(seconds, 2 * floor), 0.0) + small
            small_all.append(small)
        device_expert += seconds
        seconds_all.append(seconds)
        active_all.append(np.minimum(rows, 1.0).sum(1))  # the cost model's count (replica_policy.slots_work)
        expert.append(float(seconds.max()))
        rows_all.append(per_device)
        total = per_device.sum()
        to_device = per_device / total if total > 0 else np.zeros(D)
        # every device's tokens route alike: d -> d' carries T_d * top_k * (d''s share of the pairs)
        sent = np.outer(T * shape.top_k, to_device)
        np.fill_diagonal(sent, 0.0)
        intra = np.maximum((sent * same_node).sum(1), (sent * same_node).sum(0))
        if spec.exchange == "all-reduce":  # no dispatch: the outputs' all-reduce and the wait probe
            dispatch.append(0.0)
            combine.append(exchange_s)
            continue
        if low_latency:  # a copy per chosen expert, none deduplicated: every row off the node crosses the NIC
            inter = np.maximum((sent * ~same_node).sum(1), (sent * ~same_node).sum(0)) if nodes > 1 else np.zeros(D)
            nvlink = hw.need("intra_node_gbps") * hw.a2a_intra_node
            dispatch.append(float(tables.low_latency.seconds(intra * dispatch_bytes, inter * dispatch_bytes, nvlink,
                                                             "dispatch").max()))
            combine.append(float(tables.low_latency.seconds(intra * combine_bytes, inter * combine_bytes, nvlink,
                                                            "combine").max()))
            continue
        # normal mode: across nodes a token's rows travel once per remote node its choices hit
        # (DeepEP's node-level dedup); a device's NIC carries the more of what it sends and what it
        # receives (a hot node's NICs receive from every other node's devices)
        node_share = np.bincount(node_of, weights=to_device, minlength=nodes)
        hit = 1 - (1 - node_share) ** shape.top_k
        inter = np.maximum(T * (hit.sum() - hit[node_of]), off_node_tokens[node_of] * hit[node_of] / hw.gpus_per_node) \
            if nodes > 1 else np.zeros(D)
        dispatch.append(float(roof.links(intra * dispatch_bytes, inter * dispatch_bytes).max()))
        combine.append(float(roof.links(intra * combine_bytes, inter * combine_bytes).max()))
    return LayerTimes(attention, router, shared, dense, lm_head, expert, dispatch, combine, device_expert,
                      np.array(rows_all).reshape(shape.num_sparse, D), np.array(seconds_all).reshape(shape.num_sparse, D),
                      np.array(active_all).reshape(shape.num_sparse, D), small_moe, small_dense, core,
                      np.array(small_all).reshape(shape.num_sparse, D) if small_all else None)


def simulate(spec: SimSpec, load: StepLoad | None = None, detail: bool = False) -> dict:
    """The step's time and what it is made of (see the module's docstring); `load`: the batch
    a simulated engine scheduled (default: `spec`'s uniform batch). detail: also "detail", the
    per-device arrays ("busy_s" [D], "rows" [MoE layers, D]) and the LayerTimes ("layers")."""
    if spec.pp > 1:
        return _simulate_pipeline(spec, load, detail)
    shape, hw, D = spec.model.shape, spec.hardware, spec.devices
    load = uniform_load(spec) if load is None else load
    groups = spec.devices // spec.ep
    full = layer_times(spec, load)
    tables = hw.kernels
    mode = comm_mode(spec, load)
    overlapped = spec.overlap != "none" and load.tokens.max() > 1
    if overlapped:
        half = layer_times(spec, load.half())
        share, held = 1.0, 0.0  # of the SMs compute keeps beside an all-to-all; of its time it holds them
        if mode == "normal" and spec.exchange == "all-to-all" and tables is not None and tables.device_sms:
            share = 1 - (tables.comm_sms if spec.comm_sms is None else spec.comm_sms) / tables.device_sms
        elif mode == "low-latency":
            held = tables.low_latency.sm_share
        sync_s = (tables.stage_sync_us if tables is not None else 0.0) * 1e-6
        moe_layers = micro_batch_schedule(half, spec.overlap, share, sync_s, held)
        dense_s, head_s = 2 * half.dense_layer, 2 * float(half.lm_head.max())
    else:
        moe_layers = [c + mm for c, mm in zip(full.moe_compute, full.moe_comm)]
        dense_s, head_s = full.dense_layer, float(full.lm_head.max())
    # MTP: the draft module (one layer like the model's MoE layers, and the LM head it shares) runs
    # once per draft token
    mtp_s = spec.mtp_draft * (float(np.mean(moe_layers)) + head_s) if spec.mtp_draft and moe_layers else 0.0
    # a calibrated profile's costs beyond the kernels: per layer, and per sequence sampled (the
    # busiest attention group's; per prompt token: in the layers, see layer_times); 0 in the GPU
    # profiles, which have no sourced figure for them. Two micro-batches: each layer's second pass
    # costs its own launches and host time beyond the kernels.
    split_us = shape.num_layers * hw.micro_batch_overhead_us if overlapped else 0.0
    overhead = (shape.num_layers * hw.layer_overhead_us + split_us + float(load.sequences.max()) * hw.sequence_overhead_us
                + (tables.step_fixed_us if tables is not None else 0.0)) * 1e-6
    step = float(sum(moe_layers) + shape.num_dense * dense_s + head_s + mtp_s + overhead)
    comm = sum(full.dispatch) + sum(full.combine)
    small_expert = full.small_expert.sum(0)  # [D] the small ops around the experts, over the MoE layers
    busy = shape.num_layers * full.attention + shape.num_sparse * (full.router + full.shared + full.small_moe) \
        + shape.num_dense * (full.dense + full.small_dense) + full.lm_head + full.device_expert + overhead  # [D]
    # the mean device's step: its own work, the links, and its wait for the slowest device (at
    # every layer's dispatch and combine); without overlap the parts add up to the step
    parts = {
        "attention": shape.num_layers * full.attention.mean(), "router": shape.num_sparse * full.router.mean(),
        "dispatch": sum(full.dispatch), "expert_gemm": (full.device_expert - small_expert).mean(),
        "combine": sum(full.combine),
        "shared_dense": shape.num_sparse * full.shared.mean() + shape.num_dense * full.dense.mean(),
        "small_ops": shape.num_sparse * full.small_moe.mean() + shape.num_dense * full.small_dense.mean()
        + small_expert.mean(),
        "lm_head": full.lm_head.mean(), "mtp": mtp_s, "overhead": overhead,
    }
    # overlap hides part of the serial step, or (small batches: each half pays every kernel's
    # floor at half the rows) costs more than it hides
    serial = sum(full.moe_compute) + sum(full.moe_comm) + shape.num_dense * full.dense_layer \
        + float(full.lm_head.max())
    overlapped_part = sum(moe_layers) + shape.num_dense * dense_s + head_s
    unhidden = serial - overlapped_part if overlapped else 0.0
    parts["overlap_cost"] = max(0.0, -unhidden)
    parts["idle"] = max(0.0, step + max(0.0, unhidden) - parts["overlap_cost"] - comm - busy.mean() - mtp_s)
    balancedness = [r.mean() / r.max() for r in full.rows if r.max() > 0]
    tokens = float(load.tokens.sum()) * groups
    if spec.phase == "decode" and spec.mtp_draft:
        # uniform_load counts each sequence's verified tokens (1 + draft) as its tokens and its
        # sequences: a step delivers each sequence's accepted ones
        tokens = float(load.sequences.sum()) * groups * mtp_tokens_per_step(spec.mtp_draft, spec.mtp_accept) \
            / (1 + spec.mtp_draft)
    return {
        "simulated": True, "phase": spec.phase, "step_ms": step * 1e3,
        "tokens_per_s": tokens / step, "tokens_per_s_per_device": tokens / step / D,
        "tokens_per_s_per_node": tokens / step / D * hw.gpus_per_node,
        "devices": D, "nodes": -(-D // hw.gpus_per_node),
        "utilisation": np.tile(busy / step, groups).tolist(),
        "balancedness": float(np.mean(balancedness)) if balancedness else 1.0,
        "breakdown_ms": {k: float(v) * 1e3 for k, v in parts.items()},
        # the communication hidden, at most all of it: what the halves save beyond that is their
        # kernels' efficiency at half the rows (a calibrated CPU's small-batch kernels), not overlap
        "overlap_hidden_ms": min(max(0.0, unhidden), comm) * 1e3,
        "comm": mode, "kernel_tables": tables is not None,
        **({"detail": {"busy_s": busy, "rows": full.rows, "layers": full, "step_s": step}} if detail else {}),
    }


PP_PARTS = PARTS + ("pipeline_bubble",)  # the breakdown with pipeline stages


def _micro_batches(spec: SimSpec, load: StepLoad | None) -> tuple[StepLoad, list[StepLoad]]:
    """The step's load and its micro-batches: equal ones (priced once), or a prefill's chunks in
    order where an attention group holds fewer prompts than micro-batches (`chunk_loads`). A
    scheduled batch smaller than the micro-batches runs as many as its largest group has tokens."""
    m = spec.micro_batches
    if load is None:
        load = uniform_load(spec)
        if spec.phase == "prefill" and float(load.sequences.max()) < m:
            return load, chunk_loads(spec, m)
        return load, [load.split(m)] * m
    m = max(1, min(m, int(np.ceil(float(load.tokens.max())))))
    return load, [load.split(m)] * m


def _layer_costs(spec: SimSpec, lts: list[LayerTimes]) -> list[float]:
    """Each layer's serial seconds over the step's micro-batches (an MoE layer: its part before
    the dispatch, its slowest device's experts, the all-to-alls; a dense layer: attention and MLP),
    the LM head on the last layer: what `balanced_stages` balances."""
    shape = spec.model.shape
    costs, k = [], 0
    for sparse in shape.sparse_layers:
        if sparse:
            costs.append(sum(lt.moe_compute[k] + lt.moe_comm[k] for lt in lts))
            k += 1
        else:
            costs.append(sum(lt.dense_layer for lt in lts))
    costs[-1] += sum(float(lt.lm_head.max()) for lt in lts)
    return costs


def balanced_stages(spec: SimSpec) -> list[int]:
    """Layers per stage for `spec`'s pipeline: its --pp-layers, else the model's layers cut
    contiguously so that the slowest stage is as fast as any cut allows (memory_plan.split_layers:
    then as even as possible, later stages taking the more layers on ties), each layer costing
    its serial seconds at `spec`'s own batch over its micro-batches, on its placement
    (`_layer_costs`). A simulated cluster fixes it once (weights do not move between stages)."""
    if spec.pp_layers is not None:
        return list(spec.pp_layers)
    _, loads = _micro_batches(spec, None)
    unique = {id(x): x for x in loads}
    priced = {key: layer_times(spec, x) for key, x in unique.items()}
    return split_layers(_layer_costs(spec, [priced[id(x)] for x in loads]), spec.pp)


def stage_of_devices(spec: SimSpec) -> np.ndarray:
    """[devices] each device's pipeline stage (0 without one)."""
    return np.arange(spec.devices) // (spec.devices // spec.pp)


def _boundary_seconds(spec: SimSpec, roof: Roofline, load: StepLoad, source: int, target: int,
                      per_token_bytes: float, gather: bool) -> tuple[float, str]:
    """One micro-batch's send from stage `source` to stage `target`: device i of the one to device
    i of the other, each device its TP group's tokens / tp (vLLM and SGLang send a TP rank's slice
    and all-gather it on receipt, over NVLink), over NVLink where both sit on one node and the NIC
    where not, priced as the profile prices a link's bytes (its achieved fraction and latency);
    the busiest device's seconds, and which links it crossed."""
    hw, n, tp = spec.hardware, spec.devices // spec.pp, spec.tp
    local = np.arange(n)
    tokens = load.tokens[(local % spec.ep) // tp]
    nbytes = tokens / tp * per_token_bytes
    same = (source * n + local) // hw.gpus_per_node == (target * n + local) // hw.gpus_per_node
    seconds = roof.links(np.where(same, nbytes, 0.0), np.where(same, 0.0, nbytes))
    if gather and tp > 1:
        seconds = seconds + roof.links((tp - 1) / tp * tokens * per_token_bytes, 0 * tokens)
    kind = "intra-node" if same.all() else "inter-node" if not same.any() else "intra- and inter-node"
    return float(seconds.max()), kind


def _simulate_pipeline(spec: SimSpec, load: StepLoad | None, detail: bool) -> dict:
    """`simulate` with pipeline stages (pipeline.py): the step's micro-batches priced per stage
    (each stage's layers as `simulate` prices a layer, the LM head and MTP on the last, with
    --overlap two-batch each stage's micro-batch split in two on overlap.py's schedule), sent on
    between stages (`_boundary_seconds`: hidden states and residual, 2 x hidden in BF16 a token),
    and laid out filled and drained within the step (pipeline.flush). Also the steady state
    (pipeline.steady) with the micro-batches kept in flight across steps."""
    m_, shape, hw, D, p = spec.model, spec.model.shape, spec.hardware, spec.devices, spec.pp
    n = D // p
    tables = hw.kernels
    base, loads = _micro_batches(spec, load)
    m = len(loads)
    unique = {id(x): x for x in loads}
    priced = {key: layer_times(spec, x) for key, x in unique.items()}
    lts = [priced[id(x)] for x in loads]
    mode = comm_mode(spec, base)
    overlapped = spec.overlap != "none" and float(loads[0].tokens.max()) > 1
    halves = None
    share, held, sync_s = 1.0, 0.0, 0.0
    if overlapped:
        halved = {key: layer_times(spec, x.half()) for key, x in unique.items()}
        halves = [halved[id(x)] for x in loads]
        if mode == "normal" and spec.exchange == "all-to-all" and tables is not None and tables.device_sms:
            share = 1 - (tables.comm_sms if spec.comm_sms is None else spec.comm_sms) / tables.device_sms
        elif mode == "low-latency":
            held = tables.low_latency.sm_share
        sync_s = (tables.stage_sync_us if tables is not None else 0.0) * 1e-6
    counts = balanced_stages(spec)
    ranges = stage_ranges(counts)
    moe_of = np.cumsum(shape.sparse_layers) - 1  # layer -> its MoE layer index
    per_layer_s = (hw.layer_overhead_us + (hw.micro_batch_overhead_us if overlapped else 0.0)) * 1e-6
    ep = spec.ep

    times = [[0.0] * p for _ in range(m)]
    parts_sum = {k: 0.0 for k in PARTS}
    hidden = 0.0
    busy = np.zeros((p, ep))
    rows_dev = np.zeros((p, ep))
    link_dev = np.zeros(p)
    expert_critical = 0.0
    stage_parts = []
    for s, rng in enumerate(ranges):
        moe = [int(moe_of[i]) for i in rng if shape.sparse_layers[i]]
        dense_n, layers_n, last = len(rng) - len(moe), len(rng), s == p - 1
        acc = {k: 0.0 for k in PARTS}
        for j, lt in enumerate(lts):
            serial_moe = sum(lt.moe_compute[k] + lt.moe_comm[k] for k in moe)
            head = float(lt.lm_head.max()) if last else 0.0
            mtp_s = spec.mtp_draft * (float(np.mean([c + x for c, x in zip(lt.moe_compute, lt.moe_comm)]))
                                      + float(lt.lm_head.max())) if last and spec.mtp_draft and lt.expert else 0.0
            serial = serial_moe + dense_n * lt.dense_layer + head + mtp_s + layers_n * per_layer_s
            if overlapped:
                h = halves[j]
                sub = replace(h, expert=[h.expert[k] for k in moe], dispatch=[h.dispatch[k] for k in moe],
                              combine=[h.combine[k] for k in moe])
                t = sum(micro_batch_schedule(sub, spec.overlap, share, sync_s, held)) + dense_n * 2 * h.dense_layer \
                    + (2 * float(h.lm_head.max()) if last else 0.0) + mtp_s + layers_n * per_layer_s
            else:
                t = serial
            times[j][s] = t
            small_expert = lt.small_expert[moe].sum(0)
            stage_expert = lt.layer_expert[moe].sum(0)
            device = layers_n * lt.attention + len(moe) * (lt.router + lt.shared + lt.small_moe) \
                + dense_n * (lt.dense + lt.small_dense) + stage_expert + (lt.lm_head if last else 0.0) + layers_n * per_layer_s
            comm = sum(lt.dispatch[k] + lt.combine[k] for k in moe)
            part = {"attention": layers_n * lt.attention.mean(), "router": len(moe) * lt.router.mean(),
                    "dispatch": sum(lt.dispatch[k] for k in moe), "expert_gemm": (stage_expert - small_expert).mean(),
                    "combine": sum(lt.combine[k] for k in moe),
                    "shared_dense": len(moe) * lt.shared.mean() + dense_n * lt.dense.mean(),
                    "small_ops": len(moe) * lt.small_moe.mean() + dense_n * lt.small_dense.mean() + small_expert.mean(),
                    "lm_head": lt.lm_head.mean() if last else 0.0, "mtp": mtp_s, "overhead": layers_n * per_layer_s}
            unhidden = serial - t if overlapped else 0.0
            part["overlap_cost"] = max(0.0, -unhidden)
            part["idle"] = max(0.0, t + max(0.0, unhidden) - part["overlap_cost"] - comm - float(device.mean()) - mtp_s)
            hidden += min(max(0.0, unhidden), comm) / p
            for k, v in part.items():
                acc[k] += float(v)
            busy[s] += device
            rows_dev[s] += lt.rows[moe].sum(0)
            link_dev[s] += comm
            expert_critical += sum(lt.expert[k] for k in moe) / p
        stage_parts.append(acc)
        for k, v in acc.items():
            parts_sum[k] += v / p

    roof = Roofline(m_, hw)
    per_token = 2 * shape.hidden_size * m_.high_bytes  # hidden states and residual, what vLLM and SGLang send
    boundaries = [_boundary_seconds(spec, roof, loads[0], s, s + 1, per_token, True) for s in range(p - 1)]
    transfers = [c for c, _ in boundaries]
    back, _ = _boundary_seconds(spec, roof, replace(loads[-1], tokens=np.maximum(loads[-1].sequences, 0.0)),
                                p - 1, 0, 8.0, False)  # the sampled token ids back to the first stage
    run = flush(times, transfers)
    outside = (float(base.sequences.max()) * hw.sequence_overhead_us + (tables.step_fixed_us if tables is not None
                                                                          else 0.0)) * 1e-6
    step = run.makespan + outside
    period = steady(times, transfers, back) + outside
    parts = dict(parts_sum)
    parts["overhead"] += outside
    parts["pipeline_bubble"] = run.makespan - sum(sum(times[j][s] for j in range(m)) for s in range(p)) / p
    groups = n // ep
    tokens = float(base.tokens.sum()) * groups
    if spec.phase == "decode" and spec.mtp_draft:
        tokens = float(base.sequences.sum()) * groups * mtp_tokens_per_step(spec.mtp_draft, spec.mtp_accept) \
            / (1 + spec.mtp_draft)
    stage_of = stage_of_devices(spec)
    local = np.arange(D) % n % ep
    busy_d = busy[stage_of, local]
    rows_total = np.sum([lt.rows for lt in lts], axis=0)
    balancedness = [r.mean() / r.max() for r in rows_total if r.max() > 0]
    stage_ms = [sum(times[j][s] for j in range(m)) / m * 1e3 for s in range(p)]
    pipeline = {
        "pp": p, "micro_batches": m, "devices_per_stage": n, "layers_per_stage": counts,
        "stage_layers": [[r.start, r.stop - 1] for r in ranges],
        "micro_batches_chunked": len(unique) > 1,  # a prefill's chunks in order (chunk_loads)
        "stage_ms": stage_ms, "transfer_ms": [c * 1e3 for c in transfers], "transfer_links": [k for _, k in boundaries],
        "bubble": run.bubble, "bubble_uniform": uniform_bubble(p, m), "pipeline_ms": run.makespan * 1e3,
        "steady_step_ms": period * 1e3, "steady_bubble": 1 - run.busy / (p * (period - outside)) if period > outside
        else 0.0, "steady_tokens_per_s": tokens / period,
    }
    return {
        "simulated": True, "phase": spec.phase, "step_ms": step * 1e3,
        "tokens_per_s": tokens / step, "tokens_per_s_per_device": tokens / step / D,
        "tokens_per_s_per_node": tokens / step / D * hw.gpus_per_node,
        "devices": D, "nodes": -(-D // hw.gpus_per_node),
        "utilisation": (busy_d / step).tolist(),
        "balancedness": float(np.mean(balancedness)) if balancedness else 1.0,
        "breakdown_ms": {k: float(v) * 1e3 for k, v in parts.items()},
        "overlap_hidden_ms": hidden * 1e3,
        "comm": mode, "kernel_tables": tables is not None,
        "pp": pipeline, "stage": stage_of.tolist(),
        **({"detail": {"busy_s": busy_d, "rows": rows_total, "layers": lts[0], "step_s": step,
                       "device_rows": rows_dev[stage_of, local], "link_s": link_dev[stage_of],
                       "expert_critical_s": expert_critical, "run": run, "times": times, "transfers": transfers,
                       "stage_of": stage_of, "ranges": ranges}} if detail else {}),
    }


def memory_per_device(spec: SimSpec) -> dict:
    """Bytes one device holds: its weights (its share of attention, every shared and dense weight,
    the embeddings and LM head, its expert slots: the planner's count, PlanModel.weight_bytes) and
    its sequences' KV cache at --context; activations and communication buffers are not counted."""
    m, shape = spec.model, spec.model.shape
    # a TP group's devices each hold the KV of all the group's sequences (their share of the heads;
    # MLA's latent whole)
    tokens = spec.tokens_per_device * spec.tp
    sequences = tokens if spec.phase == "decode" else max(1, tokens // spec.context)
    _, kv_per_key = m.attention_core(spec.tp, 1, True)
    if spec.pp > 1:  # each stage its layers' weights and KV (the embedding first, the LM head last)
        stages = []
        for s, rng in enumerate(stage_ranges(balanced_stages(spec))):
            parts = shape.stage_weight_bytes(m.weights, rng, experts_local=spec.placement.slots_per_device)
            parts["attention"] = len(rng) * m.attention_weight_bytes(spec.tp)
            weights, kv = sum(parts.values()), sequences * spec.context * kv_per_key * len(rng)
            stages.append({"stage": s, "layers": [rng.start, rng.stop - 1], "weights_bytes": int(weights),
                           "kv_bytes": int(kv), "total_bytes": int(weights + kv),
                           "fits": bool(weights + kv <= spec.hardware.hbm_bytes)})
        worst = max(stages, key=lambda x: x["total_bytes"])
        return {**{k: worst[k] for k in ("weights_bytes", "kv_bytes", "total_bytes")},
                "hbm_bytes": spec.hardware.hbm_bytes, "fits": all(x["fits"] for x in stages),
                "worst_stage": worst["stage"], "stages": stages}
    parts = shape.weight_bytes(m.weights, experts_local=spec.placement.slots_per_device)
    parts["attention"] = shape.num_layers * m.attention_weight_bytes(spec.tp)  # split over the TP group's heads
    weights = sum(parts.values())
    kv = sequences * spec.context * kv_per_key * shape.num_layers
    total = weights + kv
    return {"weights_bytes": int(weights), "kv_bytes": int(kv), "total_bytes": int(total),
            "hbm_bytes": spec.hardware.hbm_bytes, "fits": bool(total <= spec.hardware.hbm_bytes)}


def migration_stall(spec: SimSpec, old: Placement, new: Placement) -> dict:
    """What moving from `old` to `new` costs one expert-parallel group, simulated: the expert
    bytes each device receives over its links (copies within a device are free), the stall being
    the busiest device's, its NVLink and NIC traffic running at once."""
    hw, D = spec.hardware, spec.ep
    rows = old.migration(new, hw.gpus_per_node)  # [layer, expert, src, src_slot, dst, dst_slot, over_link]
    moved = rows[rows[:, 6] == 1]
    per_expert = spec.model.expert_bytes()
    # with pipeline stages a layer's experts move within its stage's devices, the stages' at once:
    # stage s's EP group is devices s * (devices / pp) onwards, its receivers counted apart
    first = np.zeros(len(moved), dtype=np.int64)
    if spec.pp > 1:
        stage_of_moe = np.repeat(np.arange(spec.pp), balanced_stages(spec))[np.asarray(spec.model.shape.sparse_layers)]
        first = stage_of_moe[moved[:, 0]] * (spec.devices // spec.pp)
    node_of = (np.arange(D)[None, :] + first[:, None]) // hw.gpus_per_node if len(moved) else np.zeros((0, D), int)
    idx = np.arange(len(moved))
    remote = node_of[idx, moved[:, 2]] != node_of[idx, moved[:, 4]]
    receiver = moved[:, 4] + (first // (spec.devices // spec.pp)) * D
    size = D * spec.pp
    intra = np.bincount(receiver[~remote], minlength=size) * per_expert
    inter = np.bincount(receiver[remote], minlength=size) * per_expert
    roof = Roofline(spec.model, hw)
    seconds = roof.links(intra.astype(float), inter.astype(float))
    return {"experts_moved": int(len(moved)), "bytes": float(len(moved) * per_expert),
            "stall_ms": float(seconds.max()) * 1e3 if len(seconds) else 0.0}


def compare_rebalance(spec: SimSpec, planned: Placement) -> tuple[dict, dict]:
    """(the rebalance: the step under `spec`'s placement and under `planned`, the predicted gain,
    the migration's stall and after how many steps the faster step has paid for it; the planned
    step's whole `simulate` result)."""
    before, after = simulate(spec), simulate(replace(spec, placement=planned))
    migration = migration_stall(spec, spec.placement, planned)
    saved_ms = before["step_ms"] - after["step_ms"]
    return {"step_ms_before": before["step_ms"], "step_ms_after": after["step_ms"],
            "gain": before["step_ms"] / after["step_ms"] - 1,
            "balancedness_before": before["balancedness"], "balancedness_after": after["balancedness"],
            "migration": migration,
            "break_even_steps": migration["stall_ms"] / saved_ms if saved_ms > 0 else None}, after

"""The records of a traced run: frozen dataclasses of plain values (ints, floats, strings, tuples), never tensors.

`dataclasses.asdict()` of each record is its JSON form (tracer/trace/trace_schema.json documents every field), so a
record can be written, read back and rendered without torch. Times are integer nanoseconds measured from the run's
origin (the moment the Generation started); bytes are integer bytes; FLOPs count 2 per multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Stage kinds and which of them are matrix products: tracer/core/contract.py (KINDS) declares them; records and
# their renderers read MATMUL_KINDS from here.
from llmtrace.tracer.core.contract import MATMUL_KINDS

PREFILL = "prefill"
DECODE = "decode"

# The temperatures the sampling lesson shows the first token's logits at unless told otherwise (the seed article's).
DEFAULT_LESSON_TEMPERATURES = (0.1, 1.0, 2.0)


class ByteTraffic:
    """The byte sums every record of stage traffic derives the same way from its weight_bytes_read,
    activation_bytes_read/_written and kv_bytes_read/_written fields (StageRecord, StepTotals, summary.StageTotals)."""

    __slots__ = ()  # the dataclasses below keep their slots
    weight_bytes_read: int
    activation_bytes_read: int
    activation_bytes_written: int
    kv_bytes_read: int
    kv_bytes_written: int

    @property
    def bytes_read(self) -> int:
        return self.weight_bytes_read + self.activation_bytes_read + self.kv_bytes_read

    @property
    def bytes_written(self) -> int:
        return self.activation_bytes_written + self.kv_bytes_written

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def min_bytes(self) -> int:
        """Weights and KV traffic: what a pass must move whatever the kernel fusion (the roofline's bytes)."""
        return self.weight_bytes_read + self.kv_bytes_read + self.kv_bytes_written


@dataclass(frozen=True, slots=True)
class StageRecord(ByteTraffic):
    """One call of one stage module during one step (prefill = step 0, decode steps 1, 2, ...)."""

    phase: str  # "prefill" or "decode"
    step: int
    layer: int | None  # None for embedding, final norm and LM head
    stage: str  # stable dotted name, e.g. "layers.3.attention.wqkv" (fused path) or "layers.3.attention.wq" (staged)
    kind: str  # a kind of tracer/core/contract.py: embedding, rmsnorm, linear, rope, kv_cache, attention_scores,
    #            softmax, attention_values, residual, swiglu, lm_head
    input_shapes: tuple[tuple[int, ...], ...]  # every tensor argument, in call order
    output_shapes: tuple[tuple[int, ...], ...]  # every tensor returned, in order
    dtype: str  # dtype of the (first) output, e.g. "float32"
    matmul_flops: int  # exact: what the GEMMs executed (FlopCounterMode counts the same)
    elementwise_flops: int  # estimate with the constants of tracer/core/flop_formulas.py
    weight_bytes_read: int  # parameters read (embedding: only the rows looked up)
    activation_bytes_read: int
    activation_bytes_written: int
    kv_bytes_read: int  # cached keys/values read by the attention products
    kv_bytes_written: int  # new keys/values written into the cache
    start_ns: int
    duration_ns: int
    # The weight's format as it ran ("fp32", "q4_1 (int4pack)"; "+"-joined for a packed stage of mixed formats);
    # weight_bytes_read counts it as held (a stored GGUF matrix: its bytes in the file). "" for parameter-free
    # stages and traces written before it was recorded.
    weight_format: str = ""
    # The rank that ran it in a tensor-parallel run (run --tp N: every rank's records carry theirs, the trace's own
    # stages too); None on one device, and then absent from the JSON.
    rank: int | None = None

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.elementwise_flops

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @property
    def short_name(self) -> str:
        """The stage's role inside its layer: "attention.wqkv", "ffn_norm", or the top-level name."""
        parts = self.stage.split(".")
        return ".".join(parts[2:]) if parts[0] == "layers" else self.stage


@dataclass(frozen=True, slots=True)
class StepTotals(ByteTraffic):
    """The sums of one step's stage records, kept instead of them when `--trace-steps` leaves the step out
    (tracer/trace/step_selection.py); the fields are StageRecord's, summed, and the number of calls."""

    phase: str
    step: int
    calls: int
    matmul_flops: int
    elementwise_flops: int
    weight_bytes_read: int
    activation_bytes_read: int
    activation_bytes_written: int
    kv_bytes_read: int
    kv_bytes_written: int
    stage_ns: int  # the stages' own times, summed


@dataclass(frozen=True, slots=True)
class CandidateRecord:
    """One of the top candidates for a sampled token, and what each filter did to it."""

    token_id: int
    piece: str  # display form, byte pieces like <0xE4>
    logit: float  # raw logit, as the LM head produced it
    logit_penalized: float  # after the repetition penalty (equal to logit when it is off)
    prob_raw: float  # softmax of the raw logits
    prob_tempered: float  # softmax of logits / temperature
    kept_top_k: bool
    kept_top_p: bool
    kept_min_p: bool
    prob_final: float  # renormalised over the survivors; what the token was drawn from


@dataclass(frozen=True, slots=True)
class SamplingRecord:
    """What sampling did to one step's whole distribution (llmtrace.tracer.run.sampling.SampleResult's summary figures)."""

    probability_raw: float  # of the chosen token in the model's own distribution (softmax of the raw logits)
    rank: int  # the chosen token's 1-based rank by (penalised) logit
    vocab_size: int
    n_after_top_k: int  # tokens left after each filter, cumulative; vocab_size when a filter is off or greedy
    n_after_top_p: int
    n_after_min_p: int
    n_final: int  # tokens the draw chose from (1 under greedy)
    entropy_raw_bits: float  # of the model's own distribution
    entropy_final_bits: float  # of the distribution actually drawn from (0 under greedy)
    # Probability top-p's survivors hold among top-k's, renormalised: the first sum to reach p (1.0 when top-p is
    # off). None in traces written before it was recorded.
    top_p_mass: float | None = None


@dataclass(frozen=True, slots=True)
class RowToken:
    """One sequence's token in a step of a batched run (`llmtrace run --batch N`)."""

    sequence: int  # the sequence (0 = the first prompt), whatever row it holds now
    row: int  # its row in this step's forward (finished sequences leave the batch: the rows after them move up)
    token_id: int
    piece: str
    text: str  # text this token added to the sequence's output
    probability: float  # of the chosen token, after all filters
    context_length: int  # the sequence's own positions after this step: its prompt and tokens so far (no pads)
    kv_live_bytes: int  # K and V of those positions, all layers (its pads not counted)
    finished: str  # "" while it goes on; else why this was its last token: "eos", "max_new_tokens", "context_full"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward step and the token sampled from its logits."""

    phase: str  # "prefill" (step 0) or "decode"
    step: int
    input_tokens: int  # tokens fed to this forward (prompt length for prefill, 1 for decode)
    context_length: int  # positions in the KV cache after this step
    token_id: int  # the token sampled from this step's logits
    piece: str  # its display piece (byte pieces shown as <0x..>)
    text: str  # text this token added to the output (empty while a UTF-8 character is incomplete)
    probability: float  # of the chosen token, after all filters
    greedy: bool  # temperature 0: the argmax was taken
    filters: tuple[str, ...]  # sampling steps that acted, in order, e.g. ("temperature", "top_k") or ("greedy",)
    candidates: tuple[CandidateRecord, ...]
    sampling: SamplingRecord | None  # None in a dry run (nothing sampled)
    kv_allocated_bytes: int  # whole preallocated cache, all layers
    kv_live_bytes: int  # positions written so far, all layers
    start_ns: int
    forward_ns: int  # model forward (prefill or decode_one), device synchronised
    sample_ns: int
    detokenize_ns: int
    duration_ns: int  # the whole step: forward + sample + detokenize (+ compact_ns in a batched run)
    # A batched run (--batch N): the rows of this forward (input_tokens counts every row's tokens, pads included;
    # context_length and the kv_* bytes are the cache's, pads included) and each row's token. The step's own token
    # fields are then empty (token_id -1), as in a dry run: the tokens are in `rows`.
    batch: int = 1
    rows: tuple[RowToken, ...] = ()
    compact_ns: int = 0  # dropping the sequences this step finished from the batch (their KV rows), after sampling

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @property
    def tokens_out(self) -> int:
        """Tokens this step generated: one per row of a batched step, else one."""
        return len(self.rows) if self.rows else 1


@dataclass(frozen=True, slots=True)
class TokenizationRecord:
    """Text -> pieces -> ids."""

    text: str  # the prompt as given
    model_text: str  # what was tokenized (the prompt inside the chat template with --chat)
    pieces: tuple[str, ...]
    ids: tuple[int, ...]
    add_bos: bool
    start_ns: int
    duration_ns: int


@dataclass(frozen=True, slots=True)
class RopeRecord:
    """What rotary position embedding did in the prefill."""

    theta: float
    head_dim: int
    scaling: str | None  # e.g. "llama3 x8.0", None when unscaled
    inv_freq_first: float  # radians per position of the fastest-rotating pair (dims 0 and R/2; R = D but partial)
    inv_freq_last: float  # radians per position of the slowest pair
    positions: tuple[int, ...]  # positions rotated in the prefill


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What the user asked for."""

    model: str  # --model as given ("" = the bundled default)
    prompt: str
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None  # the seed sampling used: as given, or drawn by the Sampler (then seed_drawn)
    seed_drawn: bool = False  # no --seed was given; `seed` is the one drawn, so --seed <seed> replays the run
    dtype: str | None = None  # None = the loader's default
    device: str = "cpu"
    threads: int | None = None
    chat: bool = False
    trace: bool = True  # False: no hooks, only step times
    dry_run: bool = False
    prompt_tokens: int | None = None  # dry run without a tokenizer: assumed prompt length
    warmup: bool = True  # one untimed prefill + decode step first, so one-off kernel set-up is not traced as work
    staged: bool = False  # run (and trace) stage by stage instead of the fused path: Q, K, V, gate, up apart
    trace_steps: str = "all"  # decode steps whose stage records are kept (tracer/trace/step_selection.py)
    temperatures: tuple[float, ...] = DEFAULT_LESSON_TEMPERATURES  # the sampling lesson's columns; () = no lesson
    no_kv_cache: bool = False  # after the run, generate its tokens again without a KV cache and compare
    lens: bool = False  # the logit lens at each step's predicted position (runs stage by stage)
    attention: bool = False  # each step's attention weights at the predicted position (runs stage by stage)
    attention_steps: tuple[int, ...] = (0,)  # steps whose full weights --attention keeps (bounded); 0 = the prefill
    batch: int = 1  # --batch N: sequences generated together
    batch_prompts: tuple[str, ...] = ()  # with --batch: each sequence's prompt (the --file lines, or the prompt N times)
    weights: str = ""  # --weights: "stored", "dense" or "" (the default: stored for a GGUF every matrix of which
    #                    has a stored kernel; llmtrace.tracer.load.stored_weights)


@dataclass(frozen=True, slots=True)
class RunAhead:
    """How a run's decode steps ran several to a C call (tracer/run/generate.py, PackedBackend.ahead): the
    step, then the run's sampler, called from C, choosing the next token from its logits, back to back; each call's
    step records were made after it, the same as a step at a time makes them. Their times are C's clock readings
    (the forward, then the sampler: detokenize_ns is 0), so each step's span ends where the next one's begins; the
    Python after each call (detokenizing, records) is in no step's time."""

    calls: int  # C calls that ran decode steps
    steps: int  # decode steps they ran
    most_steps: int  # the most one call ran (as many as took about 50 ms, after a first call of one step)


@dataclass(frozen=True, slots=True)
class StagedDecode:
    """How a `--staged` run ran its one-token steps: as the native decode step with the staged stages apart, each
    its own phase timed in C (tracer/model/native_step.py), or through the stage modules, each wrapped (and why)."""

    # The one-token steps ran in C, stage by stage (the prefill always runs the stage modules): `not reason`, made
    # from it (init=False), so the two cannot disagree; a field still, so the trace's JSON holds it (schema).
    native: bool = field(init=False)
    reason: str  # why the stage modules ran them ("" when native): no native step for the model, --lens, ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "native", not self.reason)


# The backends a step can run on (tracer/run/select.py): the C decode step, the packed torch path, the stage modules.
NATIVE = "native"
PACKED = "packed"
MODULES = "modules"


@dataclass(frozen=True, slots=True)
class RouteNotTaken:
    backend: str  # NATIVE, PACKED or MODULES
    reason: str  # why it did not run the decode steps


@dataclass(frozen=True, slots=True)
class Route:
    """Which backend ran a run's steps and why each other one did not (tracer/run/select.py, chosen once the run's
    observers and tracer were attached). Run-ahead is the native backend running several steps a call."""

    prefill: str  # PACKED or MODULES (the native step takes one token)
    decode: str  # NATIVE, PACKED or MODULES
    # why each native call runs one step ("" when it runs several: run-ahead, or when decode is not native)
    ahead_reason: str
    not_taken: tuple[RouteNotTaken, ...]
    # the native backend runs several steps a call: made from `decode` and `ahead_reason` (init=False), so they
    # cannot disagree; a field still, so the trace's JSON holds it (schema)
    ahead: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ahead", self.decode == NATIVE and not self.ahead_reason)


@dataclass(frozen=True, slots=True)
class EnvironmentInfo:
    """Where the run happened."""

    llmtrace_version: str
    torch_version: str
    python_version: str
    platform: str
    device: str  # "cpu", "cuda:0", "meta", ...
    device_name: str  # CPU model or GPU name
    threads: int  # torch.get_num_threads()
    dtype: str  # the model's parameter dtype


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Where the weights came from."""

    source: str
    weight_format: str
    load_seconds: float
    parameters: int  # distinct parameter elements (a tied LM head counted once)
    parameter_bytes: int

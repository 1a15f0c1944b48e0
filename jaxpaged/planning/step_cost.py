"""What one device step takes: GEMMs, attention, sampler and a fixed cost, from its shape (no JAX).

A step computes T tokens (its token bucket) for S sequence rows (its sequence bucket):

    GEMM      = max(weight bytes / (weight_read_of_copy x copy bandwidth),
                    (GEMM FLOPs per token x T + LM-head FLOPs per row x S) / (gemm_of_peak(T) x peak))
    attention = a per-layer launch cost per attention kernel
                + decode rows: their KV bytes / (decode_attention_of_copy x copy bandwidth),
                  x mixed_decode_factor in a mixed step (they run on the ragged kernel there)
                + prefill chunks: each its attention FLOPs / (prefill_attention_of_peak(q) x peak),
                  and at least its K/V read at the copy bandwidth
    sampler   = sampler_row_s x S (x the vocabulary over Llama-3's)
    fixed     = fixed_step_s

A decode-only step (every row one token) runs the decode kernel; a step with any prefill runs
the ragged kernel for all its rows. `StepCosts` holds the calibrated efficiencies (fit on the
first H100 run, `calibration.py` reports how well), `Levers` the changes the model can price.
"""

import bisect
import dataclasses
import math

from jaxpaged.planning.gpus import GpuDescription
from jaxpaged.planning.model_costs import REFERENCE_VOCAB, ModelCosts

H100_PEAK = 989.4e12  # the peak the measured FLOP/s below are fractions of (gpus.py)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The engine's efficiencies, as fractions of the GPU's figures (so they carry to other GPUs).

    Attributes:
      weight_read_of_copy: a GEMM's weight read, of the copy bandwidth (fit: the batch-1 TPOT).
      gemm_of_peak: `(T, fraction of the bf16 peak)`, interpolated in log T, held at the ends
        (fit on the H100 runs: 540 to 700 TFLOP/s from 256 to 8,192 tokens).
      decode_attention_of_copy: decode attention's KV read in the engine's steps, of the copy
        bandwidth (fit: ShareGPT and random 512/128).
      balanced_decode_attention_of_copy: the same with length-balanced decode (a lever): the
        decode kernel's own bandwidth on batches of 64 to 256 sequences at 2K to 8K context,
        94-101% of the copy (kernels.json), taken as 0.95.
      attention_layer_s: each attention kernel's fixed cost per layer.
      mixed_decode_factor: decode rows on the ragged kernel in a mixed step, over the decode
        kernel's cost (kernels.json: the ragged kernel takes 1.8-2.8x the decode kernel's time on
        the same rows; fit: 3.0 with the padding the ragged kernel's tiles add).
      prefill_attention_of_peak: `(query tokens, fraction of the bf16 peak)` of the ragged
        kernel on a causal prompt (kernels.json: 106, 160, 240 TFLOP/s at 512, 2,048, 8,192),
        interpolated in log q, held at the ends.
      sampler_row_s: sampling per row (Llama-3's vocabulary; scaled by the model's).
      fixed_step_s: per step: launches, the embedding gather, norms, what no other term holds.
      host_program_s: the host's work per program (schedule, pack, postprocess; fit: the batch-1
        TPOT without async scheduling); hidden behind the device under async scheduling.
    """

    weight_read_of_copy: float = 0.87
    gemm_of_peak: tuple[tuple[int, float], ...] = tuple(
        (t, f * 1e12 / H100_PEAK)
        for t, f in ((256, 540), (512, 600), (1024, 650), (2048, 680), (4096, 690), (8192, 700))
    )
    decode_attention_of_copy: float = 0.71
    balanced_decode_attention_of_copy: float = 0.95
    attention_layer_s: float = 4e-6
    mixed_decode_factor: float = 3.0
    prefill_attention_of_peak: tuple[tuple[int, float], ...] = tuple(
        (q, f * 1e12 / H100_PEAK) for q, f in ((512, 106), (2048, 160), (8192, 240))
    )
    sampler_row_s: float = 2.4e-6
    fixed_step_s: float = 0.4e-3
    host_program_s: float = 1.8e-3


@dataclasses.dataclass(frozen=True)
class Levers:
    """Changes to the engine the model prices (the defaults: the engine as it is).

    Attributes:
      decode_kernel_in_mixed: a mixed step's leading decode rows run on the decode kernel (a
        second attention kernel per layer; the engine since `jaxpaged.model.mixed_attention`);
        False prices the engine of the first H100 run, every row on the ragged kernel (the
        calibration replays those runs so).
      three_quarter_buckets: the engine's token buckets as they are (powers of two and, within
        max_num_seqs, their 3/4 points); False: powers of two alone, as in the first H100 run.
      token_bucket_step: finer token buckets: above 256 tokens, multiples of this many (None:
        the engine's buckets).
      balanced_decode: length-balanced decode attention (`balanced_decode_attention_of_copy`).
    """

    decode_kernel_in_mixed: bool = True
    three_quarter_buckets: bool = True
    token_bucket_step: int | None = None
    balanced_decode: bool = False

    def names(self) -> list[str]:
        """The changes from the engine as it is, by their flag names."""
        on = []
        if not self.decode_kernel_in_mixed:
            on.append("ragged-kernel-in-mixed")
        if not self.three_quarter_buckets:
            on.append("powers-of-two-buckets")
        if self.token_bucket_step is not None:
            on.append(f"token-bucket-step {self.token_bucket_step}")
        if self.balanced_decode:
            on.append("balanced-decode")
        return on


@dataclasses.dataclass
class StepTime:
    """Seconds of one step by term."""

    gemm: float = 0.0
    decode_attention: float = 0.0
    prefill_attention: float = 0.0
    sampler: float = 0.0
    fixed: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.decode_attention + self.prefill_attention + self.sampler + self.fixed

    def add(self, other: "StepTime") -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def interpolate(table: tuple[tuple[int, float], ...], x: int) -> float:
    """`table`'s value at x, linear in log x between its points, held beyond its ends."""
    xs = [p for p, _ in table]
    if x <= xs[0]:
        return table[0][1]
    if x >= xs[-1]:
        return table[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


class StepCoster:
    """Prices steps of one model on one GPU with one set of efficiencies and levers."""

    def __init__(self, model: ModelCosts, gpu: GpuDescription, costs: StepCosts, levers: Levers):
        self.model, self.gpu, self.costs, self.levers = model, gpu, costs, levers
        self._weights_s = model.weight_read_bytes / (costs.weight_read_of_copy * gpu.copy_bandwidth)
        fraction = costs.balanced_decode_attention_of_copy if levers.balanced_decode else costs.decode_attention_of_copy
        self._decode_byte_s = model.kv_bytes_per_token / (fraction * gpu.copy_bandwidth)
        self._sampler_row_s = costs.sampler_row_s * model.vocab_size / REFERENCE_VOCAB
        self._launch_s = costs.attention_layer_s * model.num_layers
        self._gemm_cache: dict[tuple[int, int], float] = {}

    def gemm(self, tokens: int, seqs: int) -> float:
        """The decoder's and LM head's matrices over a T-token, S-row bucket."""
        key = (tokens, seqs)
        if key not in self._gemm_cache:
            m, c = self.model, self.costs
            flops = m.gemm_flops_per_token * tokens + m.head_flops_per_row * seqs
            compute = flops / (interpolate(c.gemm_of_peak, tokens) * self.gpu.bf16_peak_flops)
            self._gemm_cache[key] = max(self._weights_s, compute)
        return self._gemm_cache[key]

    def prefill_attention(self, q: int, kv: int) -> float:
        """One prefill chunk of q tokens ending at context kv (its earlier kv - q tokens cached)."""
        m = self.model
        pairs = q * (kv - q) + q * (q + 1) // 2
        fraction = interpolate(self.costs.prefill_attention_of_peak, q)
        compute = m.attention_flops(pairs) / (fraction * self.gpu.bf16_peak_flops)
        return max(compute, kv * m.kv_bytes_per_token / self.gpu.copy_bandwidth)

    def step(
        self,
        tokens: int,
        seqs: int,
        decode_kv_tokens: int,
        prefill_chunks: list[tuple[int, int]],
    ) -> StepTime:
        """One step of bucket (T = `tokens`, S = `seqs`) whose decode rows read `decode_kv_tokens`
        cached tokens in all, with `prefill_chunks` `(q, kv)` (none: a decode-only step)."""
        t = StepTime(gemm=self.gemm(tokens, seqs), fixed=self.costs.fixed_step_s)
        t.sampler = self._sampler_row_s * seqs
        decode = decode_kv_tokens * self._decode_byte_s
        if not prefill_chunks:
            t.decode_attention = self._launch_s + decode
            return t
        if self.levers.decode_kernel_in_mixed:
            t.decode_attention = (self._launch_s if decode_kv_tokens else 0.0) + decode
        else:
            t.decode_attention = self.costs.mixed_decode_factor * decode
        t.prefill_attention = self._launch_s + sum(self.prefill_attention(q, kv) for q, kv in prefill_chunks)
        return t

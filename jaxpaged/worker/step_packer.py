"""Host-side packing of one engine step into a single int32 buffer (numpy only, no JAX here).

1. Buckets: the step's token count is padded to a power of two between 16 and
   `max_num_batched_tokens`, or to a 3/4 point between two powers above 256 within
   `max_num_seqs` (`token_buckets`) (T); its sequence count to min(T, max_num_seqs) (S); block
   tables to the pages of `max_model_len` (P).
2. Each bucket owns one preallocated buffer; every input of the step (token ids, attention
   metadata, sampling parameters with floats bit-cast to int32) is written into fixed views
   of it, so a step is one host->device transfer. The fields are declared once, in
   `step_fields.STEP_FIELDS`; `step_programs.unpack` is the device side.
3. A step with constrained rows (structured outputs, allowed_token_ids, bad_words) has its packed
   token mask `[rows, W]` (W = ceil(V / 32)) after the step's fields in a longer buffer of the
   same layout; the model program reads the fields, the sampler the mask (see step_programs.py).
4. Block tables live in a persistent `[max_num_seqs, P]` matrix indexed by the sequence's
   slot, extended as blocks are appended; a step copies the rows it needs in one gather.
   Everything else is computed with vectorised numpy over the batch.
"""

import dataclasses
import itertools

import numpy as np

from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.worker.step_fields import SAMPLING_FIELDS, field_shapes

MIN_TOKEN_BUCKET = 16
# Above this many tokens, the buckets within max_num_seqs have a 3/4 point between two powers.
THREE_QUARTER_BUCKETS_ABOVE = 256
_POSITION_ROW = [name for name, _ in SAMPLING_FIELDS].index("position")
_SLOT_ROW = [name for name, _ in SAMPLING_FIELDS].index("slot")


def mask_words(vocab_size: int) -> int:
    """W: int32 words of one row of a packed token mask."""
    return -(-vocab_size // 32)


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int = 0) -> list[int]:
    """Powers of two from 16 up to the first one >= max_num_batched_tokens, ascending, with the
    3/4 point between two powers above `THREE_QUARTER_BUCKETS_ABOVE` (384, 768, 1536, ...) where
    it is at most `max_num_seqs`.

    Those are the sizes of decode steps, whose rows are all sequences: every padded row is a
    GEMM row and a sampled row, and 600 sequences padded to 1,024 waste 40% of a step that is
    compute-bound at that size. On vLLM's ShareGPT sample at 1,024 sequences the throughput
    model (`jaxpaged plan --workload sharegpt`) prices them at +3.7% output tok/s on an H100,
    for 7 programs a 3/4 point (a mixed step, two decode steps, four samplers); the larger
    mixed steps' padding is ~3% of their tokens and keeps the powers alone.
    """
    sizes = [MIN_TOKEN_BUCKET]
    while sizes[-1] < max_num_batched_tokens:
        power = sizes[-1] * 2
        three_quarters = power * 3 // 4
        if three_quarters > THREE_QUARTER_BUCKETS_ABOVE and three_quarters <= max_num_seqs:
            sizes.append(three_quarters)
            if three_quarters >= max_num_batched_tokens:
                break
        sizes.append(power)
    return sizes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each field sits in a bucket's flat int32 buffer (hashable: a jit static argument).

    `rows_per_seq` (R): tokens sampled per sequence. 1, or with speculative decoding 1 + k: a
    sequence checking proposals samples at its last token and at each proposal (row j of
    sequence s is sampling row `s * R + j`); a sequence without proposals uses its first row.
    """

    num_tokens: int  # T
    num_seqs: int  # S
    pages: int  # P
    rows_per_seq: int = 1  # R

    @property
    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        """Each field's name and shape, in buffer order (`step_fields.STEP_FIELDS`)."""
        return field_shapes(self.num_tokens, self.num_seqs, self.pages, self.rows_per_seq)

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.fields)

    def views(self, flat):
        """Splits a flat buffer (numpy or jax) into named, shaped views."""
        out, start = {}, 0
        for name, shape in self.fields:
            n = int(np.prod(shape))
            out[name] = flat[start : start + n].reshape(shape)
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class SequenceRow:
    """What packing needs of a scheduled sequence besides its `ScheduledSequence`.

    Attributes:
      seq_id: the sequence (a slot's block-table row is rebuilt when its owner changes).
      sampling: int32 `[len(SAMPLING_FIELDS)]` sampling row (see `sampling_row`).
      slot: its row in the block-table matrix and the penalty tables (< max_num_seqs).
      prompt_len: tokens of its prompt (later positions are generated tokens).
      banned_ids: token ids it may not sample before its row's `ban_until` position.
      logit_bias: `(ids int32, values float32)` of its `logit_bias` (None: none).
    """

    seq_id: int
    sampling: np.ndarray
    slot: int
    prompt_len: int
    banned_ids: tuple[int, ...] = ()
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None


def sampling_row(params, index: int, prompt_len: int = 0) -> np.ndarray:
    """The int32 sampling row of a `SamplingParams` (its seed resolved) for completion `index` of
    a prompt of `prompt_len` tokens (banned ids apply before `prompt_len + min_tokens`)."""
    values = {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": max(params.top_k, 0),
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": np.uint32((params.seed or 0) & 0xFFFFFFFF).view(np.int32),  # the device reads it as uint32
        "index": index,
        "position": 0,
        "slot": 0,
        "ban_until": prompt_len + params.min_tokens if params.min_tokens else 0,
    }
    return np.array([np.array(values[n], d).view(np.int32) for n, d in SAMPLING_FIELDS], np.int32)


class StepPacker:
    """Packs scheduled sequences into per-bucket buffers.

    Args:
      block_size: tokens per KV block.
      max_model_len: longest sequence (sets P).
      max_num_seqs: slots (rows of the block-table matrix and the penalty tables).
      max_num_batched_tokens: the largest token bucket.
      vocab_size: V (padding value of `banned_ids`).
      rows_per_seq: R of the mixed layouts (1 + the most proposals a sequence checks); the
        decode layouts (fused decode steps, one token per sequence) always have R = 1.
    """

    def __init__(
        self,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        vocab_size: int,
        rows_per_seq: int = 1,
    ):
        self.block_size = block_size
        self.pages = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        buckets = token_buckets(max_num_batched_tokens, max_num_seqs)
        self.layouts = {t: Layout(t, min(t, max_num_seqs), self.pages, rows_per_seq) for t in buckets}
        self.decode_layouts = {t: dataclasses.replace(layout, rows_per_seq=1) for t, layout in self.layouts.items()}
        every = set(self.layouts.values()) | set(self.decode_layouts.values())
        # Two buffers per layout, used in turn: a step's buffer must stay as it is until the step
        # has run (a CPU device_put aliases it), and with async scheduling the next step is
        # packed before this one has run; the one after it only once this one's results are read.
        self.buffers = {(layout, turn): np.zeros(layout.size, np.int32) for layout in every for turn in (0, 1)}
        self._views = {key: key[0].views(buffer) for key, buffer in self.buffers.items()}
        self._masked: dict[tuple[Layout, int], tuple[np.ndarray, dict]] = {}  # made on first use
        self._turn = 0
        self.tables = np.zeros((max_num_seqs, self.pages), np.int32)  # null block 0 where unused
        self._known = np.zeros(max_num_seqs, np.int64)  # entries written per slot
        self._owner = np.full(max_num_seqs, -1, np.int64)
        self._lists: list[list[int] | None] = [None] * max_num_seqs  # the table list each row mirrors

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int:
        for t, layout in self.layouts.items():
            if num_tokens <= t and num_seqs <= layout.num_seqs:
                return t
        raise ValueError(f"{num_tokens} tokens / {num_seqs} sequences exceed every step bucket")

    def release(self, slot: int) -> None:
        """Forgets a slot's block-table row (its sequence finished or was preempted)."""
        self._owner[slot] = -1
        self._lists[slot] = None

    def _sync_tables(self, inputs: list[ScheduledSequence], rows: list[SequenceRow]) -> None:
        """Copies the entries each slot's row lacks. A table only grows, except that trimming
        it (blocks of rejected proposals freed, `BlockManager.trim`) makes it a new list: a row
        is rewritten whole when its sequence or its table's list changed."""
        for seq, row in zip(inputs, rows):
            slot, table = row.slot, seq.block_table
            if self._owner[slot] != row.seq_id or self._lists[slot] is not table:
                self.tables[slot] = 0
                self._known[slot] = 0
                self._owner[slot] = row.seq_id
                self._lists[slot] = table  # held, so its identity stays its own
            known = self._known[slot]
            if len(table) < known or len(table) > self.pages:
                raise ValueError(f"block table of sequence {row.seq_id} went from {known} to {len(table)} entries")
            self.tables[slot, known : len(table)] = table[known:]
            self._known[slot] = len(table)

    def pack(
        self,
        inputs: list[ScheduledSequence],
        rows: list[SequenceRow],
        resets: list[int],
        num_drafts: list[int] | None = None,
        decode: bool = False,
        live_steps: list[int] | None = None,
        masked: bool = False,
        min_bucket: int = 0,
    ) -> tuple[int, np.ndarray]:
        """Writes one step into its bucket's buffer.

        Args:
          inputs: the scheduled sequences, in batch order.
          rows: their sampling rows and slots, same order.
          resets: penalty-table slots to clear before the step.
          num_drafts: proposals at the end of each sequence's tokens (None: none), each sampled
            at (at most R - 1 of them).
          decode: pack for a decode program (one token per sequence, R = 1).
          live_steps: of fused decode steps, how many are each sequence's own (the rest write
            nothing and are discarded); None: all.
          min_bucket: pack into this token bucket at least (a pipeline's micro-batch rides in
            the bucket of those in flight rather than wait for them to drain).

        Returns:
          `(bucket, buffer)`; the buffer is reused two packs later.
        """
        n = len(inputs)
        lens = np.fromiter((len(s.token_ids) for s in inputs), np.int64, n)
        total = int(lens.sum())
        t = self.bucket_for(max(total, min_bucket), n)
        layout = (self.decode_layouts if decode else self.layouts)[t]
        self._turn ^= 1
        key = (layout, self._turn)
        r = layout.rows_per_seq
        buffer, v = self._masked_buffer(key) if masked else (self.buffers[key], self._views[key])
        buffer.fill(0)
        if masked:
            self.mask_of(layout, buffer).fill(-1)
        self._sync_tables(inputs, rows)
        drafts = np.zeros(n, np.int64) if num_drafts is None else np.asarray(num_drafts, np.int64)
        if drafts.size and drafts.max() > r - 1:
            raise ValueError(f"a sequence checks {drafts.max()} proposals; this engine samples at most {r - 1}")

        computed = np.fromiter((s.num_computed for s in inputs), np.int64, n)
        slots = np.fromiter((r.slot for r in rows), np.int64, n)
        prompt_lens = np.fromiter((r.prompt_len for r in rows), np.int64, n)
        starts = np.cumsum(lens) - lens
        seq_of_token = np.repeat(np.arange(n), lens)
        positions = computed[seq_of_token] + np.arange(total) - starts[seq_of_token]
        tables = self.tables[slots]
        bs = self.block_size

        v["token_ids"][:total] = np.fromiter(
            itertools.chain.from_iterable(s.token_ids for s in inputs), np.int32, total
        )
        v["positions"][:total] = positions
        v["slot_mapping"][:total] = tables[seq_of_token, positions // bs] * bs + positions % bs
        v["token_slot"][:] = self.max_num_seqs  # out of range: dropped on device
        v["token_slot"][:total] = slots[seq_of_token]
        v["token_is_output"][:total] = positions >= prompt_lens[seq_of_token]
        from_last = np.fromiter((s.from_last for s in inputs), bool, n)
        v["from_last"][:total] = from_last[seq_of_token] & (positions == computed[seq_of_token])
        samples = np.fromiter((s.samples for s in inputs), bool, n)
        v["last_slot"][:] = self.max_num_seqs  # out of range: nothing recorded
        v["last_slot"][:n] = np.where(samples, slots, self.max_num_seqs)
        v["live_steps"][:n] = 1 << 30 if live_steps is None else live_steps
        v["cu_q_lens"][:n] = starts
        v["cu_q_lens"][n:] = total
        v["kv_lens"][:n] = computed + lens
        # Sampling rows: row j of sequence i samples after token `lens - 1 - drafts + j` (its own
        # last token, then each proposal); rows past its proposals repeat its last row.
        j = np.minimum(np.arange(r)[None, :], drafts[:, None])  # [n, R]
        first = starts + lens - 1 - drafts
        v["logits_indices"][: n * r] = (first[:, None] + j).ravel()
        v["num_drafts"][:n] = drafts
        v["reset_slots"][:] = self.max_num_seqs
        v["reset_slots"][: len(resets)] = resets
        v["block_tables"][:n] = tables
        sampling = v["sampling"]
        if n:
            sampling[:, : n * r] = np.repeat(np.stack([row.sampling for row in rows], axis=1), r, axis=1)
        # position of the token being sampled
        sampling[_POSITION_ROW, : n * r] = (computed + lens - drafts)[:, None].repeat(r, axis=1).ravel() + j.ravel()
        sampling[_SLOT_ROW, : n * r] = np.repeat(slots, r)
        v["banned_ids"][:] = self.vocab_size  # out of range: dropped on device
        v["logit_bias_ids"][:] = self.vocab_size  # out of range: dropped on device
        for i, row in enumerate(rows):
            if row.banned_ids:
                v["banned_ids"][i * r : (i + 1) * r, : len(row.banned_ids)] = row.banned_ids
            if row.logit_bias is not None:
                ids, values = row.logit_bias
                v["logit_bias_ids"][i * r : (i + 1) * r, : len(ids)] = ids
                v["logit_bias_values"][i * r : (i + 1) * r, : len(ids)] = values.view(np.int32)
        for i, seq in enumerate(inputs):
            if seq.prompt_targets:
                v["prompt_targets"][starts[i] : starts[i] + len(seq.prompt_targets)] = seq.prompt_targets
        lora_slots = np.fromiter((s.lora_slot for s in inputs), np.int32, n)
        v["lora_slots"][:total] = lora_slots[seq_of_token]
        v["num_seqs"][...] = n
        return t, buffer

    def mask_of(self, layout: Layout, buffer: np.ndarray) -> np.ndarray:
        """The `[S * R, W]` token mask of a masked buffer (a view)."""
        return buffer[layout.size :].reshape(layout.num_seqs * layout.rows_per_seq, mask_words(self.vocab_size))

    def _masked_buffer(self, key: tuple[Layout, int]) -> tuple[np.ndarray, dict]:
        if key not in self._masked:
            layout = key[0]
            buffer = np.zeros(
                layout.size + layout.num_seqs * layout.rows_per_seq * mask_words(self.vocab_size), np.int32
            )
            self._masked[key] = (buffer, layout.views(buffer[: layout.size]))
        return self._masked[key]

"""One step's flat batch: which rows hold which request's tokens, where each token's KV goes, and
which rows are sampled. The model runner's first sub-step (worker/model_runner.py).

Rows come in three runs, in this order: decodes (one token each, longest context first: the torch
backend groups similar lengths), prefill chunks (any run of tokens over any cached context), then
speculative rows (a request's last token and its drafts, every row sampled). Each run places its
tokens the same way (:func:`_place`); they differ in which rows they sample."""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncengine.attention.backend import SeqChunk
from asyncengine.contracts.sched_output import SchedulerOutput
from asyncengine.worker.request_state import RunnerRequestState


@dataclass
class StepLayout:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # each token's KV-cache slot (block * size + offset)
    seqs: list[SeqChunk] = field(default_factory=list)  # one per request: its rows and its context
    sample_rows: list[int] = field(default_factory=list)  # flat row of each token that is sampled
    sample_states: list[RunnerRequestState] = field(default_factory=list)
    ssm_chunks: list[tuple[int, int, int, bool]] = field(default_factory=list)  # hybrid: (row, rows, slot, fresh)
    spec_rows: list[tuple[int, int]] = field(default_factory=list)  # (first sample index, count) per spec row
    num_decodes: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)


def classify(so: SchedulerOutput, requests: dict[str, RunnerRequestState]):
    """The step's requests as (decodes, prefill chunks with their token counts, (state, drafts))."""
    decodes: list[RunnerRequestState] = []
    prefills: list[tuple[RunnerRequestState, int]] = []
    specs: list[tuple[RunnerRequestState, list[int]]] = []  # (state, drafts), after the prefills
    spec_k = so.num_spec_tokens
    for rid, n in so.num_scheduled_tokens.items():
        st = requests[rid]
        if spec_k and rid in spec_k:
            assert st.num_computed_tokens + 1 == st.num_tokens, f"{rid}: drafts scheduled off a decode"
            specs.append((st, spec_k[rid]))
        elif n == 1 and st.num_computed_tokens > 0:
            decodes.append(st)
        else:
            prefills.append((st, n))
    return decodes, prefills, specs


def _place(lay: StepLayout, st: RunnerRequestState, start: int, ids: list[int], bs: int) -> int:
    """Put ``ids`` (the request's tokens from position ``start``) on the next rows; returns the first row."""
    row = len(lay.input_ids)
    n = len(ids)
    lay.input_ids.extend(ids)
    lay.positions.extend(range(start, start + n))
    blocks = st.block_ids
    lay.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
    lay.seqs.append(SeqChunk(query_start=row, query_len=n, context_len=start, block_ids=blocks))
    return row


def lay_out(decodes: list[RunnerRequestState], prefills: list[tuple[RunnerRequestState, int]],
            specs: list[tuple[RunnerRequestState, list[int]]], bs: int) -> StepLayout:
    """The flat batch of one step (sorts ``decodes`` in place, longest context first)."""
    lay = StepLayout()
    decodes.sort(key=lambda st: st.num_computed_tokens, reverse=True)
    lay.num_decodes = len(decodes)
    for st in decodes:  # one token each: the runner's own last sample (or the prompt's next token)
        pos = st.num_computed_tokens
        n_prompt = st.num_prompt_tokens
        row = _place(lay, st, pos, [st.prompt_ids[pos] if pos < n_prompt else st.output_ids[pos - n_prompt]], bs)
        if pos + 1 == st.num_tokens:
            lay.sample_rows.append(row)
            lay.sample_states.append(st)
    for st, n in prefills:  # prefill chunks: the last row samples once the prompt is complete
        start = st.num_computed_tokens
        row = _place(lay, st, start, st.tokens(start, start + n), bs)
        lay.ssm_chunks.append((row, n, st.state_slot, start == 0))
        if start + n == st.num_tokens:
            lay.sample_rows.append(row + n - 1)
            lay.sample_states.append(st)
    for st, drafts in specs:  # the last token and its drafts, all sampled
        start = st.num_computed_tokens
        n = 1 + len(drafts)
        row = _place(lay, st, start, [st.tokens(start, start + 1)[0], *drafts], bs)
        lay.spec_rows.append((len(lay.sample_rows), n))
        lay.sample_rows.extend(range(row, row + n))
        lay.sample_states.extend([st] * n)
    return lay


def row_lora_ids(lay: StepLayout, decodes, prefills, specs) -> list[int]:
    """Each flat row's LoRA adapter id (0: base), in the order ``lay_out`` placed the requests."""
    states = [*decodes, *(st for st, _ in prefills), *(st for st, _ in specs)]
    ids: list[int] = []
    for st, seq in zip(states, lay.seqs):
        ids.extend([st.lora_id] * seq.query_len)
    return ids

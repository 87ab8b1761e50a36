"""The real scheduler and block manager driven without a model: what the engine does around a forward pass.

Each step: schedule, advance every scheduled sequence's computed tokens, and give a token to each one whose
prompt is done; finish it at its max_tokens. Fast enough to run thousands of steps in a test.
"""

from __future__ import annotations

from minserve.engine.detokenizer import IncrementalDetokenizer
from minserve.engine.outputs import RequestMetrics
from minserve.engine.sampling_params import SamplingParams
from minserve.engine.scheduler import ScheduledBatch, Scheduler
from minserve.engine.sequence import Sequence


class _NoText:
    def decode(self, token_ids, skip_special_tokens=True):
        return ""


def make_sequence(i: int, prompt: list[int], max_tokens: int, priority: int = 0) -> Sequence:
    """Request ``i`` (also its arrival order) with a prompt of token ids and ``max_tokens`` to produce."""
    return Sequence(
        request_id=str(i),
        prompt=None,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        metrics=RequestMetrics(arrival_time_s=0.0),
        detokenizer=IncrementalDetokenizer(_NoText()),
        arrival_index=i,
        priority=priority,
    )


def step(scheduler: Scheduler, next_token: int = 0) -> tuple[ScheduledBatch, list]:
    """One step without a model: the batch the scheduler chose, and the sequences that finished in it."""
    batch = scheduler.schedule()
    finished = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if scheduler.complete(seq, n):
            seq.output_token_ids.append(next_token)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq)
                finished.append(seq)
    return batch, finished

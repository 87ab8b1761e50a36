"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the target model.

* ``SpeculativeConfig`` — built from vLLM's dict shape and checked; it lives with the other settings, in
  :mod:`minserve.config.speculative`;
* :mod:`.ngram` — the prompt-lookup proposer (no model: it copies what followed an earlier match), as a
  reference scan and as an index a running sequence keeps up to date;
* :mod:`.rejection` — the verifier: accept, resample or add a bonus token so that the output distribution
  is exactly the target's (Leviathan et al. 2023; Chen et al. 2023);
* :mod:`.proposer` — what the engine core asks for drafts before each step (``make_proposer``): prompt
  lookup, or :mod:`.draft_model`, a smaller model with a paged KV cache of its own, or the target's own
  first layers as that model (:mod:`.early_exit`, self-speculation);
* :mod:`.verifier` — what the model runner does with a sequence's k + 1 rows of logits.

The engine's side: the scheduler runs a decoding sequence's last token and its drafts in one step
(``Sequence.draft_token_ids``), and ``Scheduler.complete`` counts as computed only the drafts kept.
"""

from minserve.config.speculative import SpeculativeConfig
from minserve.engine.speculative.ngram import NgramIndex, propose_ngram
from minserve.engine.speculative.rejection import Verdict, verify, verify_greedy

__all__ = ["NgramIndex", "SpeculativeConfig", "Verdict", "propose_ngram", "verify", "verify_greedy"]

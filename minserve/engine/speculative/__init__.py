"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the target model.

* :mod:`.config` — ``SpeculativeConfig``, built from vLLM's dict shape and checked;
* :mod:`.ngram` — the prompt-lookup proposer (no model: it copies what followed an earlier match), as a
  reference scan and as an index a running sequence keeps up to date;
* :mod:`.rejection` — the verifier: accept, resample or add a bonus token so that the output distribution
  is exactly the target's (Leviathan et al. 2023; Chen et al. 2023).
"""

from minserve.engine.speculative.config import SpeculativeConfig
from minserve.engine.speculative.ngram import NgramIndex, propose_ngram
from minserve.engine.speculative.rejection import Verdict, verify, verify_greedy

__all__ = ["NgramIndex", "SpeculativeConfig", "Verdict", "propose_ngram", "verify", "verify_greedy"]

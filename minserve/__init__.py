"""minserve: a small, readable LLM inference engine, and the course that teaches serving with it.

from minserve import LLM, SamplingParams
llm = LLM()                                      # the embedded "minserve-tiny"
out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))[0]
print(out.text)
"""

from minserve.config import EngineConfig
from minserve.engine.llm import LLM
from minserve.engine.outputs import RequestMetrics, RequestOutput
from minserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestMetrics", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

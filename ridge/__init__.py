"""ridge: an LLM inference engine in Python and Triton, built around the bytes it moves."""
from ridge.engine.llm import LLM
from ridge.engine.request import CompletionOutput, Logprob, RequestOutput
from ridge.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

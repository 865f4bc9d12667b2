"""The worker: Switchboard's inference engine and (later) its gRPC service."""

from worker.engine import LLMEngine
from worker.llm import LLM
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]

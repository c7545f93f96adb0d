"""jaxinfer: a JAX/Pallas cross-backend LLM inference engine.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("path/to/model")  # converted dir, HF dir or .gguf; None = embedded SmolLM2
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
"""

from jaxinfer.engine.request import SamplingParams
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "JaxinferError", "RequestOutput", "SamplingParams"]

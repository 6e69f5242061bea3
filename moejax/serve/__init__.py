"""Serving an MoE: cached decoding, sampling, generation, quantised experts, memory footprint.

::

    from moejax import serve
    tok = serve.get_tokenizer()                                  # bytes today
    out = serve.generate(model, [tok.encode("def main(")], max_new_tokens=64,
                         sampling=serve.SamplingConfig(temperature=0.8, top_p=0.95),
                         stop_id=tok.stop_id)
    print(tok.decode(out.tokens[0]))

Modules: :mod:`~moejax.serve.decode` (KV-cached prefill / decode walk over
the model's blocks, what decoding does with capacity, expert choice, Soft
MoE and mixture-of-depths), :mod:`~moejax.serve.generate` (left-padded
batches, the sampling loop), :mod:`~moejax.serve.sampling`,
:mod:`~moejax.serve.tokenize`, :mod:`~moejax.serve.quantize` (int8 / int4
expert weights) and :mod:`~moejax.topology.memory` (weight and KV-cache bytes
of any config). docs/serving.md is the guide; docs/benchmarks.md records the
measurements.
"""

from moejax.serve.decode import Decoder, check_decodable, serving_config, serving_model
from moejax.serve.generate import Generation, generate, left_pad, load_run
from moejax.serve.sampling import SamplingConfig, sample
from moejax.serve.tokenize import Tokenizer, get_tokenizer

__all__ = ["Decoder", "check_decodable", "serving_config", "serving_model", "Generation",
           "generate", "left_pad", "load_run", "SamplingConfig", "sample", "Tokenizer",
           "get_tokenizer"]

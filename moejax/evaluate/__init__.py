"""moejax.evaluate: validation metrics, expert specialisation, causal leakage, layer latency."""

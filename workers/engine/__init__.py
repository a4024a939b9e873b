"""The decoding engine: a target prepared for decoding, a slot KV cache, drafters, the adaptive
controller, lossless verification, and the generator that runs them step by step.

It knows nothing of shards, storage or Ray: `workers.registry` builds it from a job config.
"""

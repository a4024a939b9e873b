"""`specbatch bench`: this generator side by side with transformers on the workload suite, one model, one machine.

Same inputs for everyone: the prompts are encoded once, every system decodes greedily with the same EOS
set, the same `max_new_tokens` and the same torch thread count, and transformers runs the very weights
this generator decodes with. Modules, in the order a run uses them: config (what runs), workloads (the
suite's prompts), models, systems (ours) and baselines (transformers), cells (interleaved repeats),
spread (what a spread lets a ratio say), roofline (the bandwidth floor), memory (peaks), oracle (the best
draft length per step in hindsight, from the runs' traces), pipeline (the whole job through Ray), goals,
report and plot (the outputs), main (the entry point). controller_cost times the adaptive controller alone.
"""
from jobs.bench.main import benchmark, run_bench

__all__ = ["benchmark", "run_bench"]

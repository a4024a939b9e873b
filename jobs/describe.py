"""A job's summary as terminal lines: the close of `specbatch run` and the head of `specbatch show`."""
from __future__ import annotations


def describe(summary: dict) -> str:
    """The closing lines of `specbatch run`: the whole job's figures, then this run's."""
    job, run = summary["job"], summary["this_run"]
    done_before = job["shards"] and not run["shards_run"]
    lines = [f"nothing to do: all {job['shards']} shards were already committed"] if done_before else []
    lines.append(job_line(job))
    if run["shards_run"]:
        lines.append(f"this run: {run['shards_run']} shards ({run['shards_resumed']} resumed), {run['generated_tokens']} "
                     f"tokens in {run['wall_s']:.1f}s ({run['tokens_per_s']:.1f} tokens/s end to end)")
    if summary.get("resumed_with_changes"):
        lines.append("resumed with other run-only settings (the output cannot show them): "
                     + "; ".join(summary["resumed_with_changes"]))
    if summary.get("learning"):
        lines.append(learning_line(summary["learning"]))
    lines += noise_lines(summary)
    if "verify_sample" in summary:
        lines.append(describe_verification(summary["verify_sample"]))
    return "\n".join(lines + where_lines(summary["output"]))


def job_line(job: dict) -> str:
    """The whole job's figures, over every committed shard."""
    return (f"job: {job['rows']} rows ({job['failed_rows']} failed), {job['generated_tokens']} tokens, "
            f"{job['tokens_per_s']:.1f} tokens/s while generating; {job['tokens_per_row_pass']:.2f} tokens per "
            f"row per target pass (batch: {job['batch_tokens_per_pass']:.2f}), acceptance {job['acceptance_rate']:.2f}")


def learning_line(learning: dict) -> str:
    """What a learning job's distillation did (pipeline/learning.py)."""
    line = f"learning: {learning['status']}"
    if "after_rows" in learning:
        line += f" after {learning['after_rows']} rows"
    if "distill_s" in learning:
        line += f", distilled in {learning['distill_s']:.0f}s beside generation"
    if learning.get("steps") is not None:
        line += f" ({learning['steps']} steps, stopped: {learning.get('stopped') or 'unknown'})"
    if learning.get("expected_speedup") is not None:
        line += f", expected {learning['expected_speedup']:.2f}x over plain decoding at k={learning['expected_k']}"
    if learning.get("heldout_accept_by_position"):
        line += ", held-out acceptance by position (conditional) " + " ".join(f"{a:.2f}" for a in learning["heldout_accept_by_position"])
    return line + (f": {learning['error']}" if "error" in learning else "")


def noise_lines(summary: dict) -> list[str]:
    """The noise check's verdict (pipeline/noise.py), when the shards' pass times disagree too much."""
    noise = summary.get("noise") or {}
    return [f"noise: {noise['message']}"] if noise.get("noisy") else []


def where_lines(output: str) -> list[str]:
    return [f"output: {output}", f"report: {output.rstrip('/')}/report.html"]


def describe_verification(verify: dict) -> str:
    """The --verify-sample line: all identical, or each row that differs and where."""
    if not verify["mismatches"]:
        return (f"verify-sample: {verify['rows']} rows ({verify['tokens']} tokens) identical to plain greedy "
                "decoding (k = 0)")
    differing = [f"  {m['shard_id']} id={m['id']!r} sample {m['sample_index']}: token {m['position']} is "
                 f"{m['job_token']} in the output, {m['plain_token']} without speculation"
                 for m in verify["mismatches"]]
    return "\n".join([f"verify-sample: {len(differing)} of {verify['rows']} rows DIFFER from plain greedy "
                      "decoding (k = 0); -1 marks a completion that had ended:", *differing])

"""`specbatch show OUTPUT`: a job's figures and a few of its completions in the terminal, read from the output
folder alone (local or object storage), for a finished job, a stopped one or one still running."""
from __future__ import annotations

from jobs.describe import job_line, noise_lines, where_lines
from pipeline.job_state import committed_shards, job_status, read_manifest
from pipeline.samples import clip, read_samples
from workers.storage import Store, safe_url

PROMPT_CHARS, COMPLETION_CHARS = 120, 600


def show(store: Store, rows: int) -> str:
    """The job's status and figures, then its first `rows` completions."""
    manifest = read_manifest(store)
    summary = store.read_json("summary.json")
    lines = [f"{manifest['name']}: {job_status(store)}"]
    if summary:
        lines += [job_line(summary["job"]), *noise_lines(summary)]
    else:
        lines.append(f"no summary yet: {len(committed_shards(store))} of {manifest.get('shards_planned', '?')} "
                     "shards committed")
    lines += where_lines(safe_url(store.root))
    for row in read_samples(store, rows).rows:
        lines += ["", f"── {row['id']} · sample {row['sample_index']} · {row['finish_reason']} · "
                      f"{row['completion_tokens'] or 0} tokens",
                  f"prompt: {clip(row['prompt'], PROMPT_CHARS, one_line=True)}",
                  f"error: {row['error']}" if row["error"] else f"completion: {clip(row['completion'], COMPLETION_CHARS)}"]
    return "\n".join(lines)

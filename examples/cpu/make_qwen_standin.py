"""Build a small random-weight stand-in for Qwen2.5-0.5B-Instruct with a real Qwen tokenizer, for CPU plumbing runs.

    python examples/cpu/make_qwen_standin.py OUTPUT_DIR [--layers 2] [--hidden-size 64]

The model and the tokenizer files are :mod:`verl_group_ppo.qwen_standin`'s (its docstring says what the stand-in
keeps of Qwen2.5-0.5B and why its heads have 32 dimensions).
"""

from __future__ import annotations

import argparse
import sys

from verl_group_ppo.qwen_standin import QWEN2_5_0_5B, TOKENIZER_FILES, build, standin_config, tokenizer_dir

__all__ = ["QWEN2_5_0_5B", "TOKENIZER_FILES", "build", "standin_config", "tokenizer_dir", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"wrote a Qwen2.5-0.5B stand-in to {build(args.output_dir, args.layers, args.hidden_size)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

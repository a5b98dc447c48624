"""`serval chat`'s loop, run round after round in one process, for tests/test_cli.py's Ctrl-C rounds: the engine
(and its threads) stay up across rounds, as in a chat session, and each round ends with ``[quit N]`` on stdout.

Usage: python tests/chat_rounds.py ROUNDS [serval chat flags]
"""

from __future__ import annotations

import sys

from serval import cli


def main() -> int:
    num_rounds, flags = int(sys.argv[1]), sys.argv[2:]
    args = cli.build_parser().parse_args(["chat", *flags])
    llm = cli._build_llm(args)
    params = cli._sampling_params(args, llm.engine.sampling_defaults.values)
    for _ in range(num_rounds):
        code = cli.run_chat(llm.engine, params)
        print(f"[quit {code}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

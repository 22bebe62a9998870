"""`python -m sglang.launch_server --model-path ...`: parse the flags and serve HTTP.

See sglang/srt/entrypoints/http_server.py for the endpoints and the shutdown behaviour.
"""

from __future__ import annotations

import logging
import sys

from sglang.srt.entrypoints.http_server import launch_server, stop_processes
from sglang.srt.server_args import prepare_server_args


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default sys.argv[1:]) and run the server until SIGINT/SIGTERM."""
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
    )
    try:
        launch_server(server_args)
    except KeyboardInterrupt:
        pass
    finally:
        stop_processes([])  # anything a child left behind


if __name__ == "__main__":
    main()

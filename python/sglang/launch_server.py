"""`python -m sglang.launch_server --model-path ...`: parse the flags and serve HTTP.

See sglang/srt/entrypoints/http_server.py for the endpoints and the shutdown behaviour
(the OpenAI ones: sglang/srt/entrypoints/openai/routes.py).
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
    except ValueError as e:  # a bad flag or combination: one line, no traceback
        logging.getLogger("sglang.launch_server").error("%s", e)
        sys.exit(2)
    except RuntimeError as e:
        if not str(e).startswith("failed to start"):
            raise
        logging.getLogger("sglang.launch_server").error("%s", e)  # the scheduler's own error
        sys.exit(1)
    finally:
        stop_processes([])  # anything a child left behind


if __name__ == "__main__":
    main()

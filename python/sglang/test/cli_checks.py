"""Assertions the command-line tools' tests share."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def assert_usage_error(
    main: Callable[[list[str]], object], argv: list[str], message: str, capsys
) -> None:
    """main(argv) exits as argparse's usage error does (SystemExit code 2) with `message` in
    what it wrote to stderr (capsys: pytest's fixture). Raises AssertionError otherwise."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err

"""The licence (issue 39, item 22): LICENSE holds the whole Apache License 2.0, as
pyproject.toml declares."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_license_is_the_full_apache_2_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for part in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional"):
        assert part in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.split()) > 1500
    # tomllib is 3.11+; the one line is enough
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = (\{ text = )?"Apache-2.0"', pyproject, flags=re.M)

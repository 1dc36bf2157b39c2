"""What the job renderers (`hvd-rl slurm render`, `hvd-rl k8s render`) share: values shown safely in
one-line errors, a check for text that would break a line, and writing the result atomically."""
from __future__ import annotations

import os
import tempfile
import unicodedata
from pathlib import Path


class RenderError(ValueError):
    """A refused option; the message is one line."""


def show(text: str) -> str:
    """A value in a message: repr'd (one printable line), a hundred-odd characters at most."""
    text = repr(text)
    return text if len(text) <= 120 else f"{text[:60]} ... {text[-50:]}"


def has_control(text: str) -> bool:
    """Newlines, control, format and separator characters: anything that could end or hide a line."""
    return any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in text)


def write_atomically(out: Path, text: str, mode: int) -> None:
    """Replaces `out` whole or not at all: a refused or failed render never leaves half a file."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, out)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise RenderError(f"--out {show(str(out))}: cannot write it ({exc.strerror or exc})") from None

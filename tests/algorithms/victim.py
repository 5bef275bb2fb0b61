"""What the sandbox tests compare before and after a hostile answer."""

import hashlib
from pathlib import Path


def snapshot(root: Path) -> dict:
    """Every path under ``root`` with its mode and content hash."""
    return {str(p): (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "")
            for p in sorted(root.rglob("*"))}

"""With RESTAGE_TEST_COMM_LOG=<dir> and this directory first on PYTHONPATH, every rank of a run counts its
``dist.new_group`` calls and P2P rank pairs (``comm_counter``) and writes <dir>/rank<r>.json at exit."""

import os

if os.environ.get("RESTAGE_TEST_COMM_LOG"):
    import atexit
    import json

    from comm_counter import install

    _seen = install()

    @atexit.register
    def _write():
        if not _seen["groups"] and not _seen["batched"] and not _seen["unbatched"]:
            return  # not a rank (the launcher itself)
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK") or str(os.getpid())
        with open(os.path.join(os.environ["RESTAGE_TEST_COMM_LOG"], f"rank{rank}.json"), "w") as f:
            json.dump({key: sorted(value) if isinstance(value, set) else value for key, value in _seen.items()}, f)

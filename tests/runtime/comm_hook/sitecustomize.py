"""Counts what a real run creates: ``dist.new_group`` calls and point-to-point rank pairs (batched or not).

Put this directory first on PYTHONPATH with RESTAGE_TEST_COMM_LOG=<dir>: every rank writes
<dir>/rank<r>.json at exit. Only the test of the communicator bound uses it.
"""

import os

if os.environ.get("RESTAGE_TEST_COMM_LOG"):
    import atexit
    import json

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _seen = {"groups": [], "batched": set(), "unbatched": set()}
    _in_batch = [False]
    _originals = {name: getattr(c10d, name) for name in ("new_group", "isend", "irecv", "send", "recv",
                                                         "batch_isend_irecv")}

    def _new_group(ranks=None, *args, **kwargs):
        _seen["groups"].append(sorted(ranks) if ranks is not None else None)
        return _originals["new_group"](ranks, *args, **kwargs)

    def _p2p(name, peer_key, group_peer_key):
        original = _originals[name]

        def wrapped(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get(peer_key)
            if peer is None:
                group = kwargs.get("group") or (args[1] if len(args) > 1 else None)
                peer = c10d.get_global_rank(group or c10d._get_default_group(), kwargs[group_peer_key])
            pair = tuple(sorted((dist.get_rank(), int(peer))))
            _seen["batched" if _in_batch[0] else "unbatched"].add(pair)
            return original(tensor, *args, **kwargs)

        return wrapped

    def _batch(ops):
        _in_batch[0] = True
        try:
            return _originals["batch_isend_irecv"](ops)
        finally:
            _in_batch[0] = False

    # One wrapper per function, set on both modules: P2POp checks its op is c10d's own isend or irecv.
    _wrappers = {"new_group": _new_group, "batch_isend_irecv": _batch,
                 "isend": _p2p("isend", "dst", "group_dst"), "irecv": _p2p("irecv", "src", "group_src"),
                 "send": _p2p("send", "dst", "group_dst"), "recv": _p2p("recv", "src", "group_src")}
    for module in (c10d, dist):
        for name, wrapper in _wrappers.items():
            setattr(module, name, wrapper)

    @atexit.register
    def _write():
        if not dist.is_initialized() and not _seen["groups"]:
            return
        rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK") or str(os.getpid())
        path = os.path.join(os.environ["RESTAGE_TEST_COMM_LOG"], f"rank{rank}.json")
        with open(path, "w") as f:
            json.dump({"groups": _seen["groups"], "batched": sorted(_seen["batched"]),
                       "unbatched": sorted(_seen["unbatched"])}, f)

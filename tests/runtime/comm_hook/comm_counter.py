"""Counts ``dist.new_group`` calls (but host gloo groups) and point-to-point rank pairs (batched or not) in this process."""

from __future__ import annotations


def install() -> dict:
    """Wrap torch.distributed's group creation and P2P calls; returns the live record they fill."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen = {"groups": [], "batched": set(), "unbatched": set(), "p2p_groups": set()}
    in_batch = [False]
    originals = {name: getattr(c10d, name) for name in ("new_group", "isend", "irecv", "send", "recv",
                                                        "batch_isend_irecv")}

    def new_group(ranks=None, *args, **kwargs):
        # A host (gloo) group is no NCCL communicator: the NCCL-rules layer makes one for its own checks.
        if kwargs.get("backend") != "gloo":
            seen["groups"].append(sorted(ranks) if ranks is not None else None)
        return originals["new_group"](ranks, *args, **kwargs)

    def p2p(name, peer_key, group_peer_key):
        original = originals[name]

        def wrapped(tensor, *args, **kwargs):
            group = kwargs.get("group") or (args[1] if len(args) > 1 else None) or c10d._get_default_group()
            peer = args[0] if args else kwargs.get(peer_key)
            if peer is None:
                peer = c10d.get_global_rank(group, kwargs[group_peer_key])
            seen["batched" if in_batch[0] else "unbatched"].add(tuple(sorted((dist.get_rank(), int(peer)))))
            seen["p2p_groups"].add(tuple(sorted(c10d.get_process_group_ranks(group))))
            return original(tensor, *args, **kwargs)

        return wrapped

    def batch(ops):
        in_batch[0] = True
        try:
            return originals["batch_isend_irecv"](ops)
        finally:
            in_batch[0] = False

    # One wrapper per function, set on both modules: P2POp checks its op is c10d's own isend or irecv.
    wrappers = {"new_group": new_group, "batch_isend_irecv": batch, "isend": p2p("isend", "dst", "group_dst"),
                "irecv": p2p("irecv", "src", "group_src"), "send": p2p("send", "dst", "group_dst"),
                "recv": p2p("recv", "src", "group_src")}
    for module in (c10d, dist):
        for name, wrapper in wrappers.items():
            setattr(module, name, wrapper)
    return seen

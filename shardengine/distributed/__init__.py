"""Talking to the other ranks: the process group, collectives and what they cost.

``launch`` joins the process group the launcher describes; ``communicator``
issues collectives over one group (``work``: their handles; ``abort``: why a
rank left); ``traffic`` counts their bytes in the ring model; ``hybrid``
composes the shard group and the replica group; ``compression`` holds the
codecs and the compressed collectives. Only this package calls
``torch.distributed``.

What a training script asks of the ranks is published here (see [Note: the public face] in
``shardengine/public_face.py``), loaded on first use: importing a pure module (``traffic``,
``compression.codecs``) loads no process-group code.

>>> from shardengine.distributed import init_distributed, is_main_process, rank, world_size
>>> info = init_distributed()             # torchrun/SLURM env, else world size 1
>>> (rank(), world_size(), is_main_process()) == (info.rank, info.world_size, info.rank == 0)
True
"""

from ..public_face import lazy_exports

# name -> the module that defines it
_HOMES = {"init_distributed": ".launch", "rank": ".launch", "world_size": ".launch",
          "is_main_process": ".launch", "DistInfo": ".launch", "CommStats": ".traffic"}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, __all__)
